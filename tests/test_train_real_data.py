"""``ulysses-sp train`` on real data: packing keeps every token, config files, eval under SP, chat loss, LoRA.

Unit tests call the data / options functions directly; two end-to-end runs (SP=2 and SP=1 on the same
held-out split, with LoRA) go through the real command.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_train_cli import _tiny_hf_model_dir
from ulysses_sp.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny_hf_model_dir(tmp_path_factory.mktemp("tiny_hf_real"))


@pytest.fixture(scope="module")
def tok(hf_dir):
    from ulysses_sp.cli.train.data import load_tokenizer

    return load_tokenizer(str(hf_dir))


def _margs(dataset, **kw):
    base = dict(dataset=[str(dataset)], dataset_config=None, dataset_split="train", dataset_text_field="text",
                completion_only_loss=True, assistant_only_loss=False, seq_len=16, packing=True,
                packing_strategy="bfd_split", text_sample_by="line", eval_split=None, eval_dataset=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _corpus(path: Path) -> list[str]:
    docs = ["x" * 50, "short one", "y" * 33, "mid-size document here", "z" * 16]  # 3 longer than S=16
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def test_packing_keeps_every_token_of_long_documents(tok, tmp_path):
    """Bug caught: packing truncating every document longer than --seq-len (86% of a real corpus was
    dropped without a word). bfd_split keeps every token (rows of <= S tokens, long documents split
    into chunks with their own positions); bfd truncates and the counts say how much."""
    from ulysses_sp.cli.train.data import LMCollator, prepare_data

    docs = _corpus(tmp_path / "docs.jsonl")
    expected = sum(len(d) + 1 for d in docs)  # the character tokenizer: one token a character, + EOS
    kept = prepare_data(_margs(tmp_path / "docs.jsonl"), tok, seed=0)
    assert kept.tokens_in_data == expected and kept.tokens_per_epoch == expected and kept.documents == 5
    assert all(len(r["input_ids"]) <= 16 for r in kept.train)
    assert sum(sum(r["seq_lengths"]) for r in kept.train) == expected
    batch = LMCollator(pad_token_id=0)([kept.train[i] for i in range(len(kept.train))])
    assert int(batch["position_ids"].max()) < 16  # a chunk's positions restart: within what the row holds
    cut = prepare_data(_margs(tmp_path / "docs.jsonl", packing_strategy="bfd"), tok, seed=0)
    assert cut.tokens_in_data == expected and cut.tokens_per_epoch == sum(min(len(d) + 1, 16) for d in docs)
    rows = prepare_data(_margs(tmp_path / "docs.jsonl", packing=False), tok, seed=0)
    assert rows.tokens_per_epoch == cut.tokens_per_epoch and len(rows.train) == 5


def test_eval_split_holds_out_documents(tok, tmp_path):
    """Bug caught: no way to evaluate (--eval-strategy crashed in the workers): --eval-split holds out
    whole documents, packed like the training rows and never trained on."""
    from ulysses_sp.cli.train.data import prepare_data

    _corpus(tmp_path / "docs.jsonl")
    data = prepare_data(_margs(tmp_path / "docs.jsonl", eval_split=0.4), tok, seed=0)
    assert data.eval is not None and data.documents == 3
    held = sum(sum(r["seq_lengths"]) for r in data.eval)
    assert held + data.tokens_in_data == sum(len(d) + 1 for d in _corpus(tmp_path / "again.jsonl"))


def test_assistant_only_loss_masks_user_turns(tok, tmp_path):
    """Bug caught: chat loss including the user turns (no --assistant-only-loss in the command)."""
    from ulysses_sp.cli.train.data import tokenize_row

    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}"
                         "{% generation %}{{ m['content'] }}</s>{% endgeneration %}{% else %}{{ m['content'] }}</s>"
                         "{% endif %}{% endfor %}")
    row = {"messages": [{"role": "user", "content": "QQQ"}, {"role": "assistant", "content": "AB"}]}
    out = tokenize_row(row, tok, "messages", "text", completion_only=True, assistant_only=True)
    trained = "".join(tok.decode([t]) for t, lab in zip(out["input_ids"], out["labels"]) if lab != -100)
    assert trained == "AB</s>"
    full = tokenize_row(row, tok, "messages", "text", completion_only=True, assistant_only=False)
    assert all(lab != -100 for lab in full["labels"])


def test_assistant_only_loss_needs_generation_markers(hf_dir, tmp_path, capsys):
    """Bug caught: --assistant-only-loss with a template that marks nothing training on no token."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n")
    assert main(["train", "--model", str(hf_dir), "--dataset", str(data), "--assistant-only-loss",
                 "--seq-len", "32", "--output-dir", str(tmp_path / "o")]) == 2
    assert "{% generation %}" in capsys.readouterr().err


def test_config_file_round_trip_and_override(tmp_path):
    """Bug caught: no --config (runs not reproducible from a file), the file overriding the command line,
    or a typo in the file ignored."""
    from ulysses_sp.cli.train import options

    config = {"sp_size": 1, "max_steps": 7, "learning_rate": 0.01, "seq_len": 64, "packing": False,
              "lora_target_modules": ["q_proj", "v_proj"], "tiled_loss_tokens": 16}
    for name, text in (("c.yaml", "".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items())),
                       ("c.json", json.dumps(config))):
        path = tmp_path / name
        path.write_text(text)
        margs, spargs, _, targs = options.parse(["--config", str(path), "--learning-rate", "0.02"])
        assert (spargs.sp_size, targs.max_steps, margs.seq_len, margs.packing) == (1, 7, 64, False)
        assert margs.lora_target_modules == ["q_proj", "v_proj"] and spargs.tiled_loss_tokens == 16
        assert targs.learning_rate == 0.02  # the command line wins
    (tmp_path / "bad.yaml").write_text("sp_sise: 2\n")
    with pytest.raises(ValueError, match="unknown option.*sp_sise.*did you mean sp_size"):
        options.parse(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ValueError, match="does not exist"):
        options.parse(["--config", str(tmp_path / "missing.yaml")])
    margs, spargs, _, targs = options.parse(["--config", str(ROOT / "examples" / "train_config.yaml")])
    assert spargs.sp_size == 2 and targs.max_steps == 200  # the shipped example parses


@pytest.mark.parametrize("argv, message", [
    (["--eval-strategy", "steps"], "needs held-out data"),
    (["--eval-split", "1.5"], "0 < f < 1"),
    (["--eval-split", "0.1", "--eval-dataset", "x.jsonl"], "not both"),
    (["--lora-r", "4", "--lora-target-modules", "nonexistent_proj"], "match no linear layer"),
])
def test_real_data_options_refused_before_launch(argv, message, hf_dir, tmp_path, capsys):
    """Bug caught: eval / LoRA mistakes failing inside the workers."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    assert main(["train", "--model", str(hf_dir), "--dataset", str(data), "--seq-len", "32", *argv,
                 "--output-dir", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_check_takes_model_as_flag_or_positional(capsys):
    """Bug caught: check taking the model positionally while train and plan take --model."""
    assert main(["check", "--model", "/nonexistent/model", "--sp-size", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["check", "/a", "--model", "/b", "--sp-size", "2"]) == 2
    assert "two models given" in capsys.readouterr().err


def _eval_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def test_eval_under_sp_equals_one_process_and_lora_adapter_loads(hf_dir, tmp_path):
    """Bug caught: eval loss under SP differing from one process (sharded eval batches, a wrong token
    count), and a LoRA run saving something PeftModel.from_pretrained cannot load. SP=2 and SP=1 train
    the same LoRA adapters on the same documents and evaluate the same held-out split."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "abcdefgh"[i % 8] * (10 + 7 * i)}) + "\n"
                            for i in range(12)))
    losses = {}
    for sp in (2, 1):
        out = tmp_path / f"sp{sp}"
        assert main(["train", "--model", str(hf_dir), "--dataset", str(data), "--seq-len", "48", "--sp-size", str(sp),
                     "--eval-split", "0.25", "--eval-strategy", "steps", "--eval-steps", "2", "--max-steps", "4",
                     "--logging-steps", "2", "--per-device-train-batch-size", "2", "--learning-rate", "1e-2",
                     "--lora-r", "4", "--lora-target-modules", "q_proj", "v_proj", "--output-dir", str(out)]) == 0
        losses[sp] = _eval_losses(out)
        summary = json.loads((out / "run.json").read_text())
        assert summary["data"]["tokens_per_epoch"] == summary["data"]["tokens_in_data"]  # every token kept
    assert len(losses[2]) == 2 and len(losses[1]) == 2
    # fp32; SP and one process differ only in summation order (~1e-6 relative); 1e-4 leaves margin while
    # a wrong eval token count or a shard-local eval gives differences of several percent
    torch.testing.assert_close(torch.tensor(losses[2]), torch.tensor(losses[1]), rtol=1e-4, atol=0)
    base = AutoModelForCausalLM.from_pretrained(hf_dir)
    model = PeftModel.from_pretrained(base, tmp_path / "sp2")
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and any(float(p.abs().max()) > 0 for p in trained)  # B starts at 0: it was trained and saved
