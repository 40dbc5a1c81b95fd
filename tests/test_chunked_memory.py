"""Head-chunked attention keeps only sharded tensors between forward and backward, replays dropout
in its recompute, and picks its chunk count from a byte target (``UlyssesSPConfig.sp_head_chunk_mib``).

What autograd saves is recorded with ``torch.autograd.graph.saved_tensors_hooks`` installed inside
the attention call: in the forward, and in the forward that activation checkpointing re-runs
during backward. One gloo group of P=2 runs every case.
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dist_helper import spawn
from ulysses_sp import SPMesh, UlyssesAttention, UlyssesSPConfig
from ulysses_sp.comm.cost import chunk_live_bytes, chunks_for_bytes
from ulysses_sp.comm.layout import HeadPlan

B, S, N, K, H = 2, 16, 6, 2, 4


def _saving(attention, records):
    """``attention`` wrapped so every tensor autograd saves inside it is recorded as its shape."""

    def call(q, k, v, **kw):
        def pack(t):
            records.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return attention(q, k, v, **kw)

    return call


def _inputs(rank, world, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, H, generator=gen) for h in (N, K, K))
    s = S // world
    return [t[:, :, rank * s:(rank + 1) * s].clone().requires_grad_() for t in (q, k, v)]


def _check_saved(mesh, rank, world):
    s = S // world
    sharded = {(B, N, s, H), (B, K, s, H), (B, s, N, H)}  # q, k / v, and the layer's own (sharded) output
    for chunks, checkpointed in ((1, False), (3, False), (3, True)):
        records = []
        attention = _saving(UlyssesAttention(mesh.sp_group, "sdpa", head_chunks=chunks), records)
        q, k, v = _inputs(rank, world)
        if checkpointed:
            # reentrant: the forward runs without a graph and backward re-runs it with one, so the
            # probe inside sees exactly what the recompute saves (a non-reentrant checkpoint's own
            # hooks would be bypassed by the probe's, which then keeps the tensors itself)
            o = checkpoint(attention, q, k, v, use_reentrant=True)
        else:
            o = attention(q, k, v)
        in_forward = len(records)
        if chunks > 1 and not checkpointed:  # the kept kernel graphs: no full-length tensor left in them
            kept = [g for g in o.grad_fn.graphs if g is not None]
            assert kept, "sdpa on a causal mask saves q, k, v, o and the log-sum-exp: its graphs can be kept"
            for graph, *sources in kept:
                held = [tuple(h.tensor.shape) for h in graph.holders if h.tensor is not None]
                assert all(len(shape) < 4 for shape in held), held  # the (B, n_c, S) log-sum-exp only
                assert all(t.untyped_storage().nbytes() == 0 for t in sources)  # q, k, v, o freed
        o.square().sum().backward(retain_graph=not checkpointed)
        if not checkpointed:  # again (retain_graph): the kept graphs are used up, the chunks are recomputed
            first = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            o.square().sum().backward()
            for a, b in zip((q.grad, k.grad, v.grad), first):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # fp32, the same kernel recomputed
        full_length = [shape for shape in records if S in shape]
        if chunks == 1:  # the probe sees the kernel's full-length saves (q, k, v, o of my heads)
            assert full_length, records
            continue
        where = f"chunks={chunks} checkpointed={checkpointed}"
        assert not full_length, f"{where}: full-length tensors saved for backward: {full_length}"
        assert set(records) <= sharded and len(records) == 4, (where, records)
        assert in_forward == (0 if checkpointed else 4), (where, in_forward)


def _check_dropout_replay(mesh, rank, world):
    # attention is linear in v for a fixed dropout mask: sum(o * g) == sum over ranks of <dL/dv, v>
    # exactly when the recompute in backward drew the forward's mask (another mask breaks it by O(1))
    q, k, v = _inputs(rank, world, seed=3)
    g = torch.randn(B, S // world, N, H, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(1234 + rank)
    o = UlyssesAttention(mesh.sp_group, "sdpa", head_chunks=3)(q, k, v, dropout=0.5)
    loss = (o * g).sum()
    loss.backward()
    both = torch.stack([loss.detach(), (v.grad * v.detach()).sum()]).double()
    dist.all_reduce(both, group=mesh.sp_group)
    # fp32 sums of ~500 O(1) products in two orders: ~1e-5 relative; a wrong mask is O(1)
    torch.testing.assert_close(both[1], both[0], rtol=1e-4, atol=1e-4)


def _check_byte_target(mesh, rank, world):
    plan = HeadPlan(N, K, world)
    one_chunk = chunk_live_bytes(plan, 1, B, S, H, H, 4)
    for limit, want in ((one_chunk, 1), (one_chunk - 1, None), (1, plan.num_chunks(N))):
        attention = UlyssesAttention(mesh.sp_group, "sdpa", head_chunk_bytes=limit)
        C = attention.num_chunks(plan, torch.empty(B, N, S // world, H), H)
        assert C == (want or chunks_for_bytes(plan, limit, B, S, H, H, 4)) and C >= 1
        assert chunk_live_bytes(plan, C, B, S, H, H, 4) <= limit or C == plan.num_chunks(N)
        if want is None:
            assert C > 1
    # a whole model under sp_head_chunk_mib equals it unchunked (tiny: 1 byte forces one head a chunk)
    from test_chunked_attention import _model_loss_and_grads

    ref_loss, ref_grads = _model_loss_and_grads("qwen3", "packed", mesh, 1, True)
    config = UlyssesSPConfig(sp_size=world, sp_head_chunk_mib=1e-6)
    loss, grads = _model_loss_and_grads("qwen3", "packed", mesh, 1, True, config=config)
    # fp32, same inputs, summation order only (test_chunked_attention's SAME_TOL and scaled grads)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-6, atol=2e-6)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-5, msg=name)


def _check_compiled(mesh, world):
    """torch.compile (aot_eager) of a model whose chunked attention keeps its kernels' graphs equals eager."""
    from tiny_models import tiny_batch, tiny_model
    from ulysses_sp import UlyssesSP, global_num_items

    results = []
    for compiled in (False, True):
        model = tiny_model("llama")
        with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=world, sp_head_chunks=2)) as sp:
            run = torch.compile(model, backend="aot_eager") if compiled else model
            shard = sp.shard({"input_ids": tiny_batch("padding")["input_ids"]})
            loss = sp.forward_loss(run, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
            loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    # the same kernels on the same values; aot_eager may reorder a few fp32 ops: a few eps of O(1) terms
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    _check_saved(mesh, rank, world)
    _check_dropout_replay(mesh, rank, world)
    _check_byte_target(mesh, rank, world)
    _check_compiled(mesh, world)


def test_chunked_layer_saves_only_sharded_inputs_replays_dropout_and_meets_byte_target():
    """Bug caught: a chunked layer that keeps any full-length q/k/v/o for backward (its memory would
    grow with all local heads again), in what it saves or in the kernel graphs it keeps, also in the
    forward that activation checkpointing re-runs; a
    recompute that draws another dropout mask than the forward (gradients of a different function);
    a byte target that picks more chunks than needed, fewer than it needs, or does not reach a model
    through ``UlyssesSPConfig.sp_head_chunk_mib`` (or changes its loss and gradients); the kept graphs
    (saved-tensor hooks inside an autograd function) breaking ``torch.compile``, or a second backward
    (``retain_graph=True``) failing once the kept graphs are used up."""
    spawn(_worker, 2)


def test_saved_graph_drops_what_it_can_rebuild_and_its_backward_is_unchanged():
    """Bug caught: a kept chunk graph that still holds its full-length q / k / v / o (the memory the
    chunking exists to avoid), a rebuilt tensor with another layout than the one the kernel saved
    (its backward reads wrong elements), and a graph kept although the kernel saved a large tensor
    that cannot be rebuilt (a dropout mask, gathered copies)."""
    from ulysses_sp.comm.saved_graph import SavedGraph, free_storage

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 16, 4, generator=gen) for _ in range(3))  # fp32: SDPA's CPU flash kernel
    go = torch.randn(2, 16, 3, 4, generator=gen)

    def kernel(q, k, v, extra=False):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return o * torch.ones(16, 16, dtype=q.dtype).sum() / 16 if extra else o  # extra: saves a (16,16) tensor

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(kernel(*leaves), leaves, go)
    graph, leaves = SavedGraph(), [t.clone().requires_grad_() for t in (q, k, v)]
    with graph.hooks():
        o = kernel(*leaves)
    values = o.detach().clone()
    # the flash kernel saves q, k, v, its output and the fp32 log-sum-exp (2*3*16*4 = 384 bytes): only that stays
    assert graph.release({"q": leaves[0], "k": leaves[1], "v": leaves[2], "o": o}, 384)
    assert sum(h.tensor is None for h in graph.holders) >= 4
    assert sum(h.tensor.numel() for h in graph.holders if h.tensor is not None) <= 2 * 3 * 16
    free_storage(*leaves, o)
    for name, t in (("q", q), ("k", k), ("v", v), ("o", values)):
        graph.rebuild(name, t)
    got = torch.autograd.grad(o, leaves, go)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same kernel on the same values: bitwise
    graph2, leaves2 = SavedGraph(), [t.clone().requires_grad_() for t in (q, k, v)]
    with graph2.hooks():
        o2 = torch.nn.functional.dropout(kernel(*leaves2), p=0.5)  # saves a mask the graph cannot rebuild
    assert not graph2.release({"q": leaves2[0], "k": leaves2[1], "v": leaves2[2], "o": o2}, 64)


def test_byte_target_is_validated():
    """Bug caught: a chunk byte target that is not a positive number reaching the layer, or one given to the
    ring backend (which has no head chunks) silently ignored."""
    assert UlyssesSPConfig(sp_head_chunk_mib=0.5).head_chunk_bytes == 2**19
    assert UlyssesSPConfig().head_chunk_bytes is None
    for bad in (0, -1.0, True, "8", float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sp_head_chunk_mib"):
            UlyssesSPConfig(sp_head_chunk_mib=bad)
    with pytest.raises(ValueError, match="ulysses"):
        UlyssesSPConfig(sp_backend="ring", sp_head_chunk_mib=64)
    with pytest.raises(ValueError, match="head_chunk_bytes"):
        UlyssesAttention(None, "sdpa", head_chunk_bytes=0)
