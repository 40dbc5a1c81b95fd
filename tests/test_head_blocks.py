"""Head blocks (``UlyssesSPConfig.sp_head_blocks``, on with head chunks): the whole attention block,
projections included, one chunk of heads at a time (``memory.head_blocks``, ``integrations.head_blocks``).

Whole tiny HF models on gloo process groups of P in {2, 3, 4}: loss and every gradient against plain
transformers in one process (packed rows run document by document there), with and without
activation checkpointing; uneven head splits per rank, kv heads fewer than P inside a block, packed
documents and padding. Per model an independent counter (wrapping ``all_to_all_single`` and the
kernel, not the library's) checks that blocks really ran: 2G collectives forward and 4G backward per
layer with the bytes ``attention_comm(head_blocks=True)`` gives, the kernel's forward not run again
in backward (its graph kept), and that the attention modules save neither sharded nor full-length
q/k/v of all heads. Units: ``linear_into`` / ``linear_graph_only`` against ``F.linear``; which
modules qualify (``block_refusal``).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf

from dist_helper import spawn
from reference import document_starts, reference_step
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig, attention_comm, global_num_items, reported_loss
from ulysses_sp.comm.cost import head_block_ranges
from ulysses_sp.integrations.head_blocks import block_refusal
from ulysses_sp.memory.head_blocks import linear_graph_only, linear_into

# (family, batch, head chunks, checkpointing) per P. llama: N=8 K=2; qwen3: N=6 K=2, q/k norms, head_dim 16;
# qwen2: q/k/v bias; llama_bias: o_proj bias too, N=8 K=4 (4 blocks); mistral: sliding window. P=3 splits
# 3 query heads of a qwen3 block one a rank; P=4 gives llama blocks of one kv head read by four ranks (K < P
# inside the block)
MODELS = {2: [("llama", "packed", 2, True), ("qwen3", "padding", 2, False), ("qwen2", "plain", 4, False),
              ("llama_bias", "plain", 4, False)],
          3: [("qwen3", "packed", 2, True)],
          4: [("llama", "padding", 2, False), ("mistral", "packed", 2, True)]}


class Counter:
    """all_to_all_single calls (bytes this rank sends to others) and sdpa calls, per phase."""

    def __init__(self):
        self.phase, self.calls, self.kernel = "forward", {"forward": [], "backward": []}, {"forward": 0, "backward": 0}

    def __enter__(self):
        self.a2a, self.sdpa = dist.all_to_all_single, F.scaled_dot_product_attention

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            rank = dist.get_rank(group)
            sent = sum(n for j, n in enumerate(input_split_sizes) if j != rank) * input.element_size()
            self.calls[self.phase].append(sent)
            return self.a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        def sdpa(*args, **kwargs):
            self.kernel[self.phase] += 1
            return self.sdpa(*args, **kwargs)

        dist.all_to_all_single, F.scaled_dot_product_attention = a2a, sdpa
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, F.scaled_dot_product_attention = self.a2a, self.sdpa


def _run(family, kind, mesh, chunks, checkpointing, blocks=True):
    """(loss, SP-averaged grads, Counter, shapes of what the attention modules saved) of one SP step."""
    model = tiny_model(family)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    config = UlyssesSPConfig(sp_size=mesh.sp_size, sp_head_chunks=chunks, sp_head_blocks=blocks)
    saved = []
    with UlyssesSP(model, mesh, config) as sp:
        assert sp.head_block_refusals == {}  # every attention module of these families runs as blocks
        shard = sp.shard(tiny_batch(kind))
        num_items = global_num_items(shard["shift_labels"], mesh.sp_group)
        with Counter() as counter:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1],
                                                          lambda t: t):
                loss = sp.forward_loss(model, shard, num_items, grad_average_world=mesh.sp_size)
            counter.phase = "backward"
            loss.backward()
        s = shard["input_ids"].shape[1]
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[name] = p.grad / mesh.sp_size
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads, counter, saved, s


def _reference(family, kind, checkpointing):
    batch = tiny_batch(kind)
    labels = batch.get("labels", batch["input_ids"])
    starts = document_starts(batch["position_ids"][0]) if "position_ids" in batch else None
    return reference_step(tiny_model(family), {k: v for k, v in batch.items() if k != "labels"}, labels,
                          starts=starts, checkpointing=checkpointing)


def _check_model(family, kind, mesh, chunks, checkpointing):
    where = f"{family}/{kind}/P={mesh.sp_size}/chunks={chunks}/checkpointing={checkpointing}"
    ref_loss, ref_grads = _reference(family, kind, checkpointing)
    loss, grads, counter, saved, s = _run(family, kind, mesh, chunks, checkpointing)
    # fp32 against one process: summation order only (sharded weight-grad sums, per-block o_proj partial
    # sums, per-document reference); observed <= 3e-6 relative, 1e-5 / 1e-4 leave margin while a wrong
    # head, block, mask or shard is > 1e-2 (as test_hf_parity)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")
    config = tiny_model(family).config
    N, K, L = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    H = getattr(config, "head_dim", None) or config.hidden_size // N
    P, B = mesh.sp_size, tiny_batch(kind)["input_ids"].shape[0]
    G = len(head_block_ranges(N, K, P, chunks))
    assert G > 1, f"{where}: the case must run head blocks"
    comm = attention_comm("ulysses", P, B, s * P, N, K, H, 4, mesh.sp_rank, head_chunks=chunks, head_blocks=True)
    fwd, bwd = counter.calls["forward"], counter.calls["backward"]
    layers_fwd = 2 * L if checkpointing else L  # checkpointing runs each layer's forward again in backward
    assert (len(fwd), len(bwd)) == (2 * G * L, (4 * G + 2 * G * (layers_fwd > L)) * L), (where, len(fwd), len(bwd))
    assert sum(fwd) == comm.bytes_forward * L, (where, sum(fwd), comm.bytes_forward * L)
    assert sum(bwd) == (comm.bytes_backward + comm.bytes_forward * (layers_fwd > L)) * L, where
    # the kernel runs in every block's forward (again in the checkpoint's recompute), and for the backward
    # only where its graph cannot be kept (packed / padded rows: the document buckets it saves)
    kernel_fwd, kernel_bwd = counter.kernel["forward"], counter.kernel["backward"]
    recomputed = kind != "plain"
    assert kernel_fwd >= G * L and kernel_bwd == kernel_fwd * ((layers_fwd > L) + recomputed), (where, counter.kernel)
    if not checkpointing:  # nothing of all heads is saved: no (B, N, s, H) / (B, K, s, H) tensor
        all_heads = {(B, N, s, H), (B, K, s, H), (B, s, N, H), (B, s, K, H)}
        assert not all_heads & set(saved), (where, all_heads)


def _worker(rank, world, models):
    mesh = SPMesh.from_world(world)
    for family, kind, chunks, checkpointing in models:
        _check_model(family, kind, mesh, chunks, checkpointing)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_head_blocks_match_one_process(world):
    """Bug caught: a block slicing the wrong projection rows or o_proj columns, o_proj's bias added per
    block, a kv group split across blocks, x's gradient lost or counted twice (linear_into), a replayed
    attention call taking another block's results, RNG or autocast not replayed, the kernel run again in
    backward, extra collectives or bytes off the formula, and all heads' q/k/v still saved."""
    spawn(_worker, world, MODELS[world])


def _worker_fallbacks(rank, world):
    mesh = SPMesh.from_world(world)
    ref = _run("llama", "packed", mesh, 2, False, blocks=False)
    got = _run("llama", "packed", mesh, 2, False, blocks=True)
    # both chunked and exact; blocks and attention-call chunks differ only in summation order (o_proj's
    # partial sums per block): a few fp32 eps of O(1) values
    torch.testing.assert_close(got[0], ref[0], rtol=2e-6, atol=2e-6)
    for name, grad in ref[1].items():
        scale = grad.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(got[1][name] / scale, grad / scale, rtol=0, atol=1e-5)
    assert len(ref[2].calls["forward"]) == len(got[2].calls["forward"])
    # a byte target below any block's size: as many blocks as there are (2 for N=8, K=2), 4 collectives per layer
    bytes_config = UlyssesSPConfig(sp_size=world, sp_head_chunk_mib=1e-6)
    model = tiny_model("llama")
    with UlyssesSP(model, mesh, bytes_config) as sp, Counter() as counter:
        shard = sp.shard(tiny_batch("plain"))
        sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        # eval (no grad): the blocks run one after the other, logits as the unchunked model's
        model.eval()
        with torch.no_grad():
            logits = model(**sp.model_inputs(shard)).logits
    assert len(counter.calls["forward"]) == 2 * 2 * model.config.num_hidden_layers * 2  # train + eval passes
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=world)) as sp, torch.no_grad():
        plain = model(**sp.model_inputs(sp.shard(tiny_batch("plain")))).logits
    # o_proj partial sums per block: fp32 reordering through two layers, of logits up to ~10 (eps 1e-6 there);
    # a wrong block or head is O(1)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)
    # a family whose attention sizes tensors by num_heads keeps attention-call chunks, and says why
    with UlyssesSP(tiny_model("stablelm"), mesh, UlyssesSPConfig(sp_size=world, sp_head_chunks=2)) as sp:
        refusals = sp.head_block_refusals
    assert len(refusals) == 2 and all("num_heads" in why for why in refusals.values()), refusals
    assert sp.head_block_refusals == {}  # unregistered
    # a module whose forward changes o_proj's output after it (here x2) is recomputed with o_proj's values
    model = tiny_model("llama")
    for layer in model.model.layers:
        original = layer.self_attn.forward
        layer.self_attn.forward = (lambda f: lambda *a, **k: (f(*a, **k)[0] * 2, None))(original)
    losses = []
    for blocks in (False, True):
        model.zero_grad()
        with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=world, sp_head_chunks=2, sp_head_blocks=blocks)) as sp:
            shard = sp.shard(tiny_batch("packed"))
            loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
            loss.backward()
        losses.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=2e-6, atol=2e-6)
    for name, grad in losses[0][1].items():  # same tolerance as above
        scale = grad.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(losses[1][1][name] / scale, grad / scale, rtol=0, atol=1e-5)
    # a second backward (retain_graph): the first one freed each block's saved attention outputs and used up
    # the kept kernel graphs, so the second recomputes the attention (kept graph: plain rows; recomputed
    # already: packed rows) and must add the same gradients again
    for kind in ("plain", "packed"):
        model = tiny_model("llama")
        with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=world, sp_head_chunks=2)) as sp:
            shard = sp.shard(tiny_batch(kind))
            loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
            loss.backward(retain_graph=True)
            once = {name: p.grad.clone() for name, p in model.named_parameters()}
            loss.backward()
        for name, p in model.named_parameters():
            # the same kernels on the same inputs give the same gradient again, up to fp32 reordering
            # between a kept graph's backward and a recomputed one (~1e-7 relative); freed or stale
            # outputs would give garbage or an error
            scale = once[name].abs().max().clamp_min(1e-8)
            torch.testing.assert_close(p.grad / scale, 2 * once[name] / scale, rtol=0, atol=1e-5,
                                       msg=lambda m, name=name, kind=kind: f"{kind} {name}: {m}")


def test_head_blocks_equal_attention_call_chunks_and_respect_what_the_module_does_after_o_proj():
    """Bug caught: head blocks disagreeing with attention-call chunking, the recompute's graph-only
    o_proj used for a module that reads o_proj's output (its gradient would be computed from zeros),
    a byte target not choosing the blocks, eval (no grad) under blocks differing from unchunked, a
    refused module not reported by ``UlyssesSP.head_block_refusals``, and a second backward
    (``retain_graph``) reading the saved attention outputs the first one freed."""
    spawn(_worker_fallbacks, 2)


def _worker_dropout(rank, world):
    """Attention dropout 0.5 in train mode, one attention module as head blocks: for fixed dropout masks the
    module's output is linear in v_proj's weight (Llama: no bias), so sum over ranks of <y, g> must equal
    sum over ranks of <dL/dW_v, W_v> for L = <y, g>, exactly when the backward replays the forward's masks."""
    mesh = SPMesh.from_world(world)
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.train()
    attention = model.model.layers[0].self_attn
    config = UlyssesSPConfig(sp_size=world, sp_head_chunks=2, sp_attn_implementation="eager")
    with UlyssesSP(model, mesh, config) as sp:
        inputs = sp.model_inputs(sp.shard(tiny_batch("plain")))
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(*inputs["input_ids"].shape, model.config.hidden_size, generator=gen).requires_grad_()
        g = torch.randn(x.shape, generator=gen)
        position_embeddings = model.model.rotary_emb(x, inputs["position_ids"])
        with Counter() as counter:
            y, _ = attention(hidden_states=x, position_embeddings=position_embeddings, attention_mask=None,
                             ulysses_mask=inputs["ulysses_mask"])
            counter.phase = "backward"
            y.backward(g)
    assert len(counter.calls["forward"]) == 4 and len(counter.calls["backward"]) == 8  # 2 blocks ran
    weight = attention.v_proj.weight
    both = torch.stack([(y.detach() * g).sum(), (weight.grad * weight.detach()).sum()]).double()
    dist.all_reduce(both, group=mesh.sp_group)
    # fp32 sums of a few thousand O(1) products, each side in another order: ~1e-6 relative; another dropout
    # mask in the backward changes the right side by O(1) relative (half the probabilities differ)
    torch.testing.assert_close(both[1], both[0], rtol=1e-5, atol=1e-5)


def test_head_blocks_replay_dropout_masks():
    """Bug caught: a block's recompute (projections run again, the attention recomputed where the kernel
    saved a dropout mask) drawing other masks than its forward: gradients of another function."""
    spawn(_worker_dropout, 2)


def test_linear_into_and_graph_only_have_linear_gradients():
    """Bug caught: the in-place x-gradient accumulation or the graph-only linear computing another
    gradient than F.linear (transposed weight, missing bias, wrong dtype), or x getting it twice."""
    gen = torch.Generator().manual_seed(0)
    x, w, b, dy = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((2, 5, 4), (3, 4), (3,),
                                                                                          (2, 5, 3)))
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(dy)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    into = torch.zeros_like(x)
    y = linear_into(*leaves, into)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)
    y.backward(dy)
    # float64, the same products: exact up to the order of one matmul's additions
    torch.testing.assert_close(into, ref[0].grad, rtol=1e-12, atol=1e-12)
    assert leaves[0].grad is None  # x's gradient went into `into` only
    for got, want in zip(leaves[1:], ref[1:]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = linear_graph_only(*leaves, torch.float64)
    assert y.shape == (2, 5, 3) and not y.any() and y.stride() == (0, 0, 0)  # no (B, s, D) output stored
    y.backward(dy)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)


def _attention(config_cls, **kw):
    config = config_cls(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, **kw)
    model = tf.AutoModelForCausalLM.from_config(config)
    return model.model.layers[0].self_attn


def test_which_attention_modules_run_as_head_blocks():
    """Bug caught: a module whose heads are not separable (a norm over all heads, sinks, a LoRA or fused
    projection, a gate projection, a forward outside transformers whose row layout or post-o_proj ops are
    unchecked) run as head blocks (silently wrong), or a plain one refused."""
    assert block_refusal(_attention(tf.LlamaConfig)) is None
    assert block_refusal(_attention(tf.Qwen3Config, head_dim=16)) is None  # per-head q/k norms
    assert "per-head norm" in block_refusal(_attention(tf.Olmo2Config))  # q_norm over all heads' features
    assert "own" in block_refusal(_attention(tf.GptOssConfig, head_dim=16, num_local_experts=2,
                                             num_experts_per_tok=1))  # sinks
    attention = _attention(tf.LlamaConfig)

    class RemoteAttention(type(attention)):  # remote code: a forward of its own, e.g. a gated q_proj
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Subclass(type(attention)):  # e.g. a wrapper's dynamic subclass: transformers' forward
        pass

    assert "remote code" in block_refusal(RemoteAttention(attention.config, 0))
    assert block_refusal(Subclass(attention.config, 0)) is None

    class LoraLike(torch.nn.Linear):
        pass

    attention.q_proj = LoraLike(64, 64, bias=False)
    assert "plain nn.Linear" in block_refusal(attention)
    assert head_block_ranges(8, 2, 2, 4) == ((0, 1), (1, 2))  # at most one block per kv group
    assert head_block_ranges(8, 8, 2, 99) == ((0, 2), (2, 4), (4, 6), (6, 8))  # a block keeps P query heads
    assert head_block_ranges(8, 8, 2, 3) == ((0, 3), (3, 6), (6, 8))  # uneven blocks
    assert head_block_ranges(8, 8, 3, 4) == ((0, 4), (4, 8))  # never a block with fewer query heads than P
    assert head_block_ranges(8, 1, 2, 4) == ((0, 1),)  # one kv head: one block (attention-call chunks instead)
