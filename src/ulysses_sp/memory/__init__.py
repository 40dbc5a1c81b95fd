"""Activation-memory reductions and the peak-memory estimator.

Main entry points:
    apply_tiled_mlp(model, tile_tokens)   every dense ``.mlp`` and every MoE block runs in sequence
                                          tiles and is recomputed in backward; returns how many
    remove_tiled_mlp(model)               undo it
    TiledMLP(mlp, tile_tokens)            the module wrapper; TiledMLPFunction / TiledTokensFunction
                                          the autograd functions (one engine: recompute per tile)
    TiledMoE(block, tile_tokens)          the MoE-block wrapper (router logits kept exact)
    ActivationOffload(model)              checkpointed layer inputs go to host memory (register())
    memory_mark(device) / memory_peak(device)
                                          a peak measurement around some code (measure.py)
    estimate_peak_memory(config, seq_len, sp_size, dtype, MemoryFeatures(...))
                                          predicted peak memory per rank, term by term (estimate.py)
"""

from ulysses_sp.memory.estimate import (
    MemoryBreakdown,
    MemoryFeatures,
    ModelDims,
    estimate_peak_memory,
    longest_sequence,
)
from ulysses_sp.memory.measure import memory_mark, memory_peak, process_status_bytes
from ulysses_sp.memory.offload import ActivationOffload, OffloadStats
from ulysses_sp.memory.tiled_mlp import TiledMLP, TiledMLPFunction, TiledTokensFunction
from ulysses_sp.memory.tiled_moe import TiledMoE
from ulysses_sp.memory.tiling import apply_tiled_mlp, remove_tiled_mlp

__all__ = [
    "ActivationOffload", "MemoryBreakdown", "MemoryFeatures", "ModelDims", "OffloadStats", "TiledMLP",
    "TiledMLPFunction", "TiledMoE", "TiledTokensFunction", "apply_tiled_mlp", "estimate_peak_memory",
    "longest_sequence", "memory_mark", "memory_peak", "process_status_bytes", "remove_tiled_mlp",
]
