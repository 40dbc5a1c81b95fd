"""Tile every MLP of a model: dense MLPs with ``TiledMLP``, sparse MoE blocks with ``TiledMoE``.

    apply_tiled_mlp(model, tile_tokens)   wrap each ``.mlp`` attribute; returns how many
    remove_tiled_mlp(model)               put the original modules back

Only attributes of the user's model object are replaced; no model code is edited.
"""

from __future__ import annotations

from torch import nn

from ulysses_sp.memory.tiled_mlp import TiledMLP
from ulysses_sp.memory.tiled_moe import TiledMoE


def _is_tileable(mlp: object) -> bool:
    return isinstance(mlp, nn.Module) and not isinstance(mlp, TiledMLP)


def is_moe_block(mlp: nn.Module) -> bool:
    """A sparse MoE block (has ``experts``): tiled whole, router included, by ``TiledMoE``."""
    return hasattr(mlp, "experts")


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> int:
    """Wrap every submodule's ``.mlp`` so it runs in token tiles; returns how many were wrapped.

    Dense MLPs become ``TiledMLP(mlp, tile_tokens)``; sparse MoE blocks (``.experts``, e.g. Mixtral,
    Qwen2-MoE, Qwen3-MoE) become ``TiledMoE(block, tile_tokens)`` (router logits and the aux
    loss stay exact). Only attributes of the user's model object are replaced; no model code is edited.

    Raises:
        ValueError: ``tile_tokens < 1``, or an MoE block with router jitter noise (checked for all
            blocks before any is wrapped).
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be >= 1, got {tile_tokens}.")
    owners = [m for m in model.modules() if _is_tileable(getattr(m, "mlp", None)) and not isinstance(m, TiledMLP)]
    wrappers = [TiledMoE(o.mlp, tile_tokens) if is_moe_block(o.mlp) else TiledMLP(o.mlp, tile_tokens) for o in owners]
    for owner, wrapper in zip(owners, wrappers):
        owner.mlp = wrapper
    return len(owners)


def remove_tiled_mlp(model: nn.Module) -> int:
    """Undo ``apply_tiled_mlp``: put the original MLP modules back; returns the count."""
    owners = [m for m in model.modules() if isinstance(getattr(m, "mlp", None), TiledMLP)]
    for owner in owners:
        owner.mlp = owner.mlp.mlp
    return len(owners)
