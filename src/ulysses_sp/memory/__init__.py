"""Activation-memory reductions.

Main entry points:
    apply_tiled_mlp(model, tile_tokens)   every dense ``.mlp`` runs in sequence tiles and is
                                          recomputed in backward; returns how many were wrapped
    remove_tiled_mlp(model)               undo it
    TiledMLP(mlp, tile_tokens)            the module wrapper; TiledMLPFunction the autograd function
"""

from ulysses_sp.memory.tiled_mlp import TiledMLP, TiledMLPFunction, apply_tiled_mlp, remove_tiled_mlp

__all__ = ["TiledMLP", "TiledMLPFunction", "apply_tiled_mlp", "remove_tiled_mlp"]
