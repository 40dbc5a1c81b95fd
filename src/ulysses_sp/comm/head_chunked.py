"""Head-chunked Ulysses attention: full-length tensors of ONE chunk of heads at a time, forward and backward.

Shape legend: see ``ulysses_sp.comm.layout``; ``n_c`` / ``k_c`` the query / kv heads of one chunk.

The layer is one autograd function that saves its sequence-sharded inputs ``q (B,N,s,H)``,
``k, v (B,K,s,H)``, its sharded output ``o (B,s,N,Hv)`` (the tensor ``o_proj`` saves anyway) and
the params (e.g. sinks). No full-length tensor outlives its chunk::

    forward    for c in chunks:  qkv(c) --a2a--> q (B,n_c,S,H) ...  kernel  o(c) --a2a--> o (B,s,N,Hv)
               qkv(c+1) is in flight while chunk c computes; o(c) while chunk c+1's lands. The
               kernel's graph is kept, but the q / k / v / o it saved are dropped (``SavedGraph``):
               only what it saves besides them stays (the log-sum-exp)
    backward   for c in chunks (same order):
                 1. the grads of chunk c-1 (step 4) land, before any buffer of chunk c exists
                 2. qkv(c) --a2a--> full length; then o(c) and the output grad go(c) --a2a--> full
                    length (3 collectives in all)
                 3. the kept graph's q / k / v / o rebuilt from them, the kernel's own backward
                 4. dq|dk|dv(c) --a2a--> back to the sequence shards
               (memory first: in flight beside another chunk's buffers, as the forward's prefetch is,
               the exchanges of two chunks would be alive at the backward's peak)

A kernel that saves a large tensor the graph cannot rebuild (a dropout mask, the gathered
documents of packed rows, eager's probabilities) keeps no graph for that chunk: step 3 then
recomputes the chunk's forward, with the forward's RNG state replayed for dropout. Either way the
collectives are the same on every rank: 2C forward, 4C backward (``attention_comm(...,
head_chunks=C)``). Bytes: the forward's are the unchunked layer's; the backward adds the
forward's q|k|v exchange and one output exchange to the unchunked backward. A kv head read by two
chunks is received once per pass (the next chunk keeps its last kv head, "carried",
``HeadChunk.carried``); its gradient is held back until the last chunk reading it is done.

Under activation checkpointing the layer's recompute calls this forward again: it saves the same
sharded tensors, nothing full-length (the graphs it keeps hold the log-sum-exp).

Peak of the layer (besides the sharded inputs, the output and its gradient): forward, one chunk's
q/k/v/o plus the next chunk's q/k/v in flight; backward, one chunk's q/k/v/o, go and dq/dk/dv plus
the kernel's temporaries (``comm.cost.chunk_live_bytes``; ``chunks_for_bytes`` picks C from a byte target).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ulysses_sp.comm import layout
from ulysses_sp.comm.all_to_all import InFlight
from ulysses_sp.comm.layout import HeadChunk
from ulysses_sp.comm.rng import RngState
from ulysses_sp.comm.saved_graph import SavedGraph, free_storage

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, HeadChunk, tuple[torch.Tensor, ...]], torch.Tensor]
"""``attend(q (B,n,S,H), k (B,k,S,H), v (B,k,S,Hv), chunk, params) -> o (B,S,n,Hv)`` for one chunk of
heads; ``params``: the differentiable tensors besides q, k, v that attention reads (e.g. sinks)."""


class _Chunks:
    """Per-rank bookkeeping of one layer call: the chunk exchanges and the carried kv head."""

    def __init__(self, chunks: tuple[HeadChunk, ...], group: ProcessGroup, dims: tuple[int, ...]) -> None:
        self.chunks, self.group, self.dims = chunks, group, dims
        self.rank, self.P = dist.get_rank(group), chunks[0].sp_size
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None  # last kv head of the previous chunk

    def send_qkv(self, q_BNsH, k_BKsH, v_BKsH, c: int) -> InFlight:
        B, N, K, s, H, Hv = self.dims
        chunk = self.chunks[c]
        return InFlight(layout.pack_qkv(q_BNsH, k_BKsH, v_BKsH, chunk),
                         [chunk.qkv_numels(self.rank, B, s, H, Hv)] * self.P, self.group)

    def receive_qkv(self, buf: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunk ``c``'s ``q (B,n_c,S,H)`` and the kv heads its queries read, the carried one first."""
        B, N, K, s, H, Hv = self.dims
        chunk, S = self.chunks[c], self.P * s
        (ra, rb), carried = chunk.kv_read_ranges[self.rank], chunk.carried(self.rank)
        q = buf.new_empty(B, chunk.num_local_heads(self.rank)[0], S, H)
        k, v = buf.new_empty(B, rb - ra, S, H), buf.new_empty(B, rb - ra, S, Hv)
        if carried:
            k[:, :1].copy_(self.kept[0])
            v[:, :1].copy_(self.kept[1])
        layout.unpack_qkv(buf, chunk, self.rank, B, s, H, Hv, into=(q, k[:, carried:], v[:, carried:]))
        carries = c + 1 < len(self.chunks) and self.chunks[c + 1].carried(self.rank)
        self.kept = (k[:, -1:].clone(), v[:, -1:].clone()) if carries else None
        free_storage(buf)
        return q, k, v

    def carry_out(self, c: int, rank: int) -> int:
        """1 if chunk ``c + 1`` reads ``rank``'s last kv head of chunk ``c`` again (its grad waits for it)."""
        return int(c + 1 < len(self.chunks) and self.chunks[c + 1].carried(rank) == 1)

    def grad_chunk(self, c: int) -> HeadChunk:
        """Chunk ``c`` with ``kv_ranges`` = the kv heads whose (complete) gradients it sends back."""
        chunk = self.chunks[c]
        ranges = tuple((a, b - self.carry_out(c, j)) for j, (a, b) in enumerate(chunk.kv_read_ranges))
        return dataclasses.replace(chunk, kv_ranges=ranges)


class ChunkStash:
    """The forward results of head-chunked calls, held for a recompute of the code AROUND them.

    A caller that recomputes the projections around attention in backward (``memory.head_blocks``),
    but not the kernel, runs the same calls twice::

        mode "keep"    (its forward, no grad): each call runs as usual and leaves its output, the
                       kept kernel graphs and RNG states here, in call order; it returns the output
        mode "replay"  (its recompute, with grad): each call takes the next held result instead of
                       running the kernel; its backward is the usual one. A one-chunk call (head
                       blocks) exchanges its q|k|v already here, as its backward follows at once, and
                       saves them at full length instead of sharded (no sharded copy beside them)

    A replayed call that finds nothing held (a second backward) runs the kernel again.
    """

    def __init__(self) -> None:
        self.mode = "keep"
        self.runs: list[_Run] = []

    def outputs(self) -> list[torch.Tensor]:
        """The held outputs ``o (B,s,N,Hv)``, taken out (to be saved by the caller, who gives them back)."""
        outs = [run.out for run in self.runs]
        for run in self.runs:
            run.out = None
        return outs

    def replay(self, outputs: list[torch.Tensor]) -> None:
        """Switch to "replay" with the outputs :meth:`outputs` took."""
        for run, out in zip(self.runs, outputs):
            run.out = out
        self.mode = "replay"


@dataclasses.dataclass
class _Run:
    """One call's forward: its output, per chunk the RNG state and the kept graph, the param leaves."""

    out: torch.Tensor | None
    rng: list
    graphs: list
    leaves: tuple[torch.Tensor, ...]


def _run_forward(q_BNsH, k_BKsH, v_BKsH, chunks: tuple[HeadChunk, ...], group: ProcessGroup, attend: Attend,
                 replay_rng: bool, keep_graphs: bool, params: tuple[torch.Tensor, ...]) -> _Run:
    """The forward of the module docstring: every chunk exchanged, attended and sent back."""
    B, N, s, H = q_BNsH.shape
    K, Hv = k_BKsH.shape[1], v_BKsH.shape[3]
    run = _Chunks(chunks, group, (B, N, K, s, H, Hv))
    rngs: list = [None] * len(chunks)  # per chunk: the RNG state its recompute replays (dropout)
    graphs: list = [None] * len(chunks)  # per chunk: (SavedGraph, q, k, v, o) where the graph is kept
    leaves = tuple(p.detach().requires_grad_(p.requires_grad) for p in params)
    out = q_BNsH.new_empty(B, s, N, Hv)
    sent_out: tuple[InFlight, HeadChunk] | None = None
    qkv_next = run.send_qkv(q_BNsH, k_BKsH, v_BKsH, 0)
    for c, chunk in enumerate(chunks):
        qkv = qkv_next
        q, k, v = run.receive_qkv(qkv.wait(), c)  # its buffers freed before the next chunk's exist
        if c + 1 < len(chunks):
            qkv_next = run.send_qkv(q_BNsH, k_BKsH, v_BKsH, c + 1)  # in flight while chunk c computes
        rngs[c] = RngState.capture(q.device) if replay_rng else None
        o_BSnH, graph = _attend_keeping_graph(attend, q, k, v, chunk, leaves, keep_graphs)
        recv_sizes = [B * s * (qb - qa) * Hv for qa, qb in chunk.q_ranges]
        packed = layout.pack_out(o_BSnH, chunk)
        if graph is not None and graph.release({"q": q, "k": k, "v": v, "o": o_BSnH}, q.nbytes // 2):
            graphs[c] = (graph, q, k, v, o_BSnH)
            free_storage(q, k, v, o_BSnH)  # the graph rebuilds them in backward
        del q, k, v, o_BSnH, graph  # packed: free o before the receive buffer is allocated
        sending = (InFlight(packed, recv_sizes, group), chunk)
        del packed
        if sent_out is not None:
            sent_out[0].unpack(lambda buf, chunk=sent_out[1]: layout.unpack_out(buf, chunk, B, s, Hv, into=out))
        sent_out = sending
    sent_out[0].unpack(lambda buf: layout.unpack_out(buf, sent_out[1], B, s, Hv, into=out))
    return _Run(out, rngs, graphs, leaves)


class _HeadChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNsH, k_BKsH, v_BKsH, chunks: tuple[HeadChunk, ...], group: ProcessGroup, attend: Attend,
                replay_rng: bool, keep_graphs: bool, held: _Run | None, *params: torch.Tensor):
        run = held or _run_forward(q_BNsH, k_BKsH, v_BKsH, chunks, group, attend, replay_rng, keep_graphs, params)
        out = run.out.detach()
        ctx.rng, ctx.graphs, ctx.leaves = run.rng, run.graphs, run.leaves
        B, N, s, H = q_BNsH.shape
        ctx.dims = (B, N, k_BKsH.shape[1], s, H, v_BKsH.shape[3])
        ctx.prefetched = held is not None and len(chunks) == 1
        if ctx.prefetched:  # a replayed chunk, its backward next: exchange q|k|v now and keep only the full length
            chunk_run = _Chunks(chunks, group, ctx.dims)
            q_BNsH, k_BKsH, v_BKsH = chunk_run.receive_qkv(chunk_run.send_qkv(q_BNsH, k_BKsH, v_BKsH, 0).wait(), 0)
        ctx.save_for_backward(q_BNsH, k_BKsH, v_BKsH, out, *params)
        ctx.chunks, ctx.group, ctx.attend = chunks, group, attend
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_BsNH):
        q_BNsH, k_BKsH, v_BKsH, out, *params = ctx.saved_tensors  # full length already where ``prefetched``
        B, N, K, s, H, Hv = ctx.dims
        run = _Chunks(ctx.chunks, ctx.group, ctx.dims)
        grads = None  # the sharded q/k/v grads: allocated when the first chunk's land, after its kernel backward

        def landed(buf: torch.Tensor, grad_chunk: HeadChunk) -> None:
            nonlocal grads
            if grads is None:
                grads = (out.new_empty(B, N, s, H), out.new_zeros(B, K, s, H), out.new_zeros(B, K, s, Hv))
            layout.unpack_qkv_grad(buf, grad_chunk, B, s, H, Hv, into=grads)
            free_storage(buf)

        param_grads: list[torch.Tensor | None] = [None] * len(params)
        pending, sent_grads = None, None
        for c, chunk in enumerate(run.chunks):
            n = chunk.num_local_heads(run.rank)[0]
            if sent_grads is not None:  # 1. (before chunk c's buffers exist: one chunk's exchanges at a time)
                landed(sent_grads[0].wait(), sent_grads[1])
            q, k, v = (q_BNsH, k_BKsH, v_BKsH) if ctx.prefetched else run.receive_qkv(
                run.send_qkv(q_BNsH, k_BKsH, v_BKsH, c).wait(), c)  # 2.
            kept, ctx.graphs[c] = ctx.graphs[c], None
            # then o(c) and its gradient, one exchange at a time, each buffer freed once unpacked
            o_in = InFlight(layout.pack_out_grad(out, chunk), [B * s * n * Hv] * run.P, ctx.group)
            if kept is not None:  # 3. the kept graph, its q / k / v / o rebuilt (no copy where the layout is kept)
                for name, values in (("q", q), ("k", k), ("v", v)):
                    kept[0].rebuild(name, values)
                del q, k, v
                o_in.unpack(lambda buf: layout.unpack_out_grad(buf, chunk, run.rank, B, s, Hv,
                                                               into=kept[0].target("o", out)))
            else:  # 3. recompute (below): the output is not needed
                free_storage(o_in.wait())
            go_buf = InFlight(layout.pack_out_grad(g_BsNH, chunk), [B * s * n * Hv] * run.P, ctx.group).wait()
            go = layout.unpack_out_grad(go_buf, chunk, run.rank, B, s, Hv)  # may be a view of go_buf
            if kept is not None:
                dq, dk, dv, dp = _graph_grads(kept, go, ctx.leaves)
            else:  # the RNG state of the forward replayed for dropout
                with ctx.rng[c].replayed() if ctx.rng[c] is not None else contextlib.nullcontext():
                    dq, dk, dv, dp = _chunk_grads(ctx.attend, q, k, v, go, chunk, ctx.leaves)
                del q, k, v
            kept = go = None
            free_storage(go_buf)
            if ctx.prefetched:  # ours alone (this node runs backward once, inside a head block's)
                free_storage(q_BNsH, k_BKsH, v_BKsH)
            param_grads = [a if b is None else b if a is None else a + b for a, b in zip(param_grads, dp)]
            if pending is not None:  # the previous chunk's last kv head, read here again
                dk[:, :1] += pending[0]
                dv[:, :1] += pending[1]
            last = dk.shape[1] - run.carry_out(c, run.rank)
            pending = (dk[:, last:].clone(), dv[:, last:].clone()) if last < dk.shape[1] else None
            grad_chunk = run.grad_chunk(c)
            recv_sizes = [grad_chunk.qkv_numels(j, B, s, H, Hv) for j in range(run.P)]
            packed = layout.pack_qkv_grad(dq, dk[:, :last], dv[:, :last], grad_chunk)
            del dq, dk, dv  # packed: free them before the receive buffer is allocated
            sent_grads = (InFlight(packed, recv_sizes, ctx.group), grad_chunk)  # 4.
            del packed
        landed(sent_grads[0].wait(), sent_grads[1])
        return (*grads, None, None, None, None, None, None, *param_grads)


def _attend_keeping_graph(attend: Attend, q, k, v, chunk: HeadChunk, leaves: tuple[torch.Tensor, ...],
                          keep_graph: bool) -> tuple[torch.Tensor, SavedGraph | None]:
    """Chunk ``chunk``'s output ``(B,S,n,Hv)``, and its graph (q, k, v as leaves) when ``keep_graph``."""
    if not q.shape[1]:
        return q.new_empty(q.shape[0], q.shape[2], 0, v.shape[3]), None
    if not keep_graph:
        return attend(q, k, v, chunk, leaves), None
    graph = SavedGraph()
    with torch.enable_grad(), graph.hooks():
        for t in (q, k, v):
            t.requires_grad_()
        return attend(q, k, v, chunk, leaves), graph


def _graph_grads(kept: tuple, go_BSnH, params: tuple[torch.Tensor, ...]) -> tuple:
    """Backward of a kept chunk graph whose q / k / v / o were rebuilt; ``(dq, dk, dv, [d param or None])``."""
    graph, q_leaf, k_leaf, v_leaf, o_root = kept
    grads = _leaf_grads(o_root, (q_leaf, k_leaf, v_leaf), go_BSnH, params,
                        like=[graph.rebuilt[name] for name in "qkv"])
    graph.clear()
    return grads


def _chunk_grads(attend: Attend, q, k, v, go_BSnH, chunk: HeadChunk, params: tuple[torch.Tensor, ...]) -> tuple:
    """Recompute chunk ``chunk``'s attention with a graph; ``(dq, dk, dv, [d param or None])``."""
    if not q.shape[1]:
        return q, k, v, [None] * len(params)
    with torch.enable_grad():
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        return _leaf_grads(attend(q, k, v, chunk, params), (q, k, v), go_BSnH, params, like=(q, k, v))


def _leaf_grads(o_BSnH, qkv: tuple, go_BSnH, params: tuple[torch.Tensor, ...], like) -> tuple:
    """``(dq, dk, dv, [d param or None])`` of ``o_BSnH`` against ``go_BSnH`` (zeros where unused, on ``like``)."""
    wanted = [p for p in params if p.requires_grad]
    grads = list(torch.autograd.grad(o_BSnH, (*qkv, *wanted), go_BSnH, allow_unused=True))
    found = iter(grads[3:])
    dq, dk, dv = (g if g is not None else t.new_zeros(leaf.shape) for g, t, leaf in zip(grads[:3], like, qkv))
    return dq, dk, dv, [next(found) if p.requires_grad else None for p in params]


def head_chunked_attention(
    q_BNsH: torch.Tensor, k_BKsH: torch.Tensor, v_BKsH: torch.Tensor, chunks: tuple[HeadChunk, ...],
    group: ProcessGroup, attend: Attend, params: tuple[torch.Tensor, ...] = (), replay_rng: bool = False,
    stash: ChunkStash | None = None,
) -> torch.Tensor:
    """``attend`` on all tokens, one chunk of this rank's heads at a time, recomputed in backward.

    Args:
        q_BNsH, k_BKsH, v_BKsH: this rank's shard, all heads (as :func:`seq_to_head_qkv` takes them).
        chunks: ``HeadPlan(N, K, P).chunks(C)``: the heads each exchange moves.
        group: the sequence-parallel group (size >= 2).
        attend: the attention of one chunk, ``(q (B,n,S,H), k, v, chunk, params) -> o (B,S,n,Hv)``,
            differentiable and deterministic given the RNG state (it runs again in backward).
        params: other tensors ``attend`` differentiates through (e.g. the ``(N,)`` attention
            sinks); ``attend`` must read them from its ``params`` argument, not from a closure, or
            their gradients are lost.
        replay_rng: ``attend`` draws random numbers (attention dropout): replay the forward's RNG
            state for the recompute.
        stash: a caller that recomputes the code around this call (:class:`ChunkStash`): in its
            "keep" mode the results are held there (kernel graphs kept even without grad), in its
            "replay" mode they are taken from there instead of computed.

    Returns:
        ``o (B, s, N, Hv)``, equal to ``head_to_seq_out(attend(seq_to_head_qkv(...)))``.
    """
    if stash is not None and stash.mode == "keep":
        run = _run_forward(q_BNsH, k_BKsH, v_BKsH, chunks, group, attend, replay_rng, True, params)
        stash.runs.append(run)
        return run.out
    held = None
    if stash is not None and stash.runs:
        held = stash.runs.pop(0)
    keep_graphs = torch.is_grad_enabled() and any(t.requires_grad for t in (q_BNsH, k_BKsH, v_BKsH, *params))
    return _HeadChunkedAttention.apply(q_BNsH, k_BKsH, v_BKsH, chunks, group, attend, replay_rng, keep_graphs,
                                       held, *params)
