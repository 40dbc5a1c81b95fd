"""The ring's point-to-point transport: the neighbour hop and the zigzag re-layout (``attention.ring``).

Shape legend: see ``ulysses_sp.attention.ring``. ``Ring.start`` sends a flat buffer to rank r+1 and
receives one from r-1 (one ``batch_isend_irecv``); ``zigzag_moves`` is the pure chunk bookkeeping of
the causal load balance (contiguous shards <-> 2P chunks, rank r holding chunks r and 2P-1-r) and
``Relayout`` its autograd exchange (one P2P batch each way, the backward moves the grads back).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class Ring:
    """Neighbour exchange on the ring of ``group``: send to r+1, receive from r-1 (one P2P batch)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


def pack_flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack_flat(buf: torch.Tensor, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        out.append(buf[off : off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def zigzag_moves(P: int, r: int, to_zigzag: bool) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The chunk exchange of rank ``r`` between contiguous and zigzag layouts (``P`` ranks, 2P chunks).

    Returns ``(sends, recvs)``: ``sends`` lists ``(my half, destination rank, its half)`` and
    ``recvs`` lists ``(my half, source rank)``; halves are 0 (first ``s/2`` tokens) or 1. Entries
    with ``destination == r`` / ``source == r`` are local copies.
    """
    def zig_owner(chunk: int) -> tuple[int, int]:  # (rank, half) holding `chunk` in zigzag order
        return (chunk, 0) if chunk < P else (2 * P - 1 - chunk, 1)

    mine_contig = [2 * r, 2 * r + 1]
    mine_zig = [r, 2 * P - 1 - r]
    if to_zigzag:
        sends = [(h, *zig_owner(chunk)) for h, chunk in enumerate(mine_contig)]
        recvs = [(h, chunk // 2) for h, chunk in enumerate(mine_zig)]
    else:
        sends = [(h, chunk // 2, chunk % 2) for h, chunk in enumerate(mine_zig)]
        recvs = [(h, zig_owner(chunk)[0]) for h, chunk in enumerate(mine_contig)]
    return sends, recvs


def relayout(ring: Ring, tensors: tuple[torch.Tensor, ...], dim: int, to_zigzag: bool) -> list[torch.Tensor]:
    """Move the halves (along ``dim``) of ``tensors`` between contiguous and zigzag layouts: one P2P batch."""
    P, r = ring.size, ring.rank
    sends, recvs = zigzag_moves(P, r, to_zigzag)
    halves = [[t.narrow(dim, h * (t.shape[dim] // 2), t.shape[dim] // 2) for t in tensors] for h in (0, 1)]
    packed = [pack_flat(*halves[h]) for h in (0, 1)]
    received: list[torch.Tensor | None] = [None, None]
    ops = []
    for h, dest, their_half in sends:
        if dest == r:
            received[their_half] = packed[h]
        else:  # the tag is the receiver's half, so two chunks between one pair of ranks cannot swap
            peer = dist.get_global_rank(ring.group, dest)
            ops.append(dist.P2POp(dist.isend, packed[h], peer, ring.group, their_half))
    for h, src in recvs:
        if src != r:
            received[h] = torch.empty_like(packed[h])
            ops.append(dist.P2POp(dist.irecv, received[h], dist.get_global_rank(ring.group, src), ring.group, h))
    if ops:
        wait_all(dist.batch_isend_irecv(ops))
    out = []
    pieces = [unpack_flat(received[h], tuple(halves[h])) for h in (0, 1)]
    for i in range(len(tensors)):
        out.append(torch.cat([pieces[0][i], pieces[1][i]], dim=dim))
    return out


class Relayout(torch.autograd.Function):
    """Contiguous <-> zigzag layout of several tensors along ``dim``; backward moves the grads back."""

    @staticmethod
    def forward(ctx, ring: Ring, dim: int, to_zigzag: bool, *tensors: torch.Tensor):
        ctx.ring, ctx.dim, ctx.to_zigzag = ring, dim, to_zigzag
        return tuple(relayout(ring, tensors, dim, to_zigzag))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grads = tuple(g.contiguous() for g in grads)
        return (None, None, None, *relayout(ctx.ring, grads, ctx.dim, not ctx.to_zigzag))
