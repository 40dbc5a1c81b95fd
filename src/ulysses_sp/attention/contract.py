"""The call contract every sequence-parallel attention backend implements.

Shape legend: B batch, N query heads, K kv heads, s local shard (S/P), H q/k head dim, Hv v head dim.

    attention(q (B,N,s,H), k (B,K,s,H), v (B,K,s,Hv), mask: GlobalMask | None, *,
              scaling, sliding_window, softcap, dropout) -> o (B,s,N,Hv)

``mask`` is the mask of the GLOBAL sequence (``S = s * P``); ``None`` means plain causal. Backends:

    ==========  ===========================================================================
    ulysses     ``UlyssesAttention``: all-to-all to heads, any core kernel, 2 + 2 collectives
    ring        ``RingAttention``: k/v blocks around the group, any head count, no softcap
    ==========  ===========================================================================

:func:`ulysses_sp.attention.build_attention` maps ``UlyssesSPConfig.sp_backend`` to one of them.
Both check their first call's inputs across ranks with :func:`check_inputs_across_ranks`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.comm.collectives import gather_signature

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


class SPAttention(Protocol):
    """What ``UlyssesSP`` calls for every attention layer (see the module docstring)."""

    sp_size: int

    def __call__(
        self, q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, mask: GlobalMask | None = None, *,
        scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
        dropout: float = 0.0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def check_inputs_across_ranks(
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, group: ProcessGroup | None
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass q, k, v of one shape set and one dtype.

    One small ``all_gather`` (nothing without a group): a mismatch would otherwise crash (gloo
    aborts) or hang (NCCL) the backend's collectives. Backends call it on their first call only.
    """
    codes = [_DTYPE_CODES.get(t.dtype, -1) for t in (q_BNsH, k_BKsH, v_BKsH)]
    values = [*q_BNsH.shape, *k_BKsH.shape, v_BKsH.shape[3], *codes]
    one_rank = group is None or torch.distributed.get_world_size(group) == 1
    rows = [tuple(values)] if one_rank else gather_signature(values, group)
    if any(min(row[-3:]) < 0 or len(set(row[-3:])) != 1 for row in rows):
        names = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
        raise ValueError(
            "q, k and v must share one floating dtype on every rank, got "
            f"{[[names.get(c, 'unsupported') for c in row[-3:]] for row in rows]} (per rank: q, k, v); "
            "cast them, e.g. run the whole model under one dtype / autocast."
        )
    if len(set(rows)) != 1:
        raise ValueError(
            "ranks of the sequence-parallel group passed different attention inputs "
            f"(B, N, s, H, B, K, s, H, Hv, dtypes) per rank: {rows}. Every rank must hold an equal "
            "slice (S/P tokens) of the same batch in the same dtype; shard batches with "
            "UlyssesSP.shard / ulysses_sp.shard_batch (it pads S to a multiple of sp_size)."
        )
