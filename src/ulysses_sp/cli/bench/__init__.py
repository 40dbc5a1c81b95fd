"""``ulysses-sp bench``: our Ulysses SP against DeepSpeed's, ring attention and one process.

For every sequence length S and SP size P: one training step of the same random Llama model on
the same batch, per system (``single``, ``ulysses``, ``ulysses_chunked``, ``ring``, ``deepspeed``),
each configuration in fresh local processes (gloo on CPU, NCCL on CUDA with one GPU per rank; on
one GPU only what fits: ``single`` and P=1), then the paired runs (alternating steps in one process
group). A row is printed as each configuration finishes and the records (``--json``) and report
(``--markdown``) are rewritten after each, so an interrupted run keeps what it measured.
``--budget-s`` skips what would not finish in time (the default run takes under 5 minutes on 2
cores). Exit code 1 when a loss differs from one process, bytes are off the formula by more than
5% or the collective count per layer is not the model's; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time

from ulysses_sp import ATTN_IMPLEMENTATIONS

SYSTEM_NAMES = ["single", "ulysses", "ulysses_chunked", "ring", "ulysses_ring", "deepspeed"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ulysses-sp bench``."""
    parser.add_argument("--systems", nargs="+", default=[s for s in SYSTEM_NAMES if "ring" not in s],
                        choices=SYSTEM_NAMES,
                        help="default: single ulysses ulysses_chunked deepspeed (ulysses_chunked: "
                        "UlyssesSPConfig(sp_head_chunks=--sp-head-chunks); ring and ulysses_ring (Ulysses x ring, "
                        "--ring-size) on request)")
    parser.add_argument("--ring-size", type=int, default=2,
                        help="ring degree of ulysses_ring (a divisor of each --sp-sizes value; default 2)")
    parser.add_argument("--sp-sizes", nargs="+", type=int, default=[2], help="P values (default 2)")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048],
                        help="global S values (default 1024 2048)")
    parser.add_argument("--sp-head-chunks", dest="head_chunks", type=int, default=2,
                        help="UlyssesSPConfig.sp_head_chunks of ulysses_chunked (default 2)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--documents", nargs="+", type=int, default=[1],
                        help="equal documents packed in each row (position_ids restart; no label crosses a "
                        "boundary), every system on the same packed batch; several values run each (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1, min 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps; the median is reported (default 3)")
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
    parser.add_argument("--attn-implementation", default="sdpa", choices=list(ATTN_IMPLEMENTATIONS),
                        help="the model's attention kernel, run by every system (default sdpa; e.g. "
                        "flash_attention_2 on CUDA)")
    parser.add_argument("--mode", choices=["isolated", "paired", "both", "memory"], default="both",
                        help="isolated: each configuration in its own processes (time, memory, bytes); paired: the "
                        "systems of one (P, S) in the same processes with alternating steps (ratios robust to "
                        "background load; one process runs on rank 0 with all cores); default both; memory: "
                        "only --attention-memory")
    parser.add_argument("--attention-memory", action="store_true",
                        help="also measure one attention layer's peak memory (forward + backward) with 1 and "
                        "--sp-head-chunks head chunks, per S and P")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="skip configurations predicted to end later than this many seconds after the start "
                        "(default 270; 0 = no limit)")
    parser.add_argument("--json", metavar="FILE", default="ulysses_sp_bench.json",
                        help="records (a JSON list), rewritten after every configuration "
                        "(default ulysses_sp_bench.json)")
    parser.add_argument("--markdown", metavar="FILE", help="the markdown report, rewritten after every configuration")
    parser.add_argument("--plots", metavar="DIR", help="write step_time.png, peak_memory.png, bytes_sent.png here")


def _tasks(args: argparse.Namespace, cuda: bool, gpus: int) -> tuple[list[tuple[str, list]], list[str]]:
    """``[("isolated", [job]) | ("paired", [jobs]), ...]`` in run order, and the skipped configurations."""
    from ulysses_sp.cli.bench.runner import Job, ModelSpec

    spec = ModelSpec(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     head_dim=args.head_dim)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    common = dict(batch_size=args.batch_size, warmup=args.warmup, repeats=args.repeats, dtype=dtype,
                  backend="nccl" if cuda else "gloo", spec=spec, head_chunks=args.head_chunks,
                  ring_size=args.ring_size, attn=args.attn_implementation)
    isolated, paired = args.mode in ("isolated", "both"), args.mode in ("paired", "both")
    tasks, skipped = [], []
    for S, docs in ((S, d) for S in args.seq_lens for d in args.documents):
        single = Job("single", 1, S, documents=docs, **common) if "single" in args.systems else None
        if single and isolated:
            tasks.append(("isolated", [single]))
        for P in args.sp_sizes:
            jobs = []
            for system in (s for s in args.systems if s != "single"):
                why = _unrunnable(system, P, S, cuda, gpus, args.ring_size)
                if why:
                    skipped.append(f"{system} P={P} S={S}: {why}")
                else:
                    jobs.append(Job(system, P, S, documents=docs, **common))
            if isolated:
                tasks += [("isolated", [job]) for job in jobs]
            if paired and jobs:
                tasks.append(("paired", ([single] if single and not cuda else []) + jobs))
    return tasks, skipped


def _unrunnable(system: str, P: int, S: int, cuda: bool, gpus: int, ring_size: int = 2) -> str | None:
    if system == "ulysses_ring" and (P % ring_size or ring_size < 2):
        return f"--ring-size {ring_size} is not a divisor >= 2 of P={P}"
    if S % P:
        return f"S={S} is not a multiple of P={P}"
    if cuda and P > gpus:
        return f"P={P} needs {P} GPUs, {gpus} visible"
    if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'ulysses-sp[deepspeed]')"
    if system == "deepspeed" and P == 1:
        return "DeepSpeed's Ulysses needs P >= 2"
    return None


def run(args: argparse.Namespace) -> int:
    """Run every configuration, print rows as they finish, write the files; exit code (0 ok, 1 check failed)."""
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        print("ulysses-sp bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.warmup < 1 or args.repeats < 1 or args.head_chunks < 1 or args.ring_size < 1:
        print("ulysses-sp bench: error: --warmup, --repeats, --sp-head-chunks and --ring-size must be >= 1",
              file=sys.stderr)
        return 2
    bad = [(S, d) for S in args.seq_lens for d in args.documents if d < 1 or S % d]
    if bad:
        print(f"ulysses-sp bench: error: --documents must be >= 1 and divide every --seq-lens value, got {bad}",
              file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the fork server starts: every worker inherits it
    from ulysses_sp.cli.bench.report import Budget, LiveTable, check_records, plots

    gpus = torch.cuda.device_count() if cuda else 0
    tasks, skipped = _tasks(args, cuda, gpus)
    preload = ("deepspeed",) if any(j.system == "deepspeed" for _, jobs in tasks for j in jobs) else ()
    command = "ulysses-sp " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""
    budget, live, records, interrupted = Budget(args.budget_s), LiveTable(command), [], False
    print(f"ulysses-sp bench: {len(tasks)} runs; records in {args.json}", file=sys.stderr, flush=True)
    live.header()
    try:
        for kind, jobs in tasks:
            why = budget.refuses(jobs, args.warmup + 1 + args.repeats)
            if why:
                skipped.append(f"{kind} {'/'.join(j.system for j in jobs)} P={max(j.sp_size for j in jobs)} "
                               f"S={jobs[0].seq_len}: {why}")
                continue
            new = _run_task(kind, jobs, preload, budget)
            records += new
            live.rows(new, records)
            _write(args, live.report(records, skipped))
            _write_json(args.json, records)
        if args.attention_memory or args.mode == "memory":
            records += _attention_memory(args, cuda, gpus, budget, skipped)
            _write(args, live.report(records, skipped))
            _write_json(args.json, records)
    except KeyboardInterrupt:
        interrupted = True
        skipped.append("interrupted (Ctrl-C): the records above are complete, the rest was not run")
    report = live.report(records, skipped)
    print("\n" + report)
    _write(args, report)
    _write_json(args.json, records)
    if args.plots and records:
        plots(records, args.plots)
    return 1 if check_records(records) else 130 if interrupted else 0


def _run_task(kind: str, jobs: list, preload: tuple[str, ...], budget) -> list[dict]:
    from ulysses_sp.cli.bench.paired import run_paired
    from ulysses_sp.cli.bench.runner import run_job

    start = time.monotonic()
    if kind == "isolated":
        new = [run_job(jobs[0], preload=preload)]
    else:
        new = run_paired(jobs, jobs[0].repeats, preload=preload)
    steps = (jobs[0].warmup + 1 + jobs[0].repeats) * len(jobs)
    budget.measured(jobs[0].seq_len, max(r["median_step_seconds"] for r in new), steps, time.monotonic() - start)
    return new


def _attention_memory(args: argparse.Namespace, cuda: bool, gpus: int, budget, skipped: list[str]) -> list[dict]:
    """One attention layer's peak memory with 1 and ``--sp-head-chunks`` chunks, per (S, P) that fits."""
    from ulysses_sp.cli.bench.attention_memory import attention_memory

    out = []
    for S in args.seq_lens:
        for P in args.sp_sizes:
            # memory only: with fewer GPUs than P the ranks share them over gloo (per-rank CUDA peaks hold)
            why = _unrunnable("ulysses", P, S, False, gpus) or (None if P > 1 else "P=1 has no exchange")
            why = why or budget.refuses([_Len(S)], 2 * 2)
            if why:
                skipped.append(f"attention memory P={P} S={S}: {why}")
                continue
            new = attention_memory(P, S, sorted({1, args.head_chunks}), B=args.batch_size, N=args.heads,
                                   K=args.kv_heads, H=args.head_dim,
                                   dtype=args.dtype or ("bfloat16" if cuda else "float32"),
                                   device_type="cuda" if cuda else "cpu")
            print(f"[attention memory] P={P} S={S}: " + ", ".join(
                f"C={r['head_chunks']} {r['peak_attention_bytes'] / 2**20:.1f} MiB" for r in new), flush=True)
            out += new
    return out


class _Len:
    """A stand-in job for the budget (only its ``seq_len`` is read)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len


def _write(args: argparse.Namespace, report: str) -> None:
    if args.markdown:
        _atomic_write(args.markdown, report)


def _write_json(path: str | None, records: list[dict]) -> None:
    if path:
        _atomic_write(path, json.dumps(records, indent=1))


def _atomic_write(path: str, text: str) -> None:
    """Write to a temporary file and rename it, so an interruption never leaves half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
