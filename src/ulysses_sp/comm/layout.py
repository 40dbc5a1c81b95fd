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

Head chunks (``HeadPlan.chunks(C)``, the exchange of ``head_chunked_attention``): every rank's
query heads are cut into C contiguous runs; exchange c moves run c of every rank. A kv head is
sent in the first exchange whose queries read it and kept by the receiver while later runs read
it ("carried"), so q, k, v and o bytes summed over the chunks equal the unchunked exchange::

    N=6, K=2, P=2, C=2     rank 0: q0 q1 q2 (kv0)      rank 1: q3 q4 q5 (kv1)
        chunk 0            q0 q1    send kv0           q3 q4    send kv1
        chunk 1            q2       kv0 carried        q5       kv1 carried
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ulysses_sp.comm.checks import check_one_dtype


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
                f"an all-to-all over {P} ranks is larger than the number of query heads ({N}): Ulysses "
                f"splits heads over ranks, so keep it <= {N}; for more ranks use Ulysses x ring "
                "(UlyssesSPConfig.sp_ring_size, automatic by default) or data parallelism."
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

    def local_group_size(self, rank: int) -> int | None:
        """``n / k`` when local query head i reads local kv head ``i // (n/k)``, else ``None``.

        ``None`` means the local grouping is irregular (e.g. q heads 2..4 with g=3 read kv0 once
        and kv1 twice); the caller then expands k/v to one head per query head locally.
        """
        return self._group_sizes[rank]

    @cached_property
    def _group_sizes(self) -> tuple[int | None, ...]:
        return tuple(_group_size(q, kv[0], self.group_size) for q, kv in zip(self.q_ranges, self.kv_ranges))

    def num_chunks(self, requested: int) -> int:
        """Head chunks actually used for ``requested``: at most the largest local query head count."""
        return max(1, min(requested, max(b - a for a, b in self.q_ranges)))

    def chunks(self, requested: int) -> tuple[HeadChunk, ...]:
        """The exchanges of a head-chunked Ulysses layer (see the module docstring), in order.

        Each rank's query heads are split as evenly as possible over ``num_chunks(requested)``
        chunks (earlier chunks get the extra head; a rank with fewer heads than chunks has empty
        trailing chunks). Every (kv head, rank) pair is sent in exactly one chunk.
        """
        C, g = self.num_chunks(requested), self.group_size
        bounds = []
        for qa, qb in self.q_ranges:
            base, extra = divmod(qb - qa, C)
            cuts = [qa]
            for c in range(C):
                cuts.append(cuts[-1] + base + (1 if c < extra else 0))
            bounds.append(cuts)
        sent_until = [ka for ka, _ in self.kv_ranges]  # per rank: first kv head not yet sent
        chunks = []
        for c in range(C):
            q_ranges = tuple((cuts[c], cuts[c + 1]) for cuts in bounds)
            read = tuple((a // g, (b - 1) // g + 1) if b > a else (u, u) for (a, b), u in zip(q_ranges, sent_until))
            sent = tuple((max(ka, u), kb) for (ka, kb), u in zip(read, sent_until))
            sent_until = [max(u, kb) for u, (_, kb) in zip(sent_until, read)]
            chunks.append(HeadChunk(self.num_heads, self.num_kv_heads, self.sp_size, q_ranges, read, sent))
        return tuple(chunks)

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


def _group_size(q_range: tuple[int, int], kv_start: int, g: int) -> int | None:
    """``n / k`` if query head i of ``q_range`` reads kv head ``i // (n/k)`` counted from ``kv_start``."""
    qa, qb = q_range
    if qb == qa:
        return 1
    index = torch.arange(qa, qb) // g - kv_start
    n, k = qb - qa, int(index[-1]) + 1
    uniform = n % k == 0 and torch.equal(index, torch.arange(n) // (n // k))
    return n // k if uniform else None


@dataclass(frozen=True)
class HeadChunk:
    """One exchange of a head-chunked layer: per rank, the query heads of this chunk and their kv heads.

    It has the attributes of :class:`HeadPlan` that the pack / unpack functions read, with
    ``kv_ranges`` = the kv heads SENT in this chunk; ``kv_read_ranges`` are those the chunk's
    queries read, which may start with one kv head received in an earlier chunk (``carried``).
    """

    num_heads: int
    num_kv_heads: int
    sp_size: int
    q_ranges: tuple[tuple[int, int], ...]
    kv_read_ranges: tuple[tuple[int, int], ...]
    kv_ranges: tuple[tuple[int, int], ...]

    def num_local_heads(self, rank: int) -> tuple[int, int]:
        """``(n, k)``: query heads of this chunk on ``rank`` and kv heads sent to it in this chunk."""
        (qa, qb), (ka, kb) = self.q_ranges[rank], self.kv_ranges[rank]
        return qb - qa, kb - ka

    def carried(self, rank: int) -> int:
        """0 or 1: kv heads at the front of ``kv_read_ranges[rank]`` received in an earlier chunk."""
        return self.kv_ranges[rank][0] - self.kv_read_ranges[rank][0]

    def local_kv_index(self, rank: int) -> torch.Tensor:
        """For each query head of the chunk on ``rank``, the index of its kv head among those read."""
        (qa, qb), (ka, _) = self.q_ranges[rank], self.kv_read_ranges[rank]
        return torch.arange(qa, qb) // (self.num_heads // self.num_kv_heads) - ka

    def local_group_size(self, rank: int) -> int | None:
        """As :meth:`HeadPlan.local_group_size`, over the kv heads the chunk reads."""
        return self._group_sizes[rank]

    @cached_property
    def _group_sizes(self) -> tuple[int | None, ...]:
        g = self.num_heads // self.num_kv_heads
        return tuple(_group_size(q, kv[0], g) for q, kv in zip(self.q_ranges, self.kv_read_ranges))

    def qkv_numels(self, rank: int, B: int, s: int, H: int, Hv: int) -> int:
        """Elements of the q|k|v chunk that any sender sends to ``rank`` in this exchange."""
        n, k = self.num_local_heads(rank)
        return B * s * (n * H + k * (H + Hv))


def _check_qkv(q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, plan: HeadPlan | HeadChunk) -> None:
    check_one_dtype("q, k and v", q_BNsH, k_BKsH, v_BKsH, purpose=" for the fused exchange")
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
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, plan: HeadPlan | HeadChunk
) -> tuple[torch.Tensor, list[int]]:
    """Sender side of the seq->head exchange: one flat buffer and the split size per destination."""
    _check_qkv(q_BNsH, k_BKsH, v_BKsH, plan)
    ranges = zip(plan.q_ranges, plan.kv_ranges)
    return _pack([[q_BNsH[:, qa:qb], k_BKsH[:, ka:kb], v_BKsH[:, ka:kb]] for (qa, qb), (ka, kb) in ranges])


def unpack_qkv(
    buf: torch.Tensor, plan: HeadPlan | HeadChunk, rank: int, B: int, s: int, H: int, Hv: int,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Receiver side: chunks of all P sources -> ``q (B,n,S,H)``, ``k (B,k,S,H)``, ``v (B,k,S,Hv)``.

    ``into``: write into these tensors (views allowed) instead of new ones.
    """
    n, k = plan.num_local_heads(rank)
    P = plan.sp_size
    if into is None:
        into = (buf.new_empty(B, n, P * s, H), buf.new_empty(B, k, P * s, H), buf.new_empty(B, k, P * s, Hv))
    q, kk, v = into
    off = 0
    for i in range(P):
        for dst in (q, kk, v):
            part = dst[:, :, i * s : (i + 1) * s]
            part.copy_(buf[off : off + part.numel()].view(part.shape))
            off += part.numel()
    return q, kk, v


def pack_qkv_grad(
    gq_BnSH: torch.Tensor, gk_BkSH: torch.Tensor, gv_BkSH: torch.Tensor, plan: HeadPlan | HeadChunk
) -> tuple[torch.Tensor, list[int]]:
    """Adjoint of ``unpack_qkv``: for destination i, the gradients of i's tokens ``[i*s, (i+1)*s)``."""
    P = plan.sp_size
    s = gq_BnSH.shape[2] // P
    return _pack([[t[:, :, i * s : (i + 1) * s] for t in (gq_BnSH, gk_BkSH, gv_BkSH)] for i in range(P)])


def unpack_qkv_grad(
    buf: torch.Tensor, plan: HeadPlan | HeadChunk, B: int, s: int, H: int, Hv: int,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adjoint of ``pack_qkv``: chunks from all ranks -> ``gq (B,N,s,H)``, ``gk/gv (B,K,s,H)``.

    A kv head that was sent to several ranks receives the sum of their gradients. ``into``:
    ``(gq, gk, gv)`` to write the q heads of ``plan`` into and add the kv heads to (gk, gv zeroed
    by the caller), e.g. one chunk after another.
    """
    if into is None:
        into = (buf.new_empty(B, plan.num_heads, s, H), buf.new_zeros(B, plan.num_kv_heads, s, H),
                buf.new_zeros(B, plan.num_kv_heads, s, Hv))
    gq, gk, gv = into
    off = 0
    for (qa, qb), (ka, kb) in zip(plan.q_ranges, plan.kv_ranges):
        for dst, (a, b), accumulate in ((gq, (qa, qb), False), (gk, (ka, kb), True), (gv, (ka, kb), True)):
            part = dst[:, a:b]
            src = buf[off : off + part.numel()].view(part.shape)
            part.add_(src) if accumulate else part.copy_(src)
            off += part.numel()
    return gq, gk, gv


def pack_out(o_BSnH: torch.Tensor, plan: HeadPlan | HeadChunk) -> tuple[torch.Tensor, list[int]]:
    """Sender side of the head->seq exchange: destination j gets tokens ``[j*s, (j+1)*s)``."""
    P = plan.sp_size
    s = o_BSnH.shape[1] // P
    return _pack([[o_BSnH[:, j * s : (j + 1) * s]] for j in range(P)])


def unpack_out(
    buf: torch.Tensor, plan: HeadPlan | HeadChunk, B: int, s: int, Hv: int, into: torch.Tensor | None = None
) -> torch.Tensor:
    """Receiver side: per-source head chunks -> ``o (B,s,N,Hv)`` for my tokens, all heads.

    ``into``: the ``(B,s,N,Hv)`` output to fill (only the heads of ``plan``, e.g. one chunk).
    """
    o = buf.new_empty(B, s, plan.num_heads, Hv) if into is None else into
    off = 0
    for qa, qb in plan.q_ranges:
        part = o[:, :, qa:qb]
        part.copy_(buf[off : off + part.numel()].view(part.shape))
        off += part.numel()
    return o


def pack_out_grad(g_BsNH: torch.Tensor, plan: HeadPlan | HeadChunk) -> tuple[torch.Tensor, list[int]]:
    """Adjoint of ``unpack_out``: destination i gets the gradient of its heads for my tokens."""
    return _pack([[g_BsNH[:, :, qa:qb]] for qa, qb in plan.q_ranges])


def unpack_out_grad(buf: torch.Tensor, plan: HeadPlan | HeadChunk, rank: int, B: int, s: int, Hv: int,
                    into: torch.Tensor | None = None) -> torch.Tensor:
    """Adjoint of ``pack_out``: chunks of all sources -> ``g (B,S,n,Hv)`` for my heads (written into
    ``into``, a ``(B,S,n,Hv)`` tensor of any strides, when given)."""
    n, _ = plan.num_local_heads(rank)
    P = plan.sp_size
    by_source = buf.view(P, B, s, n, Hv).transpose(0, 1)
    if into is None:
        return by_source.reshape(B, P * s, n, Hv)
    into.unflatten(1, (P, s)).copy_(by_source)
    return into
