"""Transformers causal LMs under Ulysses SP against one process on the full batch.

Reference: plain transformers (its own kernel) on the global batch, loss = mean token CE (what
``model(..., labels=...)`` returns). Packed batches: transformers' sdpa/eager ignore document
boundaries in ``position_ids``, so the reference runs each document on its own and concatenates
the logits (the flash-attention varlen semantics). SP: ``UlyssesSP`` registration, sharded batch,
``sp.loss``; parameter gradients averaged over the SP group as DDP would.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_helper import spawn
from reference import document_starts, reference_step
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import GlobalMask, SPMesh, UlyssesSPConfig
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.loss import global_num_items, reported_loss


def reference(family, kind, checkpointing=False):
    batch = tiny_batch(kind)
    labels = batch.get("labels", batch["input_ids"])
    starts = document_starts(batch["position_ids"][0]) if kind == "packed" else None
    return reference_step(tiny_model(family), {k: v for k, v in batch.items() if k != "labels"}, labels,
                          starts=starts, checkpointing=checkpointing)


def sp_run(family, kind, mesh, checkpointing=False, tiled_mlp_tokens=None, tiled_loss_tokens=None, backend="ulysses",
           ring_size=None, head_chunks=1, expect_ring=None):
    model = tiny_model(family)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    config = UlyssesSPConfig(sp_size=mesh.sp_size, sp_backend=backend, tiled_mlp_tokens=tiled_mlp_tokens,
                             tiled_loss_tokens=tiled_loss_tokens, sp_ring_size=ring_size, sp_head_chunks=head_chunks)
    with UlyssesSP(model, mesh, config) as sp:
        if expect_ring is not None:  # the Ulysses x ring split that was chosen (all-to-all degree x ring)
            assert (sp.attention.a2a_size, sp.attention.ring_size) == expect_ring
        num_tiled = sum(type(m).__name__ in ("TiledMLP", "TiledMoE") for m in model.modules())
        assert num_tiled == (model.config.num_hidden_layers if tiled_mlp_tokens else 0)
        shard = sp.shard(tiny_batch(kind))
        num_items = global_num_items(shard["shift_labels"], mesh.sp_group)
        loss = sp.forward_loss(model, shard, num_items, grad_average_world=mesh.sp_size)  # grads averaged over SP below
        loss.backward()
    assert model.config._attn_implementation == tiny_model(family).config._attn_implementation  # unregistered
    assert all(type(m).__name__ not in ("TiledMLP", "TiledMoE") for m in model.modules())  # tiled MLPs removed again
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[name] = p.grad / mesh.sp_size  # DDP averages over ranks
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads


def check(family, kind, mesh, checkpointing=False, tiled_mlp_tokens=None, tiled_loss_tokens=None, backend="ulysses",
          **two_d):
    ref_loss, ref_grads = reference(family, kind, checkpointing)
    loss, grads = sp_run(family, kind, mesh, checkpointing, tiled_mlp_tokens, tiled_loss_tokens, backend, **two_d)
    where = (f"{family}/{kind}/P={mesh.sp_size}/{backend}/tiled_mlp={tiled_mlp_tokens}/tiled_loss={tiled_loss_tokens}"
             f"/{two_d}")
    # fp32: only summation order differs (shard-wise weight-grad sums, per-document or GQA kernels);
    # observed <= 2e-6 relative. 1e-5 / 1e-4 leave margin; a wrong mask or shard gives >1e-2.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")


def check_eval(family, kind, mesh):
    """Eval mode under SP: each rank computes logits for its shard only, loss equals one process."""
    with torch.no_grad():
        model = tiny_model(family).eval()
        batch = tiny_batch(kind)
        ids = batch["input_ids"]
        ref_logits = torch.cat([model(input_ids=ids[:, a:e]).logits for a, e in ((0, 9), (9, 14), (14, 23))], 1)
        ref_loss = F.cross_entropy(ref_logits[0, :-1], batch["input_ids"][0, 1:])
        with UlyssesSP(model, mesh) as sp:
            shard = sp.shard(batch)
            logits = model(**sp.model_inputs(shard)).logits
            loss = sp.loss(logits, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        assert logits.shape[1] == shard["ulysses_mask"].seq_len // mesh.sp_size  # never the full length
        # fp32, summation order only (see check())
        torch.testing.assert_close(reported_loss(loss, mesh.sp_size, mesh.sp_group), ref_loss, rtol=1e-5, atol=1e-5)


def check_lora(family, kind, mesh):
    """A PEFT LoRA-wrapped model registers through its wrapper; LoRA grads equal one process."""
    from peft import LoraConfig, get_peft_model

    def lora_model():
        torch.manual_seed(5)
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(tiny_model(family), lora)

    ref = lora_model()
    batch = tiny_batch(kind)
    ref(**{k: v for k, v in batch.items() if k != "labels"}, labels=batch["labels"]).loss.backward()
    model = lora_model()
    with UlyssesSP(model, mesh) as sp:
        shard = sp.shard(batch)
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        loss.backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            dist.all_reduce(p.grad, group=mesh.sp_group)
            scale = r.grad.abs().max()
            # fp32, summation order only (see check())
            torch.testing.assert_close(p.grad / mesh.sp_size / scale, r.grad / scale, rtol=0, atol=1e-4)


def _sp_grads(family, batch, mesh):
    model = tiny_model(family)
    with UlyssesSP(model, mesh) as sp:
        shard = sp.shard(batch)
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group),
                               grad_average_world=mesh.sp_size)
        loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), {n: p.grad for n, p in model.named_parameters()}


def check_batch_keys(mesh):
    """Batch keys besides input_ids / labels: pre-shifted ``shift_labels`` (completion-only), GPT-2's
    ``token_type_ids`` (a token-type embedding), and ``token_type_ids`` a model ignores."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 17), generator=gen)
    labels = ids.masked_fill(torch.arange(17) < 6, -100)  # prompts masked
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    types = torch.randint(0, 2, (2, 17), generator=gen)
    cases = [("llama", {"input_ids": ids, "shift_labels": shift}, {"input_ids": ids, "labels": labels}),
             ("gpt2", {"input_ids": ids, "labels": labels, "token_type_ids": types},
              {"input_ids": ids, "labels": labels, "token_type_ids": types}),
             ("llama", {"input_ids": ids, "labels": labels, "token_type_ids": types},
              {"input_ids": ids, "labels": labels})]
    for family, batch, ref_inputs in cases:
        ref = tiny_model(family)
        ref_loss = ref(**ref_inputs).loss
        ref_loss.backward()
        loss, grads = _sp_grads(family, batch, mesh)
        # fp32, summation order only (see check())
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{family} {list(batch)}: {m}")
        for name, p in ref.named_parameters():
            scale = p.grad.abs().max().clamp_min(1e-8)
            torch.testing.assert_close(grads[name] / mesh.sp_size / scale, p.grad / scale, rtol=0, atol=1e-4)
    # Gemma 3 lets image tokens (token type 1) attend bidirectionally; the global mask is causal
    vlm = tiny_model("gemma3_vlm")
    with UlyssesSP(vlm, mesh) as sp:
        with pytest.raises(ValueError, match="lets attend bidirectionally"):
            sp.shard({"input_ids": ids, "token_type_ids": types})
        text_only = sp.shard({"input_ids": ids, "token_type_ids": torch.zeros_like(types)})
        vlm(**sp.model_inputs(text_only))  # all type 0: accepted and forwarded


def check_compiled(mesh):
    """``torch.compile`` of the registered model (dynamo traces the model, graph-breaking around the
    exchange's host-side layout math): loss and grads of two steps equal one eager process.
    aot_eager traces through dynamo and AOTAutograd like inductor without its C++ compile time;
    inductor gave the same (2.7e-6) by hand."""
    ref_loss, ref_grads = reference("llama", "packed")
    model = tiny_model("llama")
    with UlyssesSP(model, mesh) as sp:
        compiled = torch.compile(model, backend="aot_eager")
        shard = sp.shard(tiny_batch("packed"))
        for _ in range(2):  # the second step runs the cached graphs
            model.zero_grad()
            loss = sp.forward_loss(compiled, shard, global_num_items(shard["shift_labels"], mesh.sp_group),
                                   grad_average_world=mesh.sp_size)
            loss.backward()
    # fp32, summation order only (see check())
    reported = reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group)
    torch.testing.assert_close(reported, ref_loss, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        scale = ref_grads[name].abs().max().clamp_min(1e-8)
        torch.testing.assert_close(p.grad / mesh.sp_size / scale, ref_grads[name] / scale, rtol=0, atol=1e-4)


FAMILIES = ["llama", "llama_k1", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "llama_mha_eager",
            "stablelm", "nemotron",  # these two drop attention kwargs
            "gpt_oss"]  # attention sinks: 6 heads, so P=4 splits them 2/2/1/1
PLAN = {
    1: [(f, k) for f in ("llama", "gemma2", "stablelm", "nemotron", "gpt_oss") for k in ("padding", "packed")],
    2: [(f, k) for f in FAMILIES for k in ("padding", "packed", "odd")],
    3: [(f, k) for f in ("llama", "qwen3", "mistral", "gpt_oss") for k in ("padding", "packed")],
    4: [(f, "packed") for f in FAMILIES] + [("gemma2", "padding"), ("llama_k1", "odd")],
}


# sp_backend="ring" through the same UlyssesSP path: any head count (2 heads on 4 ranks), windows
RING_PLAN = {3: [("llama", "packed")], 4: [("llama_n2", "padding"), ("mistral", "packed")]}

# Ulysses x ring (sp_backend="ulysses"): all-to-all inside groups of A ranks, ring across R groups.
# (family, kind, options): automatic split when P > N, explicit sp_ring_size, K < A, windows, head chunks.
TWO_D_PLAN = {
    3: [("llama_n2", "packed", dict(expect_ring=(1, 3))),  # 2 heads on 3 ranks: the only split is a ring of 3
        ("llama", "padding", dict(ring_size=3, expect_ring=(1, 3)))],
    4: [("llama_n2", "padding", dict(expect_ring=(2, 2))),  # automatic: all-to-all over 2, ring of 2
        ("llama_n2", "packed", dict(expect_ring=(2, 2))),
        ("llama_k1", "packed", dict(ring_size=2, expect_ring=(2, 2))),  # one kv head for both a2a ranks
        ("mistral", "packed", dict(ring_size=2, expect_ring=(2, 2))),  # sliding window across segments
        ("qwen3", "odd", dict(ring_size=2, head_chunks=3, expect_ring=(2, 2)))],  # 3 heads a rank, in 3 chunks
}

def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    for family, kind in PLAN[world]:
        check(family, kind, mesh)
    for family, kind in RING_PLAN.get(world, []):
        check(family, kind, mesh, backend="ring")
    for family, kind, two_d in TWO_D_PLAN.get(world, []):
        check(family, kind, mesh, **two_d)
    if world == 4:  # Ulysses x ring inside each of 2 data-parallel replicas (groups enumerated per replica)
        check("llama_n2", "packed", SPMesh.from_world(2), ring_size=2, expect_ring=(1, 2))
    if world == 2:
        check("llama", "padding", mesh, checkpointing=True)
        check("stablelm", "padding", mesh, checkpointing=True)  # the recompute finds the call's mask too
        check("qwen3", "packed", mesh, tiled_mlp_tokens=5)  # 12 local tokens: tiles of 5, 5, 2
        check("gemma2", "padding", mesh, checkpointing=True, tiled_mlp_tokens=4, tiled_loss_tokens=7)  # final softcap
        check("llama", "packed", mesh, tiled_loss_tokens=5)
        check("gpt_oss", "packed", mesh, head_chunks=3)  # sinks read inside the chunked pipeline keep their grads
        check("gpt_oss", "padding", mesh, tiled_mlp_tokens=3)  # its MoE block returns (hidden, router scores)
        check("gpt2", "padding", mesh, tiled_mlp_tokens=4)  # B=2: a sequence tile is strided; Conv1D uses .view
        check_eval("qwen2", "packed", mesh)
        check_lora("llama", "padding", mesh)
        check_batch_keys(mesh)
        check_compiled(mesh)
        model = tiny_model("llama")
        with UlyssesSP(model, mesh):  # a raw batch must not silently attend within the shard only
            with pytest.raises(ValueError, match="without `ulysses_mask`"):
                model(input_ids=torch.ones(1, 8, dtype=torch.long))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_loss_and_every_gradient_match_one_process(world):
    """Bug caught: any model family whose attention arguments (sliding window, softcap, scaling, q/k
    norm, fused qkv, GQA with K < P) or batch handling (padding, packed documents, S % P != 0,
    shift at shard boundaries) differ under SP from one process; P=1 must equal plain transformers.
    P=2 also covers gradient checkpointing and the error for a batch without the global mask.
    gpt_oss: attention sinks sliced to each rank's heads (even and uneven splits, head chunks); a
    sink read by the wrong rank, or one whose gradient is lost, fails loss or sink gradients.
    P=3/4 also run sp_backend="ring" (a config choice reaching the ring, including more ranks than heads)
    and Ulysses x ring (TWO_D_PLAN: sp_size above the head count, K < A, windows, head chunks)."""
    spawn(_worker, world)


def _worker_8(rank, world):
    mesh = SPMesh.from_world(world)
    check("llama_n4k1", "packed", mesh, expect_ring=(4, 2))  # automatic: all-to-all over the 4 heads, ring of 2
    check("llama_n4k1", "padding", mesh, ring_size=4, expect_ring=(2, 4))


def test_ulysses_x_ring_with_more_ranks_than_heads_at_8_ranks():
    """Bug caught: sp_size > num_attention_heads refused (a 4-head, 1-kv-head model could not use 8
    ranks). P=8 with N=4, K=1: the automatic split (all-to-all over 4, ring of 2) and an explicit
    ring of 4 equal one process in loss and every gradient, with packed documents and padding."""
    spawn(_worker_8, 8)


def test_unsupported_models_are_refused_at_registration():
    """Bug caught: silently wrong training of models whose token mixing Ulysses cannot shard."""
    import transformers as tf

    class FakeMesh:
        sp_size, dp_size, sp_rank, sp_group = 2, 1, 0, None

    with pytest.raises(ValueError, match="softcapping.*attn_implementation='eager'"):
        UlyssesSP(tiny_model("gemma2"), FakeMesh(), UlyssesSPConfig(sp_size=2, sp_attn_implementation="sdpa"))
    # Jamba's Mamba1 mixer has no sequence-parallel forward (Qwen3-Next / Bamba / ... do: test_linear_mixers.py)
    cfg = tf.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                         attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                         mamba_d_state=4, mamba_d_conv=4, mamba_expand=2)
    with pytest.raises(ValueError, match="linear / recurrent / hybrid"):
        UlyssesSP(tf.AutoModelForCausalLM.from_config(cfg), FakeMesh())
    # Bug caught (found by scripts/model_families.py): both trained silently wrong under SP
    roberta = tf.RobertaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, is_decoder=True)
    with pytest.raises(ValueError, match="RoBERTa-style"):  # positions offset by padding_idx + 1, from input_ids
        UlyssesSP(tf.AutoModelForCausalLM.from_config(roberta), FakeMesh())
    doge = tf.DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="learned dynamic mask"):  # a bias over the rank's own keys
        UlyssesSP(tf.AutoModelForCausalLM.from_config(doge), FakeMesh())
    llama4 = tf.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_local_experts=2, attention_chunk_size=None, no_rope_layers=[0, 1],
                                 attn_temperature_tuning=True)  # no chunked layers: only the NoPE query scale
    with pytest.raises(ValueError, match="attention temperature tuning.*train it with sp_size=1"):
        UlyssesSP(tf.Llama4ForCausalLM(llama4), FakeMesh())  # queries scaled by their LOCAL index (grads 7e-2 off)
    sp = UlyssesSP(tiny_model("llama"), FakeMesh())  # backstop at call time:
    q = torch.zeros(1, 8, 4, 8)  # a model-built mask tensor reaching the attention function is refused
    with pytest.raises(ValueError, match="passes its own attention mask"):
        sp._attention_forward(torch.nn.Module(), q, q[:, :2], q[:, :2], torch.zeros(1, 1, 4, 4),
                              ulysses_mask=GlobalMask(4))
    FakeMesh.sp_size = 16
    with pytest.raises(ValueError, match="all-to-all over 16 ranks > num_attention_heads 8: use sp_ring_size >= 2"):
        UlyssesSP(tiny_model("llama"), FakeMesh(), UlyssesSPConfig(sp_size=16, sp_ring_size=1))
    # the ring cannot softcap
    with pytest.raises(ValueError, match="Ulysses x ring when sp_size > num_attention_heads"):
        UlyssesSP(tiny_model("gemma2"), FakeMesh(), UlyssesSPConfig(sp_size=16))
    dropout = tiny_model("llama")
    dropout.config.attention_dropout = 0.1  # the ring has no attention dropout: refused before training
    with pytest.raises(ValueError, match="attention_dropout=0.1: ring attention"):
        UlyssesSP(dropout, FakeMesh(), UlyssesSPConfig(sp_size=16))
