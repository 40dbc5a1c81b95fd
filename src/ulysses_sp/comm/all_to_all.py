"""Autograd all-to-all between sequence-sharded and head-sharded layouts.

Shape legend: see ``ulysses_sp.comm.layout``.

    seq_to_head_qkv:  q (B,N,s,H), k/v (B,K,s,H)  --one all_to_all-->  q (B,n,S,H), k/v (B,k,S,H)
    head_to_seq_out:  o (B,S,n,Hv)                --one all_to_all-->  o (B,s,N,Hv)

Each backward is the reverse exchange (one collective), so an attention forward+backward costs
exactly four collectives. The layout work lives in ``layout``; this module only moves buffers.

Head-chunked attention (the exchanges per chunk of heads, with recompute) is ``comm.head_chunked``;
it overlaps exchanges with :class:`InFlight`. Every exchange frees its send buffer once sent and its
receive buffer once unpacked (``free_storage``), rather than when a backend lets go of its work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ulysses_sp.comm import layout
from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.comm.saved_graph import free_storage


class InFlight:
    """One asynchronous ``all_to_all_single`` of a packed buffer (a ``pack_*`` result); the buffers live until
    :meth:`wait` frees the sent one and returns the received one."""

    def __init__(self, packed: tuple[torch.Tensor, list[int]], recv_sizes: list[int], group: ProcessGroup) -> None:
        self.send, send_sizes = packed
        self.recv = self.send.new_empty(sum(recv_sizes))
        self.work = dist.all_to_all_single(self.recv, self.send, recv_sizes, send_sizes, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        # the send buffer is ours alone and done with: free it now (a backend may hold the work, and
        # with it the buffer, a while longer); drop the work, so the caller holds the only reference
        free_storage(self.send)
        recv, self.send, self.recv, self.work = self.recv, None, None, None
        return recv

    def unpack(self, unpack: Callable[[torch.Tensor], object]) -> None:
        """Wait, ``unpack(received)`` into tensors of its own (not views), then free the receive buffer."""
        recv = self.wait()
        unpack(recv)
        free_storage(recv)


def _exchange(packed: tuple[torch.Tensor, list[int]], recv_sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    """One blocking exchange: the send buffer is freed before the received one is unpacked (a third copy
    of q|k|v alive during the unpack otherwise)."""
    return InFlight(packed, recv_sizes, group).wait()


class _SeqToHeadQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNsH, k_BKsH, v_BKsH, plan: HeadPlan, group: ProcessGroup):
        rank = dist.get_rank(group)
        B, _, s, H = q_BNsH.shape
        Hv = v_BKsH.shape[3]
        recv_sizes = [plan.qkv_numels(rank, B, s, H, Hv)] * plan.sp_size
        recv = _exchange(layout.pack_qkv(q_BNsH, k_BKsH, v_BKsH, plan), recv_sizes, group)
        ctx.plan, ctx.group, ctx.dims = plan, group, (B, s, H, Hv)
        q, k, v = layout.unpack_qkv(recv, plan, rank, B, s, H, Hv)
        free_storage(recv)
        return q, k, v

    @staticmethod
    def backward(ctx, gq_BnSH, gk_BkSH, gv_BkSH):
        plan, group, (B, s, H, Hv) = ctx.plan, ctx.group, ctx.dims
        recv_sizes = [plan.qkv_numels(j, B, s, H, Hv) for j in range(plan.sp_size)]
        recv = _exchange(layout.pack_qkv_grad(gq_BnSH, gk_BkSH, gv_BkSH, plan), recv_sizes, group)
        gq, gk, gv = layout.unpack_qkv_grad(recv, plan, B, s, H, Hv)
        free_storage(recv)
        return gq, gk, gv, None, None


class _HeadToSeqOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_BSnH, plan: HeadPlan, group: ProcessGroup):
        B, S, n, Hv = o_BSnH.shape
        s = S // plan.sp_size
        recv_sizes = [B * s * (qb - qa) * Hv for qa, qb in plan.q_ranges]
        recv = _exchange(layout.pack_out(o_BSnH, plan), recv_sizes, group)
        ctx.plan, ctx.group, ctx.dims = plan, group, (B, s, Hv)
        o = layout.unpack_out(recv, plan, B, s, Hv)
        free_storage(recv)
        return o

    @staticmethod
    def backward(ctx, g_BsNH):
        plan, group, (B, s, Hv) = ctx.plan, ctx.group, ctx.dims
        rank = dist.get_rank(group)
        n, _ = plan.num_local_heads(rank)
        recv = _exchange(layout.pack_out_grad(g_BsNH, plan), [B * s * n * Hv] * plan.sp_size, group)
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
