"""The few small collectives the package needs, written once.

    collective_device(group)                  where a group's collectives take tensors
                                              (the current CUDA device for NCCL, else CPU)
    gather_signature(values, group)           all ranks' small int vectors (one all_gather)
    check_same_across_ranks(values, group, describe)
                                              raise ValueError on EVERY rank unless all ranks
                                              passed the same values (so none enters a
                                              collective the others skip: no hang)
    all_reduce_sum(tensor, group)             a sum over the group on the right device

``group=None`` means the default (world) group, as in ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def collective_device(group: ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend accepts: CUDA (current device) for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_signature(values: Sequence[int], group: ProcessGroup | None = None) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (same length on all ranks), in group-rank order, via one ``all_gather``."""
    sig = torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device(group))
    table = [torch.empty_like(sig) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, sig, group=group)
    return [tuple(t.tolist()) for t in table]


def check_same_across_ranks(
    values: Sequence[int], group: ProcessGroup | None, describe: Callable[[list[tuple[int, ...]]], str]
) -> list[tuple[int, ...]]:
    """All ranks' ``values``; raise ``ValueError(describe(rows))`` on every rank if they differ.

    ``group=None`` or a one-rank group returns ``[values]`` without communicating. Every rank sees
    the same table, so every rank raises or none does.
    """
    if group is None or dist.get_world_size(group) == 1:
        return [tuple(int(v) for v in values)]
    rows = gather_signature(values, group)
    if len(set(rows)) != 1:
        raise ValueError(describe(rows))
    return rows


def all_reduce_sum(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` summed over ``group``, returned on :func:`collective_device` (input unchanged)."""
    out = tensor.detach().to(collective_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
