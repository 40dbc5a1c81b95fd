"""``ulysses-sp train`` metrics: ``MetricsCallback`` driven by real TrainerState / TrainingArguments objects
(no trainer, no process group) and ``plot_metrics`` on hand-written records. Runs in a few seconds."""

import json

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from ulysses_sp.cli.train import metrics
from ulysses_sp.cli.train.metrics import MetricsCallback, format_postfix
from ulysses_sp.cli.train.plot import metrics_figure, plot_metrics, read_metrics, record_split

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                             include_num_input_tokens_seen="non_padding")


def _started(tmp_path, args, max_steps=10, rank0=True, **kwargs):
    """A callback after ``on_train_begin``, with its state (rank 0 unless told) and control."""
    callback = MetricsCallback(tmp_path / "metrics.jsonl", None, progress=False, **kwargs)
    state, control = TrainerState(max_steps=max_steps, is_world_process_zero=rank0), TrainerControl()
    callback.on_train_begin(args, state, control)
    return callback, state, control


def _step_log(callback, args, state, control, step, loss=1.0, **logs):
    state.global_step, state.epoch = step, step / 10
    state.num_input_tokens_seen += 64
    callback.on_log(args, state, control, logs={"loss": loss, "grad_norm": 0.5, "learning_rate": 1e-4,
                                                "epoch": state.epoch, **logs})


def _lines(tmp_path):
    return read_metrics(tmp_path / "metrics.jsonl")


def test_step_record_has_trainer_keys_lr_grad_norm_memory_and_speed(tmp_path, args):
    """Bug caught: metrics.jsonl dropping what the Trainer logs (learning rate, grad norm: the issue's
    complaint) or our additions (tokens/s, peak memory of every rank, elapsed time)."""
    callback, state, control = _started(tmp_path, args)
    _step_log(callback, args, state, control, 1, loss=2.5, mean_token_accuracy=0.25)
    [record] = _lines(tmp_path)
    assert record["split"] == "train" and record["step"] == 1 and record["loss"] == 2.5
    assert record["learning_rate"] == 1e-4 and record["grad_norm"] == 0.5 and record["epoch"] == 0.1
    assert record["mean_token_accuracy"] == 0.25  # any key a Trainer subclass (TRL) logs is kept
    assert record["tokens_per_second"] > 0 and record["elapsed_seconds"] >= 0
    assert record["peak_memory_bytes_per_rank"] == [record["peak_memory_bytes"]] and record["peak_memory_bytes"] > 0
    assert callback.records == [record]


def test_accuracy_is_added_for_the_copy_task(tmp_path, args, monkeypatch):
    """Bug caught: the held-out copy-task accuracy disappearing from step records."""
    monkeypatch.setattr(metrics, "answer_accuracy", lambda model, rows, ulysses: 0.75)
    callback = MetricsCallback(tmp_path / "metrics.jsonl", {"input_ids": None}, progress=False)
    callback.ulysses = object()
    state, control = TrainerState(max_steps=3, is_world_process_zero=True), TrainerControl()
    callback.on_train_begin(args, state, control)
    state.global_step = 1
    callback.on_log(args, state, control, logs={"loss": 1.0}, model=object())
    assert _lines(tmp_path)[0]["accuracy"] == 0.75


def test_every_rank_runs_the_collectives_but_only_rank_0_writes(tmp_path, args, monkeypatch):
    """Bug caught: a collective (memory all-gather) called on rank 0 only, which hangs a multi-rank run,
    and ranks other than 0 writing (interleaved) lines."""
    calls = []
    monkeypatch.setattr(metrics, "_all_gather_int", lambda value: calls.append(value) or [value, value])
    callback, state, control = _started(tmp_path, args, rank0=False)
    _step_log(callback, args, state, control, 1)
    state.global_step = 3
    callback.on_log(args, state, control, logs={"train_loss": 1.0, "train_runtime": 1.0})  # unlogged end
    assert len(calls) == 2
    assert not (tmp_path / "metrics.jsonl").exists() and callback.records == []


def test_repeated_step_is_written_once_also_across_a_resume(tmp_path, args):
    """Bug caught: metrics.jsonl repeating a step: the same step logged twice, or a resumed run logging a
    step the earlier run's file already has."""
    callback, state, control = _started(tmp_path, args)
    for step in (1, 2, 2, 3):
        _step_log(callback, args, state, control, step)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]
    resumed, state, control = _started(tmp_path, args)
    for step in (3, 4):
        _step_log(resumed, args, state, control, step)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]


def test_eval_logs_become_eval_records_next_to_the_step_records(tmp_path, args):
    """Bug caught: evaluation logs (eval_loss) being dropped, or deduplicated against the train record of
    the same step, or two eval datasets of one step overwriting each other."""
    callback, state, control = _started(tmp_path, args)
    _step_log(callback, args, state, control, 2)
    callback.on_log(args, state, control, logs={"eval_loss": 1.25, "eval_runtime": 0.5, "epoch": 0.2})
    callback.on_log(args, state, control, logs={"eval_code_loss": 1.5, "eval_code_runtime": 0.5, "epoch": 0.2})
    train, evaluation, named = _lines(tmp_path)
    assert (train["split"], train["step"]) == ("train", 2)
    assert evaluation == {"split": "eval", "step": 2, "eval_loss": 1.25, "eval_runtime": 0.5, "epoch": 0.2,
                          "elapsed_seconds": evaluation["elapsed_seconds"]}
    assert (named["split"], named["eval_code_loss"]) == ("eval_code", 1.5)
    assert format_postfix(callback._shown).startswith("loss 1.000 eval 1.250")


def test_last_step_is_logged_even_when_logging_steps_skip_it(tmp_path, args):
    """Bug caught: a run shorter than logging_steps (or ending between two logs) writing no record, hence
    no plot: on the step that reaches max_steps the callback asks the Trainer to log."""
    callback, state, control = _started(tmp_path, args, max_steps=5)
    state.global_step = 4
    callback.on_step_end(args, state, control)
    assert not control.should_log
    state.global_step = 5
    callback.on_step_end(args, state, control)
    assert control.should_log


def test_unlogged_end_gets_a_record_with_the_loss_of_the_unlogged_steps(tmp_path, args):
    """Bug caught: a run stopped (early) after its last log losing its final steps: the Trainer's summary
    train_loss (mean over the run) gives the mean loss of the steps after the last log."""
    callback, state, control = _started(tmp_path, args, elapsed_offset=100.0)
    _step_log(callback, args, state, control, 2, loss=2.0)  # steps 1-2, mean 2.0
    state.global_step = 5  # steps 3-5 never logged, mean 1.0: run mean (2 * 2 + 3 * 1) / 5
    callback.on_log(args, state, control, logs={"train_loss": 1.4, "train_runtime": 3.0, "epoch": 0.5})
    callback.on_log(args, state, control, logs={"train_loss": 1.4, "train_runtime": 3.0, "epoch": 0.5})
    first, last = _lines(tmp_path)
    assert (last["split"], last["step"], last["epoch"]) == ("train", 5, 0.5)
    assert last["loss"] == pytest.approx(1.0)
    assert last["elapsed_seconds"] >= first["elapsed_seconds"] >= 100.0  # a resumed run continues the time
    assert callback.summary["train_loss"] == 1.4


def test_read_metrics_skips_a_cut_last_line_but_names_a_broken_one(tmp_path):
    """Bug caught: a run killed mid-write making its metrics unreadable (resume, plot), and a corrupt line
    in the middle being skipped silently."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(path)


def test_postfix_labels_gib_not_gb():
    """Bug caught: binary gigabytes (2**30) labelled "GB"."""
    text = format_postfix({"loss": 1.0, "tokens_per_second": 5200.0, "learning_rate": 2e-4,
                           "peak_memory_bytes_per_rank": [2**30, 2**31]})
    assert text == "loss 1.000 lr 2.0e-04 tok/s 5.2k mem/rank 1.00,2.00 GiB"
    assert format_postfix({"eval_loss": 1.0}) == "eval 1.000"  # keys missing: no KeyError


def _axis(fig, title):
    [ax] = [a for a in fig.axes if a.get_title() == title]
    return ax


def _visible_ticks(fig, ax):
    fig.canvas.draw()
    lo, hi = sorted(ax.get_ylim())
    return [t for t in ax.get_yticks() if lo <= t <= hi]


def test_plot_written_for_one_record_with_missing_keys(tmp_path):
    """Bug caught: the plot failing (or being skipped) for a short run's single record, or for records
    without grad_norm / tokens/s / memory."""
    out = plot_metrics([{"split": "train", "step": 1, "loss": 7.6}], tmp_path / "m.png", "one step")
    assert out.read_bytes()[:8] == PNG_MAGIC
    fig = metrics_figure([{"step": 1, "loss": 7.6}], "one step")
    assert len(_visible_ticks(fig, _axis(fig, "loss"))) >= 3
    assert [t.get_text() for t in _axis(fig, "grad norm").texts] == ["not logged"]


def test_small_loss_range_gets_a_readable_linear_axis_and_eval_points(tmp_path):
    """Bug caught: the issue's unreadable loss axis: a log scale showing one tick over 7.55-7.62; also
    checks the eval loss line, the title and the panels the issue asks for."""
    records = [{"split": "train", "step": s, "loss": 7.62 - 0.01 * s, "learning_rate": 1e-4 * s, "grad_norm": 1.0,
                "tokens_per_second": 5000.0, "peak_memory_bytes": 2**30, "peak_memory_bytes_per_rank": [2**30]}
               for s in range(1, 8)]
    records.append({"split": "eval", "step": 7, "eval_loss": 7.58})
    fig = metrics_figure(records, "model on data, S=1024, P=2")
    loss = _axis(fig, "loss")
    assert loss.get_yscale() == "linear"
    ticks = _visible_ticks(fig, loss)
    assert len(ticks) >= 3
    labels = [t.get_text() for t in loss.get_yticklabels() if t.get_text()]
    assert len(set(labels)) == len(labels) >= 3  # distinct labels, not one repeated rounded value
    assert [line.get_label() for line in loss.get_lines()] == ["train", "eval"]
    titles = {a.get_title() for a in fig.axes}
    assert {"learning rate", "grad norm", "tokens / s", "peak memory (GiB, max over ranks)"} <= titles
    assert fig._suptitle.get_text() == "model on data, S=1024, P=2"
    assert plot_metrics(records, tmp_path / "m.png", "t").read_bytes()[:8] == PNG_MAGIC


def test_wide_loss_range_uses_a_log_axis_with_several_ticks():
    """Bug caught: a log loss axis (copy task: 2.3 -> 0.02) left with fewer than 3 labelled ticks."""
    records = [{"step": s, "loss": 2.3 * 0.6**s, "accuracy": min(1.0, 0.1 * s)} for s in range(1, 11)]
    fig = metrics_figure(records, "task", chance=1 / 6)
    loss = _axis(fig, "loss")
    assert loss.get_yscale() == "log" and len(_visible_ticks(fig, loss)) >= 3
    accuracy = _axis(fig, "copy-task accuracy")
    assert any(line.get_linestyle() == "--" for line in accuracy.get_lines())  # the chance line


def test_record_split_of_old_and_new_records():
    """Bug caught: records written before the "split" field (a resumed older run) being misread."""
    assert record_split({"step": 1, "loss": 1.0}) == "train"
    assert record_split({"step": 1, "eval_loss": 1.0}) == "eval"
    assert record_split({"split": "eval_code", "step": 1}) == "eval_code"
    assert json.loads(json.dumps({"split": "train"}))["split"] == "train"
