"""Passkey evaluation under SP: the scorer equals one process; eval-long and train's passkey eval end to end.

The scorer cases run in ONE spawned gloo group of 2 ranks. References are computed in the same
process on the whole, unsharded batch.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from dist_helper import spawn
from tiny_models import tiny_model
from ulysses_sp import IGNORE_INDEX, AnswerScores, SPMesh, UlyssesSP, answer_scores, shard_batch
from ulysses_sp.cli.train.passkey import PasskeyTask, builtin_filler, char_tokenizer, load_filler, passkey_scores

# fp32 logits; the SP and the reference log-likelihoods sum the same <= 8 per-token log-probs per
# sample (a different order, and SP's attention sums its softmax over the same keys in another
# kernel call: relative error ~1e-6); a wrong token, a lost shard or a double count moves a sum of
# log-probs of size ~4 each by >= 1e-1.
LL_RTOL, LL_ATOL = 1e-5, 1e-5


def _reference_scores(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> AnswerScores:
    """One process, written independently of answer_scores: shift, cross entropy per token, argmax."""
    shift = F.pad(labels_BS[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = shift != IGNORE_INDEX
    ce = F.cross_entropy(logits_BSV.transpose(1, 2).float(), shift, ignore_index=IGNORE_INDEX, reduction="none")
    correct = (logits_BSV.argmax(-1) == shift) & keep
    return AnswerScores(-ce.double().sum(1), correct.sum(1), keep.sum(1))


def _assert_same(got: AnswerScores, ref: AnswerScores, what: str) -> None:
    torch.testing.assert_close(got.log_likelihood, ref.log_likelihood, rtol=LL_RTOL, atol=LL_ATOL, msg=what)
    assert torch.equal(got.num_correct, ref.num_correct.to(got.num_correct)), (what, got, ref)  # counts: exact
    assert torch.equal(got.num_tokens, ref.num_tokens.to(got.num_tokens)), (what, got, ref)


def _synthetic(seed: int = 0):
    """(logits (3, 13, 11), labels): answers on both shards of P=2 (S=13 is padded to 14), some of them
    argmax-correct, one sample without answer tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 13, 11, generator=g)
    labels = torch.full((3, 13), IGNORE_INDEX)
    labels[0, [3, 9, 12]] = torch.tensor([4, 5, 6])
    labels[1, 5:10] = torch.randint(0, 11, (5,), generator=g)
    for b, t in ((0, 9), (1, 6), (1, 7), (0, 12)):  # the logit before answer t predicts it
        logits[b, t - 1, labels[b, t]] += 10.0
    return logits, labels


def _scorer_cases(rank: int, world: int) -> None:
    mesh = SPMesh.from_world(world)
    # 1. the library function on hand-made logits: each rank passes its own slice of the global logits
    logits, labels = _synthetic()
    shard = shard_batch({"input_ids": torch.zeros_like(labels), "labels": labels}, mesh.sp_rank, world)
    s = shard["shift_labels"].shape[1]
    padded = F.pad(logits, (0, 0, 0, s * world - logits.shape[1]))
    local = padded[:, rank * s:(rank + 1) * s]
    ref = _reference_scores(logits, labels)
    assert ref.num_correct.tolist() == [2, 2, 0] and ref.num_tokens.tolist() == [3, 5, 0]  # the case is not trivial
    got = answer_scores(local, shard["shift_labels"], mesh.sp_group)
    _assert_same(got, ref, "answer_scores, hand-made logits")
    assert got.exact_match.tolist() == [False, False, False] and abs(got.token_accuracy - 4 / 8) < 1e-12

    # 2. passkey rows through a registered tiny Llama: full-shard logits and logits_to_keep
    model = tiny_model("llama")
    task = PasskeyTask(char_tokenizer(), builtin_filler(50), digits=3)
    rows = task.rows(121, [0.05, 0.5, 0.95], seed=3)  # odd length: padded under SP; needle on rank 0 or 1
    with torch.no_grad():
        ref = _reference_scores(model(input_ids=rows["input_ids"]).logits, rows["labels"])
    with UlyssesSP(model, mesh) as sp:
        _assert_same(passkey_scores(model, rows, sp, batch_size=2), ref, "passkey_scores (logits_to_keep)")
        shard = sp.shard(rows)
        with torch.no_grad():
            full = model(**sp.model_inputs(shard)).logits
        _assert_same(answer_scores(full, shard["shift_labels"], mesh.sp_group), ref, "answer_scores, shard logits")


def test_answer_scores_under_sp_equal_one_process():
    """Bug caught: the passkey scorer reporting per-shard numbers (no SP reduction, or one counted
    twice), answers on the wrong shard after the label shift/padding, or logits_to_keep picking other
    positions than the answer's: SP=2 log-likelihoods, correct counts and token counts differ from one
    process on the whole sequence."""
    spawn(_scorer_cases, 2)


def test_answer_scores_refuses_mismatched_shapes():
    """Bug caught: scoring logits of the kept positions against the full shard's labels silently."""
    with pytest.raises(ValueError, match="logits_to_keep"):
        answer_scores(torch.zeros(1, 2, 5), torch.zeros(1, 3, dtype=torch.long))


def test_passkey_rows_plant_the_key_at_the_depth(tmp_path):
    """Bug caught: a row of the wrong length, a key missing from the needle, labels outside the key, a
    needle not at its depth, or the user's filler file ignored (the built-in text used instead)."""
    tok = char_tokenizer()
    (tmp_path / "filler.jsonl").write_text("\n".join(json.dumps({"text": f"zebra quartz row {i}."}) for i in range(3)))
    task = PasskeyTask(tok, load_filler(str(tmp_path / "filler.jsonl")), digits=5)
    for depth in (0.0, 0.5, 1.0):
        ids, labels = task.sample(300, depth, random.Random(1))
        text = tok.decode(ids)
        assert len(ids) == len(labels) == 300 and text.startswith("<s>")
        key = tok.decode([t for t in labels if t != IGNORE_INDEX])
        assert len(key) == 5 and key.isdigit() and text.endswith(f"the pass key is {key}")
        needle = text.index(f" the pass key is {key}. remember it.")
        before = text[3:needle]
        after = text[needle:].split("is the pass key. ", 1)[1].rsplit(" what is the pass key?", 1)[0]
        assert (before == "") == (depth == 0.0) and (after == "") == (depth == 1.0), (depth, before, after)
        assert "zebra quartz" in before + after and "grass" not in before + after
    ids, _ = task.sample(300, 0.5, random.Random(1))
    num_filler = 300 - task.min_length()  # one token per character: "<s>" is 1 token, 3 characters
    assert tok.decode(ids).index(" the pass key is") == 3 + round(0.5 * num_filler)  # half the filler before it
    with pytest.raises(ValueError, match="at least"):
        task.sample(20, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="does not exist"):
        load_filler(str(tmp_path / "missing.txt"))


def _save_tiny_passkey_model(path):
    """A tiny random Llama over the built-in character tokenizer, saved with it (as train saves one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def test_eval_long_cli_end_to_end(tmp_path, capsys):
    """Bug caught: eval-long not registered, not launching SP ranks, scoring other rows than it says,
    losing cells, or refusing lengths past max_position_embeddings (the unextended-model measurement):
    the JSON cells equal a one-process computation of the same rows, and the table is printed."""
    from ulysses_sp.cli.main import main
    from ulysses_sp.cli.train.passkey import cell_rows

    model, tok = _save_tiny_passkey_model(tmp_path / "model")
    (tmp_path / "filler.txt").write_text("a quiet filler line without digits. " * 20)
    out = tmp_path / "cells.json"
    argv = ["eval-long", "--model", str(tmp_path / "model"), "--lengths", "120", "200", "--depths", "0.2", "0.8",
            "--samples", "2", "--digits", "3", "--filler", str(tmp_path / "filler.txt"), "--sp-size", "2",
            "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "depth 0.2" in printed and "past the model's max_position_embeddings=128" in printed
    result = json.loads(out.read_text())
    assert result["sp_size"] == 2 and [(c["length"], c["depth"]) for c in result["cells"]] == [
        (120, 0.2), (120, 0.8), (200, 0.2), (200, 0.8)]
    task = PasskeyTask(tok, load_filler(str(tmp_path / "filler.txt")), digits=3)
    for cell in result["cells"]:
        rows = cell_rows(task, cell["length"], cell["depth"], 2)
        with torch.no_grad():
            ref = _reference_scores(model(input_ids=rows["input_ids"]).logits, rows["labels"])
        # tolerance: as LL_RTOL (fp32, the same per-token terms summed in another order)
        assert abs(cell["mean_log_likelihood"] - float(ref.mean_log_likelihood.mean())) < 1e-4, cell
        assert cell["exact_match"] == float(ref.exact_match.double().mean())
        assert cell["token_accuracy"] == ref.token_accuracy


def test_eval_long_refuses_bad_input(tmp_path, capsys):
    """Bug caught: a missing model or a length too short for the key starting processes anyway."""
    from ulysses_sp.cli.main import main

    assert main(["eval-long", "--model", str(tmp_path / "missing"), "--lengths", "256"]) == 2
    assert "not a directory" in capsys.readouterr().err
    _save_tiny_passkey_model(tmp_path / "model")
    assert main(["eval-long", "--model", str(tmp_path / "model"), "--lengths", "40"]) == 2
    assert "at least" in capsys.readouterr().err


def test_train_passkey_task_with_passkey_eval(tmp_path):
    """Bug caught: --task passkey not training on passkey rows, or --eval-passkey-lengths not reaching
    metrics.jsonl / metrics.png: records before training (step 0), at each evaluation and at the end,
    one accuracy per length and a cell per (length, depth); the heat-map panel in the figure; the saved
    model carries the built-in tokenizer, so eval-long can read it back; the train eval equals
    eval-long on the same saved model (same rows, same scorer)."""
    from ulysses_sp.cli.main import main
    from ulysses_sp.cli.train.plot import metrics_figure

    out = tmp_path / "run"
    argv = ["train", "--task", "passkey", "--seq-len", "128", "--passkey-digits", "2", "--hidden-size", "32",
            "--max-steps", "6", "--logging-steps", "3", "--eval-strategy", "steps", "--eval-steps", "3",
            "--eval-passkey-lengths", "128", "160", "--eval-passkey-depths", "0.25", "0.75",
            "--eval-passkey-samples", "2", "--task-train-rows", "64", "--task-eval-rows", "4",
            "--per-device-train-batch-size", "4", "--output-dir", str(out), "--disable-tqdm", "true"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    passkey = [r for r in records if r["split"] == "passkey"]
    assert [r["step"] for r in passkey] == [0, 3, 6]
    for r in passkey:
        assert {"passkey_exact_match_128", "passkey_exact_match_160"} <= set(r)
        assert [(c["length"], c["depth"]) for c in r["passkey_cells"]] == [(128, 0.25), (128, 0.75), (160, 0.25),
                                                                            (160, 0.75)]
    assert passkey[0]["passkey_cells"] != passkey[-1]["passkey_cells"]  # the model changed between them
    train = [r for r in records if r["split"] == "train"]
    assert train and all("accuracy" in r for r in train)  # held-out passkey rows' answer-token accuracy
    titles = {a.get_title() for a in metrics_figure(records, "t").axes}
    assert "passkey exact match, length x depth (step 6)" in titles and "passkey exact match by length" in titles
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "run.json").read_text())
    assert summary["task"] == "passkey" and summary["passkey"]["final"]["step"] == 6
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 128  # the native length
    cells = tmp_path / "cells.json"
    assert main(["eval-long", "--model", str(out), "--lengths", "128", "160", "--depths", "0.25", "0.75",
                 "--samples", "2", "--digits", "2", "--output", str(cells)]) == 0
    for got, ref in zip(json.loads(cells.read_text())["cells"], passkey[-1]["passkey_cells"]):
        assert got["exact_match"] == ref["exact_match"] and got["token_accuracy"] == ref["token_accuracy"]
        # tolerance: the same fp32 forward of the same rows, in another process (identical up to ~1e-6)
        assert abs(got["mean_log_likelihood"] - ref["mean_log_likelihood"]) < 1e-4, (got, ref)
