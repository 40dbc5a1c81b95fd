"""Pure layout math for the Ulysses all-to-all: which heads go where, and how buffers are packed.

Nothing here touches ``torch.distributed``: every function works on local tensors, so the whole
exchange can be simulated in one process (see ``tests/test_layout.py``).

Shape legend
    B batch, S global sequence, s local shard (S / P), P sequence-parallel size,
    N query heads, n query heads of one rank, K kv heads, k kv heads one rank needs,
    H q/k head dim, Hv v head dim.

Head plan (N=6, K=2, P=4, group size g = N/K = 3)::

    query heads   q0 q1 | q2 q3 | q4 | q5        even split, sizes differ by at most one
    kv heads      k0    | k0 k1 | k1 | k1        exactly the kv heads the rank's queries use

One exchange for q, k and v: sender i packs, for each destination j, its ``s`` tokens of the
heads j owns, ``[q (B,n_j,s,H) | k (B,k_j,s,H) | v (B,k_j,s,Hv)]`` flattened, into one buffer.
Receiver j places the chunk of source i at tokens ``[i*s, (i+1)*s)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class HeadPlan:
    """How N query heads and K kv heads are divided over P sequence-parallel ranks.

    Query heads are split as evenly as possible (the first ``N % P`` ranks get one more).
    Each rank receives the contiguous range of kv heads its query heads read, so with K < P
    (or ranges that straddle a kv group) a kv head is sent to several ranks, and nothing else.
    """

    num_heads: int
    num_kv_heads: int
    sp_size: int

    def __post_init__(self) -> None:
        N, K, P = self.num_heads, self.num_kv_heads, self.sp_size
        if P < 1:
            raise ValueError(f"sp_size must be >= 1, got {P}.")
        if N < 1 or K < 1:
            raise ValueError(f"num_heads ({N}) and num_kv_heads ({K}) must be >= 1.")
        if N % K != 0:
            raise ValueError(
                f"num_heads ({N}) must be a multiple of num_kv_heads ({K}) for grouped-query "
                "attention; check the model config."
            )
        if P > N:
            raise ValueError(
                f"sp_size ({P}) is larger than the number of query heads ({N}): Ulysses splits "
                f"heads over ranks, so use sp_size <= {N} (and data parallelism for the rest)."
            )

    @property
    def group_size(self) -> int:
        """Query heads per kv head (N / K)."""
        return self.num_heads // self.num_kv_heads

    @cached_property
    def q_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of the query heads each rank owns after the exchange."""
        base, extra = divmod(self.num_heads, self.sp_size)
        ranges, start = [], 0
        for r in range(self.sp_size):
            end = start + base + (1 if r < extra else 0)
            ranges.append((start, end))
            start = end
        return tuple(ranges)

    @cached_property
    def kv_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of the kv heads each rank needs for its query heads."""
        g = self.group_size
        return tuple((a // g, (b - 1) // g + 1) for a, b in self.q_ranges)

    def num_local_heads(self, rank: int) -> tuple[int, int]:
        """``(n, k)``: query and kv heads rank ``rank`` holds after the exchange."""
        (qa, qb), (ka, kb) = self.q_ranges[rank], self.kv_ranges[rank]
        return qb - qa, kb - ka

    def local_kv_index(self, rank: int) -> torch.Tensor:
        """For each local query head of ``rank``, the index of its kv head among the local ones."""
        (qa, qb), (ka, _) = self.q_ranges[rank], self.kv_ranges[rank]
        return torch.arange(qa, qb) // self.group_size - ka

    @cached_property
    def _local_group_sizes(self) -> tuple[int | None, ...]:
        sizes = []
        for rank in range(self.sp_size):
            n, k = self.num_local_heads(rank)
            uniform = n % k == 0 and torch.equal(self.local_kv_index(rank), torch.arange(n) // (n // k))
            sizes.append(n // k if uniform else None)
        return tuple(sizes)

    def local_group_size(self, rank: int) -> int | None:
        """``n / k`` when local query head i reads local kv head ``i // (n/k)``, else ``None``.

        ``None`` means the local grouping is irregular (e.g. q heads 2..4 with g=3 read kv0 once
        and kv1 twice); the caller then expands k/v to one head per query head locally.
        """
        return self._local_group_sizes[rank]

    def qkv_numels(self, rank: int, B: int, s: int, H: int, Hv: int) -> int:
        """Elements of the q|k|v chunk that any sender sends to ``rank`` (s tokens)."""
        n, k = self.num_local_heads(rank)
        return B * s * (n * H + k * (H + Hv))

    def bytes_sent_per_rank(self, rank: int, B: int, s: int, H: int, Hv: int, itemsize: int) -> dict:
        """Bytes ``rank`` puts on the wire (to the other P-1 ranks) for one attention call.

        Returns ``{"qkv": ..., "out": ...}`` for the forward; the backward sends the same amounts
        in reverse (the grad of the output goes the qkv way for q only, and vice versa).
        """
        qkv = sum(self.qkv_numels(j, B, s, H, Hv) for j in range(self.sp_size) if j != rank)
        n_r, _ = self.num_local_heads(rank)
        out = B * s * n_r * Hv * (self.sp_size - 1)
        return {"qkv": qkv * itemsize, "out": out * itemsize}


def _check_qkv(q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, plan: HeadPlan) -> None:
    if not (q_BNsH.dtype == k_BKsH.dtype == v_BKsH.dtype):
        raise ValueError(
            f"q, k and v must share one dtype for the fused exchange, got {q_BNsH.dtype}, "
            f"{k_BKsH.dtype}, {v_BKsH.dtype}; cast them (e.g. under one autocast) first."
        )
    B, N, s, H = q_BNsH.shape
    if N != plan.num_heads or k_BKsH.shape[1] != plan.num_kv_heads:
        raise ValueError(
            f"q has {N} heads and k has {k_BKsH.shape[1]}, but the head plan expects "
            f"{plan.num_heads} and {plan.num_kv_heads}; build the attention for this layer's heads."
        )
    if k_BKsH.shape[:3] != v_BKsH.shape[:3] or k_BKsH.shape[0] != B or k_BKsH.shape[2] != s:
        raise ValueError(
            f"q {tuple(q_BNsH.shape)}, k {tuple(k_BKsH.shape)}, v {tuple(v_BKsH.shape)} must agree "
            "on batch and sequence (B, heads, s, head_dim)."
        )
    if k_BKsH.shape[3] != H:
        raise ValueError(f"q and k head dims differ ({H} vs {k_BKsH.shape[3]}).")


def _pack(per_destination: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    """Copy each destination's parts, in order, into one flat buffer (one copy per element)."""
    sizes = [sum(p.numel() for p in parts) for parts in per_destination]
    first = per_destination[0][0]
    buf = first.new_empty(sum(sizes))
    off = 0
    for parts in per_destination:
        for p in parts:
            buf[off : off + p.numel()].view(p.shape).copy_(p)
            off += p.numel()
    return buf, sizes


def pack_qkv(
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, plan: HeadPlan
) -> tuple[torch.Tensor, list[int]]:
    """Sender side of the seq->head exchange: one flat buffer and the split size per destination."""
    _check_qkv(q_BNsH, k_BKsH, v_BKsH, plan)
    return _pack(
        [[q_BNsH[:, qa:qb], k_BKsH[:, ka:kb], v_BKsH[:, ka:kb]] for (qa, qb), (ka, kb) in zip(plan.q_ranges, plan.kv_ranges)]
    )


def unpack_qkv(
    buf: torch.Tensor, plan: HeadPlan, rank: int, B: int, s: int, H: int, Hv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Receiver side: chunks of all P sources -> ``q (B,n,S,H)``, ``k (B,k,S,H)``, ``v (B,k,S,Hv)``."""
    n, k = plan.num_local_heads(rank)
    P = plan.sp_size
    q = buf.new_empty(B, n, P * s, H)
    kk = buf.new_empty(B, k, P * s, H)
    v = buf.new_empty(B, k, P * s, Hv)
    off = 0
    for i in range(P):
        for dst in (q, kk, v):
            part = dst[:, :, i * s : (i + 1) * s]
            part.copy_(buf[off : off + part.numel()].view(part.shape))
            off += part.numel()
    return q, kk, v


def pack_qkv_grad(
    gq_BnSH: torch.Tensor, gk_BkSH: torch.Tensor, gv_BkSH: torch.Tensor, plan: HeadPlan
) -> tuple[torch.Tensor, list[int]]:
    """Adjoint of ``unpack_qkv``: for destination i, the gradients of i's tokens ``[i*s, (i+1)*s)``."""
    P = plan.sp_size
    s = gq_BnSH.shape[2] // P
    return _pack([[t[:, :, i * s : (i + 1) * s] for t in (gq_BnSH, gk_BkSH, gv_BkSH)] for i in range(P)])


def unpack_qkv_grad(
    buf: torch.Tensor, plan: HeadPlan, B: int, s: int, H: int, Hv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adjoint of ``pack_qkv``: chunks from all ranks -> ``gq (B,N,s,H)``, ``gk/gv (B,K,s,H)``.

    A kv head that was sent to several ranks receives the sum of their gradients.
    """
    gq = buf.new_empty(B, plan.num_heads, s, H)
    gk = buf.new_zeros(B, plan.num_kv_heads, s, H)
    gv = buf.new_zeros(B, plan.num_kv_heads, s, Hv)
    off = 0
    for (qa, qb), (ka, kb) in zip(plan.q_ranges, plan.kv_ranges):
        for dst, (a, b), accumulate in ((gq, (qa, qb), False), (gk, (ka, kb), True), (gv, (ka, kb), True)):
            part = dst[:, a:b]
            src = buf[off : off + part.numel()].view(part.shape)
            part.add_(src) if accumulate else part.copy_(src)
            off += part.numel()
    return gq, gk, gv


def pack_out(o_BSnH: torch.Tensor, plan: HeadPlan) -> tuple[torch.Tensor, list[int]]:
    """Sender side of the head->seq exchange: destination j gets tokens ``[j*s, (j+1)*s)``."""
    P = plan.sp_size
    s = o_BSnH.shape[1] // P
    return _pack([[o_BSnH[:, j * s : (j + 1) * s]] for j in range(P)])


def unpack_out(buf: torch.Tensor, plan: HeadPlan, B: int, s: int, Hv: int) -> torch.Tensor:
    """Receiver side: per-source head chunks -> ``o (B,s,N,Hv)`` for my tokens, all heads."""
    o = buf.new_empty(B, s, plan.num_heads, Hv)
    off = 0
    for qa, qb in plan.q_ranges:
        part = o[:, :, qa:qb]
        part.copy_(buf[off : off + part.numel()].view(part.shape))
        off += part.numel()
    return o


def pack_out_grad(g_BsNH: torch.Tensor, plan: HeadPlan) -> tuple[torch.Tensor, list[int]]:
    """Adjoint of ``unpack_out``: destination i gets the gradient of its heads for my tokens."""
    return _pack([[g_BsNH[:, :, qa:qb]] for qa, qb in plan.q_ranges])


def unpack_out_grad(buf: torch.Tensor, plan: HeadPlan, rank: int, B: int, s: int, Hv: int) -> torch.Tensor:
    """Adjoint of ``pack_out``: chunks of all sources -> ``g (B,S,n,Hv)`` for my heads."""
    n, _ = plan.num_local_heads(rank)
    P = plan.sp_size
    return buf.view(P, B, s, n, Hv).transpose(0, 1).reshape(B, P * s, n, Hv)
