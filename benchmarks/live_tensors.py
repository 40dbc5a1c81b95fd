"""Which tensors are alive at a memory peak: every storage an op allocates, tracked until it is freed.

A memory measurement (``memory_ablation.memory_peak``) gives one number. To check a claim about WHAT
is held at the peak (e.g. "full-length tensors of one chunk of heads at a time"), this tracker records
every storage created by an op run inside it (a ``TorchDispatchMode``, forward and backward alike),
follows it through weak references to its ``StorageImpl`` (so storages freed in place,
``untyped_storage().resize_(0)``, count as freed too), and after every op sums the live bytes:

    with LiveTensors(classify) as live:      # classify(shape) -> a category name
        y = module(x); y.backward(dy)
    live.peak                                # the most bytes alive after any op
    live.peak_by_category                    # {category: bytes} at that moment
    live.max_by_category                     # {category: the most bytes alive at any moment}
    live.max_combined                        # the most bytes of the ``combined`` categories together

What it does not see: tensors made before it started (their views are skipped), and the temporaries a
kernel allocates inside its C++ (they never reach Python dispatch). Freed storage counts at once, as
a caching allocator's "allocated" does; an RSS reading (CPU) counts only the pages written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl itself: a storage freed in place keeps its key


class LiveTensors(TorchDispatchMode):
    """Live bytes per category after every op run inside (module docstring)."""

    def __init__(self, classify: Callable[[tuple[int, ...]], str], combined: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.classify, self.combined = classify, combined
        self.max_combined = 0
        self.tracked: dict[int, tuple[StorageWeakRef, str]] = {}
        self.peak, self.peak_by_category = 0, {}
        self.max_by_category: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or _storage_key(t) in inputs:
                continue  # a view or an in-place result: not a new storage
            key = _storage_key(t)
            if key not in self.tracked or self.tracked[key][0].expired():
                self.tracked[key] = (StorageWeakRef(t.untyped_storage()), self.classify(tuple(t.shape)))
        self._count()
        return out

    def _count(self) -> None:
        by_category: dict[str, int] = {}
        for key, (ref, category) in list(self.tracked.items()):
            if ref.expired():
                del self.tracked[key]
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            if nbytes:  # 0: freed in place, the storage object outliving its memory
                by_category[category] = by_category.get(category, 0) + nbytes
        total = sum(by_category.values())
        if total > self.peak:
            self.peak, self.peak_by_category = total, by_category
        for category, nbytes in by_category.items():
            self.max_by_category[category] = max(self.max_by_category.get(category, 0), nbytes)
        self.max_combined = max(self.max_combined, sum(by_category.get(c, 0) for c in self.combined))


def sequence_classifier(S: int) -> Callable[[tuple[int, ...]], str]:
    """Categories for one Ulysses attention at global length ``S``:

    - ``"full-length"``: a tensor with a dim of ``S`` after the first (the head-sharded q/k/v/o and their
      grads, ``(B, n, S, H)`` or ``(B, S, n, H)``);
    - ``"exchange"``: a flat buffer of at least ``S`` elements (the all-to-all send / receive buffers and
      the rebuilt kernel inputs: full-length data too);
    - ``"lse"``: ``(B, n, S)``, the kernel's log-sum-exp, which every mode keeps from forward to backward
      for all heads (1/H of one q);
    - ``"sharded"``: the rest (sequence-sharded activations and grads, weights' grads).
    """

    def classify(shape: tuple[int, ...]) -> str:
        if len(shape) == 1:
            return "exchange" if shape[0] >= S else "sharded"
        if len(shape) == 3 and shape[2] == S:
            return "lse"
        return "full-length" if S in shape[1:] else "sharded"
    return classify
