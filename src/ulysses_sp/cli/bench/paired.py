"""Paired timing: several systems in the SAME processes, steps alternating A, B, C, A, B, C, ...

On a shared or noisy machine separate runs see different background load; alternating steps of
the systems inside one process group exposes them to the same load, so the per-round ratio of
step times is robust even when the absolute times are not. Each system has its own model copy
(same seed) and registration: ours use their own AttentionInterface keys, DeepSpeed replaces the
kernel's entry (so ``single`` runs the kernel's function under a key of its own), and they coexist.

``single`` (one process, no SP) runs on rank 0 alone with ALL the cores' threads while the other
ranks wait in a collective, so "one process / ours" compares equal cores under the same load; its
step times are kept in every SP record of the run (``one_process_step_seconds``), with the median
of the per-round ratios (``one_process_vs_system``).
Peak memory is not measured here (see ``runner``: one configuration per process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterator

import torch

from ulysses_sp import CommCounter, spawn
from ulysses_sp.cli.bench.runner import PRELOAD, Job, machine, setup_system, timed_step


@contextlib.contextmanager
def _all_cores(device: torch.device) -> Iterator[None]:
    """Intra-op threads on every core for one process (the launcher gives each rank cores / P)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _setup(job: Job, rank: int, device: torch.device, counter: CommCounter):
    if job.system != "single":
        return setup_system(job, device, counter)[0]
    if rank != 0:
        return None
    from ulysses_sp.cli.bench.systems import build_model, make_batch, single_step

    model = build_model(job.spec, job.seq_len, device, getattr(torch, job.dtype), job.attn)
    return single_step(model, make_batch(job.spec, job.batch_size, job.seq_len, device), own_kernel_key=True,
                       documents=job.documents)


def _step_seconds(job: Job, step, counter: CommCounter, device: torch.device, world: int) -> float:
    """One timed step; ``single`` runs on rank 0 with all cores. The slowest rank's time."""
    if step is None:
        t = 0.0
        if world > 1:
            torch.distributed.barrier()
    else:
        with _all_cores(device) if job.system == "single" else contextlib.nullcontext():
            t = timed_step(step, counter, device)
    out = torch.tensor([t], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    if world > 1:
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return float(out)


def _paired_worker(rank: int, world: int, jobs: list[Job], rounds: int, out_path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if jobs[0].backend == "nccl" else torch.device("cpu")
    counter = CommCounter()
    steps = [_setup(job, rank, device, counter) for job in jobs]  # single first (see _setup)
    losses = []
    for job, step in zip(jobs, steps):
        with _all_cores(device) if job.system == "single" else contextlib.nullcontext():
            losses.append([step.run(counter) if step is not None else float("nan") for _ in range(job.warmup + 1)])
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(rounds):
        for i, (job, step) in enumerate(zip(jobs, steps)):
            times[i].append(_step_seconds(job, step, counter, device, world))
    for step in steps:
        if step is not None:
            step.close()
    if rank == 0:
        single = [(ts, ls) for job, ts, ls in zip(jobs, times, losses) if job.system == "single"]
        records = [_record(job, ts, ls, world, single[0] if single else None)
                   for job, ts, ls in zip(jobs, times, losses) if job.system != "single"]
        with open(out_path, "w") as f:
            json.dump(records, f)


def _record(job: Job, ts: list[float], ls: list[float], world: int, single: tuple | None) -> dict:
    """One SP system's paired record; the one-process steps of the same rounds ride along."""
    record = {
        "mode": "paired", "system": job.system, "sp_size": job.sp_size, "seq_len": job.seq_len,
        "batch_size": job.batch_size, "head_chunks": job.head_chunks if job.system == "ulysses_chunked" else 1,
        "documents": job.documents,
        "ring_size": job.ring_size if job.system == "ulysses_ring" else 1,
        "median_step_seconds": statistics.median(ts), "min_step_seconds": min(ts), "step_seconds": ts,
        "tokens_per_second": job.batch_size * job.seq_len / statistics.median(ts),
        "loss": ls[0], "final_loss": ls[-1], "dtype": job.dtype, "machine": machine(world),
    }
    if single is not None:
        record.update(one_process_step_seconds=single[0], one_process_loss=single[1][0],
                      one_process_vs_system=statistics.median(a / b for a, b in zip(single[0], ts)))
    return record


def run_paired(jobs: list[Job], rounds: int, timeout_s: float = 900.0, preload: tuple[str, ...] = ()) -> list[dict]:
    """Alternate one step of each job (same ``seq_len``; SP jobs of one ``sp_size``) for ``rounds`` rounds.

    A ``single`` job runs on rank 0 of the SP jobs' group with all the cores (see the module docstring).
    """
    sp_jobs = [j for j in jobs if j.system != "single"]
    if not sp_jobs or len({(j.sp_size, j.seq_len) for j in sp_jobs}) != 1 or len({j.seq_len for j in jobs}) != 1:
        raise ValueError("paired jobs must share seq_len, include an SP system and have one sp_size.")
    jobs = sorted(jobs, key=lambda j: j.system != "single")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "paired.json")
        spawn(_paired_worker, sp_jobs[0].sp_size, jobs, rounds, out_path, backend=jobs[0].backend,
              timeout_s=timeout_s, preload=PRELOAD + list(preload))
        with open(out_path) as f:
            return json.load(f)
