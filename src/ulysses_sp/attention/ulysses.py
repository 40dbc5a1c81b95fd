"""Ulysses sequence-parallel attention: exact attention on the full sequence from 1/P shards.

Shape legend: see ``ulysses_sp.comm.layout``.

    q (B,N,s,H) k,v (B,K,s,H)    my tokens, all heads
        | 1. one all-to-all (q, k, v fused; uneven head splits; kv heads only where used)
    q (B,n,S,H) k,v (B,k,S,H)    all tokens, my heads
        | 2. regroup kv if this rank's query heads read them irregularly (N % P != 0 cases)
        | 3. unchanged kernel on the global sequence with the global mask
    o (B,S,n,Hv)
        | 4. one all-to-all back
    o (B,s,N,Hv)                 my tokens, all heads

Ulysses x ring (``ring_group`` given, 2-D sequence parallelism): ``sp_group`` is one of ``R``
all-to-all groups of ``A`` consecutive ranks (a contiguous segment of ``A*s`` tokens), and step 3
is ring attention (``attention.ring``) over the ``R`` segments, among the ranks that hold the same
heads::

    q (B,n,A*s,H)  my heads, my segment's tokens  --ring over R segments-->  o (B,A*s,n,Hv)

Per layer: the all-to-all bytes of Ulysses at degree ``A`` plus the ring's ``R-1`` k/v hops of the
local heads (``comm.cost``); any ``sp_size = A*R`` with ``A <= N``, so more ranks than heads work.

With ``head_chunks=C > 1`` steps 1-4 run per chunk of this rank's heads (``HeadPlan.chunks``) inside
one autograd function that saves only sharded tensors (``comm.head_chunked``): each chunk's kernel
graph is kept without its full-length q/k/v/o, which the backward exchanges again and rebuilds
(or, where the kernel saved more, recomputes the chunk), so full-sequence q/k/v/o and their
gradients exist for one chunk of heads at a time, forward and backward, also under activation
checkpointing. 2C collectives forward, 4C backward. ``head_chunk_bytes`` picks
C instead from a byte target for one chunk's full-length tensors (``chunk_live_bytes``).

Inside :meth:`UlyssesAttention.stashing` (head blocks, ``memory.head_blocks``: the caller runs the
whole attention module one block of heads at a time) each call is one chunk of the heads it is
given, whose forward results the caller's recompute replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ulysses_sp.attention.contract import SPAttentionBackend
from ulysses_sp.attention.kernels import Kernel, get_kernel
from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.attention.ring import RingAttention
from ulysses_sp.comm.all_to_all import head_to_seq_out, seq_to_head_qkv
from ulysses_sp.comm.cost import chunks_for_bytes
from ulysses_sp.comm.head_chunked import ChunkStash, head_chunked_attention
from ulysses_sp.comm.layout import HeadChunk, HeadPlan


class UlyssesAttention(SPAttentionBackend):
    """Attention over a sequence sharded across the ranks of ``sp_group``.

    Args:
        sp_group: the sequence-parallel process group (``SPMesh.sp_group``); ``None`` means one
            process (no communication, the kernel runs directly).
        kernel: ``"sdpa"``, ``"eager"``, ``"flex_attention"``, ``"flash_attention_2"``,
            ``"flash_attention_3"`` or a callable with the signature in ``attention.kernels``.
        head_chunks: process this rank's query heads in this many chunks, so the full-sequence
            tensors of one chunk exist at a time, forward and backward (1 = one exchange each way,
            the kernel's saved tensors kept). At most the largest local head count is
            used (``HeadPlan.num_chunks``).
        head_chunk_bytes: choose the chunk count per call so that one chunk's full-length tensors
            (``comm.cost.chunk_live_bytes``: q/k/v/o, their grads, the output grad) take at
            most this many bytes; the larger of this choice and ``head_chunks`` is used. ``None``: off.
        ring_group: Ulysses x ring: the ranks holding the same heads of the other segments
            (``SPMesh.ulysses_ring_groups``); ring attention replaces ``kernel`` (its own block
            kernels: causal, packed documents, padding, sliding window; no softcapping, no dropout).
            ``None`` (default): plain Ulysses.

    ``sp_size = a2a_size * ring_size`` (``A * R``; ``A`` without a ring; the size words:
    ``attention.contract``). The call prologue (first-call check across ranks, default mask, mask
    length) is :class:`~ulysses_sp.attention.contract.SPAttentionBackend`'s. Steady state:
    2 collectives forward, 2 backward (2C and 4C with C head chunks).
    """

    def __init__(
        self, sp_group: ProcessGroup | None, kernel: str | Kernel = "sdpa", head_chunks: int = 1,
        ring_group: ProcessGroup | None = None, head_chunk_bytes: int | None = None,
    ) -> None:
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks must be a positive integer, got {head_chunks!r}.")
        if head_chunk_bytes is not None and (isinstance(head_chunk_bytes, bool) or not isinstance(head_chunk_bytes, int)
                                             or head_chunk_bytes < 1):
            raise ValueError(f"head_chunk_bytes must be a positive integer or None, got {head_chunk_bytes!r}.")
        super().__init__(sp_group)
        self.sp_group = sp_group  # the all-to-all group
        self.a2a_size = 1 if sp_group is None else dist.get_world_size(sp_group)
        self.a2a_rank = 0 if sp_group is None else dist.get_rank(sp_group)
        self.ring = RingAttention(ring_group) if ring_group is not None else None
        self.ring_size = 1 if self.ring is None else self.ring.ring_size
        self.ring_rank = 0 if self.ring is None else self.ring.ring_rank
        self.sp_size = self.a2a_size * self.ring_size  # the size words: attention.contract
        self.sp_rank = self.ring_rank * self.a2a_size + self.a2a_rank
        self.kernel: Kernel = self.ring if self.ring is not None else (
            get_kernel(kernel) if isinstance(kernel, str) else kernel)
        self.head_chunks = head_chunks
        self.head_chunk_bytes = head_chunk_bytes
        self._plans: dict[tuple[int, int], HeadPlan] = {}
        self._chunks: dict[tuple[int, int], tuple[HeadChunk, ...]] = {}
        self._block: tuple[ChunkStash | None] | None = None  # inside a caller's head block: (its stash,)

    @contextlib.contextmanager
    def stashing(self, stash: ChunkStash | None) -> Iterator[None]:
        """Calls inside are one block of a caller that chunks the heads itself (``memory.head_blocks``):
        each runs as ONE head chunk, through ``stash`` (``comm.head_chunked.ChunkStash``, where the caller
        recomputes the code around attention) or, with None (no grad), as the plain exchange."""
        if self.ring is not None:
            raise ValueError("head blocks cannot run under Ulysses x ring; use sp_ring_size=None.")
        previous, self._block = self._block, (stash,)
        try:
            yield
        finally:
            self._block = previous

    def plan(self, num_heads: int, num_kv_heads: int) -> HeadPlan:
        """The head split for ``num_heads`` query and ``num_kv_heads`` kv heads (validated, cached)."""
        key = (num_heads, num_kv_heads)
        if key not in self._plans:
            self._plans[key] = HeadPlan(num_heads, num_kv_heads, self.a2a_size)
        return self._plans[key]

    def check_options(self, num_heads: int, *, softcap: float | None, dropout: float,
                      sinks: torch.Tensor | None) -> None:
        """Refuse sinks under Ulysses x ring and sinks of another head count (softcap, dropout: the kernel's)."""
        if sinks is not None:
            if self.ring is not None:
                raise ValueError("attention sinks cannot run under Ulysses x ring (sp_size > num_attention_heads "
                                 "or sp_ring_size > 1): use sp_size <= num_attention_heads and sp_ring_size=None.")
            if sinks.shape != (num_heads,):
                raise ValueError(f"sinks must hold one logit per query head, shape ({num_heads},); "
                                 f"got {tuple(sinks.shape)}.")

    def attend(
        self, q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, mask: GlobalMask, *,
        scaling: float | None, sliding_window: int | None, softcap: float | None, dropout: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Steps 1-4 of the module docstring on checked inputs (``SPAttentionBackend.__call__``).

        ``sinks`` ``(N,)``: the kernel gets this rank's heads' slice, so each sink's gradient comes
        from the one rank that holds its head (the gradient all-reduce over the group sums it).
        """
        N = q_BNsH.shape[1]
        plan = self.plan(N, k_BKsH.shape[1])
        kw = {"scaling": scaling, "sliding_window": sliding_window, "softcap": softcap, "dropout": dropout}

        params = () if sinks is None else (sinks,)

        def attend(q, k, v, part: HeadPlan | HeadChunk, params: tuple[torch.Tensor, ...] = params) -> torch.Tensor:
            if part.local_group_size(self.a2a_rank) is None:  # 2. irregular kv grouping: one kv per q head
                index = part.local_kv_index(self.a2a_rank).to(k.device)
                k, v = k.index_select(1, index), v.index_select(1, index)
            if not params:
                return self.kernel(q, k, v, mask, **kw)  # 3.
            qa, qb = part.q_ranges[self.a2a_rank]
            return self.kernel(q, k, v, mask, sinks=params[0][qa:qb], **kw)  # 3. this rank's heads' sinks

        C = 1 if self._block is not None else self.num_chunks(plan, q_BNsH, v_BKsH.shape[3])
        if self._block is not None and self._block[0] is not None and self.a2a_size > 1:  # a caller's head block
            return head_chunked_attention(q_BNsH, k_BKsH, v_BKsH, plan.chunks(1), self.sp_group, attend, params,
                                          replay_rng=dropout > 0, stash=self._block[0])
        if C > 1:
            if (N, plan.num_kv_heads, C) not in self._chunks:
                self._chunks[(N, plan.num_kv_heads, C)] = plan.chunks(C)
            return head_chunked_attention(q_BNsH, k_BKsH, v_BKsH, self._chunks[(N, plan.num_kv_heads, C)],
                                          self.sp_group, attend, params, replay_rng=dropout > 0)
        q, k, v = seq_to_head_qkv(q_BNsH, k_BKsH, v_BKsH, plan, self.sp_group)  # 1.
        return head_to_seq_out(attend(q, k, v, plan), plan, self.sp_group)  # 4.

    def num_chunks(self, plan: HeadPlan, q_BNsH: torch.Tensor, Hv: int) -> int:
        """The head chunks of a call with this plan and ``q (B,N,s,H)``: ``head_chunks``, or more when
        ``head_chunk_bytes`` needs them; 1 without an all-to-all. Equal on every rank (same shapes)."""
        if self.a2a_size == 1:
            return 1
        C = plan.num_chunks(self.head_chunks)
        if self.head_chunk_bytes is not None:
            B, _, s, H = q_BNsH.shape
            C = max(C, chunks_for_bytes(plan, self.head_chunk_bytes, B, s * self.a2a_size, H, Hv,
                                        q_BNsH.element_size()))
        return C
