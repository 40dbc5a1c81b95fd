"""The MoE router load-balancing loss of the whole SP group's tokens, as one share per rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from ulysses_sp.attention import GlobalMask
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.loss.router_aux import aux_from_sums, router_sums, sp_router_aux_loss


class RouterAuxLoss:
    """``router_aux_loss_coef`` x this rank's share of the MoE load-balancing loss of the SP group's tokens.

    For MoE models with ``output_router_logits=True`` (0 otherwise): the model's own ``aux_loss``
    would be the loss of this shard's tokens, a different (nonlinear) function; the shares of
    :func:`~ulysses_sp.loss.sp_router_aux_loss` sum to the one-process value. Scaled by
    ``grad_average_world`` as the token loss is, so the gradient average over the world gives
    ``coef * grad(aux)`` (summed over data-parallel replicas, as transformers' Trainer does).
    The first call checks that the model's own aux loss is this formula on the shard (else
    ``ValueError``: a family with another load-balancing rule).
    """

    def __init__(self, base: PreTrainedModel, mesh: SPMesh) -> None:
        self.base, self.mesh = base, mesh
        self.checked = False  # the formula has been compared with the model's own aux loss

    def __call__(self, output: Any, batch: Mapping[str, Any], grad_average_world: int) -> torch.Tensor | float:
        text = self.base.config.get_text_config()
        coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
        logits = getattr(output, "router_logits", None)
        if not coef or not getattr(text, "output_router_logits", False) or not logits:
            return 0.0
        logits = tuple(t.reshape(-1, t.shape[-1]) for t in logits if t is not None)
        top_k = getattr(text, "num_experts_per_tok", None)
        own = getattr(output, "aux_loss", None)
        if not self.checked and isinstance(own, torch.Tensor):
            self._check_formula(logits, top_k, own)
        mask: GlobalMask = batch["ulysses_mask"]
        s = batch["shift_labels"].shape[-1]
        r = self.mesh.sp_rank if self.mesh.sp_size > 1 else 0
        valid = None if mask.valid is None else mask.valid[:, r * s : (r + 1) * s].reshape(-1)
        group = self.mesh.sp_group if self.mesh.sp_size > 1 else None
        return coef * sp_router_aux_loss(logits, top_k, valid, group) * grad_average_world

    def _check_formula(self, logits: tuple[torch.Tensor, ...], top_k: int | None, own: torch.Tensor) -> None:
        """``ValueError`` unless the model's own aux loss is the Switch formula on this shard's router logits."""
        with torch.no_grad():
            local = aux_from_sums(*router_sums(logits, top_k or 0, None)) if top_k else None
        if local is None or not torch.allclose(local, own.detach().float(), rtol=1e-4, atol=1e-6):
            raise ValueError(
                f"{type(self.base).__name__}'s router aux loss is not the Switch-style load-balancing loss "
                "UlyssesSP computes over the whole sequence (E * sum(top-k fraction * mean router probability) "
                f"with top_k = config.num_experts_per_tok = {top_k}); set config.output_router_logits = False "
                "or router_aux_loss_coef = 0 to train it sequence-parallel."
            )
        self.checked = True
