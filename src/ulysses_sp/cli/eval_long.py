"""``ulysses-sp eval-long``: passkey retrieval of a saved model at chosen lengths and depths, under SP.

    1. validate  the model directory (config, tokenizer), the SP split of its heads, the lengths
    2. launch    --sp-size processes with the launcher of ``ulysses-sp train`` (torch's elastic
                 launcher; under ``torchrun`` the command runs as a worker itself)
    3. score     each rank loads the model, registers ``UlyssesSP`` and scores its shard of every
                 row teacher-forced (a forward pass only, ``answer_scores`` reduced over the SP group)
    4. report    a length x depth table: exact-match accuracy of the key (mean log-likelihood per
                 key token); ``--output FILE`` writes the cells as JSON

Lengths past the model's ``max_position_embeddings`` are evaluated (that is how an unextended
model is measured at a longer length); the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a saved model directory (with its tokenizer) or Hub name")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="row lengths in tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                        help="depths of the key: fraction of the filler before it")
    parser.add_argument("--samples", type=int, default=8, help="rows per length and depth")
    parser.add_argument("--filler", default=None, help="filler text (.txt, or .jsonl rows with 'text'); default: "
                        "built-in sentences")
    parser.add_argument("--digits", type=int, default=4, help="digits of the key")
    parser.add_argument("--sp-size", type=int, default=2, help="processes the sequence is split over")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--attn-implementation", default="sdpa", help="kernel on the full sequence")
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys and filler offsets")
    parser.add_argument("--output", default=None, help="write the cells as JSON to this file")


def _validate(args: argparse.Namespace) -> int | None:
    """Everything checkable before launching (ValueError with the fix); the model's max_position_embeddings."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_sp import UlyssesSPConfig, check_model_support
    from ulysses_sp.cli.train.data import load_tokenizer
    from ulysses_sp.cli.train.passkey import PasskeyTask, load_filler

    if args.sp_size < 1 or args.samples < 1:
        raise ValueError(f"--sp-size and --samples must be >= 1, got {args.sp_size} and {args.samples}.")
    if any(not 0.0 <= d <= 1.0 for d in args.depths):
        raise ValueError(f"--depths are fractions in [0, 1], got {args.depths}.")
    if looks_local := args.model.startswith((".", "/", "~")):
        if not Path(args.model).expanduser().is_dir():
            raise ValueError(f"--model {args.model} is not a directory; give a saved model directory.")
    try:
        config = AutoConfig.from_pretrained(args.model)
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"could not load a model config from --model {args.model!r}"
                         f"{'' if looks_local else ' (a Hub name needs network)'}: {first}") from err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation)
    check_model_support(model, UlyssesSPConfig(sp_size=args.sp_size))
    task = PasskeyTask(load_tokenizer(args.model), load_filler(args.filler), args.digits)
    short = [n for n in args.lengths if n < task.min_length()]
    if short:
        raise ValueError(f"passkey rows need at least {task.min_length()} tokens with this tokenizer and --digits "
                         f"{args.digits}; drop or raise --lengths {short}.")
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def run(args: argparse.Namespace) -> int:
    """Validate, launch the ranks, print the table (and write ``--output``); the exit code."""
    from ulysses_sp.cli.train.passkey import format_grid

    limit = _validate(args)
    cells = _launch(args)
    result = {"model": args.model, "sp_size": args.sp_size, "samples": args.samples, "digits": args.digits,
              "max_position_embeddings": limit, "cells": cells}
    if os.environ.get("RANK", "0") != "0":
        return 0
    past = [n for n in args.lengths if limit is not None and n > limit]
    print(f"passkey retrieval of {args.model} (SP={args.sp_size}, {args.samples} rows per cell, {args.digits}-digit "
          f"keys): exact-match accuracy (mean log-likelihood per key token)")
    print(format_grid(cells))
    if past:
        print(f"lengths {past} are past the model's max_position_embeddings={limit} (positions it was not trained on)")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def _launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cells from world rank 0, run on --sp-size local processes (or as a torchrun worker)."""
    import logging

    import torch.multiprocessing as mp
    from torch.distributed.launcher.api import elastic_launch

    from ulysses_sp.cli.train.launch import launch_config
    from ulysses_sp.cli.train.options import LaunchArguments

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker(vars(args))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    mp.get_context("forkserver").set_forkserver_preload(["torch", "transformers", "ulysses_sp.cli.eval_long"])
    saved = os.environ.get("OMP_NUM_THREADS")
    try:
        plan = SimpleNamespace(largs=LaunchArguments(), nproc_per_node=args.sp_size)
        results = elastic_launch(launch_config(plan), worker)(vars(args))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return next(r for r in results.values() if r is not None)


def worker(options: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One rank: load the model, register SP over the world, score the grid; rank 0 returns the cells."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ulysses_sp import SPMesh, UlyssesSP, close_world
    from ulysses_sp.cli.train.data import load_tokenizer
    from ulysses_sp.cli.train.passkey import PasskeyTask, load_filler, passkey_grid
    from ulysses_sp.cli.train.worker import _init_distributed

    o = SimpleNamespace(**options)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= o.sp_size
    _init_distributed(use_cuda, 1800.0)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no per-rank loading bars
    model = AutoModelForCausalLM.from_pretrained(o.model, dtype=getattr(torch, o.dtype),
                                                 attn_implementation=o.attn_implementation)
    model.to(torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"))
    task = PasskeyTask(load_tokenizer(o.model), load_filler(o.filler), o.digits)
    with UlyssesSP(model, SPMesh.from_world(dist.get_world_size())) as sp:
        cells = passkey_grid(model, sp, task, o.lengths, o.depths, o.samples, o.seed)
    rank = dist.get_rank()
    close_world()
    return cells if rank == 0 else None


if __name__ == "__main__":
    from ulysses_sp.cli.main import main

    sys.exit(main(["eval-long", *sys.argv[1:]]))
