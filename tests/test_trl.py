"""UlyssesSFTTrainer (TRL SFTTrainer + Ulysses SP) against the plain SFTTrainer in one process.

Both runs call ``examples/sft_train.py``'s ``main`` on a spawned gloo world (``dist_helper.spawn``:
no torchrun start-up; the torchrun launch path itself is covered by ``test_trainer.py``).
"""

import json
import sys
from pathlib import Path

import pytest
from dist_helper import spawn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft_train.py"


def _main(rank, world, argvs):
    sys.path.insert(0, str(EXAMPLE.parent))
    import sft_train

    for argv in argvs:  # several runs per spawn: trl / datasets are imported once per worker
        sft_train.main(argv)


def spawn_examples(nproc: int, tmp: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    argvs = [["--output-dir", str(tmp / name), "--log-file", str(tmp / f"{name}.jsonl"), *args]
             for name, args in runs.items()]
    spawn(_main, nproc, argvs)
    return {name: [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()] for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """sp=2 on 2 ranks and the plain SFTTrainer on 1 process, with and without BFD packing."""
    tmp = tmp_path_factory.mktemp("sft")
    sp = spawn_examples(2, tmp, {"sp_packed": ("--sp-size", "2", "--packing", "--eval"),
                                 "sp_padded": ("--sp-size", "2", "--eval")})
    plain = spawn_examples(1, tmp, {"plain_packed": ("--plain", "--packing", "--eval"),
                                    "plain_padded": ("--plain", "--eval")})
    return {**sp, **plain}


def step_logs(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "loss" in r}


def assert_same_run(sp: list[dict], plain: list[dict]) -> None:
    sp_steps, plain_steps = step_logs(sp), step_logs(plain)
    assert sorted(sp_steps) == [1, 2, 3] == sorted(plain_steps)
    for step in (1, 2, 3):
        a, b = sp_steps[step], plain_steps[step]
        # fp32; only the summation order differs (sharded attention, gradient all-reduce, metric sums):
        # ~1e-7 relative per step, AdamW's normalised updates keep 3 steps well inside 1e-5
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
        for key in ("num_tokens", "num_input_tokens_seen", "epoch"):  # counts: exact
            assert a[key] == b[key], (step, key)
    eval_sp = next(r for r in sp if "eval_loss" in r)
    eval_plain = next(r for r in plain if "eval_loss" in r)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert eval_sp[key] == pytest.approx(eval_plain[key], rel=1e-5, abs=1e-7), key  # fp32 forward only


def test_sft_packing_bfd_completion_only_sp2_matches_plain(runs):
    """BFD packing (padding-free rows: position_ids restart per document) with completion-only
    labels and max_length the GLOBAL row length. Catches documents attending across a packing
    boundary (the collator's position_ids ignored), prompt tokens counted in the loss or its
    normaliser, SFT's metrics computed on one shard or counted once per SP rank, and a wrong loss
    scale under gradient accumulation."""
    assert_same_run(runs["sp_packed"], runs["plain_packed"])


def test_sft_padded_batches_sp2_matches_plain(runs):
    """Without packing: right-padded rows of different lengths (attention_mask, no position_ids),
    odd global lengths padded to a multiple of sp_size. Catches padding counted as tokens or
    attended to, and num_tokens / num_input_tokens_seen counted from shards."""
    assert_same_run(runs["sp_padded"], runs["plain_padded"])
