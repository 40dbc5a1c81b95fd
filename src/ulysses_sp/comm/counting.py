"""Count collectives and the bytes this rank sends, by wrapping ``torch.distributed`` calls.

The package's one instrumentation of communication (``ulysses-sp bench``, ``ulysses-sp demo`` and
the tests use it): :class:`CommCounter` wraps the public ``torch.distributed`` functions while it
is entered and restores them on exit. Every
library that calls ``torch.distributed.<op>`` at call time (our comm layer, DeepSpeed's
``deepspeed.comm`` torch backend, ``torch.distributed.nn.functional``) is seen.

Each record is ``(op, bytes_sent, phase, scope)``:

- ``phase``: set by the caller (``"forward"``, ``"backward"``, ``"sync"``, ...);
- ``scope``: ``"attention"`` while inside an attention call wrapped with :meth:`CommCounter.scoped`
  (install it with ``UlyssesSP.wrap_attention(counter.scoped)``),
  in forward AND in backward (identity autograd markers around the call switch the scope when
  autograd enters and leaves the attention's backward), else ``None``.

The same markers time the attention: ``attention_seconds`` sums the wall time spent inside wrapped
attention calls, forward and backward (with a CUDA synchronize at each marker on GPU tensors), so
``ulysses-sp bench`` can report attention time per token apart from the rest of the step.

Bytes are what THIS rank puts on the wire in the algorithm-independent sense: all-to-all: the
chunks for other ranks; all-gather: its input times (P-1); reduce-scatter: (P-1)/P of its input;
all-reduce: 2(P-1)/P of the tensor (ring all-reduce); point-to-point: the tensors it sends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_PATCHED = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
            "reduce_scatter", "reduce_scatter_tensor", "broadcast", "batch_isend_irecv", "send")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _sent_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_) -> int:
    P, r = _size_rank(group)
    if input_split_sizes is None:
        return _nbytes(input) * (P - 1) // P
    row = input[0].numel() * input.element_size() if input.dim() > 1 else input.element_size()
    return sum(n for j, n in enumerate(input_split_sizes) if j != r) * row


def _sent(op: str, args: tuple, kwargs: dict) -> int:
    """Bytes this rank sends for one call of ``torch.distributed.<op>(*args, **kwargs)``."""
    group = kwargs.get("group")
    if op == "all_to_all_single":
        return _sent_all_to_all_single(*args, **kwargs)
    if op == "batch_isend_irecv":
        return sum(_nbytes(p.tensor) for p in args[0] if getattr(p.op, "__name__", "") == "isend")
    if op == "send":
        return _nbytes(args[0] if args else kwargs["tensor"])
    P, r = _size_rank(group)
    if op == "all_to_all":
        inputs = args[1] if len(args) > 1 else kwargs["input_tensor_list"]
        return sum(_nbytes(t) for j, t in enumerate(inputs) if j != r)
    if op in ("all_gather", "all_gather_into_tensor"):
        tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        return _nbytes(tensor) * (P - 1)
    if op == "all_reduce":
        return 2 * (P - 1) * _nbytes(args[0] if args else kwargs["tensor"]) // P
    if op == "reduce_scatter":
        inputs = args[1] if len(args) > 1 else kwargs["input_list"]
        return sum(_nbytes(t) for t in inputs) * (P - 1) // P
    if op == "reduce_scatter_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs["input"]) * (P - 1) // P
    if op == "broadcast":
        src = args[1] if len(args) > 1 else kwargs.get("src")
        return _nbytes(args[0] if args else kwargs["tensor"]) * (P - 1) if src == dist.get_rank() else 0
    raise KeyError(op)


@dataclass
class CommRecord:
    op: str
    bytes_sent: int
    phase: str | None
    scope: str | None


@dataclass
class CommCounter:
    """Context manager recording every wrapped collective this process issues while entered."""

    records: list[CommRecord] = field(default_factory=list)
    phase: str | None = None
    scope: str | None = None
    attention_seconds: float = 0.0  # wall time inside wrapped attention calls, forward + backward
    _saved: dict[str, Callable] = field(default_factory=dict)
    _attention_start: float | None = None

    def __enter__(self) -> CommCounter:
        for op in _PATCHED:
            original = getattr(dist, op)
            self._saved[op] = original
            setattr(dist, op, self._wrap(op, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for op, original in self._saved.items():
            setattr(dist, op, original)
        self._saved.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.records.append(CommRecord(op, _sent(op, args, kwargs), self.phase, self.scope))
            return original(*args, **kwargs)

        counted.__name__ = op
        return counted

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Label the collectives issued inside the block with ``phase``."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def scoped(self, attention_fn: Callable) -> Callable:
        """Wrap a transformers attention function so its collectives (forward and backward) get scope ``attention``."""

        def wrapped(module, query, key, value, *args: Any, **kwargs: Any):
            query, key, value = _LeaveInBackward.apply(self, query, key, value)
            self.enter_attention(query)
            try:
                out, weights = attention_fn(module, query, key, value, *args, **kwargs)
            finally:
                self.leave_attention(query)
            return _EnterInBackward.apply(self, out), weights

        return wrapped

    def enter_attention(self, like: torch.Tensor) -> None:
        """Scope ``attention`` from now on, and start its clock."""
        self.scope = "attention"
        _sync(like)
        self._attention_start = time.perf_counter()

    def leave_attention(self, like: torch.Tensor) -> None:
        """End the ``attention`` scope and add its time to ``attention_seconds``."""
        _sync(like)
        if self._attention_start is not None:
            self.attention_seconds += time.perf_counter() - self._attention_start
        self.scope, self._attention_start = None, None

    def select(self, phase: str | None = None, scope: str | None = None) -> list[CommRecord]:
        """Records with the given phase and scope (``None`` matches anything)."""
        return [c for c in self.records if (phase is None or c.phase == phase) and (scope is None or c.scope == scope)]


class _EnterInBackward(torch.autograd.Function):
    """Identity on the attention output; its backward marks the start of the attention's backward."""

    @staticmethod
    def forward(ctx, counter, out):
        ctx.counter = counter
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.enter_attention(grad)
        return None, grad


class _LeaveInBackward(torch.autograd.Function):
    """Identity on q, k, v; its backward runs once all three grads exist: the attention backward is over."""

    @staticmethod
    def forward(ctx, counter, q, k, v):
        ctx.counter = counter
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        ctx.counter.leave_attention(gq)
        return None, gq, gk, gv


def _sync(like: torch.Tensor) -> None:
    if like.is_cuda:
        torch.cuda.synchronize(like.device)
