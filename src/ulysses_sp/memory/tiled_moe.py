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
   gradient-less tensor per tile. While tiles run, the router's forward hooks are held back and a
   capture hook is the only one; afterwards the original hooks are called once with the
   concatenated logits::

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ulysses_sp.memory.tiled_mlp import TiledMLP, TiledTokensFunction, grad_params
from ulysses_sp.torch_internals import call_forward_hooks, forward_hooks_held_back


def _per_token(extra: Any, t: int, block: str) -> tuple[torch.Tensor, bool]:
    """A further block output as ``(t, ...)`` rows of the tile's tokens, and whether the block gave
    it with a batch dimension ``(1, t, ...)`` (else ``ValueError``)."""
    if isinstance(extra, torch.Tensor) and extra.dim() >= 2 and extra.shape[:2] == (1, t):
        return extra.reshape(t, *extra.shape[2:]), True
    if isinstance(extra, torch.Tensor) and extra.dim() >= 1 and extra.shape[0] == t:
        return extra, False
    raise ValueError(
        f"tiled MoE: {block} returns {type(extra).__name__} "
        f"{tuple(extra.shape) if isinstance(extra, torch.Tensor) else ''} besides its hidden states, not one row per "
        "token, so it cannot be tiled; do not tile the MLPs of this model (tiled_mlp_tokens=None)."
    )


@contextmanager
def _only_hook(module: nn.Module, hook: Callable) -> Iterator[None]:
    """Run ``module`` with ``hook`` as its only forward hook: its own hooks are held back (they run
    once, on all tokens, in :meth:`TiledMoE._emit_router_hooks`); ``hook`` is registered and removed
    through the public hook API."""
    with forward_hooks_held_back(module):
        handle = module.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


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
        # the block's output form, seen at its first tile: a tuple?, and per further output whether it
        # carries a batch dimension (B, s, ...) or is flat over tokens (B * s, ...)
        self._returns_tuple = False
        self._extra_batched: tuple[bool, ...] = ()

    @property
    def router(self) -> nn.Module | None:
        """The block's router (looked up, not registered: a second path to it would duplicate its
        state_dict keys and hooks)."""
        return router_of(self.mlp)

    def forward(self, x_BsD: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        B, s, D = x_BsD.shape
        x_TD, params = grad_params(self.mlp, x_BsD.reshape(B * s, D))
        tile = max(1, B * self.tile_tokens)
        outs = TiledTokensFunction.apply(self._tile_fn, x_TD, tile, 0, *params)
        extras = tuple(e.view(B, s, *e.shape[1:]) if batched else e
                       for e, batched in zip(outs[1 : 1 + len(self._extra_batched)], self._extra_batched))
        y_BsD = outs[0].view(B, s, D)
        if self.router is not None:
            self._emit_router_hooks(x_TD, outs[-1])
        return (y_BsD, *extras) if self._returns_tuple else y_BsD

    def _tile_fn(self, x_tD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The block on one tile (as a batch of one sequence): ``(y_tD, *extras, [logits_tE])``.

        ``extras``: the block's further per-token outputs when it returns a tuple (GPT-OSS returns
        ``(hidden, router_scores (t, E))``), concatenated over tiles like ``y``; ``logits_tE`` the
        router output captured at the router (its hooks run once, on all tokens, in forward).
        """
        captured: list[torch.Tensor] = []

        def capture(module: nn.Module, args: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        with _only_hook(self.router, capture) if self.router is not None else nullcontext():
            out = self.mlp(x_tD.unsqueeze(0))
        self._returns_tuple = isinstance(out, tuple)
        y, extras = (out[0], out[1:]) if self._returns_tuple else (out, ())
        t = x_tD.shape[0]
        per_token = [_per_token(e, t, type(self.mlp).__name__) for e in extras]
        extras = tuple(e for e, _ in per_token)
        self._extra_batched = tuple(batched for _, batched in per_token)
        if self.router is None:
            return (y.reshape(x_tD.shape), *extras)
        if len(captured) != 1:
            raise ValueError(
                f"tiled MoE: the router of {type(self.mlp).__name__} ran {len(captured)} times per block call; "
                "only blocks that route once (Mixtral / Qwen-MoE style) can be tiled."
            )
        return (y.reshape(x_tD.shape), *extras, captured[0].reshape(t, -1))

    def _emit_router_hooks(self, x_TD: torch.Tensor, logits_TE: torch.Tensor) -> None:
        """Call the router's forward hooks once, as the untiled block would (output index 0 = logits)."""
        call_forward_hooks(self.router, (x_TD,), (logits_TE,))

