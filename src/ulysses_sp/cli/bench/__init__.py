"""``ulysses-sp bench``: our Ulysses SP against DeepSpeed's, ring attention and one process.

For every sequence length S and SP size P: one training step of the same random Llama model on
the same batch, per system, each configuration in fresh local processes (gloo on CPU, NCCL on
CUDA with one GPU per rank; on one GPU only what fits: ``single`` and P=1). Prints a markdown
report; ``--json`` writes one record per system and configuration, ``--markdown`` the report,
``--plots`` PNG plots. Exit code 1 when a loss differs from one process, bytes are off the
formula by more than 5% or the collective count per layer is not the model's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ulysses-sp bench``."""
    parser.add_argument("--systems", nargs="+", default=["single", "ulysses", "ring", "deepspeed"],
                        choices=["single", "ulysses", "ring", "deepspeed"], help="default: all four")
    parser.add_argument("--sp-sizes", nargs="+", type=int, default=[2, 4], help="P values (default 2 4)")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048, 4096], help="global S values")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2, min 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps; the median is reported (default 5)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8, help="query heads N (default 8)")
    parser.add_argument("--kv-heads", type=int, default=4, help="kv heads K (default 4)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--mode", choices=["isolated", "paired", "both"], default="both",
                        help="isolated: each configuration in its own processes (time, memory, bytes); paired: the SP "
                        "systems of one (P, S) in the same processes with alternating steps (step-time ratios robust "
                        "to background load); default both")
    parser.add_argument("--json", metavar="FILE", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", metavar="FILE", help="write the markdown report here")
    parser.add_argument("--plots", metavar="DIR", help="write step_time.png, peak_memory.png, bytes_sent.png here")


def _jobs(args: argparse.Namespace, cuda: bool, gpus: int) -> tuple[list, list[str]]:
    from ulysses_sp.cli.bench.runner import Job, ModelSpec

    spec = ModelSpec(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     head_dim=args.head_dim)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    common = dict(batch_size=args.batch_size, warmup=args.warmup, repeats=args.repeats, dtype=dtype,
                  backend="nccl" if cuda else "gloo", spec=spec)
    jobs, skipped = [], []
    for S in args.seq_lens:
        if "single" in args.systems:
            jobs.append(Job("single", 1, S, **common))
        for P in args.sp_sizes:
            for system in (s for s in args.systems if s != "single"):
                why = None
                if S % P:
                    why = f"S={S} is not a multiple of P={P}"
                elif cuda and P > gpus:
                    why = f"P={P} needs {P} GPUs, {gpus} visible"
                elif system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                    why = "deepspeed is not installed (pip install 'ulysses-sp[deepspeed]')"
                elif system == "deepspeed" and P == 1:
                    why = "DeepSpeed's Ulysses needs P >= 2"
                if why:
                    skipped.append(f"{system} P={P} S={S}: {why}")
                else:
                    jobs.append(Job(system, P, S, **common))
    return jobs, skipped


def run(args: argparse.Namespace) -> int:
    """Run every configuration, print the report, write the requested files; exit code (0 ok, 1 check failed)."""
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("ulysses-sp bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the fork server starts: every worker inherits it
    from ulysses_sp.cli.bench.paired import paired_table
    from ulysses_sp.cli.bench.report import check_records, markdown, plots
    from ulysses_sp.cli.bench.runner import run_job

    jobs, skipped = _jobs(args, cuda, torch.cuda.device_count() if cuda else 0)
    preload = ("deepspeed",) if any(j.system == "deepspeed" for j in jobs) else ()
    records = []
    if args.mode in ("isolated", "both"):
        for i, job in enumerate(jobs):
            record = run_job(job, preload=preload)
            records.append(record)
            print(f"[{i + 1}/{len(jobs)}] {job.system:9s} P={job.sp_size} S={job.seq_len}: "
                  f"{record['median_step_seconds']:.3f} s, loss {record['loss']:.6f}", file=sys.stderr, flush=True)
    paired = _paired(jobs, args.repeats, preload) if args.mode in ("paired", "both") else []
    command = "ulysses-sp " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""
    report = markdown(records, command) if records else ""
    if paired:
        report += "\n" + "\n".join(paired_table(paired)) + "\n"
    records += paired
    if skipped:
        report += "\nSkipped: " + "; ".join(skipped) + "\n"
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report)
    if args.plots:
        plots(records, args.plots)
    return 1 if check_records(records) else 0


def _paired(jobs: list, rounds: int, preload: tuple[str, ...]) -> list[dict]:
    from ulysses_sp.cli.bench.paired import run_paired

    out = []
    for key in sorted({(j.seq_len, j.sp_size) for j in jobs if j.system != "single"}):
        group = [j for j in jobs if (j.seq_len, j.sp_size) == key and j.system != "single"]
        records = run_paired(group, rounds, preload=preload)
        print(f"[paired] P={key[1]} S={key[0]}: " + ", ".join(f"{r['system']} {r['median_step_seconds']:.3f} s"
                                                          for r in records), file=sys.stderr, flush=True)
        out += records
    return out
