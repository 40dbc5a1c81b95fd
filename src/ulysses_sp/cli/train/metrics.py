"""Metrics of ``ulysses-sp train``: the Trainer's own logs, completed, into ``metrics.jsonl``; a progress bar.

Every ``Trainer.log`` reaches ``on_log`` on ALL ranks with the same ``logs`` (what ``state.log_history``
keeps). Each becomes at most one record; world rank 0 appends it unless its ``(split, step)`` is in the
file already (a resumed run never repeats a step):

    step log     ("loss")        {"split": "train", "step", every key the Trainer logged (epoch, loss,
                                  grad_norm, learning_rate, num_input_tokens_seen, train_runtime, ...),
                                  + the keys below}. Collectives (all ranks call them):
        accuracy     (copy task) forward of held-out rows under SP: each rank scores the answer
                     positions of its own shard, correct / total summed over the SP group
        memory       ``peak_memory_bytes_per_rank`` (CUDA max allocated, else the process's peak RSS),
                     all-gathered; ``peak_memory_bytes`` is their max
        throughput   ``tokens_per_second``: tokens since the previous step log (``num_input_tokens_seen``,
                     counted once per SP group) / training seconds since it (evaluation time excluded)
        time         ``elapsed_seconds``: since training began, plus ``elapsed_offset`` (a resumed run)
    evaluation   ("<split>_loss") {"split": "eval" (``"eval_<name>"`` for a dict of eval datasets), "step",
                                   the Trainer's keys (eval_loss, eval_runtime, ..., epoch), "elapsed_seconds"}
    summary      ("train_loss")   kept as ``.summary`` (train_loss, train_runtime, ...), no record

The last step always has a record: ``on_step_end`` asks the Trainer to log the step that reaches
``max_steps`` (a run shorter than ``logging_steps`` gets one record, hence a plot). If training stops
elsewhere before a log (another callback's early stop), the summary's ``train_loss`` gives the mean
loss of the unlogged steps and that record is written (without grad_norm).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ulysses_sp import IGNORE_INDEX, all_reduce_sum, gather_signature
from ulysses_sp.cli.train.plot import GIB, read_metrics, record_split


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated bytes on ``device``; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kib) * 1024


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, rows: Mapping[str, torch.Tensor], ulysses: Any,
                    batch_size: int = 8) -> float:
    """Fraction of answer tokens (``labels != -100``) the model predicts exactly, under SP.

    Args:
        rows: global ``input_ids`` / ``labels`` ``(R, S)``, the same on every rank.
        ulysses: the registered :class:`UlyssesSP`; each rank scores its own shard
            (``shift_labels`` ``(B, s)`` against the argmax of its ``(B, s, V)`` logits).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(0, rows["input_ids"].shape[0], batch_size):
        batch = {k: v[start : start + batch_size].to(device) for k, v in rows.items()}
        shard = ulysses.shard(batch)
        logits = model(**ulysses.model_inputs(shard)).logits
        target = shard["shift_labels"]
        keep = target != IGNORE_INDEX
        counts[0] += (logits.argmax(-1)[keep] == target[keep]).sum()
        counts[1] += keep.sum()
    if ulysses.mesh.sp_size > 1:
        counts = all_reduce_sum(counts, ulysses.mesh.sp_group)
    model.train(was_training)
    return (counts[0] / counts[1].clamp_min(1)).item()


class MetricsCallback(TrainerCallback):
    """Writes ``metrics.jsonl`` (world rank 0) and draws a progress bar on stderr.

    Args:
        path: the JSONL file (appended to: a resumed run continues it).
        eval_rows: held-out task rows for :func:`answer_accuracy` (None: no accuracy).
        progress: draw the bar (world rank 0 only).
        elapsed_offset: seconds an earlier run trained (resume), added to ``elapsed_seconds``.

    Set ``.ulysses`` (the trainer's registered ``UlyssesSP``) once the trainer exists. ``.records``:
    the records this process wrote; ``.summary``: the Trainer's end-of-training logs (every rank).
    """

    def __init__(self, path: Path, eval_rows: Mapping[str, torch.Tensor] | None, progress: bool = True,
                 elapsed_offset: float = 0.0) -> None:
        self.path = Path(path)
        self.eval_rows = eval_rows
        self.progress = progress
        self.elapsed_offset = elapsed_offset
        self.ulysses: Any = None
        self.bar: Any = None
        self.records: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self._start: float | None = None  # perf_counter at train begin
        self._last = (0.0, 0)  # (time, tokens) at the previous step log
        self._first_step = self._logged_step = 0  # step at train begin / at the last step log
        self._logged_loss = 0.0  # sum of loss x steps of the step logs since train begin
        self._seen: set[tuple[str, Any]] | None = None  # (split, step) in the file (rank 0)
        self._shown: dict[str, Any] = {}  # what the bar shows

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._last = (self._start, state.num_input_tokens_seen)
        self._first_step = self._logged_step = state.global_step  # > 0 when resumed
        self._logged_loss = 0.0
        if self.progress and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True,
                            file=sys.stderr)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_log = True  # the last step, also when logging_steps would skip it
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        logs = dict(logs or {})
        if "loss" in logs:
            self._count_loss(state.global_step, logs["loss"])
            record = {"split": "train", "step": state.global_step, **logs}
            self._write(state, {**record, **self._train_extras(args, state, model)})
        elif "train_loss" in logs:
            self.summary = logs
            self._record_unlogged_end(args, state, logs, model, kwargs.get("lr_scheduler"))
        elif record_split(logs) != "train":  # an evaluation: <split>_loss
            split = record_split(logs)
            now = time.perf_counter()
            if self._start is not None:  # evaluation inside training: not training time for tokens/s
                self._last = (self._last[0] + float(logs.get(f"{split}_runtime", 0.0)), self._last[1])
            self._write(state, {"split": split, "step": state.global_step, **logs,
                                "elapsed_seconds": self._elapsed(now)})

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
            self.bar.close()
            self.bar = None

    def _count_loss(self, step: int, loss: float) -> None:
        self._logged_loss += float(loss) * (step - self._logged_step)
        self._logged_step = step

    def _record_unlogged_end(self, args, state, summary: Mapping[str, Any], model, lr_scheduler) -> None:
        """Training ended after the last step log: a step record from the summary (all ranks call this).

        The Trainer's ``train_loss`` is the mean step loss since train begin, so the steps after the
        last log had mean ``(train_loss x steps trained - sum of logged loss x steps) / unlogged steps``.
        """
        step = state.global_step
        if self._start is None or step <= self._logged_step:
            return
        trained = summary["train_loss"] * (step - self._first_step)
        loss = (trained - self._logged_loss) / (step - self._logged_step)
        self._count_loss(step, loss)
        record: dict[str, Any] = {"split": "train", "step": step, "epoch": summary.get("epoch", state.epoch),
                                  "loss": loss}
        if hasattr(lr_scheduler, "get_last_lr"):
            record["learning_rate"] = float(lr_scheduler.get_last_lr()[0])
        self._write(state, {**record, **self._train_extras(args, state, model)})

    def _train_extras(self, args, state, model) -> dict[str, Any]:
        """accuracy, tokens/s, peak memory, elapsed time of a step record (collectives: every rank)."""
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        extras: dict[str, Any] = {}
        if self.eval_rows is not None and model is not None and self.ulysses is not None:
            extras["accuracy"] = answer_accuracy(model, self.eval_rows, self.ulysses)
        if getattr(args, "include_num_input_tokens_seen", "no") not in ("no", False):
            extras["tokens_per_second"] = (tokens - self._last[1]) / max(now - self._last[0], 1e-9)
        per_rank = _all_gather_int(peak_memory_bytes(args.device))
        extras["peak_memory_bytes"] = max(per_rank)
        extras["peak_memory_bytes_per_rank"] = per_rank
        extras["elapsed_seconds"] = self._elapsed(now)
        self._last = (time.perf_counter(), tokens)  # the accuracy forward is not training time either
        return extras

    def _elapsed(self, now: float) -> float:
        return self.elapsed_offset + (now - self._start if self._start is not None else 0.0)

    def _write(self, state, record: dict[str, Any]) -> None:
        """World rank 0: append ``record`` unless its (split, step) is in the file already."""
        if not state.is_world_process_zero:
            return
        if self._seen is None:
            earlier = read_metrics(self.path) if self.path.exists() else []
            self._seen = {(record_split(r), r.get("step")) for r in earlier}
        key = (record["split"], record["step"])
        if key in self._seen:
            return
        self._seen.add(key)
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
        if record["split"] == "train":
            self._shown.update(record)
        elif record["split"] == "eval":
            self._shown["eval_loss"] = record.get("eval_loss")
        if self.bar is not None:
            self.bar.set_postfix_str(format_postfix(self._shown), refresh=True)


def format_postfix(record: Mapping[str, Any]) -> str:
    """``loss 0.123 eval 0.130 acc 0.98 lr 2.0e-04 tok/s 5.2k mem/rank 0.61,0.60 GiB`` (the keys present)."""
    parts = []
    for key, fmt in (("loss", "loss {:.3f}"), ("eval_loss", "eval {:.3f}"), ("accuracy", "acc {:.2f}"),
                     ("learning_rate", "lr {:.1e}")):
        if isinstance(record.get(key), (int, float)):
            parts.append(fmt.format(record[key]))
    if isinstance(record.get("tokens_per_second"), (int, float)):
        parts.append(f"tok/s {record['tokens_per_second'] / 1e3:.1f}k")
    if record.get("peak_memory_bytes_per_rank"):
        parts.append("mem/rank " + ",".join(f"{m / GIB:.2f}" for m in record["peak_memory_bytes_per_rank"]) + " GiB")
    return " ".join(parts)


def _all_gather_int(value: int) -> list[int]:
    """``value`` of every rank (world order); ``[value]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    return [row[0] for row in gather_signature([value])]


def _jsonable(value: Any) -> Any:
    """Tensors / numpy values a custom Trainer might log, as JSON numbers or lists."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
