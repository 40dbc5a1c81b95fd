"""RoPE scaling of ``ulysses-sp train`` (``cli/train/rope_scaling.py``): exact under SP, saved, refused when short.

The scaled models are tiny Llamas pretrained-length 16 (``max_position_embeddings``), extended 4x; the
batches (S=47, padded to 48 under P=2) are past 16 on every rank, so each rank's shard uses the
scaled frequencies and dynamic NTK's base depends on the length it sees. Reference: ONE plain
transformers process on the global batch, loss and every gradient.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers as tf

from dist_helper import spawn
from ulysses_sp import SPMesh, UlyssesSPConfig, global_num_items, reported_loss
from ulysses_sp.cli.main import main
from ulysses_sp.cli.train.rope_scaling import SCALING_TYPES, apply_rope_scaling, covered_length, length_error
from ulysses_sp.integrations.transformers import UlyssesSP

ORIGINAL, FACTOR, S = 16, 4.0, 47


def rope_args(**given):
    """The rope fields of ``ModelDataArguments`` (defaults as the command's)."""
    values = dict(rope_scaling=None, rope_factor=None, rope_original_max_position_embeddings=None, rope_theta=None,
                  rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, max_position_embeddings=None)
    return SimpleNamespace(**{**values, **given})


def scaled_model(scaling, seed=0):
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=ORIGINAL,
                            pad_token_id=0, tie_word_embeddings=False)
    if scaling is not None:
        apply_rope_scaling(config, rope_args(rope_scaling=scaling, rope_factor=FACTOR))
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # larger than the default init so attention patterns (and positions) matter
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def batch():
    return {"input_ids": torch.randint(1, 128, (2, S), generator=torch.Generator().manual_seed(1))}


def _reference(scaling):
    model = scaled_model(scaling)
    ids = batch()["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _sp(scaling, mesh):
    model = scaled_model(scaling)
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=mesh.sp_size)) as sp:
        shard = sp.shard({**batch(), "labels": batch()["input_ids"]})
        num_items = global_num_items(shard["shift_labels"], mesh.sp_group)
        loss = sp.forward_loss(model, shard, num_items, grad_average_world=mesh.sp_size)
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[name] = p.grad / mesh.sp_size  # DDP averages over ranks
    return reported_loss(loss.detach(), mesh.sp_size, mesh.sp_group), grads


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    unscaled, _ = _reference(None)
    for scaling in SCALING_TYPES:
        ref_loss, ref_grads = _reference(scaling)
        assert abs(ref_loss - unscaled) > 1e-3, f"{scaling}: the scaling changed nothing at S={S}"
        loss, grads = _sp(scaling, mesh)
        # fp32, summation order only (all-to-all layout, per-rank partial sums), as test_hf_parity; dynamic
        # NTK fed the shard's length instead of the global one is > 1e-2 off (test_rope_length)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{scaling} loss: {m}")
        for name, ref in ref_grads.items():
            scale = ref.abs().max().clamp_min(1e-8)  # relative to the tensor's largest entry
            torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                       msg=lambda m, name=name: f"{scaling} grad {name}: {m}")
    dist.barrier()


def test_each_rope_scaling_under_sp_equals_one_process():
    """Bug caught: a scaled rotary embedding under SP that differs from one process (positions of the
    shard instead of the global ones, dynamic NTK choosing its base from the shard length, YaRN's
    attention factor lost), for linear, dynamic, yarn and llama3, loss and every gradient at P=2."""
    spawn(_worker, 2)


@pytest.mark.parametrize("scaling", SCALING_TYPES)
def test_saved_scaled_model_reloads_with_identical_logits(scaling, tmp_path):
    """Bug caught: a scaling that lives only in the training process (not in config.json), so
    from_pretrained rebuilds the unscaled model: logits past the original length differ."""
    model = scaled_model(scaling).eval()
    model.save_pretrained(tmp_path)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    assert reloaded.config.rope_parameters["rope_type"] == scaling
    with torch.no_grad():
        # same weights, same ops, same process: bit-identical
        torch.testing.assert_close(reloaded(**batch()).logits, model(**batch()).logits, rtol=0, atol=0)
    assert covered_length(reloaded.config) == (None if scaling == "dynamic" else int(FACTOR * ORIGINAL))


def test_rope_parameters_follow_transformers_conventions():
    """Bug caught: keys transformers does not read (a factor it ignores, llama3 without its frequency
    factors, dynamic with max_position_embeddings raised so it never scales)."""
    expected = {
        "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 64),
        "dynamic": ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, 16),
        "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                  "rope_theta": 10000.0}, 64),
        "llama3": ({"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 16,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 10000.0}, 64),
    }
    for scaling, (params, limit) in expected.items():
        config = scaled_model(scaling).config
        assert (config.rope_parameters, config.max_position_embeddings) == (params, limit), scaling
    config = tf.LlamaConfig(max_position_embeddings=16)
    apply_rope_scaling(config, rope_args(rope_theta=5e5, max_position_embeddings=64))  # "ABF": a larger base
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5} and length_error(config, 64) is None
    qwen_yarn = tf.LlamaConfig(max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4})
    assert covered_length(qwen_yarn) == 128  # YaRN shipped with max_position_embeddings at the original length


# the embedded copy task at 64 positions, its model "pretrained" at 32 (its own default declares 1024)
SHORT = ["--task-vocab-size", "9", "--hidden-size", "32", "--num-heads", "4", "--per-device-train-batch-size", "2",
         "--task-train-rows", "16", "--task-eval-rows", "2", "--seq-len", "64"]
AT_32 = ["--rope-original-max-position-embeddings", "32"]


@pytest.mark.parametrize("extra, message", [
    (["--max-position-embeddings", "32"],
     "--rope-scaling yarn --rope-factor 2 --rope-original-max-position-embeddings 32"),
    (["--rope-scaling", "yarn", "--rope-factor", "1.5", *AT_32],
     "--rope-factor 2 --rope-original-max-position-embeddings 32"),
    (["--rope-scaling", "linear", "--rope-factor", "4", *AT_32, "--max-position-embeddings", "256"],
     "raise --rope-factor to 8"),
    (["--rope-factor", "2"], "need a scaling type: add --rope-scaling"),
    (["--rope-scaling", "linear"], "needs --rope-factor F >= 1"),
    (["--rope-scaling", "dynamic", "--rope-factor", "2", "--max-position-embeddings", "128"],
     "give --rope-original-max-position-embeddings"),
])
def test_seq_len_past_the_covered_length_is_refused_with_the_fix(extra, message, tmp_path, capsys):
    """Bug caught: --seq-len past the model's positions trained anyway (positions never seen in
    pretraining, silently), or refused without the options that extend the model."""
    out = tmp_path / "never"
    assert main(["train", *SHORT, *extra, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists() and not out.with_name("never.incomplete").exists()


def test_command_trains_past_the_original_length_and_saves_the_scaling(tmp_path):
    """Bug caught: the --rope-* options (here from a --config file) parsed but not applied to the
    model the workers build, or not written to the saved config.json: the reloaded model's rotary
    embedding must be the one the options describe."""
    (tmp_path / "rope.yaml").write_text("rope_scaling: llama3\nrope_factor: 2\nrope_theta: 20000\n"
                                        "rope_original_max_position_embeddings: 32\n")
    out = tmp_path / "run"
    assert main(["train", *SHORT, "--config", str(tmp_path / "rope.yaml"), "--max-steps", "2",
                 "--output-dir", str(out)]) == 0
    reloaded = tf.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.rope_parameters == {"rope_type": "llama3", "factor": 2.0,
                                               "original_max_position_embeddings": 32, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "rope_theta": 20000.0}
    assert reloaded.config.max_position_embeddings == 64
    expected = tf.LlamaConfig(**{**reloaded.config.to_dict(), "max_position_embeddings": 32,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    apply_rope_scaling(expected, rope_args(rope_scaling="llama3", rope_factor=2, rope_theta=20000))
    inv_freq = tf.LlamaForCausalLM(expected).model.rotary_emb.inv_freq
    torch.testing.assert_close(reloaded.model.rotary_emb.inv_freq, inv_freq, rtol=0, atol=0)  # same formula
