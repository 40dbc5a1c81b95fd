"""Staged extension: resume a checkpoint at another ``--seq-len`` / ``--sp-size`` / world size.

    stage 1   --seq-len 8192  --sp-size 1 --save-steps 500 --max-steps 500  --output-dir s1
    stage 2   --seq-len 32768 --sp-size 4 --rope-scaling yarn --rope-factor 4 ...
              --resume-from-checkpoint s1/checkpoint-500 --max-steps 800     --output-dir s2

What carries over (the Trainer's own resume): the model weights, the optimizer state (one full
``optimizer.pt``: plain / DDP training saves it whole, whatever the world size), the LR scheduler
and the global step (``--max-steps`` is the total over all stages), the RNG state where the rank
exists in both stages, and the data position: the new stage starts at batch ``global_step`` of ITS
data order, where an uninterrupted run with its settings would be. With the same tokens per step
(batch x seq-len x dp) that is the same fraction of an epoch. ``metrics.jsonl`` continues from the
checkpoint's run (cut at its step) and ``elapsed_seconds`` goes on from it.

Each stage is a record ``{seq_len, sp_size, dp_size, world_size, rope_parameters,
max_position_embeddings, start_step, end_step, epoch}``: ``checkpoint-N/ulysses_stages.json``
holds the stages up to step N (world rank 0 writes it at every save), ``run.json`` "stages" all of
them.

Refused (``check_resume``, before launch): optimizer state that is SHARDED over the ranks (DeepSpeed
ZeRO partitions, FSDP sharded state dicts) at another world size or data-parallel size, since the
shards belong to a layout that no longer exists (the fix: the same sizes, or the weights only
through ``--model``); a ``--max-steps`` the checkpoint has already reached.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

STAGES_FILE = "ulysses_stages.json"


def checkpoint_step(checkpoint: Path) -> int | None:
    """The checkpoint's ``global_step`` (``trainer_state.json``), None without one."""
    state = Path(checkpoint) / "trainer_state.json"
    return int(json.loads(state.read_text()).get("global_step", 0)) if state.is_file() else None


def checkpoint_stages(checkpoint: Path) -> list[dict[str, Any]]:
    """The stages recorded up to the checkpoint; one of unknown sizes for a checkpoint without the record."""
    path = Path(checkpoint) / STAGES_FILE
    if path.is_file():
        return list(json.loads(path.read_text())["stages"])
    step = checkpoint_step(checkpoint)
    ranks = len(list(Path(checkpoint).glob("rng_state_*.pth")))  # the Trainer saves one per rank (world > 1) ...
    ranks = ranks or (1 if (Path(checkpoint) / "rng_state.pth").is_file() else None)  # ... or rng_state.pth
    return [{"seq_len": None, "sp_size": None, "dp_size": None, "world_size": ranks, "start_step": 0,
             "end_step": step}]


def checkpoint_config(checkpoint: str | Path | None) -> Any | None:
    """The model config saved in a checkpoint (None: no checkpoint, or one without config.json, e.g. LoRA)."""
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(checkpoint)


def sharded_state(checkpoint: Path) -> str | None:
    """What in the checkpoint is sharded over the ranks that wrote it (None: nothing)."""
    checkpoint = Path(checkpoint)
    if any(checkpoint.glob("global_step*/*zero_pp_rank_*")):
        return "DeepSpeed ZeRO optimizer partitions (global_step*/*zero_pp_rank_*)"
    if any(checkpoint.glob("**/*.distcp")) or any(p.is_dir() for p in checkpoint.glob("optimizer_*")):
        return "FSDP sharded state (torch.distributed.checkpoint shards, optimizer_*/)"
    return None


def check_resume(checkpoint: Path, world_size: int, dp_size: int, max_steps: int) -> None:
    """ValueError (with the fix) for a resume that cannot continue the checkpoint's run."""
    step = checkpoint_step(checkpoint)
    if step is not None and max_steps > 0 and max_steps <= step:
        raise ValueError(f"--resume-from-checkpoint {checkpoint} is at step {step} and --max-steps {max_steps} is the "
                         f"total over all stages: give --max-steps > {step} (e.g. {step} + the steps of this stage).")
    last = checkpoint_stages(checkpoint)[-1]
    sharded = sharded_state(checkpoint)
    before = (last.get("world_size"), last.get("dp_size"))
    if sharded is None or before == (world_size, dp_size) or before == (world_size, None):
        return
    then = f"world size {before[0]}, dp size {before[1]}" if before[0] else "another layout (not recorded)"
    raise ValueError(
        f"--resume-from-checkpoint {checkpoint} holds {sharded}, written at {then}; this run has world size "
        f"{world_size}, dp size {dp_size}, and those shards cannot be loaded into another layout here. Resume at the "
        "checkpoint's world and dp sizes (--seq-len and the SP/DP split of the same world may change only without "
        "sharded state), or continue from the weights only: consolidate them (DeepSpeed: zero_to_fp32.py in the "
        "checkpoint; FSDP: state_dict_type FULL_STATE_DICT) into a model directory and start a new run with --model "
        "DIR (the optimizer and schedule restart).")


def stage_record(margs: Any, spargs: Any, world_size: int, config: Any) -> dict[str, Any]:
    """This run's stage (``start_step`` / ``end_step`` / ``epoch`` filled in by :class:`StageCallback`)."""
    text = config.get_text_config()
    return {"seq_len": margs.seq_len, "sp_size": spargs.sp_size, "dp_size": world_size // spargs.sp_size,
            "world_size": world_size, "rope_parameters": getattr(text, "rope_parameters", None),
            "max_position_embeddings": getattr(text, "max_position_embeddings", None), "start_step": 0,
            "end_step": None, "epoch": None}


def _layout(stage: dict[str, Any]) -> tuple:
    return tuple(json.dumps(stage.get(k), sort_keys=True) for k in ("seq_len", "sp_size", "dp_size", "world_size",
                                                                   "rope_parameters", "max_position_embeddings"))


class StageCallback(TrainerCallback):
    """Keeps ``.stages`` (the earlier stages + this one) and writes them into every checkpoint (rank 0).

    Args:
        current: this run's :func:`stage_record`.
        earlier: the stages of the checkpoint it resumes (``checkpoint_stages``), else ``[]``.
    """

    def __init__(self, current: dict[str, Any], earlier: list[dict[str, Any]]) -> None:
        self.current = dict(current)
        self.earlier = [dict(s) for s in earlier]

    @property
    def stages(self) -> list[dict[str, Any]]:
        """Every stage so far, this one last."""
        return [*self.earlier, self.current]

    def _update(self, state) -> None:
        self.current.update(end_step=state.global_step, epoch=state.epoch)

    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed Trainer keeps the CHECKPOINT's logging / eval / save intervals (and only warns that
        # they differ): this stage's --logging-steps / --eval-steps / --save-steps apply instead
        state.compute_steps(args, state.max_steps)
        self.current["start_step"] = state.global_step  # > 0 when resumed
        if self.earlier and self.earlier[-1].get("end_step") is None:
            self.earlier[-1]["end_step"] = state.global_step
        if self.earlier and _layout(self.earlier[-1]) == _layout(self.current):  # resumed at the same sizes
            self.current["start_step"] = self.earlier.pop()["start_step"]

    def on_save(self, args, state, control, **kwargs):
        self._update(state)
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            (folder / STAGES_FILE).write_text(json.dumps({"stages": self.stages}, indent=1) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self._update(state)
