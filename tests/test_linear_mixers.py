"""Hybrid models (gated delta net / Mamba2 layers + attention) under Ulysses SP against one process.

Reference: the unmodified transformers model on the full global batch (its torch kernels), loss =
mean token CE; packed batches run each document on its own (a document's recurrent state starts
from zero, as with ``cu_seqlens``), as in ``test_hf_parity``. SP: ``UlyssesSP`` registration
(attention through our kernel, mixers through ``ulysses_sp.mixers``), sharded batch, ``sp.loss``;
parameter gradients averaged over the SP group as DDP would.

Sequences are longer than the kernels' chunks (64 for the gated delta rule, 16 set for Mamba2), so
the chunked scans carry state across chunks and across shard boundaries.
"""

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from dist_helper import spawn
from reference import document_starts, reference_step
from ulysses_sp import SPMesh, UlyssesSPConfig
from ulysses_sp.integrations.transformers import UlyssesSP, check_model_support
from ulysses_sp.loss import global_num_items, reported_loss
from ulysses_sp.mixers import supported_mixers

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, pad_token_id=0,
              tie_word_embeddings=False)
# 6 value heads over 2 key heads: uneven at P=4 (2,2,1,1), irregular key-head reads at P=3/4, K=2 < P=3/4
GATED_DELTA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                   layer_types=["linear_attention", "full_attention"])
# 8 SSM heads over 2 groups: uneven at P=3 (3,3,2), a group read by two ranks at P=3, G=2 < P=3/4
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16)


def hybrid_config(family: str):
    if family == "qwen3_next":  # fused qkvz projection grouped by key head; dense MLPs (mlp_only_layers)
        return tf.Qwen3NextConfig(**COMMON, **GATED_DELTA, mlp_only_layers=[0, 1], num_experts=2)
    if family == "qwen3_next_8":  # for P=8 > 4 attention heads: 8 value heads, 1 kv head (Ulysses x ring 4 x 2)
        delta = {**GATED_DELTA, "linear_num_value_heads": 8, "num_key_value_heads": 1}
        return tf.Qwen3NextConfig(**COMMON, **delta, mlp_only_layers=[0, 1], num_experts=2)
    if family == "qwen3_5":  # separate q|k|v, z, b, a projections
        return tf.Qwen3_5TextConfig(**COMMON, **GATED_DELTA)
    if family == "bamba":
        return tf.BambaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], **MAMBA2)
    if family == "granitemoehybrid":  # the same mixer, muP-style multipliers around it
        return tf.GraniteMoeHybridConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
                                         layer_types=["mamba", "attention"], **MAMBA2)
    if family == "nemotron_h":  # the same mixer under other config names; an MLP-only layer type
        config = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"}
        return tf.NemotronHConfig(**config, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  layers_block_type=["linear_attention", "full_attention", "mlp"], mamba_num_heads=8,
                                  mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16)
    raise KeyError(family)


def hybrid_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hybrid_config(family), attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so the token mixing matters
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def hybrid_batch(kind: str) -> dict:
    """'plain' (B=2, S=80), 'odd' (B=1, S=77), 'padding' (B=2, S=79, right and left padding),
    'packed' (B=1, S=77, documents of 40, 7 and 30 tokens in position_ids)."""
    gen = torch.Generator().manual_seed(1)
    if kind == "plain":
        return {"input_ids": torch.randint(1, 128, (2, 80), generator=gen)}
    if kind == "odd":
        return {"input_ids": torch.randint(1, 128, (1, 77), generator=gen)}
    if kind == "padding":
        ids = torch.randint(1, 128, (2, 79), generator=gen)
        am = torch.ones(2, 79, dtype=torch.long)
        am[0, 70:] = 0
        am[1, :5] = 0
        ids[am == 0] = 0
        labels = ids.masked_fill(am == 0, -100)
        labels[1, 5] = -100  # predicted from a padding position: undefined (kernel-dependent) in transformers
        return {"input_ids": ids, "attention_mask": am, "labels": labels}
    if kind == "packed":
        pos = torch.cat([torch.arange(40), torch.arange(7), torch.arange(30)])[None]
        return {"input_ids": torch.randint(1, 128, (1, 77), generator=gen), "position_ids": pos}
    raise KeyError(kind)


def reference(family, kind, checkpointing=False):
    batch = hybrid_batch(kind)
    labels = batch.get("labels", batch["input_ids"])
    starts = document_starts(batch["position_ids"][0]) if kind == "packed" else None
    return reference_step(hybrid_model(family), {k: v for k, v in batch.items() if k != "labels"}, labels,
                          starts=starts, checkpointing=checkpointing, use_cache=False)


def sp_run(family, kind, mesh, sp_mixers=True, checkpointing=False):
    model = hybrid_model(family)
    if checkpointing:  # the recomputed mixer forward in backward must find the global mask again
        model.gradient_checkpointing_enable()
        model.train()
    mixers = [m for m in model.modules() if type(m).__name__ in supported_mixers()]
    assert mixers
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=mesh.sp_size)) as sp:
        assert all("forward" in m.__dict__ for m in mixers)  # our forward is installed
        if not sp_mixers:  # the bug: mixers run the model's own forward on their shard only
            sp._mixers.remove()
        shard = sp.shard(hybrid_batch(kind))
        num_items = global_num_items(shard["shift_labels"], mesh.sp_group)
        loss = sp.forward_loss(model, shard, num_items)
        loss.backward()
    assert all("forward" not in m.__dict__ for m in mixers)  # the class forward is back after unregister
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[name] = p.grad / mesh.sp_size  # DDP averages over ranks
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads


# Gradient tolerance, relative to each gradient's largest entry. fp32: the conv, the chunked scans
# and attention see the same values in the same chunks as one process; only summation order differs
# (weight-grad sums over shards, the backward of the key-head / group gather instead of
# repeat_interleave, the all-to-all's sums over ranks reading one key head / group). The gated delta
# rule (a triangular solve per chunk) amplifies that: the fp32 reference itself differs from an fp64
# run by up to 6.8e-5 (A_log / dt_bias / in_proj_a of these tiny models), and SP from the fp32 reference
# by up to 4e-5 (P=1..4), hence 2e-4. Mamba2: fp32-vs-fp64 2e-6, SP <= 5e-6 observed, hence 1e-4
# (as test_hf_parity). A mixer that sees only its shard, a wrong padding or document reset: >= 0.25.
GRAD_ATOL = {"qwen3_next": 2e-4, "qwen3_5": 2e-4}


def check(family, kind, mesh, checkpointing=False):
    ref_loss, ref_grads = reference(family, kind, checkpointing)
    loss, grads = sp_run(family, kind, mesh, checkpointing=checkpointing)
    where = f"{family}/{kind}/P={mesh.sp_size}/checkpointing={checkpointing}"
    # loss: observed <= 1.6e-7 relative (summation order only); a shard-local mixer moves it >= 2e-3
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=GRAD_ATOL.get(family, 1e-4),
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")


def check_shard_only_mixers_differ(family, mesh):
    """Bug caught: with the SP mixer forwards removed, each rank's mixer restarts its conv and state at
    its shard boundary; the loss must then differ from one process by far more than the tolerance."""
    ref_loss, ref_grads = reference(family, "plain")
    loss, grads = sp_run(family, "plain", mesh, sp_mixers=False)
    assert abs(float(loss) - float(ref_loss)) > 1e-3 * abs(float(ref_loss)), (family, float(loss), float(ref_loss))
    mixer_grad = next(n for n in ref_grads if "conv1d.weight" in n)
    scale = ref_grads[mixer_grad].abs().max()
    assert (grads[mixer_grad] - ref_grads[mixer_grad]).abs().max() / scale > 1e-2


FAMILIES = ["qwen3_next", "qwen3_5", "bamba", "granitemoehybrid", "nemotron_h"]
PLAN = {
    1: [(f, k) for f in FAMILIES for k in ("padding", "packed")],
    2: [(f, k) for f in FAMILIES for k in ("plain", "padding", "packed", "odd")],
    3: [(f, k) for f in FAMILIES for k in ("padding", "packed", "odd")],  # uneven: 8 SSM heads, irregular key heads
    4: [(f, k) for f in FAMILIES for k in ("padding", "packed")],  # every family with K or G = 2 < P
    # P=8 > 4 attention heads: mixers split 8 value / SSM heads, attention runs Ulysses x ring (4 x 2)
    8: [(f, k) for f in ("qwen3_next_8", "bamba", "nemotron_h") for k in ("padding", "packed")],
}


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    for family, kind in PLAN[world]:
        check(family, kind, mesh)
    if world == 2:
        for family in ("qwen3_next", "bamba"):
            check_shard_only_mixers_differ(family, mesh)
            check(family, "padding", mesh, checkpointing=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_hybrid_loss_and_every_gradient_match_one_process(world):
    """Bug caught: a linear-attention / SSM layer that mixes only its shard, a wrong head or key-head /
    group split (uneven value / SSM heads at P=3/4, fewer key heads / groups than ranks), a conv
    channel slice that does not match the heads, padding leaking into real tokens (right and left),
    a state carried across packed documents, and S % P != 0. P=1 must equal plain transformers."""
    spawn(_worker, world)


def test_check_model_support_accepts_supported_hybrids_and_refuses_others():
    """Bug caught: a hybrid whose token mixing has no SP forward slipping through (it would train on
    shard-local recurrences), and supported ones being refused."""
    for family in FAMILIES:
        assert check_model_support(hybrid_model(family), UlyssesSPConfig(sp_size=4)) == "sdpa"
    refused = {
        "JambaMambaMixer": tf.JambaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                          attn_layer_offset=1, num_experts=1, mamba_d_state=8, mamba_expand=2),
        "FalconH1Mixer": tf.FalconH1Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                                           mamba_d_head=16, mamba_d_ssm=128, mamba_n_groups=2, mamba_d_state=16,
                                           mamba_chunk_size=16),
    }
    for name, config in refused.items():
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        with pytest.raises(ValueError, match=rf"{name}.*linear / recurrent / hybrid"):
            check_model_support(model, UlyssesSPConfig(sp_size=2))
    few_heads = hybrid_config("qwen3_next")
    few_heads.linear_num_value_heads = 2
    with pytest.raises(ValueError, match="sp_size 4 > 2 value heads of Qwen3NextGatedDeltaNet"):
        check_model_support(tf.AutoModelForCausalLM.from_config(few_heads), UlyssesSPConfig(sp_size=4))


def test_mixer_calls_without_the_global_mask_or_with_a_cache_are_refused():
    """Bug caught: a mixer called without the global mask under SP (a raw batch) mixing only its shard,
    or a generation cache reaching it (its state would cover one shard). One process without the mask
    runs the layer's own forward."""
    from ulysses_sp.attention import GlobalMask
    from ulysses_sp.mixers.sequence import MixerContext, runs_own_forward

    layer = torch.nn.Identity()
    assert runs_own_forward(layer, MixerContext(None, 0, 1), None, None, "state-space")
    with pytest.raises(ValueError, match="without `ulysses_mask`"):
        runs_own_forward(layer, MixerContext(None, 0, 2), None, None, "state-space")
    with pytest.raises(ValueError, match="cache was passed to a state-space layer"):
        runs_own_forward(layer, MixerContext(None, 0, 2), GlobalMask(8), object(), "state-space")
    assert not runs_own_forward(layer, MixerContext(None, 0, 2), GlobalMask(8), None, "state-space")
