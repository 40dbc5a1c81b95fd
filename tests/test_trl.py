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
        trainer = sft_train.main(argv)
        if "--assistant-only" in argv and rank == 0:  # the raw chat rows and TRL's labels, for the mask check
            rows = sft_train.tiny_chat_dataset(4, seed=1)  # the first rows of the run's train_dataset (seed=1)
            batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
            dump = {"messages": [rows[i]["messages"] for i in range(4)],
                    "labels": [trainer.train_dataset[i]["labels"] for i in range(4)],
                    "collated_labels": batch["labels"].tolist()}
            log = Path(argv[argv.index("--log-file") + 1])
            log.with_suffix(".labels.json").write_text(json.dumps(dump))


def spawn_examples(nproc: int, tmp: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    argvs = [["--output-dir", str(tmp / name), "--log-file", str(tmp / f"{name}.jsonl"), *args]
             for name, args in runs.items()]
    spawn(_main, nproc, argvs)
    return {name: [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()] for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """sp=2 on 2 ranks and the plain SFTTrainer on 1 process: BFD packing, padded rows, padding-free
    without packing, and assistant-only loss on conversational rows."""
    tmp = tmp_path_factory.mktemp("sft")
    sp = spawn_examples(2, tmp, {"sp_packed": ("--sp-size", "2", "--packing", "--eval"),
                                 "sp_padded": ("--sp-size", "2", "--eval"),
                                 "sp_padding_free": ("--sp-size", "2", "--padding-free"),
                                 "sp_assistant": ("--sp-size", "2", "--assistant-only"),
                                 "sp_moe": ("--sp-size", "2", "--packing", "--eval", "--moe")})
    plain = spawn_examples(1, tmp, {"plain_packed": ("--plain", "--packing", "--eval"),
                                    "plain_padded": ("--plain", "--eval"),
                                    "plain_padding_free": ("--plain", "--padding-free"),
                                    "plain_assistant": ("--plain", "--assistant-only"),
                                    "plain_moe": ("--plain", "--packing", "--eval", "--moe")})
    out = {**sp, **plain}
    out["assistant_labels"] = json.loads((tmp / "plain_assistant.labels.json").read_text())
    return out


def step_logs(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "loss" in r}


def assert_same_run(sp: list[dict], plain: list[dict], evaluated: bool = True, extra: tuple[str, ...] = ()) -> None:
    sp_steps, plain_steps = step_logs(sp), step_logs(plain)
    assert sorted(sp_steps) == [1, 2, 3] == sorted(plain_steps)
    for step in (1, 2, 3):
        a, b = sp_steps[step], plain_steps[step]
        # fp32; only the summation order differs (sharded attention, gradient all-reduce, metric sums):
        # ~1e-7 relative per step, AdamW's normalised updates keep 3 steps well inside 1e-5
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", *extra):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
        for key in ("num_tokens", "num_input_tokens_seen", "epoch"):  # counts: exact
            assert a[key] == b[key], (step, key)
    if not evaluated:
        return
    eval_sp = next(r for r in sp if "eval_loss" in r)
    eval_plain = next(r for r in plain if "eval_loss" in r)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", *(f"eval_{k}" for k in extra)):
        assert eval_sp[key] == pytest.approx(eval_plain[key], rel=1e-5, abs=1e-7), key  # fp32 forward only


def test_sft_packing_bfd_completion_only_sp2_matches_plain(runs):
    """Bug caught: documents attending across a packing boundary (the collator's position_ids
    ignored), prompt tokens counted in the loss or its normaliser, SFT's metrics computed on one
    shard or counted once per SP rank, and a wrong loss scale under gradient accumulation. Case: BFD
    packing (padding-free rows: position_ids restart per document) with completion-only labels and
    max_length the GLOBAL row length."""
    assert_same_run(runs["sp_packed"], runs["plain_packed"])


def test_sft_padded_batches_sp2_matches_plain(runs):
    """Bug caught: padding counted as tokens or attended to, and num_tokens / num_input_tokens_seen
    counted from shards. Case: without packing, right-padded rows of different lengths
    (attention_mask, no position_ids), odd global lengths padded to a multiple of sp_size."""
    assert_same_run(runs["sp_padded"], runs["plain_padded"])


def test_sft_padding_free_without_packing_sp2_matches_plain(runs):
    """Bug caught: rows attending across their boundary in the concatenated row (position_ids ignored
    when there is no packing's ``seq_lengths``), a label predicting the next row's first token
    counted, and num_tokens counted from shards or padding. Case: ``SFTConfig(padding_free=True,
    packing=False)``: each batch's rows concatenated into one row, position_ids restarting per row,
    no attention_mask, the first token of each row label -100."""
    assert_same_run(runs["sp_padding_free"], runs["plain_padding_free"], evaluated=False)


def test_sft_assistant_only_loss_sp2_matches_plain(runs):
    """Bug caught: user-turn labels counted in the SP loss or its normaliser (the global valid-token
    count), and the loss scale under gradient accumulation when most tokens are masked. Case:
    ``assistant_only_loss=True`` on conversational rows: the chat template's ``{% generation %}``
    span gives the assistant mask, user turns get label -100."""
    assert_same_run(runs["sp_assistant"], runs["plain_assistant"], evaluated=False)


def test_sft_assistant_only_masks_user_turns(runs):
    """Bug caught: a template without working ``{% generation %}`` markers, which would make the
    assistant-only runs above compare full-sequence losses. Checked: TRL's labels of the chat rows,
    every user-turn token -100, every assistant word and its closing <eos> labelled with its id
    (the example's template and its fast-tokenizer assistant_masks)."""
    dump = runs["assistant_labels"]
    for messages, labels in zip(dump["messages"], dump["labels"], strict=True):
        expected = []
        for m in messages:  # the template renders the words in order, an assistant turn ends in <eos> (id 1)
            ids = [int(w[1:]) for w in m["content"].split()]
            expected += ids + [1] if m["role"] == "assistant" else [-100] * len(ids)
        assert labels == expected
    # the collator keeps those labels (right padding with -100)
    for row, labels in zip(dump["collated_labels"], dump["labels"], strict=True):
        assert row[: len(labels)] == labels and set(row[len(labels):]) <= {-100}


def test_sft_moe_router_aux_loss_sp2_matches_plain(runs):
    """Bug caught: the MoE load-balancing loss under SP being refused, dropped, or computed on one
    shard (TRL's fused head returns the shard's aux_loss but not the router logits): a tiny Mixtral
    with router_aux_loss_coef 0.5, packed, 2 accumulation steps: loss (which includes 0.5 x aux),
    grad norm, the logged aux_loss and the eval losses equal the plain SFTTrainer's."""
    assert all(r["aux_loss"] > 1.0 for r in step_logs(runs["plain_moe"]).values())  # the term is really there
    assert_same_run(runs["sp_moe"], runs["plain_moe"], extra=("aux_loss",))


def test_sft_moe_aux_loss_dp2_sp2_matches_plain_ddp(tmp_path):
    """Bug caught: a wrong data-parallel weighting of the SP aux loss: TRL averages each replica's
    ``coef * aux`` over DDP ranks, so dp=2 x sp=2 (4 ranks) must equal the plain SFTTrainer under
    DDP on 2 ranks, step by step (loss, grad norm, logged aux_loss)."""
    args = ("--packing", "--moe", "--batch-size", "1")
    sp = spawn_examples(4, tmp_path, {"sp": ("--sp-size", "2", *args)})["sp"]
    plain = spawn_examples(2, tmp_path, {"plain": ("--plain", *args)})["plain"]
    sp_steps, plain_steps = step_logs(sp), step_logs(plain)
    assert sorted(sp_steps) == [1, 2, 3] == sorted(plain_steps)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm", "aux_loss"):  # fp32, summation order only (see assert_same_run)
            assert sp_steps[step][key] == pytest.approx(plain_steps[step][key], rel=1e-5, abs=1e-7), (step, key)
