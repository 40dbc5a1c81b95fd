"""``UlyssesSPConfig``: the one configuration object every entry point accepts.

    config = UlyssesSPConfig(sp_size=2, tiled_mlp_tokens=4096, tiled_loss_tokens=4096)
    config.validate(world_size=dist.get_world_size())     # before any model work
    mesh = config.build_mesh()                             # dp x sp DeviceMesh
    sp = UlyssesSP(model, mesh, config)                    # or UlyssesTrainer(..., sp_config=config)

The object is frozen: an integration reads it, never rewrites it (``dataclasses.replace`` makes a
changed copy). Names follow Accelerate's parallelism config where users know them (``sp_size``,
``sp_backend``, ``sp_seq_length_is_variable``, ``sp_attn_implementation``); the memory features
are ours. :meth:`UlyssesSPConfig.from_dict` accepts a plain mapping (a YAML / JSON section) and
names unknown keys instead of ignoring them.

Also here, because every layer above shares them: the names of the sequence-parallel backends and
core kernels, and ``IGNORE_INDEX`` (the label value the loss skips).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ulysses_sp.comm.mesh import SPMesh, check_sp_size

IGNORE_INDEX = -100
"""Label value that contributes nothing to the loss (transformers' and PyTorch's convention)."""

SP_BACKENDS = ("ulysses", "ring")
"""Sequence-parallel attention algorithms: ``ulysses`` (head <-> sequence all-to-all around an
unchanged kernel) and ``ring`` (k/v blocks passed around the SP group, log-sum-exp merge)."""

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "torch_varlen")
"""Core kernels the ``ulysses`` backend runs on the full sequence (``ulysses_sp.attention.KERNELS``)."""


def _field(default: Any, help_text: str) -> Any:
    """A config field whose one-line help the command line shows (``ulysses-sp train --help``)."""
    return dataclasses.field(default=default, metadata={"help": help_text})


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = "a positive number of tokens or None" if allow_none else "a positive integer"
        raise ValueError(f"{name} must be {what}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class UlyssesSPConfig:
    """How to split sequences and which memory features to use.

    Attributes:
        sp_size: ranks that share one sequence (P); must divide the world size. 1 = no SP.
        sp_backend: the sequence-parallel algorithm, one of ``SP_BACKENDS``: ``"ulysses"``
            (head <-> sequence all-to-all, any core kernel) or ``"ring"`` (ring attention: any
            head count, its own block kernels, no softcapping or dropout).
        sp_attn_implementation: core kernel run on the full sequence (``sdpa``, ``eager``,
            ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``); None = the model's own.
        sp_seq_length_is_variable: batches may change length from step to step (always supported;
            kept for Accelerate compatibility: False only documents that they do not).
        tiled_mlp_tokens: run dense and MoE MLPs in sequence tiles of this many tokens (None = untiled).
        tiled_loss_tokens: run lm_head + cross entropy in tiles of this many tokens, never
            materialising the ``(s, V)`` logits (None = untiled).
        offload_activations: move checkpointed hidden states to CPU memory between forward and
            backward (needs activation / gradient checkpointing).
        recompute_norms: RMSNorm modules whose forward is ``LlamaRMSNorm``'s code (Llama, Mistral,
            Qwen2/3, ...) save only their input and recompute what they normalise in a backward run in
            token tiles (``memory.rms_norm``): one ``(B, s, D)`` tensor less per norm held from forward
            to backward (two in half precision), the same output, gradients equal up to rounding.
            Other norms keep their own forward. False = the model's own norms.
        sp_head_chunks: ``ulysses`` only: run each rank's heads in this many chunks inside one
            autograd function that keeps only sharded tensors between forward and backward (the
            chunks' q/k/v/o are exchanged again for the backward), so the full-sequence q/k/v/o
            and their gradients exist for one chunk at a time (also under activation
            checkpointing); 2C + 4C collectives per layer instead of 2 + 2, the next chunk's
            exchange in flight while one computes. At most the heads a rank holds are used.
            1 = no chunking.
        sp_head_chunk_mib: ``ulysses`` only: choose the head chunks per layer call so that one
            chunk's full-sequence tensors take at most this many MiB per rank
            (``comm.cost.chunk_live_bytes``); the larger of that and ``sp_head_chunks`` is
            used. None = off.
        sp_head_blocks: with head chunks on, chunk the whole attention block where the model's
            attention module allows it (``integrations.head_blocks``: its q/k/v projections,
            per-head norms, RoPE and ``o_proj`` run for one chunk of heads at a time, the
            projections recomputed in backward), so neither sharded nor full-length q/k/v of all
            heads exist; False = chunk only the attention call (the sharded q/k/v are saved).
        sp_ring_size: ``ulysses`` only: Ulysses x ring (2-D sequence parallelism), ``sp_size =
            a2a x ring``: the all-to-all runs inside groups of ``sp_size // sp_ring_size``
            consecutive ranks and ring attention runs across the groups (for the heads each rank
            holds after the all-to-all). None = automatic: 1 (plain Ulysses) when the model has at
            least ``sp_size`` query heads, else the smallest ring that brings the all-to-all degree
            down to at most the head count (``auto_ring_size``). Must divide ``sp_size``.

    Raises:
        ValueError: at construction, for a value no entry point could honour.
    """

    sp_size: int = _field(1, "ranks sharing one sequence; 1 = no SP")
    sp_backend: str = _field("ulysses", "sequence-parallel attention: ulysses (all-to-all) or ring")
    sp_attn_implementation: str | None = _field(None, "core kernel under SP (sdpa, eager, flex_attention, "
                                                "flash_attention_2/3, torch_varlen); default: the model's own")
    sp_seq_length_is_variable: bool = _field(True, "batches may change length (always supported)")
    tiled_mlp_tokens: int | None = _field(None, "run MLPs in tiles of this many tokens")
    tiled_loss_tokens: int | None = _field(None, "lm_head + loss in tiles of this many tokens (never the full logits)")
    offload_activations: bool = _field(False, "keep the inputs of checkpointed layers in CPU memory (needs "
                                       "activation checkpointing)")
    recompute_norms: bool = _field(False, "Llama-style RMSNorms save only their input and recompute the rest "
                                   "in a tiled backward (one (B, s, D) tensor less per norm)")
    sp_head_chunks: int = _field(1, "ulysses: heads per rank in this many chunks, so full-length attention "
                                 "tensors exist for one chunk at a time, forward and backward (1 = no chunking)")
    sp_head_chunk_mib: float | None = _field(None, "ulysses: head chunks chosen so one chunk's full-length attention "
                                             "tensors fit this many MiB per rank (default: off)")
    sp_head_blocks: bool = _field(True, "with head chunks: chunk the whole attention block (projections "
                                  "included) where the attention module allows it; False: the attention call only")
    sp_ring_size: int | None = _field(None, "ulysses x ring: ring degree (sp_size = all-to-all degree x ring); "
                                      "default: 1, or the smallest ring the head count needs")

    def __post_init__(self) -> None:
        _positive_int("sp_size", self.sp_size)
        if self.sp_backend not in SP_BACKENDS:
            raise ValueError(f"sp_backend {self.sp_backend!r} is not available; use one of {list(SP_BACKENDS)}.")
        if self.sp_attn_implementation is not None and self.sp_attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"sp_attn_implementation {self.sp_attn_implementation!r} cannot run under Ulysses SP; "
                f"use one of {sorted(ATTN_IMPLEMENTATIONS)} or None for the model's own."
            )
        _positive_int("tiled_mlp_tokens", self.tiled_mlp_tokens, allow_none=True)
        _positive_int("tiled_loss_tokens", self.tiled_loss_tokens, allow_none=True)
        _positive_int("sp_head_chunks", self.sp_head_chunks)
        if self.sp_head_chunks != 1 and self.sp_backend != "ulysses":
            raise ValueError(f"sp_head_chunks={self.sp_head_chunks} applies to sp_backend='ulysses' only; "
                             f"set sp_head_chunks=1 with sp_backend={self.sp_backend!r}.")
        mib = self.sp_head_chunk_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, (int, float)) or not 0 < mib < 1 << 40):
            raise ValueError(f"sp_head_chunk_mib must be a positive number of MiB or None, got {mib!r}.")
        if mib is not None and self.sp_backend != "ulysses":
            raise ValueError(f"sp_head_chunk_mib applies to sp_backend='ulysses' only; leave it None with "
                             f"sp_backend={self.sp_backend!r}.")
        _positive_int("sp_ring_size", self.sp_ring_size, allow_none=True)
        if self.sp_ring_size is not None and self.sp_size % self.sp_ring_size:
            divisors = [d for d in range(1, self.sp_size + 1) if self.sp_size % d == 0]
            raise ValueError(f"sp_ring_size={self.sp_ring_size} does not divide sp_size={self.sp_size}; use a divisor "
                             f"of sp_size ({divisors}) or None.")
        if self.sp_ring_size not in (None, 1) and self.sp_backend != "ulysses":
            raise ValueError(f"sp_ring_size={self.sp_ring_size} applies to sp_backend='ulysses' only (Ulysses x ring); "
                             f"sp_backend={self.sp_backend!r} already is a ring over all sp_size ranks: leave it None.")
        if not isinstance(self.sp_head_blocks, bool):
            raise ValueError(f"sp_head_blocks must be True or False, got {self.sp_head_blocks!r}.")
        if not isinstance(self.offload_activations, bool):
            raise ValueError(f"offload_activations must be True or False, got {self.offload_activations!r}.")
        if not isinstance(self.recompute_norms, bool):
            raise ValueError(f"recompute_norms must be True or False, got {self.recompute_norms!r}.")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> UlyssesSPConfig:
        """Build from a mapping; unknown keys raise a ValueError that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ulysses-sp option(s) {unknown}; known options: {sorted(known)}.")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``from_dict(to_dict())`` round-trips)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> UlyssesSPConfig:
        """A copy with ``changes`` applied (validated like a new object)."""
        return dataclasses.replace(self, **changes)

    @property
    def head_chunk_bytes(self) -> int | None:
        """``sp_head_chunk_mib`` in bytes (None when off)."""
        return None if self.sp_head_chunk_mib is None else max(1, int(self.sp_head_chunk_mib * 2**20))

    def ring_size_for(self, num_heads: int) -> int:
        """The ring degree used for a model with ``num_heads`` query heads (1 = plain Ulysses)."""
        if self.sp_backend != "ulysses":
            return 1
        return self.sp_ring_size if self.sp_ring_size is not None else auto_ring_size(self.sp_size, num_heads)

    def validate(self, world_size: int) -> None:
        """Raise before training if ``sp_size`` cannot split ``world_size`` ranks."""
        check_sp_size(self.sp_size, world_size)

    def build_mesh(self, device_type: str | None = None, timeout_s: float | None = None) -> SPMesh:
        """The ``dp x sp`` mesh over the initialised world (``SPMesh.from_world`` validates it).

        ``timeout_s``: collective timeout of the SP / DP groups (default ``comm.mesh.DEFAULT_TIMEOUT_S``).
        """
        return SPMesh.from_world(self.sp_size, device_type=device_type, timeout_s=timeout_s)


def auto_ring_size(sp_size: int, num_heads: int) -> int:
    """The smallest ring degree ``R`` (a divisor of ``sp_size``) with ``sp_size // R <= num_heads``.

    That is the largest all-to-all degree the heads allow: plain Ulysses (``R = 1``) whenever
    ``sp_size <= num_heads``; e.g. ``sp_size=16, num_heads=6`` gives ``R = 4`` (all-to-all over 4).
    """
    return next(r for r in range(1, sp_size + 1) if sp_size % r == 0 and sp_size // r <= max(num_heads, 1))
