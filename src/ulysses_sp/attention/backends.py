"""The sequence-parallel backend chosen by ``UlyssesSPConfig.sp_backend``.

Everything above (``UlyssesSP``, the trainers, the bench) picks a backend only through
:func:`build_attention`; a new backend implements ``attention.contract.SPAttention`` and gets a
name in ``config.SP_BACKENDS`` and a branch here.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from ulysses_sp.attention.contract import SPAttention
from ulysses_sp.attention.kernels import Kernel
from ulysses_sp.attention.ring import RingAttention
from ulysses_sp.attention.ulysses import UlyssesAttention
from ulysses_sp.config import SP_BACKENDS


def build_attention(
    backend: str, sp_group: ProcessGroup | None, kernel: str | Kernel = "sdpa", head_chunks: int = 1,
    ring_group: ProcessGroup | None = None, head_chunk_bytes: int | None = None,
) -> SPAttention:
    """The attention of ``backend`` (one of ``SP_BACKENDS``) over ``sp_group`` (``None``: one process).

    ``kernel`` is the core kernel of the ``ulysses`` backend; ``ring`` runs its own block kernels.
    ``head_chunks`` (``UlyssesSPConfig.sp_head_chunks``): the ``ulysses`` backend's head chunks
    (each recomputed in backward) and ``head_chunk_bytes`` (``UlyssesSPConfig.head_chunk_bytes``) its
    byte target for one chunk; the ring has none (1 and None only). ``ring_group``: ``ulysses`` only, Ulysses x
    ring: ``sp_group`` is then this rank's all-to-all group and ``ring_group`` its ring
    (``SPMesh.ulysses_ring_groups``).
    """
    if backend == "ulysses":
        return UlyssesAttention(sp_group, kernel, head_chunks, ring_group, head_chunk_bytes)
    if ring_group is not None:
        raise ValueError(f"ring_group applies to sp_backend='ulysses' (Ulysses x ring) only, got {backend!r}.")
    if backend == "ring":
        if head_chunks != 1 or head_chunk_bytes is not None:
            raise ValueError(f"head_chunks={head_chunks} / head_chunk_bytes={head_chunk_bytes} apply to "
                             "sp_backend='ulysses' only; use 1 / None with 'ring'.")
        return RingAttention(sp_group)
    raise ValueError(f"sp_backend {backend!r} is not available; use one of {list(SP_BACKENDS)}.")
