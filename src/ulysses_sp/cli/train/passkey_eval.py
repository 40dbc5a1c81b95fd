"""``--eval-passkey-lengths``: passkey retrieval under SP during ``ulysses-sp train``, into ``metrics.jsonl``.

At train begin (the model as it starts: before an extension is trained), after every evaluation of
the Trainer (``--eval-strategy``) and at train end, every rank scores the same grid of rows
(``passkey.passkey_grid``: a forward pass under SP, answer scores reduced over the SP group) and
world rank 0 appends one record::

    {"split": "passkey", "step": N, "elapsed_seconds": ...,
     "passkey_exact_match_<length>": mean over depths, ...,      one key per length
     "passkey_cells": [{"length", "depth", "exact_match", "token_accuracy", "mean_log_likelihood"}, ...]}

``plot.py`` draws the last record's cells as a length x depth heat map (and the per-length accuracy
against the step when there are several records). A step already in the file (a resumed run) is not
scored again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ulysses_sp.cli.train.passkey import PasskeyTask, passkey_grid
from ulysses_sp.cli.train.plot import read_metrics, record_split

SPLIT = "passkey"


class PasskeyEvalCallback(TrainerCallback):
    """Scores the passkey grid at train begin, after each evaluation and at train end (all ranks).

    Args:
        path: the run's ``metrics.jsonl`` (world rank 0 appends to it).
        task: the rows' tokenizer, filler and key digits.
        lengths, depths, samples: the grid (``samples`` rows per cell).
        seed: seed of the keys and filler offsets (the same rows at every step).

    Set ``.ulysses`` (the trainer's registered ``UlyssesSP``) once the trainer exists.
    """

    def __init__(self, path: Path, task: PasskeyTask, lengths: list[int], depths: list[float], samples: int,
                 seed: int = 0) -> None:
        self.path = Path(path)
        self.task, self.lengths, self.depths, self.samples, self.seed = task, lengths, depths, samples, seed
        self.ulysses: Any = None
        self._start = time.perf_counter()
        self._scored: set[int] = set()  # steps this run scored

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._start = time.perf_counter()
        self._score(state, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self._score(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._score(state, model)

    def _score(self, state, model) -> None:
        if model is None or self.ulysses is None or state.global_step in self._scored:
            return
        self._scored.add(state.global_step)  # every rank: the same steps, so the same collectives
        cells = passkey_grid(model, self.ulysses, self.task, self.lengths, self.depths, self.samples, self.seed)
        if not state.is_world_process_zero:
            return
        earlier = read_metrics(self.path) if self.path.exists() else []
        if any(record_split(r) == SPLIT and r.get("step") == state.global_step for r in earlier):
            return  # a resumed run: this step's record is in the file already
        record: dict[str, Any] = {"split": SPLIT, "step": state.global_step,
                                  "elapsed_seconds": time.perf_counter() - self._start}
        for length in self.lengths:
            row = [c["exact_match"] for c in cells if c["length"] == length]
            record[f"passkey_exact_match_{length}"] = sum(row) / len(row)
        record["passkey_cells"] = cells
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
