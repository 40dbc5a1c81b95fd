"""Tiled MoE block: a whole sparse MoE block (router + experts) runs over token tiles.

Shapes: ``B`` batch, ``s`` local sequence, ``T = B*s`` tokens, ``t`` tokens of one tile, ``D``
hidden, ``E`` experts.

A sparse MoE block (Mixtral / Qwen2-MoE / Qwen3-MoE in Transformers 5) is token-wise: each token
is routed on its own (no capacity limit), so it can run on token tiles exactly like a dense MLP.
Two things differ from :class:`~ulysses_sp.memory.TiledMLP`:

1. The router logits ``(T, E)`` are an output too: Transformers records them with a forward
   hook on the router (``gate``) module when ``output_router_logits=True`` and builds the
   load-balancing aux loss from them, so they need their gradient. The tiled function therefore
   returns ``(y_TD, router_logits_TE)`` and its backward takes both incoming gradients.
2. The router's own forward hooks must see ONE ``(T, E)`` tensor with a grad path, not one
   gradient-less tensor per tile. While tiles run, the router's forward hooks are replaced by a
   capture hook; afterwards the original hooks are called once with the concatenated logits::

    x_BsD -> x_TD --tiles of t rows--> block(x_1tD) (no grad)  -> y_tD, r_tE (captured at gate)
          cat: y_TD, r_TE = TiledTokensFunction(...)   save x_TD only
          router hooks(gate, (x_TD,), (r_TE,))     # what the untiled block would have recorded
    backward per tile: recompute block(x_1tD) with grad -> autograd.grad([y_tD, r_tE], [x_tD, *params], [dy, dr])

Tokens are flattened in ``(B, s)`` order (the order of the router input in the untiled block), so
the router logits are row-for-row those of the untiled block. Parameter gradients are summed over
tiles and returned once (DDP / FSDP / ZeRO hooks fire once); tile counts are local, no
collectives. Router jitter noise (random) cannot be recomputed and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ulysses_sp.memory.tiled_mlp import TiledMLP


class TiledTokensFunction(torch.autograd.Function):
    """``apply(fn, x_TD, tile, *params) -> tuple of outputs``, each ``(T, ...)``, tiled over rows.

    ``fn(x_tD)`` returns a tuple of tensors whose first dim is ``t``; outputs are concatenated
    along dim 0. Backward recomputes each tile and skips outputs that received no gradient.
    """

    @staticmethod
    def forward(ctx, fn: Callable, x_TD: torch.Tensor, tile: int, *params: torch.Tensor):
        ctx.fn, ctx.tile = fn, tile
        ctx.set_materialize_grads(False)
        device_type = x_TD.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(x_TD, *params)
        with torch.no_grad():
            tiles = [fn(x_tD) for x_tD in x_TD.split(tile)]
        return tuple(torch.cat(parts) for parts in zip(*tiles))

    @staticmethod
    def backward(ctx, *grads_out: torch.Tensor | None):
        x_TD, *params = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[1]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        param_grads: list[torch.Tensor | None] = [None] * len(wanted)
        dx_tiles = []
        device_type, autocast_on, autocast_dtype = ctx.autocast
        for i, x_tile in enumerate(x_TD.split(ctx.tile)):
            rows = slice(i * ctx.tile, i * ctx.tile + x_tile.shape[0])
            x_tD = x_tile.detach().requires_grad_(need_dx)
            with torch.enable_grad(), torch.autocast(device_type, enabled=autocast_on, dtype=autocast_dtype):
                outs = ctx.fn(x_tD)
            pairs = [(o, g[rows]) for o, g in zip(outs, grads_out) if g is not None and o.requires_grad]
            inputs = ([x_tD] if need_dx else []) + wanted
            if pairs:
                grads = list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
            else:
                grads = [None] * len(inputs)
            if need_dx:
                dx = grads.pop(0)
                dx_tiles.append(torch.zeros_like(x_tD) if dx is None else dx)
            for j, g in enumerate(grads):
                if g is not None:
                    param_grads[j] = g if param_grads[j] is None else param_grads[j] + g
            del outs, pairs, grads  # free this tile's recomputed graph before the next tile
        dx_TD = torch.cat(dx_tiles) if need_dx else None
        it = iter(param_grads)
        return (None, dx_TD, None, *[next(it) if need else None for need in ctx.needs_input_grad[3:]])


@contextmanager
def _forward_hooks_replaced(module: nn.Module, hook: Callable) -> Any:
    """Run ``module`` with ``hook`` as its only forward hook (the original hooks are kept aside)."""
    saved = module._forward_hooks
    module._forward_hooks = {-1: hook}
    try:
        yield saved
    finally:
        module._forward_hooks = saved


def router_of(block: nn.Module) -> nn.Module | None:
    """The router module of an MoE block (``gate`` in Mixtral / Qwen-MoE, ``router`` elsewhere)."""
    for name in ("gate", "router"):
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


class TiledMoE(TiledMLP):
    """Wraps a sparse MoE block so it runs on tiles of ``B * tile_tokens`` flattened tokens.

    Same tokens per tile as :class:`TiledMLP` with ``(B, tile_tokens)`` tiles; ``state_dict`` keys
    are those of the unwrapped block.

    Raises:
        ValueError: if the block adds router jitter noise (random, so the recompute would differ).
    """

    def __init__(self, block: nn.Module, tile_tokens: int):
        if getattr(block, "jitter_noise", 0) or getattr(block, "router_jitter_noise", 0):
            raise ValueError(
                f"{type(block).__name__} adds random router jitter noise, which the tiled backward cannot "
                "recompute; set config.router_jitter_noise = 0 or do not tile the MLPs of this model."
            )
        super().__init__(block, tile_tokens)

    @property
    def router(self) -> nn.Module | None:
        """The block's router (looked up, not registered: a second path to it would duplicate its
        state_dict keys and hooks)."""
        return router_of(self.mlp)

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor:
        B, s, D = x_BsD.shape
        x_TD = x_BsD.reshape(B * s, D)
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        tile = max(1, B * self.tile_tokens)
        if self.router is None:
            (y_TD,) = TiledTokensFunction.apply(self._tile_fn, x_TD, tile, *params)
            return y_TD.view(B, s, D)
        y_TD, logits_TE = TiledTokensFunction.apply(self._tile_fn, x_TD, tile, *params)
        self._emit_router_hooks(x_TD, logits_TE)
        return y_TD.view(B, s, D)

    def _tile_fn(self, x_tD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The block on one tile (as a batch of one sequence): ``(y_tD,)`` or ``(y_tD, logits_tE)``."""
        if self.router is None:
            return (self.mlp(x_tD.unsqueeze(0)).reshape(x_tD.shape),)
        captured: list[torch.Tensor] = []

        def capture(module: nn.Module, args: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        with _forward_hooks_replaced(self.router, capture):
            y_tD = self.mlp(x_tD.unsqueeze(0)).reshape(x_tD.shape)
        if len(captured) != 1:
            raise ValueError(
                f"tiled MoE: the router of {type(self.mlp).__name__} ran {len(captured)} times per block call; "
                "only blocks that route once (Mixtral / Qwen-MoE style) can be tiled."
            )
        return y_tD, captured[0].reshape(x_tD.shape[0], -1)

    def _emit_router_hooks(self, x_TD: torch.Tensor, logits_TE: torch.Tensor) -> None:
        """Call the router's forward hooks once, as the untiled block would (output index 0 = logits)."""
        with_kwargs = self.router._forward_hooks_with_kwargs
        for hook_id, hook in list(self.router._forward_hooks.items()):
            if with_kwargs.get(hook_id, False):
                hook(self.router, (x_TD,), {}, (logits_TE,))
            else:
                hook(self.router, (x_TD,), (logits_TE,))

