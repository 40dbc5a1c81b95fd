"""The only places this package touches private names of transformers' ``Trainer`` and TRL's ``SFTTrainer``.

Checked on transformers 5.0 - 5.25 and TRL 1.0 - 1.16 (the versions pyproject allows and the ones
installed here). Each helper says why no public route exists; if one appears, replace the body and
keep the name.

Overridden private methods (defined in ``trainer.py`` / ``trl.py``, calling the parent through
:func:`count_input_tokens`):

- ``Trainer._track_num_input_tokens(inputs)``: the Trainer counts ``num_input_tokens_seen`` on the
  batch each rank holds; under SP the ranks of a group hold shards of ONE batch, and there is no
  public hook to count the global batch once per group (TRL's ``num_tokens`` is counted there too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def prepare_inputs(trainer: Any, batch: Mapping[str, Any]) -> Any:
    """``Trainer._prepare_inputs``: the batch on the trainer's device, as ``training_step`` would
    move it (the public ``training_step`` / ``prediction_step`` call it internally; we shard first)."""
    return trainer._prepare_inputs(batch)


def train_batch_size(trainer: Any) -> int:
    """``Trainer._train_batch_size``: the per-device batch size after auto batch-size finding
    (``args.per_device_train_batch_size`` is the value before; no public getter)."""
    return trainer._train_batch_size


def count_input_tokens(parent: Any, inputs: Mapping[str, Any]) -> None:
    """``parent._track_num_input_tokens(inputs)``, ``parent`` being ``super()`` of an override
    (see the module docstring)."""
    parent._track_num_input_tokens(inputs)


def sft_metrics(trainer: Any) -> dict[str, dict[str, list[float]]]:
    """TRL's ``SFTTrainer._metrics`` (``{"train" | "eval": {name: [values]}}``): the only way to add
    values to what ``SFTTrainer.log`` reports (entropy, token accuracy, aux loss, num_tokens)."""
    return trainer._metrics


def add_sft_train_tokens(trainer: Any, num_tokens: int) -> None:
    """Add to TRL's running ``SFTTrainer._total_train_tokens`` and report it as ``num_tokens``
    (TRL counts it in its own ``_track_num_input_tokens``-time code with no public setter)."""
    trainer._total_train_tokens += num_tokens
    trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]
