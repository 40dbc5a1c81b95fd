"""Validate a ``ulysses-sp train`` run before any worker starts, then launch the workers.

    1. validate   options, output directory, model (config only, on the meta device: head split,
                  --seq-len covered by its positions, RoPE scaling applied: rope_scaling.py), data
                  (files exist, rows have a known format); a later stage's resume (stages.py)
    2. launch     ``torch.distributed.launcher.elastic_launch`` (what ``torchrun`` runs) with the
                  torchrun options of ``LaunchArguments``; workers are forked from a fork server
                  that imported torch and transformers once. Under ``torchrun`` (RANK set) the
                  command runs as a worker itself instead of launching.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulysses_sp.cli.train import lock, options
from ulysses_sp.cli.train.rope_scaling import apply_rope_scaling, length_error
from ulysses_sp.cli.train.stages import check_resume, checkpoint_config
from ulysses_sp.cli.train.tasks import CopyTask, embedded_model_config
from ulysses_sp.cli.train.worker import staging_dir

PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", "transformers.trainer",
           "ulysses_sp.integrations.trainer", "ulysses_sp.cli.train.worker"]


class TrainInputError(ValueError):
    """A run that cannot start: the message says what to change."""


@dataclass
class Plan:
    """A validated run: parsed options, the output directory and the world layout."""

    argv: list[str]
    margs: options.ModelDataArguments
    spargs: options.SPArguments
    largs: options.LaunchArguments
    output_dir: Path
    world_size: int
    nproc_per_node: int
    use_cuda: bool


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _output_dir(argv: list[str], targs: Any, overwrite: bool) -> Path:
    """The explicit --output-dir, or the first free ``runs/ulysses-sp-train[-N]``; refuses a used one.

    Under torchrun every rank validates on its own, so the default is not numbered there (ranks
    could pick different numbers).
    """
    given = any(a.split("=")[0] in ("--output-dir", "--output_dir") for a in argv)
    if not given and not _under_torchrun():
        path, n = Path(options.DEFAULT_OUTPUT_DIR), 1
        while path.exists() or staging_dir(path).exists():
            n += 1
            path = Path(f"{options.DEFAULT_OUTPUT_DIR}-{n}")
        return path
    path = Path(targs.output_dir if given else options.DEFAULT_OUTPUT_DIR).expanduser()
    if path.exists() and not path.is_dir():
        raise TrainInputError(f"--output-dir {path} is a file; give a directory.")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise TrainInputError(f"--output-dir {path} exists and is not empty; choose another directory or pass "
                              "--overwrite-output-dir to replace it when the new run completes.")
    return path


def _model_config(margs: options.ModelDataArguments):
    """The config of the model to train (no weights are read)."""
    from transformers import AutoConfig

    if margs.model is None:
        return embedded_model_config(margs)
    path = Path(margs.model).expanduser()
    if not path.exists() and (margs.model.startswith((".", "/", "~")) or margs.model.count("/") > 1):
        raise TrainInputError(f"--model {margs.model} does not exist; give a local model directory "
                              "(save_pretrained) or a Hugging Face Hub name (needs network).")
    try:
        return AutoConfig.from_pretrained(margs.model)
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainInputError(f"could not load a model config from --model {margs.model!r}: {first}") from err


def _check_model(margs: options.ModelDataArguments, spargs: options.SPArguments, resume: str | None = None) -> None:
    """Head split and sequence length, on a meta-device instance of the model."""
    import torch
    from transformers import AutoModelForCausalLM

    from ulysses_sp import check_model_support

    config = apply_rope_scaling(_model_config(margs), margs, checkpoint_config(resume))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=margs.attn_implementation)
    try:
        check_model_support(model, spargs.to_config())
    except ValueError as err:
        raise TrainInputError(f"--sp-size {spargs.sp_size} --sp-backend {spargs.sp_backend}: {err}") from err
    targets = margs.lora_target_modules
    if margs.lora_r > 0 and targets != ["all-linear"]:
        names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        missing = sorted(set(targets) - names)
        if missing:
            raise TrainInputError(f"--lora-target-modules {missing} match no linear layer of {type(model).__name__}; "
                                  f"its linear layers: {sorted(names)} (or all-linear).")
    too_long = length_error(config, margs.seq_len)  # covered by the model's positions, scaled ones included
    if too_long:
        raise TrainInputError(too_long)
    from ulysses_sp.cli.train.passkey import check_passkey_options

    check_passkey_options(margs, config.get_text_config().vocab_size)
    if margs.uses_task and margs.task == "copy" and margs.task_vocab_size > config.get_text_config().vocab_size:
        raise TrainInputError(f"--task-vocab-size {margs.task_vocab_size} exceeds the model's vocab_size "
                              f"{config.get_text_config().vocab_size}.")


def _check_data(margs: options.ModelDataArguments) -> None:
    """Task parameters, or: a tokenizer exists and EVERY row of the data is usable (``validate``:
    local files streamed row by row; dataset names and save_to_disk directories loaded)."""
    from ulysses_sp.cli.train.data import load_raw, load_tokenizer, local_files, row_format
    from ulysses_sp.cli.train.validate import validate_files

    if margs.uses_task:
        if margs.task == "copy":
            CopyTask(margs.seq_len, margs.task_vocab_size)
        return
    tokenizer = load_tokenizer(margs.model)
    if margs.assistant_only_loss and not re.search(r"{%-?\s*generation\s*-?%}", tokenizer.chat_template or ""):
        raise TrainInputError("--assistant-only-loss needs a chat template that marks the assistant turns with "
                              "{% generation %} ... {% endgeneration %}; this tokenizer's template does not.")
    if margs.eval_dataset:
        eval_files = local_files(margs.eval_dataset)
        if eval_files is not None:
            validate_files(eval_files, margs.dataset_text_field)
    files = local_files(margs.dataset)
    if files is not None:
        validate_files(files, margs.dataset_text_field)
        return
    raw = load_raw(margs.dataset, margs.dataset_config, margs.dataset_split)
    if len(raw) == 0:
        raise TrainInputError(f"--dataset {margs.dataset} has no rows.")
    row_format(raw[0], margs.dataset_text_field)


def plan(argv: list[str]) -> Plan:
    """Parse and validate everything that can be checked before launching (TrainInputError)."""
    try:
        argv = options.expand_config(argv)  # the workers get the file's options as flags
        margs, spargs, largs, targs = options.parse(argv)
        spargs.to_config()
    except ValueError as err:
        raise TrainInputError(str(err)) from err
    if spargs.dp_size < 1:
        raise TrainInputError(f"--dp-size must be >= 1, got {spargs.dp_size}.")
    world = spargs.sp_size * spargs.dp_size
    nproc = largs.nproc_per_node or world // max(largs.nnodes, 1)
    if nproc < 1 or nproc * largs.nnodes != world:
        raise TrainInputError(f"--sp-size {spargs.sp_size} x --dp-size {spargs.dp_size} = {world} processes, but "
                              f"--nnodes {largs.nnodes} x --nproc-per-node {nproc} = {nproc * largs.nnodes}; "
                              "make them equal.")
    if spargs.offload_activations and not targs.gradient_checkpointing:
        raise TrainInputError("--offload-activations moves the inputs of checkpointed layers to CPU: add "
                              "--activation-checkpointing (or drop --offload-activations).")
    if margs.seq_len < 2:
        raise TrainInputError(f"--seq-len must be >= 2, got {margs.seq_len}.")
    _check_eval_and_lora(margs, targs)
    output_dir = _output_dir(argv, targs, margs.overwrite_output_dir)
    _check_staging(output_dir, targs, margs.overwrite_output_dir)
    if targs.resume_from_checkpoint is not None:  # a later stage: other sizes, but no sharded state across them
        try:
            check_resume(Path(targs.resume_from_checkpoint), world, spargs.dp_size, targs.max_steps)
        except ValueError as err:
            raise TrainInputError(str(err)) from err
    try:
        _check_reporting(targs)
        _check_model(margs, spargs, targs.resume_from_checkpoint)
        _check_data(margs)
    except TrainInputError:
        raise
    except ValueError as err:
        raise TrainInputError(str(err)) from err
    return Plan(list(argv), margs, spargs, largs, output_dir, world, nproc, _use_cuda(targs, nproc))


def _check_eval_and_lora(margs: options.ModelDataArguments, targs: Any) -> None:
    """Evaluation needs held-out data; --eval-split is a fraction; LoRA needs peft and a rank."""
    import importlib.util

    if margs.eval_split is not None and not 0 < margs.eval_split < 1:
        raise TrainInputError(f"--eval-split is the fraction of documents held out, 0 < f < 1; got {margs.eval_split}.")
    if margs.eval_split is not None and margs.eval_dataset:
        raise TrainInputError("give --eval-dataset or --eval-split, not both.")
    if margs.uses_task and (margs.eval_split is not None or margs.eval_dataset):
        raise TrainInputError("--eval-dataset / --eval-split need --dataset (the copy task has its own held-out "
                              "rows: --eval-strategy steps evaluates on them).")
    strategy = getattr(targs.eval_strategy, "value", targs.eval_strategy)
    if strategy != "no" and not margs.uses_task and not (margs.eval_split or margs.eval_dataset):
        raise TrainInputError(f"--eval-strategy {strategy} needs held-out data: add --eval-dataset FILE "
                              "or --eval-split 0.05.")
    if margs.lora_r < 0:
        raise TrainInputError(f"--lora-r must be >= 0 (0 = no LoRA), got {margs.lora_r}.")
    if margs.lora_r > 0 and importlib.util.find_spec("peft") is None:
        raise TrainInputError("--lora-r needs the peft package: pip install peft.")


def _check_staging(output_dir: Path, targs: Any, overwrite: bool) -> None:
    """Never delete a stopped run's checkpoints without --overwrite-output-dir; resume paths exist."""
    staging = staging_dir(output_dir)
    resume = targs.resume_from_checkpoint
    if resume is not None:
        if not Path(resume).is_dir():
            raise TrainInputError(f"--resume-from-checkpoint {resume} is not a directory; give a checkpoint-N "
                                  f"directory (e.g. under {staging}).")
        return
    checkpoints = sorted(staging.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]) if
                         p.name.split("-")[-1].isdigit() else -1)
    if checkpoints and not overwrite:
        raise TrainInputError(
            f"{staging} holds checkpoints of a stopped run ({', '.join(p.name for p in checkpoints)}): resume it "
            f"with --resume-from-checkpoint {checkpoints[-1]}, or pass --overwrite-output-dir to discard them."
        )


def _check_reporting(targs: Any) -> None:
    """Every --report-to integration is installed (else it fails in the workers, mid-start)."""
    from transformers.integrations import get_reporting_integration_callbacks

    names = [r for r in (targs.report_to or []) if r not in ("none", "all")]
    try:
        for callback in get_reporting_integration_callbacks(names):
            callback()
    except (ValueError, RuntimeError, ImportError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TrainInputError(f"--report-to {' '.join(names)}: {first} (install the package or drop the "
                              "option).") from err


def _use_cuda(targs: Any, nproc: int) -> bool:
    """NCCL on GPUs when every local process gets its own GPU; else gloo on CPU."""
    import torch

    return bool(torch.cuda.is_available() and not targs.use_cpu and torch.cuda.device_count() >= nproc)


def launch_config(p: Plan):
    """The ``LaunchConfig`` torchrun would build from the same options (single node: standalone)."""
    from torch.distributed import run as torchrun

    from ulysses_sp import free_port

    la = p.largs
    argv = ["--nproc-per-node", str(p.nproc_per_node), "--nnodes", str(la.nnodes), "--max-restarts",
            str(la.max_restarts), "--start-method", "forkserver", "--rdzv-id", la.rdzv_id]
    if la.nnodes == 1 and la.rdzv_endpoint is None and la.master_addr is None:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    else:
        argv += ["--rdzv-backend", la.rdzv_backend]
        argv += ["--node-rank", str(la.node_rank)] if la.rdzv_backend == "static" else []
        argv += ["--rdzv-endpoint", la.rdzv_endpoint] if la.rdzv_endpoint else []
        argv += ["--master-addr", la.master_addr] if la.master_addr else []
        argv += ["--master-port", str(la.master_port)] if la.master_port else []
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p.nproc_per_node)))
    config, _, _ = torchrun.config_from_args(torchrun.parse_args(argv + ["ulysses-sp-train"]))
    if hasattr(config, "shutdown_timeout"):
        config.shutdown_timeout = 5  # a stalled worker is killed 5 s after another one failed (torch: 30)
    return config


def launch(p: Plan) -> dict[str, Any] | None:
    """Run the workers; world rank 0's summary if it ran on this node."""
    import torch.multiprocessing as mp
    from torch.distributed.launcher.api import elastic_launch

    from ulysses_sp.cli.train import worker

    if _under_torchrun():  # already a worker of torchrun: train here (rank 0 holds the lock)
        return _locked(p, os.environ.get("RANK") == "0", lambda: worker.main(p.argv, str(p.output_dir), p.use_cuda))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    saved_threads = os.environ.get("OMP_NUM_THREADS")  # launch_config sets it for the workers only
    try:
        results = _locked(p, p.largs.node_rank == 0, lambda: elastic_launch(launch_config(p), worker.main)(
            p.argv, str(p.output_dir), p.use_cuda))
    finally:
        if saved_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_threads
    return next((r for r in results.values() if r is not None), None)


def _locked(p: Plan, take: bool, run: Any) -> Any:
    """``run()`` while holding ``DIR.lock`` (when ``take``; ``lock.OutputLockedError`` if another run lives)."""
    if not take:
        return run()
    try:
        lock.acquire(p.output_dir)
    except lock.OutputLockedError as err:
        raise TrainInputError(str(err)) from err
    try:
        return run()
    finally:
        lock.release(p.output_dir)
