"""Ring attention: exact attention over a sequence sharded across P ranks, by passing k/v blocks.

Shape legend: B batch, S global sequence, s local shard (S/P), P ring size, N query heads,
K kv heads, H q/k head dim, Hv v head dim, r this rank.

Forward, rank r (P steps; block t is the k/v shard of source rank (r - t) mod P)::

    q_r (B,N,s,H)   k,v (B,K,s,H)
    t = 0 .. P-1:   start send of the k|v block I hold to r+1, receive the next one from r-1
                    (one batch_isend_irecv, P-1 times; overlapped with the block below)
                    o_t, lse_t = kernel(q_r, k_t, v_t, block mask)   one kernel call per block
                    o, lse     = log-sum-exp merge of (o, lse) and (o_t, lse_t)
    o (B,s,N,Hv)

Backward (custom autograd, exact): the same ring again for k/v, plus a second ring that carries
each block's dk/dv accumulator (fp32) one hop behind it; the P-th hop returns it to its owner::

    t = 0 .. P-1:   dq   += dQ(q_r, k_t, v_t; o, lse, do)      with the GLOBAL o and lse
                    dkv_t += dK, dV of the same block           then send dkv_t to r+1

Blocks a causal mask hides completely are skipped. Causal load balance: contiguous shards would
leave the causal work unbalanced (rank P-1 computing P blocks, rank 0 one), so for a causal mask
without a sliding window (and an even shard length) the ring first re-lays its inputs out in
"zigzag" order: the sequence is cut into 2P chunks of c = s/2 tokens and rank r holds chunks r and
2P-1-r, one early and one late, so every rank computes about P+1 chunk blocks of c x c instead of up
to 4P. One P2P exchange moves q|k|v chunks to their zigzag owner before the ring and one moves the
output chunks back after it (the backward runs the same exchanges reversed); the model and every
other layer keep the contiguous shards::

    contiguous (2 chunks a rank)   r0: [0 1]  r1: [2 3]  r2: [4 5]  r3: [6 7]
    zigzag (inside the ring only)  r0: [0 7]  r1: [1 6]  r2: [2 5]  r3: [3 4]

The ring then runs over chunk pairs: each step computes the sub-blocks (query chunk, key chunk)
that the mask does not hide and merges them per query chunk. Windowed masks keep contiguous
shards (their work is already even).
Kernels per block: PyTorch's fused CPU flash kernel (plain causal/full blocks, CPU) or an
explicit fp32 softmax (any device; packed documents, padding, sliding window).
"""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from ulysses_sp.attention.contract import SPAttentionBackend
from ulysses_sp.attention.heads import repeat_kv
from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.comm.ring_p2p import Relayout, Ring, pack_flat, unpack_flat, wait_all
from ulysses_sp.torch_internals import flash_attention_cpu, flash_attention_cpu_backward

_NEG_INF = float("-inf")


def _block_mask(
    mask: GlobalMask, row0: int, col0: int, s: int, window: int | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """Who may attend in the block of query rows ``[row0, row0+s)`` x key cols ``[col0, col0+s)``.

    Returns ``(allowed, causal_diag)``: ``allowed(a, b)`` gives the ``(B or 1, 1, b - a, s)`` bool rows
    ``[a, b)`` of the block (``GlobalMask.block``; built per row tile, never ``s x s`` at once), or
    ``allowed`` is ``None`` when the block is
    either fully visible (``causal_diag=False``) or the plain causal diagonal (``True``).
    Blocks are aligned (``row0``, ``col0`` multiples of ``s``), so a causal block is either
    fully below the diagonal, on it, or fully above it (hidden; the caller skips those).
    """
    if window is None and mask.document_ids is None and mask.valid is None:
        if not mask.causal or col0 < row0:
            return None, False
        if col0 == row0:
            return None, True
    return (lambda a, b: mask.block(row0 + a, col0, b - a, s, device, window)[:, None]), False


def _reduce_heads(g_BNsH: torch.Tensor, K: int) -> torch.Tensor:
    B, N, s, H = g_BNsH.shape
    return g_BNsH if K == N else g_BNsH.view(B, K, N // K, s, H).sum(2)


TILE_SCORES = 1 << 24
"""Score elements (fp32) the explicit block kernel holds at once: it runs over tiles of query rows,
so a masked (or GPU) block of c x c costs O(rows_per_tile * c), not O(c^2), at any length."""


def _row_tiles(q: torch.Tensor, num_cols: int) -> list[tuple[int, int]]:
    """``[a, b)`` query-row ranges of at most ``TILE_SCORES`` scores (over ``B * N`` heads) each."""
    B, N, rows = q.shape[0], q.shape[1], q.shape[2]
    step = max(1, TILE_SCORES // max(1, B * N * num_cols))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _tile_scores(q_tile, kf, allowed_tile, causal_diag: bool, scale: float, a: int, b: int) -> torch.Tensor:
    """fp32 masked scores of query rows ``[a, b)`` of the block against all its keys."""
    scores = torch.matmul(q_tile.float(), kf.transpose(2, 3)) * scale
    if allowed_tile is not None:
        return scores.masked_fill(~allowed_tile, _NEG_INF)
    if causal_diag:  # key j is hidden from row a + i when j > a + i
        hidden = torch.ones(b - a, kf.shape[2], dtype=torch.bool, device=scores.device).triu(1 + a)
        return scores.masked_fill(hidden, _NEG_INF)
    return scores


def _block_forward(q, k, v, allowed, causal_diag: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``o (B,N,s,Hv)`` fp32 and ``lse (B,N,s)`` fp32 (``-inf`` for rows with no key)."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    if allowed is None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        o, lse = flash_attention_cpu(q, k, v, causal_diag, scale)
        return o.float(), lse
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for a, b in _row_tiles(q, k.shape[2]):
        allowed_tile = allowed(a, b) if allowed is not None else None
        if allowed_tile is not None and not bool(allowed_tile.any()):  # no key for these rows in this block
            outs.append(torch.zeros(*q.shape[:2], b - a, v.shape[3], dtype=torch.float32, device=q.device))
            lses.append(torch.full((*q.shape[:2], b - a), _NEG_INF, dtype=torch.float32, device=q.device))
            continue
        scores = _tile_scores(q[:, :, a:b], kf, allowed_tile, causal_diag, scale, a, b)
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse.masked_fill(lse == _NEG_INF, 0.0)[..., None])
        outs.append(torch.matmul(p, vf))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(do, q, k, v, o, lse, allowed, causal_diag: bool, scale: float):
    """Grads of one block given the GLOBAL output ``o`` and ``lse``: ``dq (B,N,s,H)``, ``dk, dv (B,K,s,.)``."""
    K, N = k.shape[1], q.shape[1]
    ke, ve = repeat_kv(k, N), repeat_kv(v, N)
    if allowed is None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        dq, dk, dv = flash_attention_cpu_backward(do, q, ke, ve, o, lse, causal_diag, scale)
        return dq.float(), _reduce_heads(dk.float(), K), _reduce_heads(dv.float(), K)
    kf, vf = ke.float(), ve.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vf.shape, dtype=torch.float32, device=q.device)
    for a, b in _row_tiles(q, kf.shape[2]):
        allowed_tile = allowed(a, b) if allowed is not None else None
        if allowed_tile is not None and not bool(allowed_tile.any()):
            continue
        qf, dof = q[:, :, a:b].float(), do[:, :, a:b].float()
        scores = _tile_scores(qf, kf, allowed_tile, causal_diag, scale, a, b)
        rows_lse = lse[:, :, a:b]
        p = torch.exp(scores - rows_lse.masked_fill(rows_lse == _NEG_INF, 0.0)[..., None])
        dv += torch.matmul(p.transpose(2, 3), dof)
        dp = torch.matmul(dof, vf.transpose(2, 3))
        ds = p * (dp - (dof * o[:, :, a:b].float()).sum(-1, keepdim=True)) * scale
        dq[:, :, a:b] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(2, 3), qf)
    return dq, _reduce_heads(dk, K), _reduce_heads(dv, K)


def _chunks(P: int, r: int, s: int, zigzag: bool) -> list[tuple[int, int, int]]:
    """``(global start, local start, length)`` of the token chunks rank ``r`` holds in the ring."""
    if not zigzag:
        return [(r * s, 0, s)]
    c = s // 2
    return [(r * c, 0, c), ((2 * P - 1 - r) * c, c, c)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: GlobalMask, ring: Ring, scale: float, window, zigzag: bool):
        P, r, s = ring.size, ring.rank, q.shape[2]
        rows = [(row0, a, n, q[:, :, a:a + n].contiguous()) for row0, a, n in _chunks(P, r, s, zigzag)]
        B, N, Hv = q.shape[0], q.shape[1], v.shape[3]
        o = torch.zeros(B, N, s, Hv, dtype=torch.float32, device=q.device)
        lse = torch.full((B, N, s), _NEG_INF, dtype=torch.float32, device=q.device)
        buf = pack_flat(k, v)
        for t in range(P):
            src = (r - t) % P
            pending = ring.start(buf) if t < P - 1 else None
            kt, vt = unpack_flat(buf, (k, v))
            for col0, a_k, m in _chunks(P, src, s, zigzag):
                if zigzag:
                    kc, vc = kt[:, :, a_k:a_k + m].contiguous(), vt[:, :, a_k:a_k + m].contiguous()
                else:
                    kc, vc = kt, vt
                for row0, a, n, qc in rows:
                    if mask.causal and col0 > row0:  # aligned chunks: entirely above the diagonal
                        continue
                    allowed, diag = _block_mask(mask, row0, col0, n, window, q.device)
                    o_t, lse_t = _block_forward(qc, kc, vc, allowed, diag, scale)
                    o[:, :, a:a + n], lse[:, :, a:a + n] = _merge(o[:, :, a:a + n], lse[:, :, a:a + n], o_t, lse_t)
            if pending is not None:
                wait_all(pending[1])
                buf = pending[0]
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.mask, ctx.scale, ctx.window, ctx.zigzag = ring, mask, scale, window, zigzag
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ring, mask, scale, window, zigzag = ctx.ring, ctx.mask, ctx.scale, ctx.window, ctx.zigzag
        P, r, s = ring.size, ring.rank, q.shape[2]
        do = do.contiguous()
        rows = [(row0, a, n, *(x[:, :, a:a + n].contiguous() for x in (q, do, out)), lse[:, :, a:a + n].contiguous())
                for row0, a, n in _chunks(P, r, s, zigzag)]
        buf = pack_flat(k, v)
        dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for t in range(P):
            src = (r - t) % P
            pending = ring.start(buf) if t < P - 1 else None
            kt, vt = unpack_flat(buf, (k, v))
            dk_t, dv_t = unpack_flat(dkv, (k, v))
            for col0, a_k, m in _chunks(P, src, s, zigzag):
                if zigzag:
                    kc, vc = kt[:, :, a_k:a_k + m].contiguous(), vt[:, :, a_k:a_k + m].contiguous()
                else:
                    kc, vc = kt, vt
                for row0, a, n, qc, doc, oc, lsec in rows:
                    if mask.causal and col0 > row0:
                        continue
                    allowed, diag = _block_mask(mask, row0, col0, n, window, q.device)
                    g = _block_backward(doc, qc, kc, vc, oc, lsec, allowed, diag, scale)
                    dq[:, :, a:a + n] += g[0]
                    dk_t[:, :, a_k:a_k + m] += g[1]
                    dv_t[:, :, a_k:a_k + m] += g[2]
            if P > 1:  # the accumulator of the block I hold goes one hop on; the P-th hop reaches its owner
                dkv_next, works = ring.start(dkv)
                wait_all(works + (pending[1] if pending else []))
                dkv = dkv_next
                buf = pending[0] if pending else buf
        dk, dv = unpack_flat(dkv, (k, v))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _merge(o, lse, o_t, lse_t):
    """Log-sum-exp merge of two partial softmax results (rows with no key so far have lse -inf)."""
    new = torch.logaddexp(lse, lse_t)
    safe = new.masked_fill(new == _NEG_INF, 0.0)
    return o * torch.exp(lse - safe)[..., None] + o_t * torch.exp(lse_t - safe)[..., None], new


class RingAttention(SPAttentionBackend):
    """Ring attention over a sequence sharded across ``sp_group``; same call contract as ``UlyssesAttention``.

    Args:
        sp_group: the sequence-parallel process group; ``None`` means one process (one block).
        balance: causal load balance (zigzag chunks inside the ring, see the module docstring)
            when the mask is causal without a window and the shard length is even; False keeps
            contiguous blocks (rank P-1 then computes P blocks, rank 0 one).

    Masks: causal, packed documents, padding and sliding window from the ``GlobalMask``; no
    softcapping and no attention dropout. Heads are never split, so any ``N``, ``K`` and ``P`` work.
    Per call: ``P-1`` k/v exchanges forward; ``P-1`` k/v plus ``P`` dk/dv (fp32) exchanges backward;
    balanced (zigzag) calls add one q|k|v and one output chunk exchange each way (``comm.cost``).
    ``ring_size`` / ``ring_rank``: the ring group; ``sp_size = ring_size`` (the shards its call's mask
    covers: segments of ``A * s`` tokens under Ulysses x ring; the size words: ``attention.contract``).
    The call prologue (first-call check across ranks, default mask, mask length) is
    :class:`~ulysses_sp.attention.contract.SPAttentionBackend`'s.
    """

    def __init__(self, sp_group: ProcessGroup | None, balance: bool = True) -> None:
        self.balance = balance
        self.ring = Ring(sp_group)
        super().__init__(self.ring.group)
        self.ring_size = self.sp_size = self.ring.size
        self.ring_rank = self.sp_rank = self.ring.rank

    def check_options(self, num_heads: int, *, softcap: float | None, dropout: float,
                      sinks: torch.Tensor | None) -> None:
        """Refuse attention sinks, logit softcapping and attention dropout (the block kernels have none)."""
        if sinks is not None:
            raise ValueError("RingAttention has no attention sinks; use sp_backend='ulysses' with "
                             "attn_implementation='eager' or 'flex_attention' for models with sinks (GPT-OSS).")
        if softcap is not None or dropout:
            raise ValueError(
                "RingAttention has no logit softcapping and no attention dropout; use UlyssesAttention with "
                "'eager' / 'flex_attention' for softcapped models and set attention_dropout=0."
            )

    def attend(
        self, q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, mask: GlobalMask, *,
        scaling: float | None, sliding_window: int | None, softcap: float | None, dropout: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``q (B,N,s,H)``, ``k (B,K,s,H)``, ``v (B,K,s,Hv)`` of my tokens -> ``o (B,s,N,Hv)`` (checked inputs)."""
        s = q_BNsH.shape[2]
        scale = scaling if scaling is not None else 1.0 / math.sqrt(q_BNsH.shape[-1])
        q, k, v = q_BNsH.contiguous(), k_BKsH.contiguous(), v_BKsH.contiguous()
        zigzag = self.zigzag_applies(s, mask, sliding_window)
        if zigzag:
            q, k, v = Relayout.apply(self.ring, 2, True, q, k, v)
        o = _RingAttention.apply(q, k, v, mask, self.ring, scale, sliding_window, zigzag)
        if zigzag:
            (o,) = Relayout.apply(self.ring, 2, False, o)
        return o.transpose(1, 2)

    def zigzag_applies(self, s: int, mask: GlobalMask, sliding_window: int | None) -> bool:
        """Whether a call with shard length ``s`` runs causally load-balanced (zigzag chunks)."""
        return self.balance and self.sp_size > 1 and s % 2 == 0 and mask.causal and sliding_window is None
