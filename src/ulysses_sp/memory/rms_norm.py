"""RMSNorm layers that save only their input, with a backward in token tiles.

Shapes: ``T`` tokens (``B * s`` flattened), ``D`` hidden, ``t`` tokens of one tile.

transformers' ``LlamaRMSNorm`` (and every family whose RMSNorm forward is the same code: Mistral,
Qwen2/3, ...) computes::

    y = weight * (x32 * r).to(x.dtype)        x32 = x.float(), r = rsqrt(mean(x32^2, -1) + eps)  (T, 1)

Under autograd it saves the float32 copy ``x32`` (a new tensor for a half-precision ``x``), ``r`` and the
normalised ``x32 * r`` ``(T, D)`` for the weight's gradient. Here one autograd function runs the same ops
forward (the same output, bit for bit) and saves ``x`` and ``r`` only; its backward, per tile of tokens::

    xn = x32 * r                  g = (dy * weight).to(x.dtype).float()
    dx = r * (g - xn * mean(g * xn, -1))         written into one (T, D) buffer, cast to x's dtype
    d weight += sum over the tile of dy * xn.to(x.dtype)

A norm so holds one ``(T, D)`` tensor less from forward to backward (two in half precision), and its
backward the input gradient plus one tile's temporaries (at most ``TILE_ELEMENTS``, and at most 1/8 of the
tokens) instead of ~three ``(T, D)`` tensors. The
gradients are the module's own up to float rounding (the same sums in another order).

:func:`rms_norm` is the function; ``integrations.norms`` swaps it into a model's modules whose forward is
that code (``UlyssesSPConfig.recompute_norms``); other norms keep their own forward.
"""

from __future__ import annotations

import torch

TILE_ELEMENTS = 1 << 22
"""At most this many elements in one tile's ``(t, D)`` temporaries in backward (16 MiB in float32)."""
MIN_TILES = 8
"""At least this many tiles (where there are as many tokens): a tile's temporaries stay a fraction of the
``(T, D)`` input gradient."""


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, tile_elements: int):
        x32 = x.to(torch.float32)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # the module's ops, in its order
        y = weight * (x32 * r).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        ctx.tile_elements = tile_elements
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        D = x.shape[-1]
        x2, r2, dy2 = x.reshape(-1, D), r.reshape(-1, 1), dy.reshape(-1, D)
        dx = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(D, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        step = max(1, min(ctx.tile_elements // D, -(-x2.shape[0] // MIN_TILES)))
        for a in range(0, x2.shape[0], step):
            xn = x2[a:a + step].to(torch.float32) * r2[a:a + step]
            if dw is not None:
                dw += (dy2[a:a + step] * xn.to(x.dtype)).sum(0, dtype=torch.float32)
            if dx is not None:
                g = (dy2[a:a + step] * weight).to(x.dtype).to(torch.float32)  # autograd's casts
                g -= xn * (g * xn).mean(-1, keepdim=True)
                dx[a:a + step] = (g * r2[a:a + step]).to(x.dtype)
            del xn
        return (None if dx is None else dx.view(x.shape), None if dw is None else dw.to(weight.dtype), None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tile_elements: int = TILE_ELEMENTS) -> torch.Tensor:
    """``LlamaRMSNorm``'s forward on ``x (..., D)`` with ``weight (D,)``, saving only ``x`` and ``r`` (module
    docstring); ``tile_elements`` bounds one backward tile's temporaries (and there are at least
    ``MIN_TILES`` tiles)."""
    return _RMSNorm.apply(x, weight, eps, tile_elements)
