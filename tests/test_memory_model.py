"""The memory model (ulysses_sp.memory.estimate) and ``ulysses-sp plan``.

The model's accuracy against measured peaks is a benchmark (benchmarks/memory_ablation.py);
these tests check its structure and the one coefficient that can be counted exactly and quickly:
the bytes autograd saves per token in a Llama decoder layer.
"""

import pytest
import torch
import transformers as tf

from ulysses_sp.cli.main import main as cli_main
from ulysses_sp.memory.estimate import MemoryFeatures, ModelDims, estimate_peak_memory, longest_sequence

LLAMA = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)
MIB = 2**20


@pytest.mark.parametrize("config", [
    tf.LlamaConfig(**LLAMA),
    tf.LlamaConfig(**LLAMA, tie_word_embeddings=True),
    tf.Qwen3Config(**LLAMA, head_dim=48),
    tf.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2),
], ids=["llama", "llama_tied", "qwen3_head_dim", "mixtral"])
def test_param_count_matches_transformers(config):
    """Bug caught: a wrong size formula (GQA k/v, decoupled head_dim, tied embeddings, MoE experts and
    router): the grads and static terms scale with it."""
    model = tf.AutoModelForCausalLM.from_config(config)
    dims = ModelDims.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    qwen3 = isinstance(config, tf.Qwen3Config)
    extra_norms = 2 * config.num_hidden_layers * getattr(config, "head_dim", 0) if qwen3 else 0
    assert dims.num_params == real - extra_norms  # Qwen3's q/k norms (2 * head_dim per layer) are left out


def test_saved_bytes_per_token_of_a_layer_match_the_counted_term():
    """Bug caught: a wrong activation coefficient: the model's per-layer saved term (no checkpointing:
    (4D + 3NH + 2KH + 4I) * e per token, plus the layer input) against the storages autograd
    really saves in a GQA Llama layer (parameters excluded; cos/sin are shared by all layers)."""
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    model = tf.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    T = 300
    x = torch.randn(1, T, 64, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(T)[None])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in {c.untyped_storage().data_ptr() for c in cos_sin}:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_embeddings=cos_sin, attention_mask=None)
    D, I, NH, KH = 64, 96, 4 * 24, 2 * 24
    expected = (4 * D + 3 * NH + 2 * KH + 4 * I + D) * 4  # + D: the layer input (= ckpt input)
    per_token = sum(v for v in saved.values() if v >= T * 4) / T
    assert abs(per_token - expected) <= 0.05 * expected, (per_token, expected)


def test_feature_terms_scale_as_documented():
    """Bug caught: features that do not change the terms they should: tiled loss removes the T*V
    term, SP divides per-rank token terms by P, offload moves the checkpointed inputs to the host,
    and on a CPU-only machine offload frees nothing."""
    f = MemoryFeatures
    plain = estimate_peak_memory(LLAMA, 8192, 1, torch.float32, f())
    assert plain.phase == "loss" and plain.terms["loss"] == (3 * 32000 * 4 + 5 * 256 * 4) * 8192
    tiled = estimate_peak_memory(LLAMA, 8192, 1, torch.float32, f(tiled_loss_tokens=64))
    assert tiled.peak_bytes < plain.peak_bytes / 5
    sp = estimate_peak_memory(LLAMA, 8192, 2, torch.float32, f(tiled_loss_tokens=64))
    assert sp.terms["checkpointed_inputs"] * 2 == tiled.terms["checkpointed_inputs"]
    off = estimate_peak_memory(LLAMA, 8192, 2, torch.float32, f(tiled_loss_tokens=64, offload=True))
    assert off.host_bytes == sp.terms["checkpointed_inputs"] and off.peak_bytes < sp.peak_bytes
    cpu = estimate_peak_memory(LLAMA, 8192, 2, torch.float32,
                               f(tiled_loss_tokens=64, offload=True, host_is_device=True))
    assert cpu.peak_bytes == sp.peak_bytes and cpu.host_bytes == 0
    bf16 = estimate_peak_memory(LLAMA, 8192, 1, torch.bfloat16, f(), optimizer="adam")
    assert bf16.static["optimizer"] == ModelDims.from_config(LLAMA).num_params * 12
    with pytest.raises(ValueError, match="checkpointing"):
        estimate_peak_memory(LLAMA, 8192, 1, torch.float32, f(checkpointing=False, offload=True))


def test_longest_sequence_is_the_boundary():
    """Bug caught: an off-by-one search: the returned S fits, the next multiple of P*granule does not."""
    features = MemoryFeatures(tiled_loss_tokens=64)
    budget = 300 * MIB
    s = longest_sequence(LLAMA, 2, torch.float32, features, budget, granule=64, include_static=False)
    assert s > 0
    fits = lambda n: estimate_peak_memory(LLAMA, n, 2, torch.float32, features).peak_bytes <= budget  # noqa: E731
    assert fits(s) and not fits(s + 128)


def test_plan_cli_preset_and_local_directory(tmp_path, capsys):
    """Bug caught: the plan command failing on a local model directory or a preset, recommending a
    rung that does not fit, or exiting 0 when nothing fits."""
    assert cli_main(["plan", "--model", "llama-3-8b", "--seq-len", "131072", "--sp-size", "8", "--budget-gib", "24",
                     "--state-shards", "8"]) == 0
    out = capsys.readouterr().out
    assert "recommended: + offload" in out  # GPU default: ALST-calibrated (peak x 1.25 + 1 GiB reserve)
    tf.LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    assert cli_main(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--budget-gib", "0.001"]) == 1
    assert "nothing fits" in capsys.readouterr().out
    # bad input: a message naming the presets and exit 2, not a traceback
    assert cli_main(["plan", "--model", "no-such-model", "--seq-len", "1", "--budget-gib", "1"]) == 2
    assert "preset" in capsys.readouterr().err
