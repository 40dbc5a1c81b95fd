"""RoPE variants that choose their frequencies from the sequence length, fed the GLOBAL length.

transformers' dynamic NTK (``rope_type`` containing ``"dynamic"``) and LongRoPE (``"longrope"``)
rotary embeddings pick their inverse frequencies from ``max(position_ids) + 1`` of each call. Under
SP a rank's call holds only its shard's positions: with LongRoPE's 4K original length and a 32K
sequence on 8 ranks, rank 0 would pick the short factors and the other ranks the long ones, a
different model on each rank and none of them the one-process model (``ulysses-sp check`` on tiny
models: gradients 3e-2 off for Phi-3 LongRoPE, 0.26 for Llama dynamic NTK).

For each such rotary module, two public ``nn.Module`` hooks:

    pre-hook   position_ids (..., s) -> (..., s + 1): one extra position, the largest position id
               of the global batch (``GlobalMask.max_position`` of the model call in progress), and
               the positions of the tokens that pad S to a multiple of P clamped to it, so
               ``max(position_ids) + 1`` is the one-process sequence length on every rank
    hook       each output (..., s + 1, D) -> (..., s, D): the extra position's cos / sin dropped

Every other rotary embedding (default, linear, YaRN, Llama 3, MRoPE ...) depends only on the
positions themselves and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ulysses_sp.attention import GlobalMask


def length_dependent_rope(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose frequencies depend on the call's sequence length."""
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def feed_global_length(model: torch.nn.Module, current_mask: Callable[[], GlobalMask | None]) -> list[Any]:
    """Hook every length-dependent rotary embedding of ``model``; returns the hook handles.

    ``current_mask()``: the ``ulysses_mask`` of the model call in progress (``None`` outside one,
    or for a batch that did not come from ``shard_batch``: the module then runs unchanged).
    """
    handles = []
    for module in model.modules():
        if length_dependent_rope(module):
            pending: list[int] = []  # the shard length s of the call in progress
            handles.append(module.register_forward_pre_hook(_extend(current_mask, pending), with_kwargs=True))
            handles.append(module.register_forward_hook(_trim(pending)))
    return handles


def _extend(current_mask: Callable[[], GlobalMask | None], pending: list[int]) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        mask = current_mask()
        in_args = len(args) > 1
        position_ids = args[1] if in_args else kwargs.get("position_ids")
        if mask is None or mask.max_position is None or position_ids is None:
            return None
        # positions past the batch's own (the tokens that pad S to a multiple of P: masked out of every
        # real token's attention and of the loss) are clamped, so the largest is the one process's
        extra = torch.full_like(position_ids[..., :1], mask.max_position)
        extended = torch.cat([position_ids.clamp(max=mask.max_position), extra], dim=-1)
        pending.append(position_ids.shape[-1])
        if in_args:
            return (args[0], extended, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": extended}

    return hook


def _trim(pending: list[int]) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if not pending:
            return None
        s = pending.pop()

        def trim(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] != s + 1:
                raise ValueError(
                    f"{type(module).__name__} (rope_type {module.rope_type!r}) returned "
                    f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}, not (..., {s + 1}, D) for "
                    f"{s + 1} positions, so UlyssesSP cannot give it the global sequence length; train this model "
                    "with a rope_type that does not depend on the sequence length, or with sp_size=1."
                )
            return t.narrow(-2, 0, s)

        return tuple(trim(t) for t in output) if isinstance(output, tuple) else trim(output)

    return hook
