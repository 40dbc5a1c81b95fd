"""lm_head + cross entropy over token tiles: the full logits are never materialised.

Shape legend: B batch, s local shard, T = B*s tokens, t tokens of one tile, D hidden, V vocab.

Same value and gradients as ``sp_token_loss(F.linear(hidden, W, bias), ...)`` (the convention of
:mod:`ulysses_sp.loss.cross_entropy`: ``loss_r = local CE sum / N * W``), computed tile by tile,
the gradients formed while each tile's logits exist (no recomputation)::

    forward  for each tile of t tokens:  z = h_tD @ W_VD^T (+ b)  -> fp32 (t, V)
                                         y = tanh(z / c) * c       (optional softcap)
                                         loss += CE_sum(y, labels), dy = softmax(y) - onehot
                                                 (one softmax pass, ignored rows zero; fp32)
                                         dz = dy * scale (* (1 - tanh^2) with softcap)
                                         grad_h[tile] = dz @ W, grad_W += dz^T @ h, grad_b += dz.sum(0)
             saved for backward: grad_h (T, D), grad_W (V, D), grad_b (the inputs are not kept)
    backward multiply the saved gradients by grad_out

``scale = W / N``. Peak extra memory: a few fp32 (t, V) buffers of ONE tile, instead of (T, V)
logits in the model dtype plus their fp32 copy plus the fp32 softmax that the untiled path keeps;
plus grad_hidden (T, D) (held instead of the hidden states themselves) and, when W needs a
gradient, an fp32 (V, D) accumulator during the forward (kept in W's dtype until backward), so
that summing the tiles' grad_W contributions rounds once, like the untiled matmul. Against
recomputing the logits in backward this saves one (T, D) x (D, V) matmul and one softmax pass
per tile; a forward under ``torch.no_grad()`` (evaluation) computes the loss alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses_sp.config import IGNORE_INDEX
from ulysses_sp.loss.cross_entropy import softmax_cross_entropy


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
    grads_wanted = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_BsD, lm_head_weight_VD, lm_head_bias))
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
        grads_wanted,
    )


def _tile_logits(h_tD, w_VD, b_V, cap):
    """fp32 ``(t, V)`` logits of one tile (softcapped when ``cap``) and ``tanh(z / c)`` (or None)."""
    logits = F.linear(h_tD, w_VD, b_V).float()
    if cap is None:
        return logits, None
    tanh = logits.div_(cap).tanh_()
    return tanh * cap, tanh


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """CE sum of ``F.linear(h_TD, w_VD, b_V)`` over tiles, scaled by ``world / count``.

    With gradients wanted, each tile's gradients are formed while its logits exist (forward):
    ``dz = (softmax - onehot) * world / count`` (times ``1 - tanh^2`` with a softcap), then
    ``grad_h[tile] = dz @ W``, ``grad_W += dz^T @ h``, ``grad_b += dz.sum(0)``; backward only
    multiplies them by ``grad_out``. Without, the tiles give the loss alone.
    """

    @staticmethod
    def forward(ctx, h_TD, w_VD, b_V, labels_T, count, world, tile, ignore_index, cap, grads_wanted):
        need_h, need_w, need_b = (grads_wanted and need for need in ctx.needs_input_grad[:3])
        scale = 1.0 / count * world  # d loss / d (CE sum) for grad_out = 1 (a 0-d tensor or a float)
        grad_h = torch.empty_like(h_TD) if need_h else None
        grad_w = torch.zeros_like(w_VD, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(b_V, dtype=torch.float32) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        for start in range(0, h_TD.shape[0], tile):
            h_tD, labels_t = h_TD[start:start + tile], labels_T[start:start + tile]
            logits_tV, tanh_tV = _tile_logits(h_tD, w_VD, b_V, cap)
            if not (need_h or need_w or need_b):
                total += F.cross_entropy(logits_tV, labels_t, ignore_index=ignore_index, reduction="sum")
                continue
            ce, dz_tV = softmax_cross_entropy(logits_tV, labels_t, ignore_index)
            total += ce
            del logits_tV
            dz_tV.mul_(scale)
            if tanh_tV is not None:
                dz_tV.mul_(tanh_tV.square_().neg_().add_(1))  # d tanh(z/c)*c / dz = 1 - tanh^2
            if need_b:
                grad_b += dz_tV.sum(0)
            dz_tV = dz_tV.to(h_TD.dtype)
            if need_h:
                grad_h[start:start + tile] = dz_tV @ w_VD.to(h_TD.dtype)
            if need_w:
                grad_w += dz_tV.t() @ h_tD
            del dz_tV
        ctx.save_for_backward(grad_h, grad_w.to(w_VD.dtype) if need_w else None,
                              grad_b.to(b_V.dtype) if need_b else None)
        return total / count * world

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # grad_out is a 0-d fp32 tensor: each product is computed in fp32 and rounded once
        grads = [None if g is None else g * grad_out for g in ctx.saved_tensors]
        return *grads, None, None, None, None, None, None, None
