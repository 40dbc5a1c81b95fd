"""The seq->head all-to-all of a token-mixing layer: several per-head tensors, each its own head split.

Shape legend
    B batch, S global sequence, s local shard (S / P), P sequence-parallel size,
    h_i heads of part i (all ranks), F_i features per head of part i.

A linear-attention or state-space layer has two kinds of heads, like attention's query and kv
heads: per value / SSM head (value, beta, decay or x, dt) and per key head / group (q, k or B, C).
Each kind is one *part* ``(B, s, h_i, F_i)`` with its own per-rank head ranges (from
:class:`~ulysses_sp.comm.layout.HeadPlan`: ``q_ranges`` for the first kind, ``kv_ranges`` for the
second, so a group read by heads of several ranks goes to each of them)::

    sender r, for destination j:  [ part_0[:, :, a_0j:b_0j] | part_1[:, :, a_1j:b_1j] | ... ]
    receiver j, from source r:    tokens [r*s, (r+1)*s) of every part, its heads only

One ``all_to_all_single`` for all parts; the backward is the reverse exchange, and a head sent to
several ranks receives the sum of their gradients. The head->seq direction of the output is
:func:`ulysses_sp.comm.all_to_all.head_to_seq_out`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ulysses_sp.comm.checks import check_one_dtype

Ranges = tuple[tuple[int, int], ...]


def _send_sizes(parts: tuple[torch.Tensor, ...], ranges: tuple[Ranges, ...]) -> list[int]:
    B, s = parts[0].shape[:2]
    P = len(ranges[0])
    return [sum(B * s * (r[j][1] - r[j][0]) * t.shape[3] for t, r in zip(parts, ranges)) for j in range(P)]


class _SeqToHeadParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ranges: tuple[Ranges, ...], group: ProcessGroup, *parts_BshF: torch.Tensor):
        rank, P = dist.get_rank(group), len(ranges[0])
        B, s = parts_BshF[0].shape[:2]
        send = torch.cat([t[:, :, r[j][0] : r[j][1]].reshape(-1) for j in range(P) for t, r in zip(parts_BshF, ranges)])
        mine = [(r[rank][1] - r[rank][0], t.shape[3]) for t, r in zip(parts_BshF, ranges)]
        recv = send.new_empty(P * sum(B * s * h * F for h, F in mine))
        dist.all_to_all_single(recv, send, [recv.numel() // P] * P, _send_sizes(parts_BshF, ranges), group=group)
        outs = [send.new_empty(B, P * s, h, F) for h, F in mine]
        off = 0
        for src in range(P):
            for out in outs:
                part = out[:, src * s : (src + 1) * s]
                part.copy_(recv[off : off + part.numel()].view(part.shape))
                off += part.numel()
        ctx.ranges, ctx.group, ctx.shapes = ranges, group, [t.shape for t in parts_BshF]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads_BShF: torch.Tensor):
        ranges, group, shapes = ctx.ranges, ctx.group, ctx.shapes
        P = len(ranges[0])
        B, s = shapes[0][:2]
        send = torch.cat([g[:, i * s : (i + 1) * s].reshape(-1) for i in range(P) for g in grads_BShF])
        recv_sizes = [sum(B * s * (r[j][1] - r[j][0]) * shape[3] for shape, r in zip(shapes, ranges)) for j in range(P)]
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, [send.numel() // P] * P, group=group)
        outs = [send.new_zeros(shape) for shape in shapes]
        off = 0
        for j in range(P):
            for out, r in zip(outs, ranges):
                part = out[:, :, r[j][0] : r[j][1]]
                part.add_(recv[off : off + part.numel()].view(part.shape))
                off += part.numel()
        return (None, None, *outs)


def seq_to_head_parts(
    parts_BshF: tuple[torch.Tensor, ...], ranges: tuple[Ranges, ...], group: ProcessGroup | None
) -> tuple[torch.Tensor, ...]:
    """My tokens, all heads -> all tokens, my heads, for every part in ONE all-to-all.

    Args:
        parts_BshF: ``(B, s, h_i, F_i)`` tensors of one dtype (this rank's shard).
        ranges: per part, the ``(start, end)`` heads of every rank (``HeadPlan.q_ranges`` / ``kv_ranges``).
        group: the sequence-parallel group; ``None`` (or one range per part): identity.

    Returns:
        per part ``(B, S, n_i, F_i)``: this rank's heads of it over the whole sequence.
    """
    if group is None or len(ranges[0]) == 1:
        return tuple(parts_BshF)
    check_one_dtype("the exchanged parts", *parts_BshF)
    return _SeqToHeadParts.apply(ranges, group, *parts_BshF)
