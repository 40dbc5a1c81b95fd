"""Metrics of ``ulysses-sp train``: a ``TrainerCallback`` that writes ``metrics.jsonl`` and a progress bar.

At every Trainer log (``logging_steps``), on ALL ranks (it runs collectives):

    1. accuracy      (embedded task) forward of held-out rows under SP: each rank scores the answer
                     positions of its own shard, correct / total summed over the SP group
    2. memory        peak memory of every rank (CUDA max allocated, else the process's peak RSS),
                     all-gathered
    3. throughput    tokens since the last log (the Trainer's ``num_input_tokens_seen``, counted once
                     per SP group) / wall time since the last log

and world rank 0 appends one JSON object per log to ``metrics.jsonl``: ``step``, ``loss``,
``grad_norm``, ``learning_rate``, ``epoch``, ``accuracy`` (task only), ``tokens_per_second``,
``peak_memory_bytes`` (max over ranks), ``peak_memory_bytes_per_rank``, ``elapsed_seconds``.
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

from ulysses_sp import IGNORE_INDEX as IGNORE
from ulysses_sp import all_reduce_sum, gather_signature


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated bytes on ``device``; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return int(kib) * 1024


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, rows: Mapping[str, torch.Tensor], ulysses: Any, batch_size: int = 8) -> float:
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
        keep = target != IGNORE
        counts[0] += (logits.argmax(-1)[keep] == target[keep]).sum()
        counts[1] += keep.sum()
    if ulysses.mesh.sp_size > 1:
        counts = all_reduce_sum(counts, ulysses.mesh.sp_group)
    model.train(was_training)
    return (counts[0] / counts[1].clamp_min(1)).item()


class MetricsCallback(TrainerCallback):
    """Writes ``metrics.jsonl`` (world rank 0) and draws a progress bar on stderr.

    Args:
        path: the JSONL file.
        eval_rows: held-out task rows for :func:`answer_accuracy` (None: no accuracy).
        ulysses_fn: returns the trainer's registered ``UlyssesSP`` (set after the trainer exists).
        progress: draw the bar (world rank 0 only).
    """

    def __init__(self, path: Path, eval_rows: Mapping[str, torch.Tensor] | None, progress: bool = True,
                 elapsed_offset: float = 0.0) -> None:
        self.path = Path(path)
        self.elapsed_offset = elapsed_offset  # seconds an earlier, resumed run had trained
        self.eval_rows = eval_rows
        self.progress = progress
        self.ulysses: Any = None
        self.bar: Any = None
        self._last = (0.0, 0)  # (time, tokens) at the previous log
        self._start = 0.0
        self.records: list[dict[str, Any]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self._last = (self._start, state.num_input_tokens_seen)
        if self.progress and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, desc="train", dynamic_ncols=True, file=sys.stderr)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:  # the end-of-training summary or an evaluation: not a step record
            return
        record: dict[str, Any] = {"step": state.global_step}
        record.update({k: logs[k] for k in ("loss", "grad_norm", "learning_rate", "epoch") if k in logs})
        if self.eval_rows is not None and model is not None and self.ulysses is not None:
            record["accuracy"] = answer_accuracy(model, self.eval_rows, self.ulysses)
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        record["tokens_per_second"] = (tokens - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, tokens)
        per_rank = _all_gather_int(peak_memory_bytes(args.device))
        record["peak_memory_bytes"] = max(per_rank)
        record["peak_memory_bytes_per_rank"] = per_rank
        record["elapsed_seconds"] = self.elapsed_offset + now - self._start
        if state.is_world_process_zero:
            self.records.append(record)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.bar is not None:
                self.bar.set_postfix_str(format_postfix(record), refresh=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
            self.bar.close()
            self.bar = None


def format_postfix(record: Mapping[str, Any]) -> str:
    """``loss 0.123 acc 0.98 tok/s 5.2k mem/rank 0.61,0.60 GB`` for the progress bar."""
    parts = [f"loss {record['loss']:.3f}"]
    if "accuracy" in record:
        parts.append(f"acc {record['accuracy']:.2f}")
    parts.append(f"tok/s {record['tokens_per_second'] / 1e3:.1f}k")
    parts.append("mem/rank " + ",".join(f"{m / 2**30:.2f}" for m in record["peak_memory_bytes_per_rank"]) + " GB")
    return " ".join(parts)


def _all_gather_int(value: int) -> list[int]:
    """``value`` of every rank (world order); ``[value]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    return [row[0] for row in gather_signature([value])]
