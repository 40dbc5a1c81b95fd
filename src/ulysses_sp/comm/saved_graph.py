"""An autograd graph whose large saved tensors are dropped after the forward and rebuilt for the backward.

Used by ``comm.head_chunked``: a chunk's attention kernel saves its full-length q, k, v and output
(or views of them) for its backward. Keeping the graph keeps them; recomputing the kernel costs a
second forward. :class:`SavedGraph` keeps the graph but not those tensors::

    graph = SavedGraph()
    with graph.hooks():                       # every tensor the kernel saves goes through a holder
        o = kernel(q, k, v)                   # q, k, v: leaves that require grad
    ok = graph.release({"q": q, "k": k, "v": v, "o": o}, max_kept_bytes)
        # holders whose tensor shares storage with q / k / v / o record (shape, stride, offset) and
        # drop it; the caller frees the storages (``free_storage``). ``ok`` is False when what the
        # graph still holds (other saved tensors: a dropout mask, gathered copies) exceeds the limit
    ...
    graph.rebuild("q", q_values) ...          # backward: the same values, from wherever they live
    torch.autograd.grad(o, (q, k, v), grad)   # the kernel's own backward reads the rebuilt tensors

A rebuilt source has the original's strides and storage offset in a storage of the original's
size, so every saved view reads exactly what it read in the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class _Holder:
    """One saved tensor: the tensor itself, or where to find it in a rebuilt source."""

    __slots__ = ("tensor", "source", "shape", "stride", "offset")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.source: str | None = None
        self.shape, self.stride, self.offset = tensor.shape, tensor.stride(), tensor.storage_offset()


class SavedGraph:
    """The saved tensors of one forward, each kept or replaced by a recipe to rebuild it."""

    def __init__(self) -> None:
        self.holders: list[_Holder] = []
        self.layouts: dict[str, tuple[torch.Size, tuple[int, ...], int, int]] = {}
        self.rebuilt: dict[str, torch.Tensor] = {}

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Route the saved tensors of the autograd ops run inside through this graph's holders."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(tensor)
        self.holders.append(holder)
        return holder

    def _unpack(self, holder: _Holder) -> torch.Tensor:
        if holder.tensor is not None:
            return holder.tensor
        return self.rebuilt[holder.source].as_strided(holder.shape, holder.stride, holder.offset)

    def release(self, sources: dict[str, torch.Tensor], max_kept_bytes: int) -> bool:
        """Drop every saved tensor that shares storage (and dtype) with one of ``sources``; True if the
        storages of what stays saved take at most ``max_kept_bytes``."""
        by_storage = {t.untyped_storage().data_ptr(): name for name, t in sources.items() if t.numel()}
        for name, t in sources.items():
            self.layouts[name] = (t.shape, t.stride(), t.storage_offset(), t.untyped_storage().nbytes())
        kept: dict[int, int] = {}
        for holder in self.holders:
            t = holder.tensor
            if t is None:
                continue
            name = by_storage.get(t.untyped_storage().data_ptr())
            if name is not None and t.dtype == sources[name].dtype:
                holder.tensor, holder.source = None, name
            else:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(kept.values()) <= max_kept_bytes

    def rebuild(self, name: str, values: torch.Tensor) -> None:
        """Source ``name`` again, from ``values`` (its logical shape), with the original's layout: ``values``
        itself where its layout is the original's (no copy), else a copy in a storage laid out like it."""
        shape, stride, offset, nbytes = self.layouts[name]
        if (values.shape, values.stride(), values.storage_offset(), values.untyped_storage().nbytes()) == (
                shape, stride, offset, nbytes):
            self.rebuilt[name] = values
            return
        self.target(name, values).copy_(values)

    def target(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An empty source ``name`` laid out as the original (dtype and device of ``like``) for the caller
        to fill in place, e.g. straight from a receive buffer."""
        shape, stride, offset, nbytes = self.layouts[name]
        storage = like.new_empty(nbytes // like.element_size())
        self.rebuilt[name] = storage
        return storage.as_strided(shape, stride, offset)

    def clear(self) -> None:
        """Forget the rebuilt sources (their memory goes once the caller's references do)."""
        self.rebuilt.clear()


def free_storage(*tensors: torch.Tensor) -> None:
    """Release the memory of ``tensors`` while keeping the tensor objects (and their autograd identity)."""
    for t in tensors:
        t.untyped_storage().resize_(0)
