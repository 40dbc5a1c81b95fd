"""Setup checks the Trainer and the Accelerate adapters share, written once.

    refuse_accelerate_parallelism(pc, owner, source, entry)
                                    Accelerate's own ParallelismConfig with sp / tp / cp / dp_shard > 1
    ensure_process_group(world_size, backend, who)
                                    a one-process world when the script runs without a launcher
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

ACCELERATE_PARALLELISM = ("sp_size", "tp_size", "cp_size", "dp_shard_size")
"""The sizes of Accelerate's ``ParallelismConfig`` that start a parallelism of its own."""


def refuse_accelerate_parallelism(pc: Any, owner: str, source: str, entry: str) -> None:
    """Raise ``ValueError`` if the ``ParallelismConfig`` ``pc`` (or ``None``) sets any of ``ACCELERATE_PARALLELISM``.

    Accelerate would start its own parallelism next to ours (``sp_size``: DeepSpeed's ALST sequence
    parallelism), before any check of ours. ``owner`` names where ``pc`` comes from, ``source`` where
    to remove it and ``entry`` where the SP settings go instead.
    """
    sizes = {k: getattr(pc, k, 1) or 1 for k in ACCELERATE_PARALLELISM} if pc is not None else {}
    used = {k: v for k, v in sizes.items() if v > 1}
    if used:
        raise ValueError(
            f"{owner} sets {used} (Accelerate's own parallelism; sp_size would start DeepSpeed's ALST sequence "
            f"parallelism beside ulysses-sp): remove parallelism_config from {source} and pass the SP settings "
            f"as {entry}."
        )


def ensure_process_group(world_size: int, backend: str = "gloo", who: str = "the launcher") -> None:
    """The default process group: a one-rank ``backend`` world (in-memory store) when none is initialised
    and ``world_size`` is 1 (``python train.py``); ``ValueError`` when one is missing for more processes,
    or when the initialised world is not ``world_size`` ranks (``who`` expected that many)."""
    if not dist.is_initialized():
        if world_size != 1:
            raise ValueError(f"torch.distributed is not initialised for a world of {world_size}; "
                             "launch with torchrun / accelerate launch.")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != world_size:
        raise ValueError(f"torch.distributed has {dist.get_world_size()} ranks but {who} {world_size}; "
                         "launch with accelerate launch / torchrun so that both agree.")
