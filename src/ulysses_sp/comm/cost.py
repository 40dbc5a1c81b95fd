"""Communication model per attention layer: bytes one rank sends and collectives, per system.

``ulysses`` and ``ring`` are this package's backends (``UlyssesSPConfig.sp_backend``); ``deepspeed``
is the peer the bench compares with (DeepSpeed's ``UlyssesSPAttentionHF``), modelled here so one
table of formulas covers every system the bench checks.

Shape legend: B batch, S global sequence, s = S/P, N query heads, K kv heads, H head dim
(Hv = H here), b bytes per element, L layers.

    ulysses (ours)   forward: q|k|v of the heads other ranks own + my heads' output for their
                     tokens: HeadPlan.bytes_sent_per_rank, ~ B*s*(2NH + 2KH)*(P-1)/P*b (K >= P);
                     backward: the same amounts reversed.  2 collectives forward, 2 backward.
    ulysses, C head  forward: the same bytes (each q head, (kv head, rank) pair and output moves
    chunks           once, in the chunk that first needs it), 2C collectives; backward: the
                     unchunked bytes + the forward's q|k|v bytes + the output moved as its
                     gradient is (each chunk's q|k|v and output exchanged again for its
                     backward, ``comm.head_chunked``), 4C collectives;
                     C = HeadPlan.num_chunks(sp_head_chunks) = min(chunks, max heads on a rank).
    deepspeed        q, k, v in three all-to-alls (k/v heads repeated to P when K < P), output
                     in a fourth; + an all-gather of int64 position_ids (B*s*8*(P-1)) per layer.
                     5 collectives forward (4 all-to-all + 1 all-gather), 4 backward.
    ring             k|v blocks pass P-1 hops: (P-1)*B*s*K*2H*b forward; backward the k|v ring
                     again plus P hops of fp32 dk|dv: (P-1)*B*s*K*2H*b + P*B*s*K*2H*4.
                     P-1 P2P exchanges forward, 2P-1 backward. Causal without a window and s
                     even (the bench's case): + the zigzag re-layout for load balance, the
                     q|k|v and output halves that change owner (``_zigzag_terms``), +2 and +2.

    ulysses_ring     Ulysses x ring, P = A*R: the ulysses terms at degree A (same s = S/P tokens a
                     rank), then the ring over R segments of A*s tokens for the k_r kv heads this
                     rank holds after the exchange (k_r = n_r when its grouping is irregular):
                     forward + (R-1)*B*A*s*k_r*2H*b; backward + (R-1)*B*A*s*k_r*2H*b +
                     R*B*A*s*k_r*2H*4. Collectives: 2 + (R-1) forward, 2 + (2R-1) backward; with
                     A*s even the ring's zigzag re-layout adds its halves and 2 + 2 (see ring).

Ulysses / ring crossover (forward bytes, K >= P): ring/ulysses = P*K / (N + K): ring sends less
for small P with grouped kv heads and more once P > (N + K)/K; ring's hops are sequential while
the all-to-all is one step, and ring's causal work is unbalanced over contiguous shards.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.comm.ring_p2p import zigzag_moves


def _zigzag_terms(P: int, r: int, B: int, s: int, n: int, k: int, H: int, itemsize: int,
                  balanced: bool = True) -> tuple[int, int]:
    """Bytes rank ``r`` sends to re-lay a ring's inputs/outputs in zigzag order and back (fwd, bwd).

    Causal masks without a window, even ``s`` (``RingAttention.zigzag_applies``): forward sends the
    q|k|v halves whose zigzag owner is another rank, then the output halves back; backward the
    output-grad halves, then the q|k|v grad halves. One P2P batch each, 2 + 2 collectives.
    """
    if P == 1 or s % 2 or not balanced:
        return 0, 0
    moved_to = sum(dest != r for _, dest, _ in zigzag_moves(P, r, True)[0])
    moved_back = sum(dest != r for _, dest, _ in zigzag_moves(P, r, False)[0])
    qkv_half, o_half = B * (s // 2) * (n * H + 2 * k * H) * itemsize, B * (s // 2) * n * H * itemsize
    return moved_to * qkv_half + moved_back * o_half, moved_to * o_half + moved_back * qkv_half


def _ulysses_bytes(plan: HeadPlan, rank: int, B: int, s: int, H: int, itemsize: int) -> tuple[int, int, int]:
    """Rank ``rank``'s bytes of one Ulysses layer: (forward, backward, what a chunked backward sends again)."""
    P = plan.sp_size
    sent = plan.bytes_sent_per_rank(rank, B, s, H, H, itemsize)
    n = [plan.num_local_heads(j)[0] for j in range(P)]
    out_grads = sum(B * s * n[j] * H for j in range(P) if j != rank)
    bwd = ((P - 1) * plan.qkv_numels(rank, B, s, H, H) + out_grads) * itemsize
    return sent["qkv"] + sent["out"], bwd, sent["qkv"] + out_grads * itemsize


@dataclass(frozen=True)
class AttentionComm:
    """Per attention layer and rank: bytes sent forward / backward and collective counts, with the formula text."""

    bytes_forward: int
    bytes_backward: int
    collectives_forward: int
    collectives_backward: int
    text: str


def head_block_ranges(N: int, K: int, P: int, requested: int) -> tuple[tuple[int, int], ...]:
    """The kv-head ranges ``[a, b)`` of the head blocks of one attention module (``memory.head_blocks``).

    A block is a run of whole kv groups and their ``(b - a) * N / K`` query heads, block sizes
    differing by at most one kv head; as many blocks as ``requested`` but never one with fewer query
    heads than the ``P`` ranks its all-to-all splits them over.
    """
    group = N // K
    most = max((G for G in range(1, K + 1) if (K // G) * group >= P), default=1)
    G = max(1, min(requested, most))
    sizes = [K // G + (g < K % G) for g in range(G)]
    return tuple((sum(sizes[:g]), sum(sizes[:g + 1])) for g in range(G))


def attention_comm(
    system: str, P: int, B: int, S: int, N: int, K: int, H: int, itemsize: int, rank: int = 0, head_chunks: int = 1,
    ring_size: int = 1, ring_balanced: bool = True, head_blocks: bool = False,
) -> AttentionComm:
    """The communication model of ``system`` for one attention layer (see the module docstring).

    ``head_chunks``: ``sp_head_chunks`` of the ``ulysses`` system (2C + 4C collectives, the backward
    re-sends each chunk's q|k|v and output).
    ``head_blocks``: with ``head_chunks``, the attention module runs as head blocks
    (``head_block_ranges``; ``sp_head_blocks``): per block the exchanges of a one-chunk chunked
    call of its heads, 2G + 4G collectives; a block with fewer kv heads than P sends each to several
    ranks, so grouped kv heads cost more bytes than attention-call chunking. One block: as without.
    ``ring_size``: ``R`` of the ``ulysses_ring`` system (``rank`` is the SP rank; its all-to-all
    rank is ``rank % (P // R)``). ``ring_balanced``: the ring's zigzag re-layout runs (a causal
    mask without a window, ``RingAttention.zigzag_applies``); False for windowed / non-causal calls.
    """
    s = S // P
    if system == "ulysses_ring":
        if P % ring_size or head_chunks != 1:
            raise ValueError(f"ulysses_ring needs ring_size dividing P={P} and head_chunks=1, got {ring_size}, "
                             f"{head_chunks}.")
        A, R = P // ring_size, ring_size
        inner = attention_comm("ulysses", A, B, s * A, N, K, H, itemsize, rank % A)
        n_r, k_r = HeadPlan(N, K, A).num_local_heads(rank % A)
        if HeadPlan(N, K, A).local_group_size(rank % A) is None:
            k_r = n_r  # irregular grouping: k/v expanded to one head per query head before the ring
        kv = B * A * s * k_r * 2 * H
        ring_rank = rank // A
        zig_f, zig_b = _zigzag_terms(R, ring_rank, B, A * s, n_r, k_r, H, itemsize, ring_balanced)
        extra = 2 if R > 1 and (A * s) % 2 == 0 and ring_balanced else 0
        return AttentionComm(inner.bytes_forward + (R - 1) * kv * itemsize + zig_f,
                             inner.bytes_backward + (R - 1) * kv * itemsize + R * kv * 4 + zig_b,
                             inner.collectives_forward + R - 1 + extra, inner.collectives_backward + 2 * R - 1 + extra,
                             f"ulysses at A={A} + ring over R={R}: fwd (R-1)*B*A*s*2k_rH*b; "
                             "bwd (R-1)*B*A*s*2k_rH*b + R*B*A*s*2k_rH*4")
    if P == 1 or system == "single":
        return AttentionComm(0, 0, 0, 0, "no communication")
    if head_chunks != 1 and system != "ulysses":
        raise ValueError(f"head_chunks applies to the 'ulysses' system only, got system {system!r}.")
    if system == "ulysses" and head_blocks and len(head_block_ranges(N, K, P, head_chunks)) > 1:
        blocks = head_block_ranges(N, K, P, head_chunks)
        parts = [_ulysses_bytes(HeadPlan((b - a) * (N // K), b - a, P), rank, B, s, H, itemsize) for a, b in blocks]
        return AttentionComm(sum(f for f, _, _ in parts), sum(b + again for _, b, again in parts),
                             2 * len(blocks), 4 * len(blocks),
                             f"{len(blocks)} head blocks (kv ranges {list(blocks)}): per block, the chunked formula "
                             "of its heads; 2G + 4G collectives")
    if system == "ulysses":
        plan = HeadPlan(N, K, P)
        fwd, bwd, again = _ulysses_bytes(plan, rank, B, s, H, itemsize)
        text = "HeadPlan.bytes_sent_per_rank: qkv+out = B*s*(n_j*H + k_j*2H) over j!=r + B*s*n_r*H*(P-1), x b"
        C = plan.num_chunks(head_chunks)
        if C == 1:
            return AttentionComm(fwd, bwd, 2, 2, text)
        text += f"; {C} head chunks: + q|k|v and o again in backward, 2C + 4C collectives"
        return AttentionComm(fwd, bwd + again, 2 * C, 4 * C, text)
    if system == "deepspeed":
        Kx = max(K, P)
        a2a = B * s * (2 * N * H + 2 * Kx * H) * itemsize * (P - 1) // P
        pos = B * s * 8 * (P - 1)
        return AttentionComm(a2a + pos, a2a, 5, 4, "B*s*(2NH + 2max(K,P)H)*(P-1)/P*b + position_ids B*s*8*(P-1)")
    if system == "ring":
        kv = B * s * K * 2 * H
        zig_f, zig_b = _zigzag_terms(P, rank, B, s, N, K, H, itemsize, ring_balanced)
        extra = 2 if s % 2 == 0 and ring_balanced else 0
        return AttentionComm((P - 1) * kv * itemsize + zig_f, (P - 1) * kv * itemsize + P * kv * 4 + zig_b,
                             P - 1 + extra, 2 * P - 1 + extra,
                             "fwd (P-1)*B*s*2KH*b; bwd (P-1)*B*s*2KH*b + P*B*s*2KH*4; + zigzag re-layout (s even)")
    raise ValueError(f"unknown system {system!r}")


def chunk_live_bytes(plan: HeadPlan, C: int, B: int, S: int, H: int, Hv: int, itemsize: int) -> int:
    """Bytes of the full-length tensors one chunk holds in backward, the largest over ranks and chunks.

    Per chunk of ``n_c`` query heads reading ``k_c`` kv heads, what the kernel's backward holds: q
    and dq, o and its gradient ``B*S*n_c*(2H + 2Hv)``, k, v, dk and dv ``B*S*k_c*2*(H + Hv)`` (times
    ``itemsize``), and the fp32 log-sum-exp ``B*S*n_c*4``. Not counted: the kernel's own
    temporaries. With grouped kv heads (N > K) a chunk needs a whole kv head even for one query
    head, so the kv part shrinks with C only down to one kv head a chunk.
    """
    worst = 0
    for chunk in plan.chunks(C):
        for r in range(plan.sp_size):
            (qa, qb), (ka, kb) = chunk.q_ranges[r], chunk.kv_read_ranges[r]
            n, k = qb - qa, kb - ka
            worst = max(worst, B * S * (itemsize * (n * (2 * H + 2 * Hv) + k * 2 * (H + Hv)) + 4 * n))
    return worst


def chunks_for_bytes(plan: HeadPlan, limit_bytes: int, B: int, S: int, H: int, Hv: int, itemsize: int) -> int:
    """The fewest head chunks whose :func:`chunk_live_bytes` fit ``limit_bytes`` (the most chunks if none do)."""
    most = plan.num_chunks(plan.num_heads)
    return next((C for C in range(1, most + 1) if chunk_live_bytes(plan, C, B, S, H, Hv, itemsize) <= limit_bytes),
                most)
