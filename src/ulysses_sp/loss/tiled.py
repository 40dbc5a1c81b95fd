"""lm_head + cross entropy over token tiles: the full logits are never materialised.

Shape legend: B batch, s local shard, T = B*s tokens, t tokens of one tile, D hidden, V vocab.

Same value and gradients as ``sp_token_loss(F.linear(hidden, W, bias), ...)`` (the convention of
:mod:`ulysses_sp.loss.cross_entropy`: ``loss_r = local CE sum / N * W``), computed tile by tile::

    forward  for each tile of t tokens:  z = h_tD @ W_VD^T (+ b)  -> fp32 (t, V)
                                         y = tanh(z / c) * c       (optional softcap)
                                         loss += CE_sum(y, labels) (fp32), z and y dropped
             saved for backward: hidden, W, bias, labels (the inputs only)
    backward for each tile: recompute y, dy = (softmax(y) - onehot) * valid * scale   (fp32)
                            dz = dy * (1 - tanh^2)                     (softcap only)
                            grad_h[tile] = dz @ W,  grad_W += dz^T @ h,  grad_b += dz.sum(0)

Peak extra memory: a few fp32 (t, V) buffers of ONE tile (logits, softmax, and with softcap the
tanh), instead of (T, V) logits in the model dtype plus their fp32 copy plus the fp32 softmax
that the untiled path keeps. Backward also holds grad_hidden (T, D) and, when W needs a gradient
and is not fp32, an fp32 (V, D) accumulator (released on return) so that summing the tiles'
grad_W contributions rounds once, like the untiled matmul.

The price is one extra (T, D) x (D, V) matmul in backward (the recomputed logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses_sp.config import IGNORE_INDEX


def tiled_token_loss(
    hidden_BsD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    shift_labels_Bs: torch.Tensor,
    num_items_in_batch: int | torch.Tensor,
    *,
    grad_average_world: int,
    tile_tokens: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    lm_head_bias: torch.Tensor | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """This rank's share of the global token-mean CE of ``lm_head(hidden)``, tile by tile.

    Args:
        hidden_BsD: ``(B, s, D)`` final hidden states of this rank's tokens (after the final norm).
        lm_head_weight_VD: ``(V, D)`` lm_head weight (may be frozen: ``requires_grad=False``).
        shift_labels_Bs: ``(B, s)`` targets (already shifted), ``ignore_index`` where ignored.
        num_items_in_batch: N, valid tokens of the whole optimizer step (an int or a 0-d tensor;
            a tensor avoids a host sync). 0 is treated as 1.
        grad_average_world: W, ranks the gradient reduction averages over (see
            :func:`ulysses_sp.loss.sp_token_loss`).
        tile_tokens: tokens per tile ``t``; peak extra memory is a few fp32 ``(t, V)`` buffers.
        ignore_index: label value that contributes nothing.
        lm_head_bias: optional ``(V,)`` bias.
        final_logit_softcapping: ``c`` of ``tanh(logits / c) * c`` (Gemma-2 style), applied in fp32.

    Returns:
        A scalar fp32 tensor equal to ``sp_token_loss(F.linear(hidden, W, bias), ...)``. A rank
        without valid tokens returns an exact 0 that is still part of the graph.
    """
    if hidden_BsD.dim() != 3 or hidden_BsD.shape[:2] != shift_labels_Bs.shape:
        raise ValueError(
            f"hidden must be (batch, seq, hidden) and shift_labels (batch, seq) of the same tokens, got "
            f"{tuple(hidden_BsD.shape)} and {tuple(shift_labels_Bs.shape)}; pass the shard's shift_labels."
        )
    if lm_head_weight_VD.dim() != 2 or lm_head_weight_VD.shape[1] != hidden_BsD.shape[-1]:
        raise ValueError(
            f"lm_head weight must be (vocab, hidden={hidden_BsD.shape[-1]}), got {tuple(lm_head_weight_VD.shape)}; "
            "pass model.lm_head.weight."
        )
    if lm_head_bias is not None and lm_head_bias.shape != (lm_head_weight_VD.shape[0],):
        raise ValueError(f"lm_head bias must be (vocab,), got {tuple(lm_head_bias.shape)}.")
    if not isinstance(grad_average_world, int) or grad_average_world < 1:
        raise ValueError(
            f"grad_average_world must be a positive int (DDP / FSDP under SP: dist.get_world_size()), "
            f"got {grad_average_world!r}."
        )
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive int, got {tile_tokens!r}.")
    if final_logit_softcapping is not None and not final_logit_softcapping > 0:
        raise ValueError(f"final_logit_softcapping must be positive or None, got {final_logit_softcapping!r}.")
    if isinstance(num_items_in_batch, torch.Tensor):
        count = num_items_in_batch.detach().to(device=hidden_BsD.device, dtype=torch.float32).clamp_min(1)
    else:
        count = float(max(int(num_items_in_batch), 1))
    return _TiledLinearCrossEntropy.apply(
        hidden_BsD.reshape(-1, hidden_BsD.shape[-1]),
        lm_head_weight_VD,
        lm_head_bias,
        shift_labels_Bs.reshape(-1).to(hidden_BsD.device),
        count,
        grad_average_world,
        tile_tokens,
        ignore_index,
        final_logit_softcapping,
    )


def _tile_logits(h_tD, w_VD, b_V, cap):
    """fp32 ``(t, V)`` logits of one tile (softcapped when ``cap``) and ``tanh(z / c)`` (or None)."""
    logits = F.linear(h_tD, w_VD, b_V).float()
    if cap is None:
        return logits, None
    tanh = logits.div_(cap).tanh_()
    return tanh * cap, tanh


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """CE sum of ``F.linear(h_TD, w_VD, b_V)`` over tiles, scaled by ``world / count``."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, b_V, labels_T, count, world, tile, ignore_index, cap):
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, h_TD.shape[0], tile):
            logits_tV, _ = _tile_logits(h_TD[start:start + tile], w_VD, b_V, cap)
            total += F.cross_entropy(
                logits_tV, labels_T[start:start + tile], ignore_index=ignore_index, reduction="sum"
            )
            del logits_tV
        ctx.count_is_tensor = isinstance(count, torch.Tensor)
        saved_count = (count,) if ctx.count_is_tensor else ()
        ctx.save_for_backward(h_TD, w_VD, b_V, labels_T, *saved_count)
        ctx.count = None if ctx.count_is_tensor else count
        ctx.world, ctx.tile, ctx.ignore_index, ctx.cap = world, tile, ignore_index, cap
        return total / count * world

    @staticmethod
    def backward(ctx, grad_out):
        h_TD, w_VD, b_V, labels_T, *saved_count = ctx.saved_tensors
        count = saved_count[0] if ctx.count_is_tensor else ctx.count
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad_out.float() / count * ctx.world  # d loss / d (CE sum), 0-d fp32
        grad_h = torch.empty_like(h_TD) if need_h else None
        if need_w:
            grad_w = torch.zeros_like(w_VD, dtype=torch.float32)
        grad_b = torch.zeros_like(b_V, dtype=torch.float32) if need_b else None
        if need_h or need_w or need_b:
            for start in range(0, h_TD.shape[0], ctx.tile):
                h_tD = h_TD[start:start + ctx.tile]
                dz_tV = _tile_grad_logits(h_tD, w_VD, b_V, labels_T[start:start + ctx.tile], scale, ctx)
                if need_b:
                    grad_b += dz_tV.sum(0)
                dz_tV = dz_tV.to(h_TD.dtype)
                if need_h:
                    grad_h[start:start + ctx.tile] = dz_tV @ w_VD.to(h_TD.dtype)
                if need_w:
                    grad_w += dz_tV.t() @ h_tD
                del dz_tV
        if need_w:
            grad_w = grad_w.to(w_VD.dtype)
        if need_b:
            grad_b = grad_b.to(b_V.dtype)
        return grad_h, grad_w if need_w else None, grad_b, None, None, None, None, None, None


def _tile_grad_logits(h_tD, w_VD, b_V, labels_t, scale, ctx):
    """fp32 ``(t, V)`` d loss / d (pre-softcap logits) of one tile, recomputed from its inputs."""
    logits_tV, tanh_tV = _tile_logits(h_tD, w_VD, b_V, ctx.cap)
    valid_t = labels_t != ctx.ignore_index
    grad_tV = torch.softmax(logits_tV, dim=-1)
    del logits_tV
    rows = torch.arange(labels_t.shape[0], device=labels_t.device)
    grad_tV[rows, torch.where(valid_t, labels_t, 0)] -= 1
    grad_tV.mul_((valid_t.float() * scale).unsqueeze(1))
    if tanh_tV is not None:
        grad_tV.mul_(tanh_tV.square_().neg_().add_(1))  # d tanh(z/c)*c / dz = 1 - tanh^2
    return grad_tV
