"""``ulysses-sp check``: the end-to-end command, its mismatch detector and its bad-input exits."""

import pytest
import torch

from tiny_models import tiny_model
from ulysses_sp.cli.check import format_report
from ulysses_sp.cli.check.engine import (
    TOLERANCES,
    CheckBatch,
    CheckOptions,
    CheckReport,
    StepResult,
    compare,
    noise_floor,
)
from ulysses_sp.cli.main import main


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(path)  # N=8 query heads, K=2 kv heads
    return path


def test_check_command_matches_on_packed_odd_length_batch(llama_dir, capsys):
    """Bug caught: a broken check pipeline: SP loss/grads of a saved model (packed documents, S=23 not
    divisible by P=2) must match the per-document one-process reference and exit 0 with the table."""
    code = main(["check", str(llama_dir), "--sp-size", "2", "--packed", "--seq-len", "23"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "RESULT: MATCH" in out and "LlamaForCausalLM" in out
    assert "loss" in out and "grads (21 tensors)" in out and "12 tokens per rank (S padded to 24)" in out


def test_check_with_memory_features_matches_and_refuses_bad_tile_sizes(llama_dir, capsys):
    """Bug caught: the tiled loss / tiled MLP / head chunk / checkpointing / offload flags not reaching
    the SP run (the report names them and the run still matches) and bad values being spawned
    instead of refused."""
    code = main(["check", str(llama_dir), "--sp-size", "2", "--padding", "--seq-len", "23",
                 "--tiled-loss-tokens", "5", "--tiled-mlp-tokens", "3", "--sp-head-chunks", "2",
                 "--gradient-checkpointing", "--offload-activations"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "RESULT: MATCH" in out and "SP memory features: tiled loss 5, tiled MLP 3 (tokens per tile)" in out
    assert "head chunks 2 (head blocks where the module allows), activation checkpointing on" in out
    assert "offloaded" in out
    assert main(["check", str(llama_dir), "--sp-size", "2", "--tiled-mlp-tokens", "0"]) == 2
    assert "--tiled-mlp-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["check", str(llama_dir), "--sp-size", "2", "--offload-activations"]) == 2
    assert "add --gradient-checkpointing" in capsys.readouterr().err


def test_checkpointed_check_of_a_model_with_dropout_is_deterministic(tmp_path, capsys):
    """Bug caught: train mode (which checkpointing needs) leaving the config's dropout on: GPT-2's
    default 0.1 residual / attention / embedding dropout would make the two runs differ."""
    import transformers as tf

    config = tf.GPT2Config(vocab_size=128, n_embd=64, n_head=8, n_layer=2, n_positions=64, n_inner=96,
                           bos_token_id=1, eos_token_id=2)
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    code = main(["check", str(tmp_path), "--sp-size", "2", "--seq-len", "19", "--gradient-checkpointing",
                 "--tiled-mlp-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: MATCH" in out, out


def _fake_results(seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = {"embed.weight": torch.randn(16, 8, generator=g), "layers.0.q_proj.weight": torch.randn(8, 8, generator=g)}
    ref = StepResult(loss=4.0, grads=grads)
    sp = StepResult(loss=4.0 * (1 + 1e-7), grads={k: v * (1 + 1e-7) for k, v in grads.items()})
    return ref, sp


def test_compare_reports_a_perturbed_gradient_as_mismatch():
    """Bug caught: a detector that cannot fail: one gradient element off by 1% of that tensor's max must
    give exit 1 and name the tensor, while fp32 rounding noise (1e-7) must still pass."""
    ref, sp = _fake_results()
    assert compare(ref, sp, TOLERANCES["float32"]).exit_code == 0  # rounding-level noise is a match
    bad = sp.grads["layers.0.q_proj.weight"]
    bad[3, 5] += 0.01 * bad.abs().max()
    result = compare(ref, sp, TOLERANCES["float32"])
    assert not result.ok and result.exit_code == 1
    assert result.grad_rel_name == "layers.0.q_proj.weight" and result.grad_rel == pytest.approx(0.01, rel=0.05)
    report = CheckReport(CheckOptions("m", 2, seq_len=9), "Fake", 1, "sdpa", "gloo",
                         CheckBatch({}, [[(0, 9)]]), result)
    assert "RESULT: MISMATCH" in format_report(report)


def test_compare_reports_loss_mismatch_missing_gradient_and_nan():
    """Bug caught: mismatches that hide from a max over gradients: a wrong loss scale, a parameter
    without a gradient on one side, and NaN (which compares False with everything)."""
    ref, sp = _fake_results()
    sp.loss = ref.loss * 2  # e.g. a loss not divided by the SP size
    assert compare(ref, sp, TOLERANCES["float32"]).exit_code == 1
    ref, sp = _fake_results()
    del sp.grads["embed.weight"]
    assert compare(ref, sp, TOLERANCES["float32"]).grad_rel_name == "embed.weight"
    ref, sp = _fake_results()
    sp.grads["embed.weight"][0, 0] = float("nan")
    assert compare(ref, sp, TOLERANCES["float32"]).exit_code == 1


def test_missing_model_path_exits_2(tmp_path, capsys):
    """Bug caught: a typo in the model path turning into a Hub download attempt or a traceback."""
    missing = tmp_path / "no_such_model"
    assert main(["check", str(missing), "--sp-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"model path {missing} does not exist" in err


def test_sp_size_larger_than_heads_exits_2_with_ulysses_message(llama_dir, capsys):
    """Bug caught: spawning P processes for a model UlyssesSP refuses: the refusal (with its fix) is
    printed and nothing is launched."""
    assert main(["check", str(llama_dir), "--sp-size", "16", "--sp-ring-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot be made sequence-parallel" in err and "all-to-all over 16 ranks > num_attention_heads 8" in err
    assert main(["check", str(llama_dir), "--sp-size", "4", "--sp-ring-size", "3"]) == 2
    assert "sp_ring_size=3 does not divide sp_size=4" in capsys.readouterr().err


def test_compare_treats_a_theoretically_zero_gradient_as_zero_but_not_a_wrong_one():
    """Bug caught: a key-projection bias (gradient exactly zero in theory: softmax ignores a shift
    shared by all keys) holding rounding noise of 1e-8 on both sides was reported as a 20 % mismatch
    (biogpt, opt, bert, ... exact under SP). Against a floor of 1e-2 of the model's largest gradient
    the noise is a match, while a real error in that tensor (1e-3 of the largest gradient) still fails."""
    ref, sp = _fake_results()
    ref.grads["layers.0.k_proj.bias"] = torch.full((8,), 1.4e-8)
    sp.grads["layers.0.k_proj.bias"] = torch.full((8,), 1.1e-8)
    assert compare(ref, sp, TOLERANCES["float32"]).exit_code == 0
    sp.grads["layers.0.k_proj.bias"][0] = 1e-3 * ref.grads["embed.weight"].abs().max()
    result = compare(ref, sp, TOLERANCES["float32"])
    assert result.exit_code == 1 and result.grad_rel_name == "layers.0.k_proj.bias"


def test_device_flag_refusals(llama_dir, capsys, monkeypatch):
    """Bug caught: --device cuda on a machine without CUDA turning into a CUDA traceback in the workers,
    and a ring over GPUs shared through gloo (send/recv of CUDA tensors) being launched."""
    if not torch.cuda.is_available():
        assert main(["check", str(llama_dir), "--sp-size", "2", "--device", "cuda"]) == 2
        assert "torch sees no CUDA device; use --device cpu" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["check", str(llama_dir), "--sp-size", "4", "--sp-ring-size", "2", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "ring's send/recv over GPUs shared through gloo is not supported" in err and "--device cpu" in err


def test_bf16_accepts_rounding_the_one_process_run_shares_but_not_a_bug():
    """Bug caught: bf16 checks that flag rounding as a MISMATCH (a tiny random model's bf16 gradients
    sit up to 0.6 of a tensor's scale off fp32 in ONE process already), and a noise rule so loose
    that a real error passes: SP is judged against an fp32 run, by the bf16 reference's own error."""
    g = torch.Generator().manual_seed(0)
    truth = {"attn.k": torch.randn(8, 8, generator=g), "norm": torch.randn(8, generator=g)}

    def off(by):  # each tensor moved by by[name] x its largest |value|, in a fixed random direction
        return {n: t + by[n] * t.abs().max() * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).sign()
                for n, t in truth.items()}

    t32 = StepResult(4.0, truth)
    ref16 = StepResult(4.001, off({"attn.k": 0.3, "norm": 0.02}))
    rounding = StepResult(4.0012, off({"attn.k": -0.35, "norm": 0.03}))  # SP's rounding: as large, another sign
    c = compare(ref16, rounding, TOLERANCES["bfloat16"])
    assert c.grad_rel > TOLERANCES["bfloat16"].grad_rel and not c.ok  # the fixed bf16 tolerance alone flags it
    c.noise = noise_floor(t32, ref16, rounding)
    assert c.ok and c.noise.grads_ok and c.noise.loss_ok
    bug = StepResult(4.0012, off({"attn.k": 0.3, "norm": 0.5}))  # the well-conditioned tensor far off: a bug
    c = compare(ref16, bug, TOLERANCES["bfloat16"])
    c.noise = noise_floor(t32, ref16, bug)
    assert not c.ok and c.noise.grad_worst_name == "norm"
    wrong_loss = StepResult(4.05, off({"attn.k": 0.3, "norm": 0.02}))
    c = compare(ref16, wrong_loss, TOLERANCES["bfloat16"])
    c.noise = noise_floor(t32, ref16, wrong_loss)
    assert not c.loss_ok and not c.ok


def test_bf16_check_of_a_saved_model_matches_with_the_fp32_comparison(llama_dir, capsys):
    """Bug caught: a bf16 check failing on rounding alone, or a report without the comparison that
    accepts it: the bf16 command end to end shows both bf16 runs against one fp32 process."""
    code = main(["check", str(llama_dir), "--sp-size", "2", "--packed", "--seq-len", "23", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: MATCH" in out, out
    assert "bf16 against one fp32 process" in out and "x reference" in out


def test_check_flags_come_from_the_config():
    """Bug caught: ``check`` re-declaring ``UlyssesSPConfig`` fields by hand, so a field's default,
    type or help changed in the config does not reach the command (``train`` derives all of its)."""
    import argparse
    import dataclasses

    from ulysses_sp import UlyssesSPConfig
    from ulysses_sp.cli.check import CONFIG_FLAGS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    fields = {f.name: f for f in dataclasses.fields(UlyssesSPConfig)}
    assert len(CONFIG_FLAGS) == 9  # the six of issue 26 + sp_head_chunk_mib + sp_head_blocks + recompute_norms
    for name in CONFIG_FLAGS:
        action, field = actions[name], fields[name]
        flag = "--" + name.replace("_", "-")
        # a bool that defaults to True gets its --no- form too
        assert action.option_strings == ([flag, "--no-" + flag[2:]] if field.default is True else [flag])
        assert action.help.startswith(field.metadata["help"]), name
        assert action.required or action.default == field.default, name
    assert actions["sp_size"].required
    args = parser.parse_args(["m", "--sp-size", "2", "--sp-head-chunks", "3", "--offload-activations"])
    assert (args.sp_size, args.sp_head_chunks, args.offload_activations, args.tiled_mlp_tokens) == (2, 3, True, None)
