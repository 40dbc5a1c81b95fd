"""``UlyssesSPConfig``: the few configuration lines every entry point shares.

    config = UlyssesSPConfig(sp_size=2, tiled_mlp_tokens=4096, tiled_loss_tokens=4096)
    config.validate(world_size=dist.get_world_size())     # before any model work
    mesh = config.build_mesh()                             # dp x sp DeviceMesh

Names follow Accelerate's parallelism config where users know them (``sp_size``,
``sp_backend``, ``sp_seq_length_is_variable``, ``sp_attn_implementation``); the memory features
are ours. :meth:`UlyssesSPConfig.from_dict` accepts a plain mapping (a YAML / JSON section) and
names unknown keys instead of ignoring them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ulysses_sp.attention.kernels import KERNELS
from ulysses_sp.comm.mesh import SPMesh

SP_BACKENDS = ("ulysses",)


@dataclasses.dataclass
class UlyssesSPConfig:
    """How to split sequences and which memory features to use.

    Attributes:
        sp_size: ranks that share one sequence (P); must divide the world size. 1 = no SP.
        sp_backend: the sequence-parallel algorithm; ``"ulysses"`` (head <-> sequence all-to-all).
        sp_attn_implementation: core kernel run on the full sequence (``sdpa``, ``eager``,
            ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``); None = the model's own.
        sp_seq_length_is_variable: batches may change length from step to step (always supported;
            kept for Accelerate compatibility: False only documents that they do not).
        tiled_mlp_tokens: run dense MLPs in sequence tiles of this many tokens (None = untiled).
        tiled_loss_tokens: run lm_head + cross entropy in tiles of this many tokens, never
            materialising the ``(s, V)`` logits (None = untiled).
        offload_activations: move checkpointed hidden states to CPU memory between forward and
            backward (needs gradient checkpointing).
    """

    sp_size: int = 1
    sp_backend: str = "ulysses"
    sp_attn_implementation: str | None = None
    sp_seq_length_is_variable: bool = True
    tiled_mlp_tokens: int | None = None
    tiled_loss_tokens: int | None = None
    offload_activations: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sp_size, bool) or not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise ValueError(f"sp_size must be a positive integer, got {self.sp_size!r}.")
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(f"sp_backend {self.sp_backend!r} is not available; use one of {list(SP_BACKENDS)}.")
        if self.sp_attn_implementation is not None and self.sp_attn_implementation not in KERNELS:
            raise ValueError(
                f"sp_attn_implementation {self.sp_attn_implementation!r} cannot run under Ulysses SP; "
                f"use one of {sorted(KERNELS)} or None for the model's own."
            )
        for name in ("tiled_mlp_tokens", "tiled_loss_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of tokens or None, got {value!r}.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> UlyssesSPConfig:
        """Build from a mapping; unknown keys raise a ValueError that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ulysses-sp option(s) {unknown}; known options: {sorted(known)}.")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, world_size: int) -> None:
        """Raise before training if ``sp_size`` cannot split ``world_size`` ranks."""
        if world_size % self.sp_size != 0:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"sp_size={self.sp_size} does not divide the world size {world_size}; "
                f"use one of {divisors} or launch a multiple of {self.sp_size} processes."
            )

    def build_mesh(self, device_type: str | None = None) -> SPMesh:
        """The ``dp x sp`` mesh over the initialised world (``SPMesh.from_world`` validates it)."""
        return SPMesh.from_world(self.sp_size, device_type=device_type)
