"""Start ``world_size`` local processes with an initialised ``torch.distributed`` world.

Used by the CLI on a single machine and by the tests; ``torchrun`` / ``accelerate launch`` do the
same job on clusters, and everything else in the package only needs an initialised world.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_backend(world_size: int, device_type: str) -> str:
    """The backend for ``world_size`` local ranks on ``device_type`` (``"cpu"`` or ``"cuda"``).

    ``"nccl"`` when CUDA has a GPU for every rank; otherwise ``"gloo"``, also on CUDA, where the
    ranks then share the GPUs (rank r on GPU r % count) and gloo moves CUDA tensors through host
    memory: that runs the CUDA kernels and measures per-rank CUDA memory on one GPU, but its
    step times say nothing about NCCL. Raises ``ValueError`` for ``"cuda"`` without CUDA.
    """
    if device_type == "cpu":
        return "gloo"
    if device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}.")
    if not torch.cuda.is_available():
        raise ValueError("device_type='cuda' but torch sees no CUDA device; use 'cpu' or a CUDA build of torch.")
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


_FINAL_WORKS: list[dist.Work] = []  # see close_world: held until the interpreter exits


def close_world() -> None:
    """End of a distributed run: a barrier, then ``destroy_process_group()``; safe at interpreter exit.

    Call it on every rank where a script would call ``dist.barrier(); dist.destroy_process_group()``.
    With gloo that pair can deadlock the exit (1 run in 10 of ``examples/torchrun_train.py`` on a
    loaded machine, torch 2.13): ``barrier()`` returns when the work completes, but gloo's worker
    thread drops its own reference to the work a moment later, and if that is the last one, freeing
    the tensors of the collectives it waited on needs the GIL. If the main thread meanwhile frees
    the last holder of the process group (a DDP model's reducer, when the training function
    returns), the group's destructor joins that worker while holding the GIL: neither moves. Here
    this module keeps the barrier's work until the interpreter exits, so the worker's reference is
    never the last one. No-op if the world is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    work = dist.barrier(async_op=True)
    _FINAL_WORKS.append(work)
    work.wait()
    dist.destroy_process_group()


def _worker(rank: int, fn: Callable, world_size: int, port: int, backend: str, timeout_s: float, args: tuple,
            device_type: str = "cpu") -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl" or device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # nccl: one GPU per rank (checked in spawn)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        if dist.is_initialized():  # no barrier: a rank that raised must not wait for the others
            dist.destroy_process_group()
        raise
    close_world()  # every rank got here: barrier + destroy without gloo's exit deadlock (no-op if fn closed it)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    preload: Sequence[str] = (),
    device_type: str = "cpu",
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes of one process group.

    ``fn`` must be importable (a module-level function). An exception in any rank is re-raised
    here with that rank's traceback; ``timeout_s`` bounds every collective, so a rank that stops
    early turns into an error in the others instead of a hang. ``preload`` names modules the
    fork server imports once (e.g. ``"transformers.modeling_utils"``); it takes effect when the
    server first starts in this process. ``device_type="cuda"`` makes rank r's current CUDA
    device GPU r % count (with gloo the ranks may share GPUs; see :func:`local_backend`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl needs a GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs; "
                         "use local_backend(world_size, 'cuda') (gloo when GPUs are shared) or fewer ranks.")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device_type='cuda' but torch sees no CUDA device; use device_type='cpu'.")
    # forkserver: one server process imports torch once and forks every worker from it, so repeated
    # launches (the tests, the CLI) do not pay the import in each process; it never ran a kernel,
    # so no thread pool is inherited half-initialised as with plain fork.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ulysses_sp.comm.launch", *preload])
    mp.start_processes(
        _worker, args=(fn, world_size, free_port(), backend, timeout_s, args, device_type), nprocs=world_size,
        join=True, start_method="forkserver",
    )
