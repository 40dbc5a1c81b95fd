"""Activation-memory reductions.

Main entry points:
    apply_tiled_mlp(model, tile_tokens)   every dense ``.mlp`` and every MoE block runs in sequence
                                          tiles and is recomputed in backward; returns how many
    remove_tiled_mlp(model)               undo it
    TiledMLP(mlp, tile_tokens)            the module wrapper; TiledMLPFunction the autograd function
    ActivationOffload(model)              checkpointed layer inputs go to host memory (register())
"""

from ulysses_sp.memory.offload import ActivationOffload, OffloadStats
from ulysses_sp.memory.tiled_mlp import TiledMLP, TiledMLPFunction, apply_tiled_mlp, remove_tiled_mlp

__all__ = ["ActivationOffload", "OffloadStats", "TiledMLP", "TiledMLPFunction", "apply_tiled_mlp", "remove_tiled_mlp"]
