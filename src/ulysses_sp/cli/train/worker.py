"""One rank of ``ulysses-sp train`` (started by torch's elastic launcher, or by ``torchrun``).

    1. process group   gloo on CPU, NCCL on GPU (env:// from the launcher); options re-parsed
    2. model           the embedded Llama (seeded random init) or ``--model`` (from_pretrained), with
                       the --rope-* scaling applied to its config first (rope_scaling.py)
    3. data            the copy task (train rows + held-out rows) or the user's data (data.py)
    4. train           ``UlyssesTrainer`` (every TrainingArguments option) + MetricsCallback
    5. finish (rank 0) save the model (+ tokenizer), run.json, metrics.png into the STAGING
                       directory ``DIR.incomplete``, then rename it to ``DIR``: a run that stops
                       early never leaves a ``DIR`` that looks complete
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp import close_world
from ulysses_sp.cli.train import options
from ulysses_sp.cli.train.rope_scaling import apply_rope_scaling
from ulysses_sp.cli.train.stages import (
    StageCallback,
    checkpoint_config,
    checkpoint_stages,
    checkpoint_step,
    stage_record,
)
from ulysses_sp.cli.train.tasks import CopyTask, embedded_model_config
from ulysses_sp.cli.train.watchdog import Heartbeat, is_timeout, timeout_message

STAGING_SUFFIX = ".incomplete"


def staging_dir(output_dir: str | Path) -> Path:
    """Where a run writes until it completes (renamed to ``output_dir`` at the end)."""
    path = Path(output_dir)
    return path.with_name(path.name + STAGING_SUFFIX)


def _init_distributed(use_cuda: bool, timeout_s: float) -> None:
    """env:// process group of the launcher (NCCL with one GPU per rank, else gloo on CPU).

    ``timeout_s`` (``--ddp-timeout``) bounds every collective of the world and of the SP / DP groups.
    """
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(int(threads))  # the user's OMP_NUM_THREADS, else this rank's share of the cores
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))


def build_model(margs: options.ModelDataArguments, seed: int, resume: str | None = None):
    """The model every rank starts from (identical: seeded init or the same checkpoint).

    ``resume``: the checkpoint a later stage resumes (its model's length is the default original
    length of a --rope-scaling; the Trainer loads its weights afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = margs.dtype if margs.dtype == "auto" else getattr(torch, margs.dtype)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": margs.attn_implementation}
    torch.manual_seed(seed)
    if margs.model is None or margs.random_init:
        kwargs["dtype"] = torch.float32 if dtype == "auto" else dtype  # from_config has no "auto"
    if margs.model is None:
        config = embedded_model_config(margs)
    else:
        config = AutoConfig.from_pretrained(margs.model)
    config = apply_rope_scaling(config, margs, checkpoint_config(resume))  # before the model: scaled rotaries
    if margs.model is None or margs.random_init:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    return AutoModelForCausalLM.from_pretrained(margs.model, config=config, **kwargs)


def build_data(margs: options.ModelDataArguments, seed: int, want_eval: bool):
    """``(train_dataset, eval_dataset, collator, eval_rows, tokenizer, data_summary)``.

    The copy task: its held-out rows give the accuracy and, when ``want_eval``, an eval dataset.
    Real data: local rank 0 of each node tokenizes and packs first, writing the datasets cache; the
    other ranks wait at a barrier and then read those cache files (memory-mapped), so the data is
    tokenized once per node and memory per rank does not grow with the dataset.
    """
    from ulysses_sp.cli.train.data import LMCollator, load_tokenizer, prepare_data

    if margs.uses_task and margs.task == "passkey":
        from ulysses_sp.cli.train.passkey import passkey_task

        task, tokenizer = passkey_task(margs, margs.passkey_filler)
        rows = task.dataset(margs.task_train_rows + margs.task_eval_rows, margs.seq_len, seed=seed + 1)
        train, held_out = rows[:margs.task_train_rows], rows[margs.task_train_rows:]
        eval_rows = {k: torch.stack([r[k] for r in held_out]) for k in ("input_ids", "labels")}
        return (train, held_out if want_eval else None, LMCollator(pad_token_id=tokenizer.pad_token_id or 0),
                eval_rows, tokenizer, None)
    if margs.uses_task:
        task = CopyTask(margs.seq_len, margs.task_vocab_size)
        eval_rows = task.rows(margs.task_eval_rows, seed=seed + 1_000_003)
        eval_dataset = task.dataset(margs.task_eval_rows, seed=seed + 1_000_003) if want_eval else None
        return (task.dataset(margs.task_train_rows, seed=seed + 1), eval_dataset, LMCollator(pad_token_id=0),
                eval_rows, None, None)
    tokenizer = load_tokenizer(margs.model)
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if first:
        data = prepare_data(margs, tokenizer, seed, keep_in_memory=False)
    dist.barrier()
    if not first:
        data = prepare_data(margs, tokenizer, seed, keep_in_memory=False)
    return (data.train, data.eval, LMCollator(pad_token_id=tokenizer.pad_token_id or 0), None, tokenizer,
            data.summary())


def apply_lora(model, margs: options.ModelDataArguments):
    """``model`` wrapped by PEFT LoRA when ``--lora-r`` > 0 (only the adapters train)."""
    if margs.lora_r <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    targets = margs.lora_target_modules
    config = LoraConfig(r=margs.lora_r, lora_alpha=margs.lora_alpha, lora_dropout=margs.lora_dropout,
                        target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def main(argv: list[str], output_dir: str, use_cuda: bool) -> dict[str, Any] | None:
    """Train on this rank; world rank 0 returns the run summary (others None).

    A collective that times out becomes a ``RuntimeError`` naming the timeout and the silent
    rank(s) (``watchdog``), so the launcher's report says which rank stalled.
    """
    margs, spargs, _, targs = options.parse(argv, use_cuda=use_cuda)
    _init_distributed(use_cuda, targs.ddp_timeout)
    heartbeat = Heartbeat.start(dist.get_rank(), dist.get_world_size(), targs.ddp_timeout)
    try:
        return _train(margs, spargs, targs, output_dir)
    except Exception as err:
        if dist.get_world_size() > 1 and is_timeout(err):
            raise RuntimeError(timeout_message(dist.get_rank(), targs.ddp_timeout, heartbeat)) from err
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _train(margs, spargs, targs, output_dir: str) -> dict[str, Any] | None:
    from transformers.trainer_callback import PrinterCallback

    from ulysses_sp import UlyssesTrainer
    from ulysses_sp.cli.train.metrics import MetricsCallback

    final, staging = Path(output_dir), staging_dir(output_dir)
    rank0 = dist.get_rank() == 0
    offset = torch.zeros(1, dtype=torch.float64)
    if rank0:
        offset[0] = _prepare_staging(staging, targs.resume_from_checkpoint)
    dist.broadcast(offset, src=0)  # every rank: the earlier run's training seconds (0 for a new run)
    _write_workers(staging)
    progress = not targs.disable_tqdm  # our bar replaces the Trainer's (one bar, as --disable-tqdm says)
    targs.disable_tqdm = True
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no per-rank loading / saving bars either
    targs.output_dir = str(staging)
    if targs.include_num_input_tokens_seen == "all":  # the parser only takes booleans: count real tokens
        targs.include_num_input_tokens_seen = "non_padding"
    model = apply_lora(build_model(margs, targs.seed, targs.resume_from_checkpoint), margs)
    want_eval = targs.eval_strategy != "no" or bool(margs.eval_dataset or margs.eval_split)
    train_dataset, eval_dataset, collator, eval_rows, tokenizer, data_summary = build_data(margs, targs.seed,
                                                                                            want_eval)
    if rank0 and data_summary is not None:
        print(f"ulysses-sp train: {data_summary['documents']} documents, {data_summary['tokens_in_data']} tokens in "
              f"the data, {data_summary['tokens_per_epoch']} tokens trained per epoch "
              f"(--packing-strategy {margs.packing_strategy if margs.packing else 'none'})", flush=True)
    callback = MetricsCallback(staging / "metrics.jsonl", eval_rows, progress=progress,
                               elapsed_offset=float(offset[0]))
    resume = targs.resume_from_checkpoint
    stages = StageCallback(stage_record(margs, spargs, dist.get_world_size(), model.config),
                           checkpoint_stages(Path(resume)) if resume else [])  # run.json + checkpoints: the stages
    passkey_eval = _passkey_eval(margs, staging, targs.seed)
    trainer = UlyssesTrainer(model=model, args=targs, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             data_collator=collator, processing_class=tokenizer,
                             callbacks=[callback, stages] + ([passkey_eval] if passkey_eval is not None else []),
                             sp_config=spargs.to_config())
    callback.ulysses = trainer.ulysses
    if passkey_eval is not None:
        passkey_eval.ulysses = trainer.ulysses
    trainer.remove_callback(PrinterCallback)  # our progress bar shows the logs
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    if eval_dataset is not None and targs.eval_strategy == "no":
        trainer.evaluate()  # held-out data without --eval-strategy: evaluate once, at the end
    seconds = float(offset[0]) + time.perf_counter() - started
    trainer.save_model(str(staging))
    dist.barrier()
    summary = None
    if rank0:
        summary = _finish(margs, spargs, seconds, staging, final, data_summary, callback.summary, stages.stages)
    close_world()  # barrier + destroy_process_group, without gloo's exit deadlock (see its docstring)
    return summary


def _passkey_eval(margs, staging: Path, seed: int):
    """The ``--eval-passkey-*`` callback (None without ``--eval-passkey-lengths``): the model's tokenizer."""
    if not margs.eval_passkey_lengths:
        return None
    from ulysses_sp.cli.train.passkey import passkey_task
    from ulysses_sp.cli.train.passkey_eval import PasskeyEvalCallback

    task, _ = passkey_task(margs, margs.eval_passkey_filler or margs.passkey_filler)
    return PasskeyEvalCallback(staging / "metrics.jsonl", task, margs.eval_passkey_lengths, margs.eval_passkey_depths,
                               margs.eval_passkey_samples, seed)


def _write_workers(staging: Path) -> None:
    """``DIR.incomplete/workers.json``: rank -> pid and host, to inspect or signal one rank of a live run."""
    import socket

    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, {"pid": os.getpid(), "host": socket.gethostname()})
    if dist.get_rank() == 0:
        (staging / "workers.json").write_text(json.dumps({str(r): t for r, t in enumerate(table)}, indent=1) + "\n")


def _prepare_staging(staging: Path, resume_from: str | None) -> float:
    """Rank 0: the staging directory; returns the seconds an earlier run trained (0 for a new run).

    New run: an empty directory (``launch.plan`` refused to start if the old one held checkpoints and
    --overwrite-output-dir was not given). Resume: the stopped run's directory, with ``metrics.jsonl``
    cut back to the checkpoint's step (the steps after it are trained again) and the earlier run's
    elapsed time, the largest ``elapsed_seconds`` it logged, carried on. A later stage in a new
    directory (``stages``) starts from the checkpoint's run's ``metrics.jsonl`` (its parent directory),
    cut at the checkpoint's step, and its elapsed time up to that step.
    """
    if resume_from is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
        return 0.0
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / "metrics.jsonl"
    source = path if path.exists() else Path(resume_from).parent / "metrics.jsonl"
    if not source.exists():
        return 0.0
    from ulysses_sp.cli.train.plot import read_metrics

    records = read_metrics(source)
    step = checkpoint_step(Path(resume_from))
    kept = [r for r in records if step is None or r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    timed = records if source == path else kept  # this directory's run trained all its seconds
    return max((float(r.get("elapsed_seconds", 0.0)) for r in timed), default=0.0)


def _finish(margs, spargs, seconds: float, staging: Path, final: Path, data_summary: dict | None,
            trainer_summary: dict | None = None, stages: list[dict] | None = None) -> dict[str, Any]:
    """Rank 0: run.json + metrics.png into ``staging``, then rename it to ``final``."""
    from ulysses_sp.cli.train.plot import plot_metrics, read_metrics, record_split

    path = staging / "metrics.jsonl"
    records = read_metrics(path) if path.exists() else []  # the whole run, also when resumed
    train = [r for r in records if record_split(r) == "train"]
    evals = [r for r in records if record_split(r) not in ("train", "passkey")]
    passkey = [r for r in records if record_split(r) == "passkey"]

    world = dist.get_world_size()
    copy = margs.uses_task and margs.task == "copy"
    chance = CopyTask(margs.seq_len, margs.task_vocab_size).chance_accuracy if copy else None
    summary = {
        "complete": True, "train_seconds": seconds, "world_size": world, "sp_size": spargs.sp_size,
        "dp_size": world // spargs.sp_size, "seq_len": margs.seq_len,
        "task": margs.task if margs.uses_task else None, "chance_accuracy": chance,
        "model": margs.model or "embedded-llama", "dataset": margs.dataset, "data": data_summary,
        "lora_r": margs.lora_r or None,
        "final": train[-1] if train else None, "first": train[0] if train else None,
        "final_eval": evals[-1] if evals else None, "trainer_summary": trainer_summary, "stages": stages,
        "passkey": {"first": passkey[0], "final": passkey[-1]} if passkey else None,
    }
    if records:
        data = f"{margs.task} task" if margs.uses_task else ", ".join(Path(d).name for d in margs.dataset or [])
        earlier = [s for s in (stages or [])[:-1] if s.get("seq_len")]
        staged = "".join(f"{s['seq_len']} (SP={s['sp_size']}) -> " for s in earlier)  # a staged extension
        title = (f"{Path(margs.model).name if margs.model else 'embedded Llama'} on {data}: S={staged}"
                 f"{margs.seq_len}, SP={spargs.sp_size} x DP={world // spargs.sp_size}")
        plot_metrics(records, staging / "metrics.png", title, chance)
    (staging / "run.json").write_text(json.dumps(summary, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final) if final.is_dir() else final.unlink()  # --overwrite-output-dir (checked before)
    os.replace(staging, final)
    return summary
