"""Run one (system, P, S) configuration in fresh local processes and return its JSON record.

Each configuration gets its own process group (so peak memory is that configuration's own):

    1. build the model (seed 0) and the batch (seed 1) on every rank; set the system up
    2. ``warmup`` steps (the first one's loss is the comparable ``loss``: same weights everywhere)
    3. one step under ``CommCounter``: collectives and bytes by phase, attention-scoped
    4. ``repeats`` timed steps: barrier, wall clock (CUDA events on GPU); the step time is the
       slowest rank's; the record keeps every repeat and the median
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ulysses_sp import CommCounter, SPMesh, attention_comm, auto_ring_size, spawn
from ulysses_sp.cli.bench.systems import (
    ModelSpec,
    Step,
    build_model,
    deepspeed_step,
    make_batch,
    ours_step,
    single_step,
)

PRELOAD = ["transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "ulysses_sp.integrations.transformers", "ulysses_sp.cli.bench.systems"]


@dataclass(frozen=True)
class Job:
    """One configuration to measure."""

    system: str
    sp_size: int
    seq_len: int
    batch_size: int = 1
    warmup: int = 2
    repeats: int = 5
    dtype: str = "float32"
    backend: str = "gloo"
    spec: ModelSpec = field(default_factory=ModelSpec)
    head_chunks: int = 2  # ulysses_chunked only
    ring_size: int = 2  # ulysses_ring only (must divide sp_size)
    attn: str = "sdpa"  # the model's attention kernel (every system runs it)
    documents: int = 1  # equal documents packed in each row (position_ids restart)

    @property
    def world(self) -> int:
        """Processes the job runs in (one for ``single``)."""
        return 1 if self.system == "single" else self.sp_size

    def comm_model(self, rank: int = 0):
        """``attention_comm`` of this job (``ulysses_chunked`` is ``ulysses`` with head chunks, as head blocks:
        the bench's Llama qualifies)."""
        spec, chunked = self.spec, self.system == "ulysses_chunked"
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        ring = (self.ring_size if self.system == "ulysses_ring"
                else auto_ring_size(self.sp_size, spec.num_attention_heads))
        if self.system == "ulysses_ring" or (self.system == "ulysses" and ring > 1):  # ulysses: automatic when P > N
            return attention_comm("ulysses_ring", self.sp_size, self.batch_size, self.seq_len, spec.num_attention_heads,
                                  spec.num_key_value_heads, spec.head_dim, itemsize, rank, ring_size=ring)
        return attention_comm("ulysses" if chunked else self.system, self.sp_size, self.batch_size, self.seq_len,
                              spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, itemsize, rank,
                              head_chunks=self.head_chunks if chunked else 1, head_blocks=chunked)


def _rss_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _memory_mark(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return _rss_bytes("VmRSS")


def _memory_peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_bytes("VmHWM")


def setup_system(job: Job, device: torch.device, counter: CommCounter) -> tuple[Step, torch.nn.Module]:
    model = build_model(job.spec, job.seq_len, device, getattr(torch, job.dtype), job.attn)
    ids = make_batch(job.spec, job.batch_size, job.seq_len, device)
    docs = job.documents
    if job.system == "single":
        return single_step(model, ids, documents=docs, counter=counter), model
    mesh = SPMesh.from_world(job.sp_size)
    if job.system == "deepspeed":
        return deepspeed_step(model, ids, mesh, counter, documents=docs), model
    if job.system == "ulysses_chunked":
        return ours_step(model, ids, mesh, counter, backend="ulysses", head_chunks=job.head_chunks,
                         documents=docs), model
    if job.system == "ulysses_ring":
        return ours_step(model, ids, mesh, counter, backend="ulysses", ring_size=job.ring_size, documents=docs), model
    return ours_step(model, ids, mesh, counter, backend=job.system, documents=docs), model


def timed_step(step: Step, counter: CommCounter, device: torch.device) -> float:
    if dist.is_initialized():
        dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step.run(counter)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000.0
    import time

    t0 = time.perf_counter()
    step.run(counter)
    return time.perf_counter() - t0


def _comm_summary(counter: CommCounter, num_layers: int) -> dict:
    fwd, bwd = counter.select("forward", "attention"), counter.select("backward", "attention")
    by_op: dict[str, int] = {}
    for c in counter.records:
        by_op[c.op] = by_op.get(c.op, 0) + 1
    return {
        "bytes_sent_per_rank_forward": sum(c.bytes_sent for c in fwd) // num_layers,
        "bytes_sent_per_rank_backward": sum(c.bytes_sent for c in bwd) // num_layers,
        "collectives_per_layer": len(fwd) / num_layers,
        "collectives_per_layer_backward": len(bwd) / num_layers,
        "step_collectives": len(counter.records),
        "step_collectives_by_op": by_op,
        "step_bytes_sent_per_rank": sum(c.bytes_sent for c in counter.records),
    }


def _gather(value: float, device: torch.device, world: int) -> list[float]:
    if world == 1:
        return [float(value)]
    t = torch.tensor([float(value)], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    table = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(table, t)
    return [float(x) for x in table]


def _worker(rank: int, world: int, job: Job, out_path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if job.backend == "nccl" else torch.device("cpu")
    counter = CommCounter()
    step, model = setup_system(job, device, counter)
    base = _memory_mark(device)
    losses = [step.run(counter) for _ in range(job.warmup)]
    with counter:
        losses.append(step.run(counter))
    comm = _comm_summary(counter, step.num_layers)
    times, attention = [], []
    for _ in range(job.repeats):
        counter.attention_seconds = 0.0
        times.append(timed_step(step, counter, device))
        attention.append(counter.attention_seconds)  # inside the attention calls, forward + backward
    peak = _gather(_memory_peak(device) - base, device, world)
    slowest = [max(_gather(t, device, world)) for t in times]
    attention = [max(_gather(a, device, world)) for a in attention]
    bytes_fwd = _gather(comm["bytes_sent_per_rank_forward"], device, world)
    bytes_bwd = _gather(comm["bytes_sent_per_rank_backward"], device, world)
    step.close()
    if rank != 0:
        return
    spec, model_comm = job.spec, job.comm_model()
    comm.update(bytes_sent_per_rank_forward=int(max(bytes_fwd)), bytes_sent_per_rank_backward=int(max(bytes_bwd)))
    record = {
        "system": job.system, "sp_size": job.sp_size, "seq_len": job.seq_len, "batch_size": job.batch_size,
        "head_chunks": job.head_chunks if job.system == "ulysses_chunked" else 1,
        "documents": job.documents,
        "ring_size": job.ring_size if job.system == "ulysses_ring" else 1,
        "median_step_seconds": statistics.median(slowest), "min_step_seconds": min(slowest), "step_seconds": slowest,
        "tokens_per_second": job.batch_size * job.seq_len / statistics.median(slowest),
        "attention_seconds": statistics.median(attention),
        "attention_us_per_token": statistics.median(attention) / (job.batch_size * job.seq_len) * 1e6,
        "peak_memory_bytes": int(max(peak)), "peak_memory_bytes_per_rank": [int(p) for p in peak],
        "bytes_sent_per_rank": comm["bytes_sent_per_rank_forward"] + comm["bytes_sent_per_rank_backward"],
        **comm,
        "formula_bytes_sent_per_rank": model_comm.bytes_forward + model_comm.bytes_backward,
        "formula_bytes_sent_per_rank_forward": model_comm.bytes_forward,
        "formula_collectives_per_layer": model_comm.collectives_forward,
        "formula_collectives_per_layer_backward": model_comm.collectives_backward,
        "formula": model_comm.text,
        "loss": losses[0], "final_loss": losses[-1], "num_layers": step.num_layers,
        "dtype": job.dtype, "attn_implementation": job.attn, "backend": job.backend if world > 1 else "none",
        "device": str(device),
        "model": asdict(spec), "num_params": sum(p.numel() for p in model.parameters()),
        "warmup": job.warmup, "repeats": job.repeats, "machine": machine(world),
    }
    with open(out_path, "w") as f:
        json.dump(record, f)


def machine(world: int = 1) -> dict:
    """What the numbers were measured on."""
    info = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0], "processes": world,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def run_job(job: Job, timeout_s: float = 900.0, preload: tuple[str, ...] = ()) -> dict:
    """Measure ``job`` in ``sp_size`` fresh processes (one for ``single``) and return its record.

    ``preload``: extra modules the fork server imports once (e.g. ``"deepspeed"``); only the first
    launch in this process starts the server, so pass the same list to every call.
    """
    if job.warmup < 1 or job.repeats < 1:
        raise ValueError("warmup and repeats must be >= 1 (the first step runs one-time checks).")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "record.json")
        spawn(_worker, job.world, job, out_path, backend=job.backend, timeout_s=timeout_s,
              preload=PRELOAD + list(preload))
        with open(out_path) as f:
            return json.load(f)
