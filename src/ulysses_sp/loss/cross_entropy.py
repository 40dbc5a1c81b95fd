"""Token-mean cross entropy over a batch sharded by sequence (SP) and by replica (DP).

Shape legend: B batch, s local shard, V vocab, W ``grad_average_world``, N global token count.

Convention: every rank returns

    loss_r = (sum of CE over this rank's valid tokens) / N * W

    N = valid tokens of the WHOLE optimizer step: all SP shards, all DP replicas, all
        gradient-accumulation micro-steps (:func:`global_num_items`).
    W = the number of ranks the gradient reduction AVERAGES over. DDP / FSDP average over their
        process group, which under SP is the whole world (dp * sp: SP ranks hold the same
        parameters, and their gradient contributions must be summed, not averaged).

Backward through the exact all-to-alls, then the DP average, gives every rank

    grad = (1/W) * sum_r d(loss_r) = d(sum of all token losses) / N = d(global token mean)

Example, dp=2, sp=2 (world W=4), one micro-step::

    replica 0 (batch A):  rank 0: 3 valid tokens, CE sum 6.0 | rank 1: 1 valid token,  CE sum 2.0
    replica 1 (batch B):  rank 2: 4 valid tokens, CE sum 4.0 | rank 3: 0 valid tokens, CE sum 0
    N = 3+1+4+0 = 8, global mean = (6+2+4+0)/8 = 1.5
    loss_r = 6/8*4 = 3.0 | 2/8*4 = 1.0 | 4/8*4 = 2.0 | 0.0   (rank 3: exact 0, no NaN)
    DP average of d(loss_r) = d(3+1+2+0)/4 = d(1.5)          reported_loss = (3+1+2+0)/4 = 1.5

A loss_r value alone is not the model's loss; log :func:`reported_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ulysses_sp.comm.collectives import all_reduce_sum
from ulysses_sp.config import IGNORE_INDEX


def sp_token_loss(
    logits_BsV: torch.Tensor,
    shift_labels_Bs: torch.Tensor,
    num_items_in_batch: int | torch.Tensor,
    *,
    grad_average_world: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This rank's share of the global token-mean CE: ``local_sum / num_items_in_batch * grad_average_world``.

    Args:
        logits_BsV: ``(B, s, V)`` logits of this rank's tokens (any float dtype; CE runs in fp32).
        shift_labels_Bs: ``(B, s)`` targets from :func:`ulysses_sp.data.shard_batch` (already shifted).
        num_items_in_batch: N, valid tokens of the whole optimizer step (:func:`global_num_items`);
            an int or a scalar tensor (a tensor avoids a host sync). 0 is treated as 1.
        grad_average_world: W, ranks the gradient reduction averages over (DDP / FSDP under SP:
            the world size ``dp * sp``; 1 when no reduction follows).
        ignore_index: label value that contributes nothing.

    Returns:
        A scalar fp32 tensor. A rank without valid tokens returns an exact 0 that is still part of
        the graph (its backward, and the all-to-alls inside it, still run).

    With gradients on, the gradient with respect to the logits is formed in the forward
    (``_TokenCrossEntropy``): the loss step peaks at 2 fp32 ``(T, V)`` buffers (2.5 for bf16
    logits) instead of autograd's 3, at the same speed on CPU. First derivatives only.
    """
    if logits_BsV.dim() != 3 or logits_BsV.shape[:2] != shift_labels_Bs.shape:
        raise ValueError(
            f"logits must be (batch, seq, vocab) and shift_labels (batch, seq) of the same tokens, got "
            f"{tuple(logits_BsV.shape)} and {tuple(shift_labels_Bs.shape)}; pass the shard's shift_labels."
        )
    if not isinstance(grad_average_world, int) or grad_average_world < 1:
        raise ValueError(
            f"grad_average_world must be a positive int (DDP / FSDP under SP: dist.get_world_size()), "
            f"got {grad_average_world!r}."
        )
    logits_TV = logits_BsV.reshape(-1, logits_BsV.shape[-1])
    labels_T = shift_labels_Bs.reshape(-1).to(logits_BsV.device)
    if isinstance(num_items_in_batch, torch.Tensor):
        count = num_items_in_batch.to(device=logits_BsV.device, dtype=torch.float32).clamp_min(1)
    else:
        count = float(max(int(num_items_in_batch), 1))
    if torch.is_grad_enabled() and logits_TV.requires_grad:
        return _TokenCrossEntropy.apply(logits_TV, labels_T, count, grad_average_world, ignore_index)
    local_sum = F.cross_entropy(logits_TV.float(), labels_T, ignore_index=ignore_index, reduction="sum")
    return local_sum / count * grad_average_world


def softmax_cross_entropy(logits_TV: torch.Tensor, labels_T: torch.Tensor,
                          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CE sum over valid tokens, softmax - onehot)`` in fp32 from one softmax pass.

    Shape legend: T tokens, V vocab. ``p = softmax(logits)``; each row's log-sum-exp from its
    largest logit ``m`` as ``m - log(p[argmax])`` (``p[argmax] >= 1/V``: never underflows), the
    CE ``lse - logit[target]``; then ``p`` turns in place into ``softmax - onehot`` with the rows of
    ignored labels zeroed: d(CE sum)/d logits, ``(T, V)`` fp32.
    """
    p_TV = torch.softmax(logits_TV, dim=-1, dtype=torch.float32)
    valid_T = labels_T != ignore_index
    target_T1 = labels_T.masked_fill(~valid_T, 0).unsqueeze(1)
    top_T, top_at_T = logits_TV.max(dim=-1)
    lse_T = top_T.float() - p_TV.gather(1, top_at_T.unsqueeze(1)).squeeze(1).log()
    picked_T = logits_TV.gather(1, target_T1).squeeze(1).float()
    local_sum = (lse_T - picked_T).masked_fill(~valid_T, 0).sum()
    valid_T1 = valid_T.unsqueeze(1).to(p_TV.dtype)
    return local_sum, p_TV.scatter_add_(1, target_T1, -valid_T1).mul_(valid_T1)


class _TokenCrossEntropy(torch.autograd.Function):
    """``CE_sum(logits, labels) / count * world`` with d/dlogits formed during the forward.

    Forward: :func:`softmax_cross_entropy` (the loss and ``softmax - onehot``, saved); backward
    only scales the saved gradient by ``grad_out / count * world``.

    Same values and gradients as ``F.cross_entropy(logits.float(), ..., reduction="sum") / count *
    world`` under autograd (log_softmax backward computes ``g - softmax * sum(g)`` with
    ``g = -onehot * scale``: the same terms) up to fp32 rounding, but it skips autograd's
    zero-filled ``(T, V)`` NLL gradient, the separate log_softmax and its backward pass. The saved
    fp32 ``(T, V)`` buffer replaces the log_softmax output autograd saves. First derivatives only.
    """

    @staticmethod
    def forward(ctx, logits_TV, labels_T, count, world, ignore_index):
        local_sum, grad_TV = softmax_cross_entropy(logits_TV, labels_T, ignore_index)
        ctx.save_for_backward(grad_TV)
        # d loss / d (CE sum) for grad_out = 1: a float, or a 0-d tensor made from N (no graph)
        ctx.scale, ctx.dtype = 1.0 / count * world, logits_TV.dtype
        return local_sum / count * world

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (grad_TV,) = ctx.saved_tensors
        scale = grad_out.float() * ctx.scale
        # written straight in the logits dtype: no fp32 (T, V) product next to the saved buffer
        return torch.mul(grad_TV, scale, out=torch.empty_like(grad_TV, dtype=ctx.dtype)), None, None, None, None


def global_num_items(
    shift_labels_Bs: torch.Tensor | Sequence[torch.Tensor],
    group: ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """N: valid tokens of the given local label shards, summed over ``group`` (one all-reduce).

    Args:
        shift_labels_Bs: this rank's ``(B, s)`` shift labels, or a sequence of them (all
            gradient-accumulation micro-batches of one optimizer step, counted together).
        group: ranks whose tokens make up the step: ``None`` (the world) for dp * sp; the SP
            group alone when there is no data parallelism.
        ignore_index: label value that is not counted.

    Returns:
        A 0-d int64 tensor on ``collective_device(group)`` (CUDA for an NCCL group, else CPU).
    """
    shards = [shift_labels_Bs] if isinstance(shift_labels_Bs, torch.Tensor) else list(shift_labels_Bs)
    if not shards:
        raise ValueError("global_num_items needs at least one shift_labels tensor.")
    count = sum((t != ignore_index).sum() for t in shards).to(torch.int64)
    return all_reduce_sum(count, group)


def reported_loss(loss: torch.Tensor, grad_average_world: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """The global token-mean loss for logging, from each rank's :func:`sp_token_loss` (detached).

    ``sum over group of loss_r / W`` = ``sum of token losses / N``. With ``group`` the world this is
    the mean over the whole step's tokens; with gradient accumulation (N counts every micro-step)
    the values of one step's micro-steps add up to the step's mean. Same value on every rank.
    """
    return all_reduce_sum(loss.detach().float() / grad_average_world, group)
