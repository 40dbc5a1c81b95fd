"""Paired timing: several SP systems in the SAME processes, steps alternating A, B, C, A, B, C, ...

On a shared or noisy machine separate runs see different background load; alternating steps of
the systems inside one process group exposes them to the same load, so the per-round ratio of
step times is robust even when the absolute times are not. Each system has its own model copy
(same seed) and registration: ours use their own AttentionInterface keys, DeepSpeed replaces the
``sdpa`` entry, so they coexist. Peak memory is not measured here (see ``runner``: one
configuration per process group).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import torch

from ulysses_sp import CommCounter, spawn
from ulysses_sp.cli.bench.runner import PRELOAD, Job, machine, setup_system, timed_step


def _paired_worker(rank: int, world: int, jobs: list[Job], rounds: int, out_path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if jobs[0].backend == "nccl" else torch.device("cpu")
    counter = CommCounter()
    steps = [setup_system(job, device, counter)[0] for job in jobs]
    losses = [[step.run(counter) for _ in range(job.warmup + 1)] for job, step in zip(jobs, steps)]
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            t = torch.tensor([timed_step(step, counter, device)], dtype=torch.float64,
                             device=device if device.type == "cuda" else "cpu")
            if world > 1:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            times[i].append(float(t))
    if rank == 0:
        records = [{
            "mode": "paired", "system": job.system, "sp_size": job.sp_size, "seq_len": job.seq_len,
            "batch_size": job.batch_size, "median_step_seconds": statistics.median(ts), "min_step_seconds": min(ts),
            "step_seconds": ts, "loss": ls[0], "final_loss": ls[-1], "dtype": job.dtype, "machine": machine(world),
        } for job, ts, ls in zip(jobs, times, losses)]
        with open(out_path, "w") as f:
            json.dump(records, f)


def run_paired(jobs: list[Job], rounds: int, timeout_s: float = 900.0, preload: tuple[str, ...] = ()) -> list[dict]:
    """Alternate one step of each job (same ``sp_size`` and ``seq_len``, no ``single``) for ``rounds`` rounds."""
    if len({(j.sp_size, j.seq_len) for j in jobs}) != 1 or any(j.system == "single" for j in jobs):
        raise ValueError("paired jobs must share sp_size and seq_len and use SP systems (not 'single').")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "paired.json")
        spawn(_paired_worker, jobs[0].sp_size, jobs, rounds, out_path, backend=jobs[0].backend,
                     timeout_s=timeout_s, preload=PRELOAD + list(preload))
        with open(out_path) as f:
            return json.load(f)


def paired_table(records: list[dict]) -> list[str]:
    """Markdown: per (P, S), each system's median step and the median of its per-round ratio to ulysses."""
    lines = ["Paired timing (same processes, alternating steps; ratio = median over rounds of step / ulysses step):",
             "", "| S | P | system | median (min) step s | step / ulysses step (median of rounds) |",
             "|---|---|---|---|---|"]
    for key in sorted({(r["seq_len"], r["sp_size"]) for r in records}):
        group = [r for r in records if (r["seq_len"], r["sp_size"]) == key]
        ours = next((r for r in group if r["system"] == "ulysses"), None)
        for r in sorted(group, key=lambda r: r["system"]):
            ratio = "-"
            if ours is not None:
                ratio = f"{statistics.median(a / b for a, b in zip(r['step_seconds'], ours['step_seconds'])):.2f}"
            lines.append(f"| {key[0]} | {key[1]} | {r['system']} | {r['median_step_seconds']:.3f} "
                         f"({r['min_step_seconds']:.3f}) | {ratio} |")
    return lines
