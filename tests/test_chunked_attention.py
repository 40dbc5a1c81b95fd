"""Head-chunked Ulysses (``UlyssesSPConfig.sp_head_chunks`` / ``UlyssesAttention(head_chunks=C)``).

One gloo process group per world size P in {2, 3, 4}; inside it, every case compares the chunked
layer's output and the gradients of q, k and v with (1) a float64 attention on the whole
sequence computed here with an explicitly built mask, and (2) the unchunked layer on the same
inputs. Cases: uneven head splits (N % P != 0), fewer kv heads than ranks (K < P), chunks that
cut a kv group (a kv head carried to the next chunk), more chunks than heads, packed documents,
padding and sliding window, sdpa and eager kernels. An independent counter (wrapping
``torch.distributed.all_to_all_single`` here, not the library's ``CommCounter``) checks the
collectives per layer (2C forward, 4C backward: each chunk's q|k|v and output are exchanged again
for its backward), that they are asynchronous and in flight where the schedule says, that the
kernel's forward runs again only where its graph could not be kept, and that the bytes equal the
unchunked layer's plus the forward's once more, as ``attention_comm`` says. Memory: what autograd
saves for the chunked layer is its sharded inputs only (no full-length tensor), also inside
activation checkpointing, and the recompute replays the forward's dropout mask.
"""

import pytest
import torch
import torch.distributed as dist

from dist_helper import spawn
from reference import allowed_reference, attention_reference
from ulysses_sp import GlobalMask, SPMesh, UlyssesAttention, UlyssesSPConfig, attention_comm, build_attention
from ulysses_sp.comm.layout import HeadPlan

B, S, H = 2, 12, 4
# row 0: documents of 5, 4 and 3 tokens; row 1: 7 and 5 (packed, the boundaries fall inside shards)
POSITIONS = torch.tensor([list(range(5)) + list(range(4)) + list(range(3)), list(range(7)) + list(range(5))])
VALID = torch.tensor([[1] * 10 + [0] * 2, [1] * 12], dtype=torch.bool)  # row 0: right padding
MASKS = {  # name -> (documents, padding, sliding window)
    "causal": (False, False, None),
    "packed": (True, False, None),
    "packed+padding+window": (True, True, 5),
}
# (N, K) per world size: uneven splits and K < P at every P, irregular kv grouping at P = 3 and 4
HEADS = {2: [(5, 1), (8, 4), (6, 2)], 3: [(8, 2), (12, 4), (6, 3)], 4: [(6, 2), (8, 1), (10, 5)]}
# whole models through UlyssesSP(config.sp_head_chunks): (family, batch, chunks, checkpointing);
# qwen3 has N=6 K=2 (uneven at P=4), llama_k1 N=8 K=1 (K < P), 'packed' holds three documents
MODELS = {2: [("llama", "packed", 2, True)], 3: [("qwen3", "packed", 2, False)],
          4: [("qwen3", "packed", 2, False), ("llama_k1", "padding", 2, True)]}
CHUNKS = (2, 3, 99)  # 99: more chunks than any rank has heads (clamped to the largest local count)

# fp32 against float64: ~1e-7 relative rounding per op, sums over <= 12 keys of O(1) terms;
# 1e-5 is two orders above that, while a wrong head, token or carried kv gradient is O(0.1-1).
FP64_TOL = {"rtol": 1e-5, "atol": 1e-5}
# chunked against unchunked, both fp32 on the same inputs: per head the same kernel math; only the
# order of additions can differ (a kv head read by two chunks gets its two partial gradients summed
# outside the kernel, and the kernel may block a smaller batch of heads differently): a few fp32
# eps (1.2e-7) of O(1) values, so 2e-6.
SAME_TOL = {"rtol": 2e-6, "atol": 2e-6}


class Recorder:
    """Records every all_to_all_single while entered: (bytes this rank sends to others, async_op)."""

    active = None  # the recorder entered now (the stamping kernel reads its count)

    def __init__(self):
        self.calls = []

    def __enter__(self):
        Recorder.active = self
        self.original = dist.all_to_all_single

        def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            rank = dist.get_rank(group)
            sent = sum(n for j, n in enumerate(input_split_sizes) if j != rank) * input.element_size()
            self.calls.append((sent, async_op))
            return self.original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = recorded
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original
        Recorder.active = None


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``hook()`` (runs just before the kernel's own backward)."""

    @staticmethod
    def forward(ctx, hook, o):
        ctx.hook = hook
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


def run_layer(attention, q, k, v, g, mask, window, rank, P):
    """This rank's shard through ``attention``, forward and backward: (o, grads of q, k, v, recorder)."""
    s = S // P
    sl = slice(rank * s, (rank + 1) * s)
    q, k, v = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
    with Recorder() as rec:
        o = attention(q, k, v, mask, sliding_window=window)
        (o * g[:, sl]).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad, rec


def _case(N, K, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, S, H, generator=gen) for n in (N, K, K))
    return q, k, v, torch.randn(B, S, N, H, generator=gen)


def _worker(rank, world, heads, models):
    mesh = SPMesh.from_world(world)
    for family, kind, head_chunks, checkpointing in models:
        _check_model(family, kind, mesh, head_chunks, checkpointing)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    for N, K in heads:
        plan = HeadPlan(N, K, world)
        q, k, v, g = _case(N, K, seed=N * 10 + K)
        for mask_name, (docs, padding, window) in MASKS.items():
            mask = GlobalMask(S, True, GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None,
                              VALID if padding else None)
            ref = attention_reference(q, k, v, g, allowed_reference(POSITIONS, VALID, docs, padding, window))
            rows = VALID[:, sl] if padding else torch.ones(B, s, dtype=torch.bool)  # padding queries: no reference
            kernels = ("sdpa", "eager") if mask_name == "packed" else ("sdpa",)
            for kernel in kernels:
                plain = run_layer(UlyssesAttention(mesh.sp_group, kernel), q, k, v, g, mask, window, rank, world)
                for chunks in CHUNKS:
                    C = plan.num_chunks(chunks)
                    stamps = {"forward": [], "backward": []}
                    attention = UlyssesAttention(mesh.sp_group, _stamping_kernel(kernel, stamps), head_chunks=chunks)
                    got = run_layer(attention, q, k, v, g, mask, window, rank, world)
                    where = f"P={world} N={N} K={K} mask={mask_name} kernel={kernel} chunks={chunks} (C={C})"
                    try:
                        _compare(got, ref, plain, sl, rows)
                        graph_kept = kernel == "sdpa" and mask_name == "causal"  # else the kernel saves more
                        _check_collectives(got[4], plain[4], C, stamps, plan, rank, graph_kept)
                        model = attention_comm("ulysses", world, B, S, N, K, H, 4, rank, head_chunks=chunks)
                        assert sum(b for b, _ in got[4].calls) == model.bytes_forward + model.bytes_backward
                        assert (model.collectives_forward, model.collectives_backward) == (2 * C, 4 * C)
                    except AssertionError as e:
                        raise AssertionError(f"{where}: {e}") from e


def _model_loss_and_grads(family, kind, mesh, head_chunks, checkpointing, config=None):
    """A tiny HF model under UlyssesSP(sp_head_chunks=...) (or ``config``): the global loss and the
    SP-summed grads."""
    from tiny_models import tiny_batch, tiny_model
    from ulysses_sp import UlyssesSP, global_num_items, reported_loss

    model = tiny_model(family)
    if checkpointing:  # the chunked forward then runs again inside backward
        model.gradient_checkpointing_enable()
        model.train()
    config = config or UlyssesSPConfig(sp_size=mesh.sp_size, sp_head_chunks=head_chunks)
    with UlyssesSP(model, mesh, config) as sp:
        assert sp.attention.head_chunks == config.sp_head_chunks
        assert sp.attention.head_chunk_bytes == config.head_chunk_bytes
        shard = sp.shard(tiny_batch(kind))
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[name] = p.grad
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads


def _check_model(family, kind, mesh, head_chunks, checkpointing=False):
    ref_loss, ref_grads = _model_loss_and_grads(family, kind, mesh, 1, checkpointing)
    loss, grads = _model_loss_and_grads(family, kind, mesh, head_chunks, checkpointing)
    where = f"{family}/{kind}/P={mesh.sp_size}/chunks={head_chunks}/checkpointing={checkpointing}"
    # chunked vs unchunked, fp32, same inputs: summation order only (see SAME_TOL). Weight grads
    # sum per-token products over the sequence and two layers, so they are compared relative to
    # each tensor's largest element: 1e-5 there is ~100 fp32 eps, a wrong head or token is O(1).
    torch.testing.assert_close(loss, ref_loss, **SAME_TOL, msg=lambda m: f"{where} loss: {m}")
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-5,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")


def _stamping_kernel(name, stamps):
    """The kernel ``name``, recording how many all-to-alls were issued when each chunk's forward / backward ran."""
    from ulysses_sp import get_kernel

    kernel = get_kernel(name)

    def stamped(q, k, v, mask, **kw):
        stamps["forward"].append(len(Recorder.active.calls))
        o = kernel(q, k, v, mask, **kw)
        return _OnBackward.apply(lambda: stamps["backward"].append(len(Recorder.active.calls)), o)

    return stamped


def _compare(got, ref, plain, sl, rows):
    o, gq, gk, gv, _ = got
    ref_o, ref_gq, ref_gk, ref_gv = ref
    torch.testing.assert_close(o.double()[rows], ref_o[:, sl][rows], **FP64_TOL)
    for name, grad, ref_grad in (("q", gq, ref_gq), ("k", gk, ref_gk), ("v", gv, ref_gv)):
        torch.testing.assert_close(grad.double(), ref_grad[:, :, sl], **FP64_TOL,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
    for name, a, b in zip(("o", "grad q", "grad k", "grad v"), got[:4], plain[:4]):
        torch.testing.assert_close(a, b, **SAME_TOL, msg=lambda m, name=name: f"{name} vs unchunked: {m}")


def _check_collectives(rec, plain_rec, C, stamps, plan, rank, graph_kept):
    n_local = plan.num_local_heads(rank)[0]
    assert len(rec.calls) == 6 * C, f"{len(rec.calls)} all-to-alls, expected 2C + 4C = {6 * C}"
    assert all(is_async for _, is_async in rec.calls), "chunk exchanges must be issued with async_op=True"
    assert len(plain_rec.calls) == 4
    # the backward re-sends the forward's q|k|v exchanges (calls 0, 1, 3, 5, ...) and moves the output to the
    # heads' owners as the output gradient goes (the plain layer's third call)
    qkv_forward = [rec.calls[0][0]] + [rec.calls[2 * c - 1][0] for c in range(1, C)]
    extra = sum(qkv_forward) + plain_rec.calls[2][0]
    assert sum(b for b, _ in rec.calls) == sum(b for b, _ in plain_rec.calls) + extra, "bytes: unchunked + q|k|v + o"
    # forward: qkv(0) qkv(1) [attend 0] out(0) qkv(2) [attend 1] ...: chunk c computes with the next
    # chunk's q|k|v exchange and the previous chunk's output exchange already issued
    chunk_heads = [c.num_local_heads(rank)[0] for c in plan.chunks(C)]
    computed = [c for c in range(C) if chunk_heads[c]]
    expected_fwd = [2 * c + 2 if c + 1 < C else 2 * C - 1 for c in computed]
    # backward, chunks in order: qkv(c) o(c) gout(c) [land grads(c-1)] [backward of c] grads(c); the kernel's
    # forward runs again only where the chunk's graph was not kept (the kernel saved more than q/k/v/o)
    expected_bwd = [2 * C + 4 * c + 3 for c in computed]
    again = [] if graph_kept else expected_bwd
    assert stamps["forward"] == expected_fwd + again, (stamps["forward"], expected_fwd + again)
    assert stamps["backward"] == expected_bwd, (stamps["backward"], expected_bwd)
    assert sum(chunk_heads) == n_local


@pytest.mark.parametrize("world", [2, 3, 4])
def test_chunked_ulysses_matches_reference_and_unchunked(world):
    """Bug caught: a chunk exchange that sends the wrong heads or tokens, a kv head carried to the next
    chunk without its gradient flowing back (or sent twice), chunks misaligned across ranks with
    uneven head splits or K < P, a backward that is not pipelined or returns wrong grads, extra
    collectives or bytes, synchronous (non-overlapped) exchanges, and UlyssesSP not passing
    ``sp_head_chunks`` on (or chunking breaking a whole model, with activation checkpointing)."""
    spawn(_worker, world, HEADS[world], MODELS[world])


def test_head_chunks_partition_every_rank_heads_and_send_each_kv_head_once():
    """Bug caught: chunk plans that lose or duplicate a query head, send a (kv head, rank) pair twice or
    never, let a chunk read a kv head it neither received nor carried, or change the total bytes;
    derived here from the definition (rank r owns q heads [a, b) and reads kv heads h // (N/K))."""
    for N, K, P in [(5, 1, 2), (8, 4, 2), (6, 2, 4), (12, 4, 3), (10, 5, 4), (8, 1, 4), (32, 8, 4), (3, 3, 3)]:
        plan = HeadPlan(N, K, P)
        for requested in range(1, 9):
            chunks = plan.chunks(requested)
            assert len(chunks) == min(requested, max(b - a for a, b in plan.q_ranges))
            for r, (a, b) in enumerate(plan.q_ranges):
                q_heads = [h for c in chunks for h in range(*c.q_ranges[r])]
                assert q_heads == list(range(a, b))
                sent = [h for c in chunks for h in range(*c.kv_ranges[r])]
                assert sent == sorted({h // (N // K) for h in range(a, b)})
                received = set()
                for c in chunks:
                    received |= set(range(*c.kv_ranges[r]))
                    needed = {h // (N // K) for h in range(*c.q_ranges[r])}
                    assert needed <= received and set(range(*c.kv_read_ranges[r])) == needed
                    assert c.carried(r) in (0, 1) and (c.carried(r) == 0 or c.kv_read_ranges[r][0] in received)
            for r in range(P):
                total = sum(c.qkv_numels(r, 2, 3, 4, 5) for c in chunks)
                assert total == plan.qkv_numels(r, 2, 3, 4, 5)


def test_head_chunks_are_validated():
    """Bug caught: a chunk count that is not a positive integer reaching the layer, and chunks silently
    ignored by the ring backend (which has no head chunks)."""
    assert UlyssesSPConfig(sp_head_chunks=4).sp_head_chunks == 4
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="sp_head_chunks"):
            UlyssesSPConfig(sp_head_chunks=bad)
    with pytest.raises(ValueError, match="ulysses"):
        UlyssesSPConfig(sp_backend="ring", sp_head_chunks=2)
    with pytest.raises(ValueError, match="head_chunks"):
        build_attention("ring", None, "sdpa", head_chunks=2)
    with pytest.raises(ValueError, match="head_chunks"):
        UlyssesAttention(None, "sdpa", head_chunks=0)
