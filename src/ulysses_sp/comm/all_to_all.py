"""Autograd all-to-all between sequence-sharded and head-sharded layouts.

Shape legend: see ``ulysses_sp.comm.layout``.

    seq_to_head_qkv:  q (B,N,s,H), k/v (B,K,s,H)  --one all_to_all-->  q (B,n,S,H), k/v (B,k,S,H)
    head_to_seq_out:  o (B,S,n,Hv)                --one all_to_all-->  o (B,s,N,Hv)

Each backward is the reverse exchange (one collective), so an attention forward+backward costs
exactly four collectives. The layout work lives in ``layout``; this module only moves buffers.

``head_chunked_attention`` runs an attention function chunk by chunk of heads (``HeadPlan.chunks``)
with the exchanges of neighbouring chunks in flight (``async_op=True``) while a chunk computes::

    forward   qkv(0) qkv(1) | attend(0) | out(0) qkv(2) | attend(1) | out(1) ... wait out(C-1)
    backward  gout(C-1) gout(C-2) | grad(C-1) | gqkv(C-1) gout(C-3) | grad(C-2) | ... wait gqkv(0)

2C collectives forward, 2C backward, the same bytes as the unchunked pair; full-sequence buffers
of one chunk of heads at a time (the attention's saved tensors are those of all chunks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ulysses_sp.comm import layout
from ulysses_sp.comm.layout import HeadChunk, HeadPlan

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HeadChunk, tuple[torch.Tensor, ...]], torch.Tensor]
"""``attend(q (B,n,S,H), k (B,k,S,H), v (B,k,S,Hv), chunk, params) -> o (B,S,n,Hv)`` for one chunk of
heads; ``params``: the differentiable tensors besides q, k, v that attention reads (e.g. sinks)."""


def _exchange(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv


class _SeqToHeadQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNsH, k_BKsH, v_BKsH, plan: HeadPlan, group: ProcessGroup):
        rank = dist.get_rank(group)
        B, _, s, H = q_BNsH.shape
        Hv = v_BKsH.shape[3]
        send, send_sizes = layout.pack_qkv(q_BNsH, k_BKsH, v_BKsH, plan)
        recv_sizes = [plan.qkv_numels(rank, B, s, H, Hv)] * plan.sp_size
        recv = _exchange(send, send_sizes, recv_sizes, group)
        ctx.plan, ctx.group, ctx.dims = plan, group, (B, s, H, Hv)
        return layout.unpack_qkv(recv, plan, rank, B, s, H, Hv)

    @staticmethod
    def backward(ctx, gq_BnSH, gk_BkSH, gv_BkSH):
        plan, group, (B, s, H, Hv) = ctx.plan, ctx.group, ctx.dims
        rank = dist.get_rank(group)
        send, send_sizes = layout.pack_qkv_grad(gq_BnSH, gk_BkSH, gv_BkSH, plan)
        recv_sizes = [plan.qkv_numels(j, B, s, H, Hv) for j in range(plan.sp_size)]
        assert send_sizes == [plan.qkv_numels(rank, B, s, H, Hv)] * plan.sp_size
        recv = _exchange(send, send_sizes, recv_sizes, group)
        gq, gk, gv = layout.unpack_qkv_grad(recv, plan, B, s, H, Hv)
        return gq, gk, gv, None, None


class _HeadToSeqOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_BSnH, plan: HeadPlan, group: ProcessGroup):
        B, S, n, Hv = o_BSnH.shape
        s = S // plan.sp_size
        send, send_sizes = layout.pack_out(o_BSnH, plan)
        recv_sizes = [B * s * (qb - qa) * Hv for qa, qb in plan.q_ranges]
        recv = _exchange(send, send_sizes, recv_sizes, group)
        ctx.plan, ctx.group, ctx.dims = plan, group, (B, s, Hv)
        return layout.unpack_out(recv, plan, B, s, Hv)

    @staticmethod
    def backward(ctx, g_BsNH):
        plan, group, (B, s, Hv) = ctx.plan, ctx.group, ctx.dims
        rank = dist.get_rank(group)
        n, _ = plan.num_local_heads(rank)
        send, send_sizes = layout.pack_out_grad(g_BsNH, plan)
        recv = _exchange(send, send_sizes, [B * s * n * Hv] * plan.sp_size, group)
        return layout.unpack_out_grad(recv, plan, rank, B, s, Hv), None, None


def seq_to_head_qkv(
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, plan: HeadPlan, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """My tokens, all heads -> all tokens, my heads, for q, k and v in ONE all-to-all.

    Args:
        q_BNsH: queries ``(B, N, s, H)`` of this rank's shard.
        k_BKsH, v_BKsH: keys ``(B, K, s, H)`` and values ``(B, K, s, Hv)``.
        plan: the head split (``HeadPlan(N, K, P)``).
        group: the sequence-parallel group (``None`` or size 1: identity, no collective).

    Returns:
        ``q (B, n, S, H)``, ``k (B, k, S, H)``, ``v (B, k, S, Hv)`` for this rank's heads.
    """
    if plan.sp_size == 1:
        return q_BNsH, k_BKsH, v_BKsH
    return _SeqToHeadQKV.apply(q_BNsH, k_BKsH, v_BKsH, plan, group)


def head_to_seq_out(o_BSnH: torch.Tensor, plan: HeadPlan, group: ProcessGroup | None) -> torch.Tensor:
    """All tokens, my heads ``(B, S, n, Hv)`` -> my tokens, all heads ``(B, s, N, Hv)``; one all-to-all."""
    if plan.sp_size == 1:
        return o_BSnH
    return _HeadToSeqOut.apply(o_BSnH, plan, group)


class _InFlight:
    """One asynchronous ``all_to_all_single``; the buffers live until :meth:`wait` returns the received one."""

    def __init__(self, packed: tuple[torch.Tensor, list[int]], recv_sizes: list[int], group: ProcessGroup) -> None:
        self.send, send_sizes = packed
        self.recv = self.send.new_empty(sum(recv_sizes))
        self.work = dist.all_to_all_single(self.recv, self.send, recv_sizes, send_sizes, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        # the work object holds the buffers too: drop it, so the caller holds the only reference
        recv, self.send, self.recv, self.work = self.recv, None, None, None
        return recv


class _HeadChunkedAttention(torch.autograd.Function):
    """Forward: chunks in order; backward: in reverse. Full-size results are allocated when the
    first chunk's exchange lands, and a chunk's buffers are dropped as soon as they are sent, so
    besides the kernels' saved tensors (q, k, v, o of every chunk) only about two chunks of
    buffers are alive at a time. The kv heads of all chunks share one buffer (kept for backward
    anyway), so a kv head carried into the next chunk is not copied."""

    @staticmethod
    def forward(ctx, q_BNsH, k_BKsH, v_BKsH, chunks: tuple[HeadChunk, ...], group: ProcessGroup, attend: Attend,
                *params: torch.Tensor):
        rank, P = dist.get_rank(group), len(chunks[0].q_ranges)
        # the params as leaves of the chunks' graphs (shared by all chunks; their grads are summed in backward)
        param_leaves = tuple(p.detach().requires_grad_(p.requires_grad) for p in params)
        B, N, s, H = q_BNsH.shape
        K, Hv = k_BKsH.shape[1], v_BKsH.shape[3]
        out: list[torch.Tensor] = []  # o (B,s,N,Hv), once the first chunk's output lands

        def send_qkv(chunk: HeadChunk) -> _InFlight:
            packed = layout.pack_qkv(q_BNsH, k_BKsH, v_BKsH, chunk)
            return _InFlight(packed, [chunk.qkv_numels(rank, B, s, H, Hv)] * P, group)

        def land_out(sent: tuple[_InFlight, HeadChunk]) -> None:
            buf = sent[0].wait()
            if not out:
                out.append(buf.new_empty(B, s, N, Hv))
            layout.unpack_out(buf, sent[1], B, s, Hv, into=out[0])

        graphs, kv, out_prev = [], [], None
        qkv_next = send_qkv(chunks[0])
        for c, chunk in enumerate(chunks):
            qkv = qkv_next
            if c + 1 < len(chunks):
                qkv_next = send_qkv(chunks[c + 1])  # in flight while this chunk computes
            q, k, v = _receive_qkv(qkv.wait(), chunks, c, rank, kv, B, s, H, Hv)
            with torch.enable_grad():
                leaves = tuple(t.requires_grad_() for t in (q, k, v))
                o_BSnH = attend(q, k, v, chunk, param_leaves) if q.shape[1] else q.new_empty(B, P * s, 0, Hv)
            graphs.append((leaves, o_BSnH))
            recv_sizes = [B * s * (qb - qa) * Hv for qa, qb in chunk.q_ranges]
            sent = (_InFlight(layout.pack_out(o_BSnH.detach(), chunk), recv_sizes, group), chunk)
            if out_prev is not None:
                land_out(out_prev)
            out_prev = sent
        land_out(out_prev)
        ctx.chunks, ctx.group, ctx.graphs, ctx.dims = chunks, group, graphs, (B, N, K, s, H, Hv)
        ctx.param_leaves = param_leaves
        return out[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, g_BsNH):
        chunks, group, graphs, (B, N, K, s, H, Hv) = ctx.chunks, ctx.group, ctx.graphs, ctx.dims
        rank, P = dist.get_rank(group), len(chunks[0].q_ranges)
        g_BsNH = g_BsNH.contiguous()
        grads: list[torch.Tensor] = []  # gq (B,N,s,H), gk, gv (B,K,s,H), once the first chunk's grads land

        def send_gout(chunk: HeadChunk) -> _InFlight:
            n, _ = chunk.num_local_heads(rank)
            return _InFlight(layout.pack_out_grad(g_BsNH, chunk), [B * s * n * Hv] * P, group)

        def land_grads(sent: tuple[_InFlight, HeadChunk]) -> None:
            buf = sent[0].wait()
            if not grads:
                grads.extend((buf.new_empty(B, N, s, H), buf.new_zeros(B, K, s, H), buf.new_zeros(B, K, s, Hv)))
            layout.unpack_qkv_grad(buf, sent[1], B, s, H, Hv, into=tuple(grads))

        params = ctx.param_leaves
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        carry, grad_prev = None, None
        gout_next = send_gout(chunks[-1])
        for c in reversed(range(len(chunks))):
            chunk, gout = chunks[c], gout_next
            if c > 0:
                gout_next = send_gout(chunks[c - 1])  # in flight while this chunk computes
            gout_chunk = layout.unpack_out_grad(gout.wait(), chunk, rank, B, s, Hv)
            dq, dk, dv, *dp = _chunk_grads(graphs, c, gout_chunk, params)
            param_grads = [a if b is None else b if a is None else a + b for a, b in zip(param_grads, dp)]
            if carry is not None:  # the next chunk read my last kv head without receiving it again
                dk[:, -1:] += carry[0]
                dv[:, -1:] += carry[1]
            first = chunk.carried(rank)
            carry = (dk[:, :first].clone(), dv[:, :first].clone()) if first else None
            recv_sizes = [chunk.qkv_numels(j, B, s, H, Hv) for j in range(P)]
            sent = (_InFlight(layout.pack_qkv_grad(dq, dk[:, first:], dv[:, first:], chunk), recv_sizes, group), chunk)
            del dq, dk, dv  # packed: the chunk's grads are not needed any more
            if grad_prev is not None:
                land_grads(grad_prev)
            grad_prev = sent
        land_grads(grad_prev)
        ctx.graphs, ctx.param_leaves = None, None
        return (*grads, None, None, None, *param_grads)


def _chunk_grads(graphs: list, c: int, go_BSnH: torch.Tensor, params: tuple[torch.Tensor, ...] = ()) -> tuple:
    """Grads of chunk ``c``'s q, k, v (and of ``params``, None where unused) from its kept graph,
    which is released."""
    (q, k, v), o_BSnH = graphs[c]
    graphs[c] = None
    if not q.shape[1]:
        return q.detach(), k.detach(), v.detach(), *([None] * len(params))
    wanted = [p for p in params if p.requires_grad]
    grads = list(torch.autograd.grad(o_BSnH, (q, k, v, *wanted), go_BSnH, allow_unused=True))
    found = iter(grads[3:])
    return *grads[:3], *(next(found) if p.requires_grad else None for p in params)


def _receive_qkv(buf, chunks: tuple[HeadChunk, ...], c: int, rank: int, kv: list, B: int, s: int, H: int, Hv: int):
    """Unpack chunk ``c``'s q|k|v. Its kv heads land in ``kv`` = [k, v] of all the kv heads this
    rank reads (allocated at the first chunk); the chunk's k, v are views of them, so a carried
    head is shared with the previous chunk, not copied."""
    k0, S = chunks[0].kv_read_ranges[rank][0], chunks[0].sp_size * s
    if not kv:
        num_kv = max(ch.kv_read_ranges[rank][1] for ch in chunks) - k0
        kv.extend((buf.new_empty(B, num_kv, S, H), buf.new_empty(B, num_kv, S, Hv)))
    chunk = chunks[c]
    (ra, rb), (na, nb) = chunk.kv_read_ranges[rank], chunk.kv_ranges[rank]
    q = buf.new_empty(B, chunk.num_local_heads(rank)[0], S, H)
    layout.unpack_qkv(buf, chunk, rank, B, s, H, Hv, into=(q, kv[0][:, na - k0 : nb - k0], kv[1][:, na - k0 : nb - k0]))
    return q, _alias(kv[0][:, ra - k0 : rb - k0]), _alias(kv[1][:, ra - k0 : rb - k0])


def _alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor on ``view``'s memory with a version counter of its own: later chunks write other
    heads of the same buffer, which must not look like an in-place change to this chunk's graph."""
    return view.new_empty(0).set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())


def head_chunked_attention(
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, chunks: tuple[HeadChunk, ...],
    group: ProcessGroup, attend: Attend, params: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """``attend`` on all tokens, chunk by chunk of this rank's heads, exchanges overlapped with compute.

    Args:
        q_BNsH, k_BKsH, v_BKsH: this rank's shard, all heads (as :func:`seq_to_head_qkv`).
        chunks: ``HeadPlan(N, K, P).chunks(C)``: the heads each exchange moves.
        group: the sequence-parallel group (size >= 2).
        attend: the attention of one chunk, ``(q (B,n,S,H), k, v, chunk, params) -> o (B,S,n,Hv)``;
            differentiable (its graph is kept per chunk and run backward chunk by chunk).
        params: other tensors ``attend`` differentiates through (e.g. the ``(N,)`` attention
            sinks); ``attend`` must read them from its ``params`` argument, not from a closure, or
            their gradients are lost.

    Returns:
        ``o (B, s, N, Hv)``, the same as ``head_to_seq_out(attend(seq_to_head_qkv(...)))``.
    """
    return _HeadChunkedAttention.apply(q_BNsH, k_BKsH, v_BKsH, chunks, group, attend, *params)
