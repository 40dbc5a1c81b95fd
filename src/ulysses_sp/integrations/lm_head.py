"""The tiled lm_head loss: lm_head + cross entropy in token tiles, the ``(B, s, V)`` logits never exist.

    loss, output = tiled_head_loss(model, base, inputs, shift_labels, num_items, world, tile_tokens)

1. for this call, lm_head's ``forward`` becomes one that takes the final hidden states
   ``(B, s, D)`` and returns the tiled loss (shape ``(1, 1, 1)``) instead of logits;
2. the model runs as usual, so lm_head's weight is whatever the wrapper's own hooks made it
   for the module's forward (FSDP2 unshards, ZeRO-3 gathers); it is never read sharded;
3. the returned loss is ``tiled + 0 * model_output``: equal to the tiled loss, and the
   backward passes through the model's output, where the wrappers hook their backward
   (re-gather lm_head, then one gradient reduction, as for untiled logits).

Final logit softcapping (Gemma2), a constant logit multiplier (Cohere, Granite) and an lm_head bias
are applied inside the tiles; any other transform of the logits is refused after the first call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from ulysses_sp.loss import tiled_token_loss
from ulysses_sp.swaps import instance_forward


def tiled_head_loss(
    model: torch.nn.Module, base: PreTrainedModel, inputs: Mapping[str, Any], shift_labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor, grad_average_world: int, tile_tokens: int,
) -> tuple[torch.Tensor, Any]:
    """``(my share of the token-mean loss, the model output)`` of ``model(**inputs)`` with a tiled lm_head.

    ``base``: the ``PreTrainedModel`` inside ``model``'s wrappers (its lm_head is swapped);
    ``shift_labels``: ``(B, s)``, this rank's shifted labels.
    """
    softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
    scale = _logit_multiplier(base)
    head = base.get_output_embeddings()
    losses: list[torch.Tensor] = []

    def tiled_head(hidden_BsD: torch.Tensor) -> torch.Tensor:
        bias = head.bias
        if scale != 1.0:  # the model scales lm_head's output: (W h + b) * c = W (c h) + c b
            hidden_BsD, bias = hidden_BsD * scale, None if bias is None else bias * scale
        losses.append(tiled_token_loss(
            hidden_BsD, head.weight, shift_labels, num_items_in_batch, grad_average_world=grad_average_world,
            tile_tokens=tile_tokens, lm_head_bias=bias, final_logit_softcapping=softcap,
        ))
        return losses[-1].view(1, 1, 1).clone()  # not a view: wrappers hook the output's backward

    with instance_forward(head, tiled_head):  # an instance forward (Accelerate's hooks) comes back after
        output = model(**inputs)
    if len(losses) != 1:
        raise ValueError(
            f"tiled_loss_tokens: {type(base).__name__} called its lm_head {len(losses)} times in one forward; "
            "only causal LMs that apply lm_head once to the final hidden states can tile the loss."
        )
    _check_logit_transform(base, losses[0], output.logits, scale, softcap)
    return losses[0] + output.logits.sum() * 0, output


def _logit_multiplier(base: PreTrainedModel) -> float:
    """The constant the model multiplies lm_head's output by before the loss (1.0: none).

    Cohere / Command-R: ``model.logit_scale``; Granite families: ``1 / config.logits_scaling``.
    The tiled loss must apply it inside its tiles; :func:`_check_logit_transform` catches any
    other transform of the logits after the first tiled forward.
    """
    scale = getattr(base, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    text = base.config.get_text_config()
    if str(getattr(text, "model_type", "")).startswith("granite") and getattr(text, "logits_scaling", None):
        return 1.0 / float(text.logits_scaling)
    return 1.0


def _check_logit_transform(
    base: PreTrainedModel, returned: torch.Tensor, logits: torch.Tensor, scale: float, softcap: float | None
) -> None:
    """Raise if the model transformed lm_head's output other than the tiled loss assumed.

    The tiled head returns the loss ``v`` in place of the logits; the model's own post-processing
    turns it into ``logits``. Expected: ``v * scale``, softcapped when ``final_logit_softcapping``.
    Anything else (another multiplier, an offset, a nonlinearity) is a logit transform the tiles
    did not apply, which would train silently wrong.
    """
    with torch.no_grad():
        expected = returned.detach().float() * scale
        if softcap is not None:
            expected = torch.tanh(expected / softcap) * softcap
        found = logits.detach().float().reshape(-1)
        if found.numel() != 1 or not torch.allclose(found[0], expected, rtol=1e-4, atol=1e-6):
            raise ValueError(
                f"tiled_loss_tokens: {type(base).__name__} transforms lm_head's output before the loss (it returned "
                f"{found.tolist()[:4]} for {float(returned):.6g}, expected {float(expected):.6g}), which the tiled "
                "loss cannot reproduce; unset tiled_loss_tokens for this model."
            )
