"""UlyssesTrainer (transformers.Trainer + Ulysses SP) against the plain Trainer in one process.

The SP run launches ``examples/trainer_train.py`` through ``torchrun --standalone`` as users do; the
reference, resume and refusal runs call the same code on a spawned gloo world (``dist_helper.spawn``,
faster to start).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dist_helper import run_launcher, spawn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trainer_train.py"


def run_example(nproc: int, tmp: Path, name: str, *args: str) -> list[dict]:
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(EXAMPLE),
           "--output-dir", str(tmp / name), "--log-file", str(log), *args]
    out = run_launcher(cmd, 300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


def _main(rank, world, argv):
    sys.path.insert(0, str(EXAMPLE.parent))
    import trainer_train

    trainer_train.main(argv)


def spawn_example(nproc: int, tmp: Path, name: str, *args: str) -> list[dict]:
    """The example's main() on a spawned gloo world (no torchrun start-up: faster, same code)."""
    log = tmp / f"{name}.jsonl"
    spawn(_main, nproc, ["--output-dir", str(tmp / name), "--log-file", str(log), *args])
    return [json.loads(line) for line in log.read_text().splitlines()]


def step_logs(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "loss" in r}


# the SP runs also use the memory features: tiled loss and tiled MLP (tiles that do not divide the
# shard), gradient checkpointing and activation offload, none of which may change the numbers
SP_FLAGS = ("--sp-size", "2", "--tiled-loss-tokens", "7", "--tiled-mlp-tokens", "5", "--gradient-checkpointing",
            "--offload-activations")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SP=2 on 2 ranks (checkpoint at step 2) and the plain Trainer on 1 process, same data:
    3 optimizer steps of 2 micro-batches of 2 variable-length, right-padded rows (odd lengths
    too), then evaluate()."""
    tmp = tmp_path_factory.mktemp("trainer")
    sp = run_example(2, tmp, "sp2", *SP_FLAGS, "--eval", "--save-steps", "2")
    plain = spawn_example(1, tmp, "plain", "--plain", "--eval")
    return tmp, sp, plain


def test_sp2_matches_plain_trainer_step_by_step(runs):
    """Bug caught: a wrong loss scale (Trainer's GA division or world scaling applied on top of ours),
    SP ranks reading different data or the world sharding data, targets lost at shard borders, and
    padding counted as tokens: any of them changes the logged loss or grad_norm from step 1 on."""
    _, sp, plain = runs
    sp_steps, plain_steps = step_logs(sp), step_logs(plain)
    assert sorted(sp_steps) == [1, 2, 3] == sorted(plain_steps)
    for step in (1, 2, 3):
        # fp32, only the summation order differs (sharded attention, gradient all-reduce): ~1e-7
        # relative per step; AdamW's normalised updates keep 3 steps well inside 1e-5
        assert sp_steps[step]["loss"] == pytest.approx(plain_steps[step]["loss"], rel=1e-5)
        assert sp_steps[step]["grad_norm"] == pytest.approx(plain_steps[step]["grad_norm"], rel=1e-5)


def test_sp2_offloads_checkpointed_layer_inputs(runs):
    """Bug caught: offload lost when Trainer.train() re-enables gradient checkpointing (it replaces the
    layers' checkpoint functions after UlyssesTrainer.__init__): then nothing would be offloaded."""
    _, sp, _ = runs
    stats = next(r for r in sp if "offloaded_tensors" in r)
    # 3 steps x 2 micro-batches x 2 layers, one layer input each; all restored for backward
    assert stats["offloaded_tensors"] == stats["restored_tensors"] == 12


def test_sp2_counts_steps_epochs_and_tokens_once_per_group(runs):
    """Bug caught: SP ranks counted as extra data: a world-sharded dataloader halves the steps per epoch
    (epoch doubles) and num_input_tokens_seen gathered over all ranks doubles."""
    _, sp, plain = runs
    for key in ("epoch", "num_input_tokens_seen"):
        assert [r[key] for r in step_logs(sp).values()] == [r[key] for r in step_logs(plain).values()]
    summary_sp = next(r for r in sp if r.get("summary"))
    summary_plain = next(r for r in plain if r.get("summary"))
    for key in ("global_step", "max_steps", "num_train_epochs", "epoch", "num_input_tokens_seen"):
        assert summary_sp[key] == summary_plain[key]
    train_sp = next(r for r in sp if "train_loss" in r)
    train_plain = next(r for r in plain if "train_loss" in r)
    assert train_sp["train_loss"] == pytest.approx(train_plain["train_loss"], rel=1e-5)


def test_sp2_eval_loss_matches_plain_trainer(runs):
    """Bug caught: an eval loss that is one rank's shard mean (not the batch's token mean) or that
    double-counts / truncates batches when gathering duplicates from SP ranks (6 rows, batch 2)."""
    _, sp, plain = runs
    eval_sp = next(r for r in sp if "eval_loss" in r)
    eval_plain = next(r for r in plain if "eval_loss" in r)
    # fp32 forward only, summation order differs: ~1e-7 relative
    assert eval_sp["eval_loss"] == pytest.approx(eval_plain["eval_loss"], rel=1e-5)


def test_sp2_resume_from_checkpoint_continues_identically(runs):
    """Bug caught: a resume that replays or skips data (world-sharded skip), loses optimizer / scheduler
    state, or a checkpoint saved with our attention key: step 3 after resuming from step 2 must
    give the uninterrupted run's loss. The saved config keeps the model's own attention kernel."""
    tmp, sp, _ = runs
    checkpoint = tmp / "sp2" / "checkpoint-2"
    assert "ulysses" not in (checkpoint / "config.json").read_text()
    resumed = step_logs(spawn_example(2, tmp, "resumed", *SP_FLAGS, "--resume-from", str(checkpoint)))
    assert sorted(resumed) == [3]
    # same fp32 computation on the same ranks after reloading exact weights and optimizer state
    assert resumed[3]["loss"] == pytest.approx(step_logs(sp)[3]["loss"], rel=1e-6)
    assert resumed[3]["grad_norm"] == pytest.approx(step_logs(sp)[3]["grad_norm"], rel=1e-6)


def _main_deepspeed(rank, world, argv):
    os.environ["DS_ACCELERATOR"] = "cpu"
    _main(rank, world, argv)


def test_sp2_under_deepspeed_zero2_matches_plain_trainer(runs):
    """Bug caught: DeepSpeed's own loss scaling (1/GAS) or its gradient averaging combining wrongly
    with our per-rank loss (ZeRO-2 through TrainingArguments(deepspeed=...))."""
    tmp, _, plain = runs
    config = tmp / "zero2.json"
    config.write_text(json.dumps({
        "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
    }))
    log = tmp / "zero2.jsonl"
    spawn(_main_deepspeed, 2, ["--sp-size", "2", "--deepspeed", str(config), "--output-dir", str(tmp / "zero2"),
                               "--log-file", str(log)])
    zero2 = step_logs([json.loads(line) for line in log.read_text().splitlines()])
    for step in (1, 2, 3):
        # fp32, same tolerance reasoning as the DDP parity test
        assert zero2[step]["loss"] == pytest.approx(step_logs(plain)[step]["loss"], rel=1e-5)
        assert zero2[step]["grad_norm"] == pytest.approx(step_logs(plain)[step]["grad_norm"], rel=1e-5)


# refusals ---------------------------------------------------------------------------------
def _collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows])
    batch = {"input_ids": ids, "labels": ids.clone()}
    if "position_ids" in rows[0]:
        batch["position_ids"] = torch.tensor([r["position_ids"] for r in rows])
    return batch


def _drop_position_ids(rows):
    return {k: v for k, v in _collate(rows).items() if k != "position_ids"}


def _trainer(tmp, sp_size, heads=4, collator=_collate, train_rows=None, eval_rows=None, args_kwargs=None, **kwargs):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from ulysses_sp.config import UlyssesSPConfig
    from ulysses_sp.integrations.trainer import UlyssesTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=heads, num_key_value_heads=1))
    args = TrainingArguments(output_dir=str(tmp), max_steps=1, per_device_train_batch_size=1, report_to="none",
                             use_cpu=True, ddp_backend="gloo", save_strategy="no", **(args_kwargs or {}))
    rows = train_rows or [{"input_ids": list(range(1, 9)), "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]}] * 4
    return UlyssesTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collator,
                          eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
                          sp_config=UlyssesSPConfig(sp_size=sp_size), **kwargs)


def _refusals(rank, world, tmp):
    with pytest.raises(ValueError, match="sp_size=3 does not divide the world size 2"):
        _trainer(tmp, sp_size=3)
    one_head = _trainer(tmp, sp_size=2, heads=1)  # more ranks than heads: Ulysses x ring, chosen automatically
    assert (one_head.ulysses.attention.a2a_size, one_head.ulysses.attention.ring_size) == (1, 2)
    with pytest.raises(ValueError, match="batch_rebalance"):
        _trainer(tmp, sp_size=2, args_kwargs={"train_sampling_strategy": "batch_rebalance"})
    with pytest.raises(ValueError, match="compute_metrics needs full-sequence logits"):
        _trainer(tmp, sp_size=2, compute_metrics=lambda p: {})
    with pytest.raises(ValueError, match="collated batch has none"):
        _trainer(tmp, sp_size=2, collator=_drop_position_ids).train()
    # rank 1 evaluates a longer sequence than rank 0: the SP group would not share one batch
    rows = [{"input_ids": list(range(1, 8 + 2 * rank))}]
    with pytest.raises(ValueError, match="same batch"):
        _trainer(tmp, sp_size=2, train_rows=rows, eval_rows=rows).evaluate()


def test_bad_configurations_raise_before_training(tmp_path):
    """Bug caught: settings that would silently train something else or hang on gloo: sp_size not
    dividing the world, a model with fewer heads than sp_size, a sampler that deals batches per
    world rank, compute_metrics on sharded logits,
    a collator dropping the position_ids of packed rows (documents would attend to each other), and
    an eval batch that differs between the SP ranks."""
    spawn(_refusals, 2, tmp_path)
