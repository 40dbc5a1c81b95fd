"""Activation-memory reductions.

Main entry points:
    apply_tiled_mlp(model, tile_tokens)   every dense ``.mlp`` and every MoE block runs in sequence
                                          tiles and is recomputed in backward; returns how many
    remove_tiled_mlp(model)               undo it
    TiledMLP(mlp, tile_tokens)            the module wrapper; TiledTokensFunction the autograd function
    TiledMoE(block, tile_tokens)          the MoE-block wrapper (router logits kept exact)
    ActivationOffload(model)              checkpointed layer inputs go to host memory (register())
    model.estimate_peak_memory(config, seq_len, sp_size, dtype, MemoryFeatures(...))
                                          predicted peak memory per rank, term by term
"""

from ulysses_sp.memory.offload import ActivationOffload, OffloadStats
from ulysses_sp.memory.tiled_mlp import (
    TiledMLP, TiledMLPFunction, TiledTokensFunction, apply_tiled_mlp, remove_tiled_mlp,
)
from ulysses_sp.memory.tiled_moe import TiledMoE

__all__ = [
    "ActivationOffload", "OffloadStats", "TiledMLP", "TiledMLPFunction", "TiledMoE", "TiledTokensFunction",
    "apply_tiled_mlp", "remove_tiled_mlp",
]
