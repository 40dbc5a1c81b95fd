"""Staged extension (``cli/train/stages.py``): a checkpoint resumed at another --sp-size / --seq-len.

Through the real command on the embedded copy task (tiny: hidden 32). Two lineages:

    sp change     64 tokens at SP=1 (6 steps, saved at 3)  ->  resumed at SP=2 for steps 4-6: the
                  same losses as the uninterrupted SP=1 run, so weights, optimizer moments, LR
                  schedule and data position all continued (SP is exact, test_train_cli)
    seq change    64 tokens at SP=1 "pretrained" at 64 positions (2 steps)  ->  256 tokens at SP=2
                  with YaRN x4 (steps 3-4). Learning rate 0 keeps the weights at their init, so each
                  step's loss depends only on its batch: steps 3-4 must equal an uninterrupted
                  256-token run's steps 3-4 (the data position of the new stage's data order)
"""

import json
import shutil

import pytest
import torch

from ulysses_sp.cli.main import main

BASE = ["--task-vocab-size", "9", "--hidden-size", "32", "--num-heads", "4", "--task-train-rows", "64",
        "--task-eval-rows", "2", "--logging-steps", "1", "--save-strategy", "steps"]
AT_64 = ["--seq-len", "64", "--per-device-train-batch-size", "8"]
AT_256 = ["--seq-len", "256", "--per-device-train-batch-size", "2", "--sp-size", "2",  # same tokens per step
          "--rope-scaling", "yarn", "--rope-factor", "4", "--rope-original-max-position-embeddings", "64"]
FROZEN = ["--learning-rate", "0"]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(out, *argv):
    assert main(["train", *BASE, *argv, "--output-dir", str(out)]) == 0, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged")
    _train(tmp / "sp1", *AT_64, "--sp-size", "1", "--warmup-steps", "4", "--max-steps", "6", "--save-steps", "3")
    _train(tmp / "sp2", *AT_64, "--sp-size", "2", "--warmup-steps", "4", "--max-steps", "6", "--save-steps", "3",
           "--resume-from-checkpoint", str(tmp / "sp1" / "checkpoint-3"))
    _train(tmp / "long", *AT_256, *FROZEN, "--max-steps", "4", "--save-steps", "10")
    _train(tmp / "short", *AT_64, *FROZEN, "--sp-size", "1", "--max-steps", "2", "--save-steps", "2",
           "--max-position-embeddings", "64")
    # no --rope-original-max-position-embeddings: the resumed checkpoint's model's length (64) is the default
    _train(tmp / "extended", *AT_256[:-2], *FROZEN, "--max-steps", "4", "--save-steps", "10",
           "--resume-from-checkpoint", str(tmp / "short" / "checkpoint-2"))
    return tmp


def test_resume_at_another_sp_size_continues_the_run_exactly(runs):
    """Bug caught: a resume at another SP / world size that restarts the optimizer (moments lost), the
    schedule or the data (first batches again), or renumbers the steps: steps 4-6 at SP=2 must give
    the losses of the uninterrupted SP=1 run. fp32, summation order only (SP=2 vs 1, as
    test_train_cli), observed ~1e-6 relative; a lost Adam moment or a replayed batch moves the loss
    by > 1e-2."""
    one, resumed = _records(runs / "sp1"), _records(runs / "sp2")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert resumed[:3] == one[:3]  # the earlier stage's records, kept once
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed[3:]]),
                               torch.tensor([r["loss"] for r in one[3:]]), rtol=1e-4, atol=0)
    # the schedule is a function of the step only: the same float computation on both sides
    assert [r["learning_rate"] for r in resumed] == [r["learning_rate"] for r in one]
    assert resumed[3]["elapsed_seconds"] >= resumed[2]["elapsed_seconds"]
    stages = json.loads((runs / "sp2" / "run.json").read_text())["stages"]
    assert [(s["sp_size"], s["world_size"], s["seq_len"], s["start_step"], s["end_step"]) for s in stages] == [
        (1, 1, 64, 0, 3), (2, 2, 64, 3, 6)]


def test_resume_at_a_longer_seq_len_continues_step_data_and_metrics(runs):
    """Bug caught: a longer stage that restarts its data order (replays the first batches), counts
    steps from 0, drops the earlier stage's metrics, does not record the stages, or scales RoPE from
    the wrong original length (the resumed model's 64, not the embedded default's 1024). Learning rate 0:
    the weights stay at the (seeded) init, so both runs compute the same thing on the same batch
    bit for bit (1e-6 relative allows for nothing else); the four batches' losses differ by > 1e-5
    relative (observed >= 1e-4), so a wrong batch fails."""
    long, short, extended = _records(runs / "long"), _records(runs / "short"), _records(runs / "extended")
    losses = torch.tensor([r["loss"] for r in long])
    assert (losses[:, None] - losses[None, :]).abs().add(torch.eye(4)).min() > 1e-5 * losses.max()
    assert [r["step"] for r in extended] == [1, 2, 3, 4]
    assert extended[:2] == short  # stage 1's records carried over, once
    torch.testing.assert_close(torch.tensor([r["loss"] for r in extended[2:]]), losses[2:], rtol=1e-6, atol=0)
    assert extended[2]["num_input_tokens_seen"] > short[-1]["num_input_tokens_seen"]  # the token count goes on
    assert extended[2]["elapsed_seconds"] >= short[-1]["elapsed_seconds"]
    summary = json.loads((runs / "extended" / "run.json").read_text())
    first, second = summary["stages"]
    assert (first["seq_len"], first["sp_size"], first["start_step"], first["end_step"]) == (64, 1, 0, 2)
    assert (second["seq_len"], second["sp_size"], second["start_step"], second["end_step"]) == (256, 2, 2, 4)
    assert first["rope_parameters"]["rope_type"] == "default" and first["max_position_embeddings"] == 64
    assert second["rope_parameters"]["rope_type"] == "yarn" and second["max_position_embeddings"] == 256
    saved = json.loads((runs / "short" / "checkpoint-2" / "ulysses_stages.json").read_text())["stages"]
    assert [(s["seq_len"], s["end_step"]) for s in saved] == [(64, 2)]


@pytest.mark.parametrize("shard, message, recorded", [
    ("global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt", "DeepSpeed ZeRO optimizer partitions", True),
    ("optimizer_0/__0_0.distcp", "FSDP sharded state", True),
    ("optimizer_0/__0_0.distcp", "FSDP sharded state", False),  # no ulysses_stages.json: sizes from rng_state*
])
def test_sharded_optimizer_state_at_another_world_size_is_refused(runs, shard, message, recorded, tmp_path, capsys):
    """Bug caught: optimizer shards written by a world of 1 loaded into a world of 2 (wrong or missing
    partitions, a crash mid-start); refused before launch with the fix, while the same world size
    still resumes (also for a checkpoint without the stage record, e.g. an older one)."""
    from ulysses_sp.cli.train.launch import plan

    ckpt = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(runs / "sp1" / "checkpoint-3", ckpt)
    if not recorded:
        (ckpt / "ulysses_stages.json").unlink()
    (ckpt / shard).parent.mkdir(parents=True, exist_ok=True)
    (ckpt / shard).write_bytes(b"")
    argv = [*BASE, *AT_64, "--max-steps", "6", "--resume-from-checkpoint", str(ckpt)]
    out = tmp_path / "never"
    assert main(["train", *argv, "--sp-size", "2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "written at world size 1" in err and "--model DIR" in err, err
    assert not out.exists()
    plan([*argv, "--sp-size", "1", "--output-dir", str(out)])  # same layout: accepted


def test_max_steps_already_reached_is_refused(runs, tmp_path, capsys):
    """Bug caught: a later stage given its own step count (--max-steps 3 after 3 steps) silently
    training nothing and writing the checkpoint's model as the result."""
    argv = ["train", *BASE, *AT_256, "--max-steps", "3", "--resume-from-checkpoint",
            str(runs / "sp1" / "checkpoint-3"), "--output-dir", str(tmp_path / "never")]
    assert main(argv) == 2
    assert "--max-steps > 3" in capsys.readouterr().err


def test_a_resumed_stage_uses_its_own_logging_eval_and_save_intervals():
    """Bug caught: a stage resumed from a checkpoint evaluating, logging and saving at the CHECKPOINT's
    intervals (transformers restores them from trainer_state.json and only warns), so stage 2's
    --eval-steps 100 evaluated only at the end of a 200-step stage."""
    import types

    from transformers import TrainerControl, TrainerState

    from ulysses_sp.cli.train.stages import StageCallback

    state = TrainerState(max_steps=600, global_step=400, logging_steps=50, eval_steps=200, save_steps=400)
    args = types.SimpleNamespace(logging_steps=10, eval_steps=100, save_steps=0.5)  # a ratio: of max_steps
    callback = StageCallback({"seq_len": 1024, "sp_size": 2}, [{"seq_len": 256, "sp_size": 1, "start_step": 0}])
    callback.on_train_begin(args, state, TrainerControl())
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (10, 100, 300)
    assert callback.current["start_step"] == 400 and callback.earlier[-1]["end_step"] == 400
