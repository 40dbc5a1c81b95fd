"""Ulysses SP inside TRL's ``SFTTrainer``.

    trainer = UlyssesSFTTrainer(model=model, args=SFTConfig(..., packing=True, max_length=32768),
                                train_dataset=ds, processing_class=tok,
                                sp_config=UlyssesSPConfig(sp_size=4))

Everything of :class:`~ulysses_sp.integrations.trainer.UlyssesTrainerMixin` applies (data split
over DP replicas only, the step's global token count, one-process logging). SFT specifics:

- ``max_length`` is the GLOBAL sequence length: TRL truncates / packs rows to it before the
  collator; each SP rank then holds ``max_length / sp_size`` tokens.
- Packing (BFD) and ``padding_free``: the collator's ``position_ids`` restart at 0 for every
  document; the shard's global mask keeps documents apart (the collator's ``cu_seq_lens`` are not
  needed). Completion-only and assistant-only loss arrive as ``-100`` labels and are simply not
  counted.
- The loss uses TRL's fused LM head (``model(..., shift_labels=..., fused_lm_head=True)``): per-token
  log-probabilities computed in chunks, never the ``(B, s, V)`` logits, so ``tiled_loss_tokens``
  is not needed here and is ignored. ``loss_type="dft"`` works. The ``entropy``,
  ``mean_token_accuracy`` and ``num_tokens`` metrics are summed over the ranks' shards, so they are
  the one-process values.
- The MoE router load-balancing loss (``router_aux_loss_coef`` != 0 on a model with
  ``output_router_logits``) is computed over the whole sequence of the SP group (the model's own
  ``aux_loss`` would cover one shard) with TRL's weighting; ``aux_loss`` is logged as TRL does.
- Not supported under SP (ValueError): ``compute_loss_func``, label smoothing, ``compute_metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from trl import SFTTrainer

from ulysses_sp.comm.collectives import all_reduce_sum
from ulysses_sp.integrations.hf_internals import recording_outputs
from ulysses_sp.integrations.trainer import UlyssesTrainerMixin
from ulysses_sp.integrations.trainer_internals import add_sft_train_tokens, count_input_tokens, sft_metrics
from ulysses_sp.integrations.transformers import UlyssesSP


class UlyssesSFTTrainer(UlyssesTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with Ulysses sequence parallelism (``sp_config=UlyssesSPConfig(...)``)."""

    def _sp_loss(
        self, model: torch.nn.Module, shard: Mapping[str, Any], num_items: torch.Tensor | int, grad_average_world: int
    ) -> torch.Tensor:
        """``-sum(log p(target))`` over my tokens ``/ num_items * grad_average_world``, plus SFT's metrics.

        TRL's fused head scores the pre-shifted ``shift_labels`` of the shard (``(B, s)``) without
        building logits; metric sums go over the world (each token lives on exactly one rank).
        """
        mode = "train" if self.model.training else "eval"
        extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
        recorder = recording_outputs(self.ulysses.base, "router_logits") if self.aux_loss_enabled else nullcontext([])
        with recorder as router:
            out = model(**UlyssesSP.model_inputs(shard), shift_labels=shard["shift_labels"], fused_lm_head=True,
                        **extra)
        per_token = -out.log_probs
        if self.args.loss_type == "dft":
            per_token = per_token * out.log_probs.exp().detach()
        count = torch.as_tensor(num_items, device=per_token.device, dtype=torch.float32).clamp(min=1)
        loss = per_token.sum() / count * grad_average_world
        if self.aux_loss_enabled:  # the fused head's output keeps aux_loss (of this shard) but not the router logits
            outputs = SimpleNamespace(router_logits=tuple(router), aux_loss=out.aux_loss)
            loss = loss + self._sp_aux_loss(outputs, shard, mode)
        sums = torch.stack([out.label_mask.sum(), out.entropy.detach().sum(), out.is_top1.sum()]).float()
        num_valid, entropy, correct = all_reduce_sum(sums).tolist()
        sft_metrics(self)[mode]["entropy"].append(entropy / num_valid if num_valid > 0 else 0.0)
        sft_metrics(self)[mode]["mean_token_accuracy"].append(correct / num_valid if num_valid > 0 else 0.0)
        return loss

    def _sp_aux_loss(self, out: Any, shard: Mapping[str, Any], mode: str) -> torch.Tensor | float:
        """My share of TRL's ``router_aux_loss_coef * aux_loss`` for the WHOLE sequence of the SP group.

        TRL adds ``coef * aux / grad_accum_steps`` (training) or ``coef * aux`` (eval) per
        micro-batch, and DDP averages it over the ranks: so here the shares of the SP group sum to
        the group's aux loss (``UlyssesSP.router_aux_loss``), scaled by ``sp_size`` in training so
        that averaging the gradients over ``dp * sp`` ranks leaves the mean over DP replicas, as with
        one process per replica. Logged ``aux_loss``: the unweighted value, averaged over replicas.
        """
        weighted = self.ulysses.router_aux_loss(out, shard, 1)  # coef * my share of the group's aux
        if not isinstance(weighted, torch.Tensor):
            return 0.0
        coef = float(self.router_aux_loss_coef)
        total = all_reduce_sum(weighted.detach().float().reshape(1)).item()  # sum over dp * sp ranks
        sft_metrics(self)[mode]["aux_loss"].append(total / coef / self.sp_mesh.dp_size)
        if mode == "eval":
            return weighted
        return weighted * self.sp_mesh.sp_size / self.current_gradient_accumulation_steps

    def _track_num_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """Also TRL's ``num_tokens``: non-padding tokens of the GLOBAL batch (padding-free: its length)."""
        count_input_tokens(super(), inputs)
        batch = self.global_batch(inputs)
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        local = mask.sum() if mask is not None else torch.tensor(ids.numel(), device=ids.device)
        total = self.accelerator.gather(local.reshape(1).to(self.args.device)).sum().item()
        add_sft_train_tokens(self, int(total) // self.sp_mesh.sp_size)
