"""Data-parallel x sequence-parallel process groups on an initialised ``torch.distributed`` world.

    world ranks 0..7, sp_size=4            dp axis ->
                                       sp  [0 1 2 3]   one SP group: contiguous ranks, same batch
                                       |   [4 5 6 7]
    mesh = DeviceMesh(["dp", "sp"], shape (world/sp, sp))

Contiguous SP ranks keep the all-to-all inside a node whenever ``sp_size`` divides the GPUs per node.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout of the SP and DP groups when none is given: a stalled or dead rank turns into
an error on the other ranks after 10 minutes (torch's own default for new groups is 30)."""


@dataclass(frozen=True)
class SPMesh:
    """The ``dp x sp`` device mesh and the handles the rest of the package needs.

    Build it with :meth:`from_world` after ``torch.distributed`` is initialised (by ``torchrun``,
    ``accelerate launch`` or :func:`ulysses_sp.comm.launch.spawn`).
    """

    device_mesh: DeviceMesh
    sp_size: int
    dp_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_world(cls, sp_size: int, device_type: str | None = None, timeout_s: float | None = None) -> SPMesh:
        """Split the initialised world into ``dp = world // sp_size`` groups of ``sp_size`` ranks.

        Args:
            sp_size: ranks that share one sequence (the whole SP degree, all-to-all x ring; the size
                words: ``attention.contract``), ``1 <= sp_size <= world``.
            device_type: ``"cuda"`` or ``"cpu"``; default: ``"cuda"`` for an NCCL world, else ``"cpu"``.
            timeout_s: how long a collective of the SP / DP groups waits for a missing rank before
                it raises (default ``DEFAULT_TIMEOUT_S``, 600 s; the Trainer passes ``ddp_timeout``).
                torch would otherwise give new groups 30 minutes, whatever the world's timeout.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialised: launch with torchrun / accelerate launch, or "
                "call torch.distributed.init_process_group(...) before SPMesh.from_world()."
            )
        world = dist.get_world_size()
        check_sp_size(sp_size, world)
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        dp_size = world // sp_size
        timeout = datetime.timedelta(seconds=timeout_s)
        # every rank creates every group, in the same order (torch.distributed's rule for new groups)
        sp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(d * sp_size, (d + 1) * sp_size)) for d in range(dp_size)], timeout=timeout)
        dp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(r, world, sp_size)) for r in range(sp_size)], timeout=timeout)
        layout = torch.arange(world).view(dp_size, sp_size)
        mesh = DeviceMesh.from_group([dp_group, sp_group], device_type, mesh=layout, mesh_dim_names=("dp", "sp"))
        return cls(device_mesh=mesh, sp_size=sp_size, dp_size=dp_size, timeout_s=timeout_s)

    @property
    def sp_group(self) -> ProcessGroup:
        """The ranks sharing one sequence."""
        return self.device_mesh.get_group("sp")

    @property
    def dp_group(self) -> ProcessGroup:
        """The ranks at the same sequence position in different replicas (gradient reduction)."""
        return self.device_mesh.get_group("dp")

    @property
    def sp_rank(self) -> int:
        """This rank's shard index, 0..sp_size-1: it holds tokens ``[sp_rank*s, (sp_rank+1)*s)``."""
        return self.device_mesh.get_local_rank("sp")

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index (which batch it reads), 0..dp_size-1."""
        return self.device_mesh.get_local_rank("dp")

    def ulysses_ring_groups(self, ring_size: int) -> tuple[ProcessGroup, ProcessGroup]:
        """This rank's (all-to-all group, ring group) for Ulysses x ring with ``ring_size`` rings.

        Collective over the whole world (every rank must call it, in the same order). The SP group
        of ``P = A * R`` ranks splits into ``R`` all-to-all groups of ``A`` consecutive SP ranks
        (so each holds a contiguous segment of ``A * s`` tokens) and ``A`` ring groups of the SP
        ranks with the same position in their all-to-all group (the same heads after the
        exchange)::

            sp ranks 0..7, ring_size 2:   a2a [0 1 2 3] [4 5 6 7]     ring [0 4] [1 5] [2 6] [3 7]

        Both use the mesh's ``timeout_s``.
        """
        P = self.sp_size
        if not isinstance(ring_size, int) or ring_size < 1 or P % ring_size:
            raise ValueError(f"ring_size must be a positive divisor of sp_size={P}, got {ring_size!r}.")
        A = P // ring_size
        rows = self.device_mesh.mesh.view(self.dp_size, P).tolist()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        a2a, _ = dist.new_subgroups_by_enumeration(
            [row[j * A:(j + 1) * A] for row in rows for j in range(ring_size)], timeout=timeout)
        ring, _ = dist.new_subgroups_by_enumeration(
            [row[i::A] for row in rows for i in range(A)], timeout=timeout)
        return a2a, ring

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        if self.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_mesh.device_type)


def check_sp_size(sp_size: int, world_size: int) -> None:
    """Raise ``ValueError`` unless ``sp_size`` is a positive integer dividing ``world_size``.

    The one check of "sp_size divides the world" (the config, the mesh and every integration
    call it), with one message naming both fixes.
    """
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}.")
    if world_size % sp_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world_size} ({world_size} processes are not a "
            f"multiple of sp_size {sp_size}); use an sp_size in {divisors} or launch a multiple of {sp_size} "
            "processes (torchrun --nproc-per-node / accelerate launch --num_processes)."
        )
