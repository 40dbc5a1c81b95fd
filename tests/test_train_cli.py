"""``ulysses-sp train``: end-to-end runs (SP=2 vs SP=1, real data) and bad input refused before launch.

The end-to-end runs go through the real command: elastic launch, UlyssesTrainer, metrics callback,
staging directory renamed at the end. Small settings keep the whole file near a minute.
"""

import json
import string

import pytest
import torch

from ulysses_sp.cli.main import main
from ulysses_sp.cli.train.data import LMCollator
from ulysses_sp.cli.train.tasks import CopyTask

# tiny copy task: S=32 (15 copied tokens per row), 6 content tokens (chance 1/6)
TASK = ["--seq-len", "32", "--task-vocab-size", "9", "--hidden-size", "64", "--num-heads", "4",
        "--per-device-train-batch-size", "8", "--logging-steps", "1", "--warmup-steps", "5",
        "--task-train-rows", "512", "--task-eval-rows", "16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sp2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sp2"
    assert main(["train", *TASK, "--max-steps", "50", "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def sp1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sp1"
    assert main(["train", *TASK, "--max-steps", "5", "--sp-size", "1", "--output-dir", str(out)]) == 0
    return out


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_default_task_run_writes_metrics_plot_and_loadable_checkpoint(sp2_run):
    """Bug caught: a run that does not learn across shards, or writes incomplete / unloadable results:
    metrics.jsonl has a record per logged step with the documented fields, the accuracy on held-out
    rows (answers only in the other rank's shard) rises far above chance, the PNG is a PNG, and the
    saved checkpoint loads with from_pretrained and copies fresh rows in one process without SP."""
    from transformers import AutoModelForCausalLM

    records = _records(sp2_run)
    assert [r["step"] for r in records] == list(range(1, 51))
    for r in records:
        assert {"step", "loss", "accuracy", "tokens_per_second", "peak_memory_bytes"} <= set(r)
        assert r["tokens_per_second"] > 0 and r["peak_memory_bytes"] > 0 and len(r["peak_memory_bytes_per_rank"]) == 2
    task = CopyTask(32, 9)
    assert records[0]["accuracy"] < 2 * task.chance_accuracy
    assert records[-1]["accuracy"] > 0.9, [r["accuracy"] for r in records]
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert (sp2_run / "metrics.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((sp2_run / "run.json").read_text())
    assert summary["complete"] and summary["sp_size"] == 2 and summary["world_size"] == 2
    assert not sp2_run.with_name("sp2.incomplete").exists()

    model = AutoModelForCausalLM.from_pretrained(sp2_run).eval()
    rows = task.rows(16, seed=12345)
    with torch.no_grad():
        logits = model(input_ids=rows["input_ids"]).logits[:, :-1]
    labels = rows["labels"][:, 1:]
    answer = labels != -100
    accuracy = (logits.argmax(-1)[answer] == labels[answer]).float().mean().item()
    assert accuracy > 0.9  # a plain one-process forward of the checkpoint solves the task too


def test_sp2_and_sp1_give_the_same_losses_on_the_same_data(sp2_run, sp1_run):
    """Bug caught: SP changing the training (wrong loss scale, shards of different batches, a seed that
    depends on the rank): with one data-parallel replica both runs read the same batches from the
    same init, so the losses of the first steps must agree. fp32; only summation order differs
    (all-to-all layout, per-rank weight-grad sums), observed ~1e-6 relative; 1e-4 leaves margin
    while a wrong scale or a missing cross-shard target moves the loss by > 1e-2."""
    sp2 = [r["loss"] for r in _records(sp2_run)[:5]]
    sp1 = [r["loss"] for r in _records(sp1_run)]
    torch.testing.assert_close(torch.tensor(sp2), torch.tensor(sp1), rtol=1e-4, atol=0)
    sp2_acc = [r["accuracy"] for r in _records(sp2_run)[:5]]
    sp1_acc = [r["accuracy"] for r in _records(sp1_run)]
    assert sp2_acc == pytest.approx(sp1_acc, abs=1 / 240)  # 240 answers: at most one flipped argmax


def _tiny_hf_model_dir(path):
    """A character-level tokenizer with a chat template and a tiny random Llama (no download)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _tiny_hf_model_dir(tmp_path_factory.mktemp("tiny_hf"))


def test_real_model_on_chat_jsonl_trains_with_sp2(hf_dir, tmp_path):
    """Bug caught: the real-data path breaking (tokenizer + chat template + packing + collator + SP +
    the memory flags): a local model directory trains 2 steps on a JSONL chat file and saves model
    and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "chat.jsonl"
    with data.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + 1?"},
                                             {"role": "assistant", "content": f"{i + 1}"}]}) + "\n")
    out = tmp_path / "run"
    argv = ["train", "--model", str(hf_dir), "--dataset", str(data), "--seq-len", "64", "--max-steps", "2",
            "--per-device-train-batch-size", "2", "--logging-steps", "1", "--output-dir", str(out),
            # the memory features through the CLI: tiles not dividing the 32-token shard, offload
            "--activation-checkpointing", "--offload-activations", "--tiled-mlp-tokens", "12",
            "--tiled-loss-tokens", "10"]
    assert main(argv) == 0
    records = _records(out)
    assert len(records) == 2 and all("accuracy" not in r and r["loss"] > 0 for r in records)
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template is not None


def test_collator_restarts_positions_and_masks_document_starts():
    """Bug caught: packed documents attending to / predicting each other: position_ids restart at each
    document (the SP mask's boundaries) and a document's first token gets label -100."""
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]},
            {"input_ids": [4, 3], "labels": [-100, 3], "seq_lengths": [2]}]
    batch = LMCollator(pad_token_id=0)(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100, 9], [-100, 3, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]


@pytest.mark.parametrize("argv, message", [
    (["--bogus-flag", "1"], "unknown option(s): --bogus-flag"),
    (["--sp-size", "8", "--num-heads", "4", "--sp-ring-size", "1"], "all-to-all over 8 ranks > num_attention_heads 4"),
    (["--sp-size", "4", "--sp-ring-size", "3"], "sp_ring_size=3 does not divide sp_size=4"),
    (["--seq-len", "33"], "even --seq-len"),
    (["--sp-size", "2", "--nproc-per-node", "3"], "make them equal"),
    (["--offload-activations"], "add --activation-checkpointing"),
])
def test_bad_options_exit_2_before_launch(argv, message, tmp_path, capsys):
    """Bug caught: bad options turning into a worker traceback, a hang or a half-written run: exit 2,
    a message naming the fix, and no output directory."""
    out = tmp_path / "never"
    assert main(["train", *argv, "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not out.with_name("never.incomplete").exists()


def test_missing_model_and_dataset_files_exit_2(hf_dir, tmp_path, capsys):
    """Bug caught: a typo in a path becoming a Hub download attempt or a traceback in the workers."""
    assert main(["train", "--model", str(tmp_path / "no_model"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    argv = ["train", "--model", str(hf_dir), "--dataset", str(tmp_path / "missing.jsonl"), "--seq-len", "64",
            "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "missing.jsonl" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["train", "--model", str(hf_dir), "--seq-len", "128", "--output-dir", str(tmp_path / "o")]) == 2
    assert "max_position_embeddings=64" in capsys.readouterr().err


def test_help_lists_command_and_trainer_options(capsys):
    """Bug caught: the subcommand swallowing --help or losing the TrainingArguments options."""
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--sp_size" in out and "--tiled_loss_tokens" in out and "--learning_rate" in out and "--nnodes" in out


def test_non_empty_output_dir_is_refused_and_kept(tmp_path, capsys):
    """Bug caught: a run overwriting (or mixing into) an earlier run's results without being asked."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "metrics.jsonl").write_text("earlier\n")
    assert main(["train", "--output-dir", str(out)]) == 2
    assert "--overwrite-output-dir" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == "earlier\n"


def test_failed_run_leaves_no_output_dir(tmp_path, capsys):
    """Bug caught: a failed run leaving a directory a later step would take for complete: a worker
    error (here: resuming from an empty directory that is no checkpoint; a missing path is refused
    before launch) exits 1 and only the staging directory ``DIR.incomplete`` exists, without run.json."""
    out = tmp_path / "failed"
    (tmp_path / "nope").mkdir()
    argv = ["train", *TASK, "--max-steps", "1", "--resume-from-checkpoint", str(tmp_path / "nope"),
            "--output-dir", str(out)]
    assert main(argv) == 1
    assert "worker failed" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "failed.incomplete" / "run.json").exists()


def test_multi_node_options_reach_the_elastic_launcher(tmp_path):
    """Bug caught: torchrun's rendezvous options being dropped or renamed on the way to the launcher:
    2 nodes x 2 processes with a static rendezvous on node rank 1."""
    from ulysses_sp.cli.train.launch import launch_config, plan

    p = plan(["--sp-size", "4", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static",
              "--master-addr", "10.1.2.3", "--master-port", "29555", "--output-dir", str(tmp_path / "o")])
    config = launch_config(p)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == 1
    assert config.rdzv_endpoint == "10.1.2.3:29555" and config.start_method == "forkserver"


def test_prompt_completion_and_text_rows_tokenize_and_pack_like_trl(hf_dir, tmp_path):
    """Bug caught: prompt tokens counted in the loss, a missing EOS, or packing that loses document
    boundaries: prompt/completion rows get labels -100 on the prompt; text rows end with EOS;
    packed rows hold several documents with their lengths in seq_lengths."""
    from types import SimpleNamespace

    from ulysses_sp.cli.train.data import load_tokenizer, prepare_dataset

    tok = load_tokenizer(str(hf_dir))
    pc = tmp_path / "pc.jsonl"
    pc.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f"A{i}"}) + "\n" for i in range(3)))
    opts = dict(dataset_config=None, dataset_split="train", dataset_text_field="text", completion_only_loss=True,
                seq_len=64)
    rows = prepare_dataset(SimpleNamespace(dataset=[str(pc)], packing=False, **opts), tok, seed=0)
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    n_prompt = len(tok("Q0:", add_special_tokens=False)["input_ids"])
    assert ids[-1] == tok.eos_token_id
    assert labels[:n_prompt] == [-100] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
    text = tmp_path / "lines.txt"
    text.write_text("abcdef\nghij\nkl\n")
    packed = prepare_dataset(SimpleNamespace(dataset=[str(text)], packing=True, **opts), tok, seed=0)
    assert len(packed) == 1 and sorted(packed[0]["seq_lengths"]) == [3, 5, 7]  # each line + EOS, one row
    assert packed[0]["input_ids"].count(tok.eos_token_id) == 3
