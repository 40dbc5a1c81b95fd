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
Both derive from :class:`SPAttentionBackend`, which holds the call prologue once: the signature,
the first call's input check across ranks (:func:`check_inputs_across_ranks`), the default mask
and the mask-length check.

The size words, the same in every class (``SPMesh``, the backends, ``UlyssesSPConfig``)::

    sp_size    P = A * R   ranks that share one sequence: the global S is cut into P shards of s
    a2a_size   A           the all-to-all group of Ulysses (the heads are split A ways)
    ring_size  R           the ring of ring attention (R segments of A * s tokens pass k/v around)

    plain Ulysses: A = P, R = 1     ring backend: A = 1, R = P     Ulysses x ring: A * R = P

and ``sp_rank`` / ``a2a_rank`` / ``ring_rank`` the rank in each: ``sp_rank = ring_rank * A + a2a_rank``
(the shard a rank holds). A backend's ``sp_size`` is the number of shards its call's mask covers:
``mask.seq_len == s * sp_size``.
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


class SPAttentionBackend:
    """Base of the backends: the call prologue of :class:`SPAttention`, written once.

    ``__call__``: 1. :meth:`check_options` refuses what the backend cannot apply (before any
    collective, so every rank raises alike); 2. first call only: :func:`check_inputs_across_ranks`
    over ``check_group`` (shapes and dtype equal on every rank) and the q/k/v shape check, which,
    the shapes being equal on all ranks by then, raises on every rank alike; 3. ``mask=None``
    becomes plain causal over ``S = s * sp_size``, and a mask of another length is refused;
    4. :meth:`attend` (the backend's algorithm). Later calls trust their shapes: per-step
    consistency is checked once per batch by the batch sharder, not per layer.

    Subclasses set ``sp_size`` (module docstring) and implement :meth:`attend`.
    """

    sp_size: int

    def __init__(self, check_group: ProcessGroup | None) -> None:
        self.check_group = check_group
        self._validated = False

    def __call__(
        self, q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, mask: GlobalMask | None = None, *,
        scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
        dropout: float = 0.0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's query tokens over the whole sequence.

        Args:
            q_BNsH: ``(B, N, s, H)`` queries of this rank's tokens ``[r*s, (r+1)*s)``.
            k_BKsH, v_BKsH: ``(B, K, s, H)`` keys and ``(B, K, s, Hv)`` values of the same tokens.
            mask: the GLOBAL mask (length ``S = s * sp_size``); ``None`` means plain causal.
            scaling, sliding_window, softcap, dropout: as transformers passes them to attention.
            sinks: ``(N,)`` per-head attention-sink logits of ALL heads (GPT-OSS style) or ``None``.

        Returns:
            ``(B, s, N, Hv)``: attention output for this rank's tokens, all heads.
        """
        self.check_options(q_BNsH.shape[1], softcap=softcap, dropout=dropout, sinks=sinks)
        if not self._validated:
            check_inputs_across_ranks(q_BNsH, k_BKsH, v_BKsH, self.check_group)
            check_qkv_shapes(q_BNsH, k_BKsH, v_BKsH)
            self._validated = True
        mask = self.global_mask(mask, q_BNsH.shape[2])
        return self.attend(q_BNsH, k_BKsH, v_BKsH, mask, scaling=scaling, sliding_window=sliding_window,
                           softcap=softcap, dropout=dropout, sinks=sinks)

    def check_options(self, num_heads: int, *, softcap: float | None, dropout: float,
                      sinks: torch.Tensor | None) -> None:
        """Raise ``ValueError`` for an option this backend cannot apply (default: all apply)."""

    def global_mask(self, mask: GlobalMask | None, s: int) -> GlobalMask:
        """``mask``, or plain causal when ``None``; ``ValueError`` unless it covers ``S = s * sp_size`` tokens."""
        S = s * self.sp_size
        if mask is None:
            return GlobalMask(S)
        if mask.seq_len != S:
            raise ValueError(
                f"the mask covers {mask.seq_len} tokens but {self.sp_size} shards of {s} make {S}. "
                f"Every rank must hold S/P tokens: pad the batch to a multiple of sp_size with "
                "UlyssesSP.shard / ulysses_sp.shard_batch (it pads and ignores the padded labels)."
            )
        return mask

    def attend(
        self, q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, mask: GlobalMask, *,
        scaling: float | None, sliding_window: int | None, softcap: float | None, dropout: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """The backend's algorithm on checked inputs (``mask`` of length ``s * sp_size``) -> ``(B, s, N, Hv)``."""
        raise NotImplementedError


def check_qkv_shapes(q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor) -> None:
    """Raise ``ValueError`` unless q, k, v are ``(B, N, s, H)``, ``(B, K, s, H)``, ``(B, K, s, Hv)``
    with N a multiple of K."""
    q, k, v = q_BNsH, k_BKsH, v_BKsH
    if (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[1] % k.shape[1] or q.shape[0] != k.shape[0]
            or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3] or k.shape[:3] != v.shape[:3]):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected (B, N, s, H), (B, K, s, H), "
            "(B, K, s, Hv) with N a multiple of K."
        )
