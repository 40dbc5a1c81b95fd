"""The MoE router load-balancing loss (Switch Transformer, as transformers computes it) under SP.

Shape legend: L MoE layers, T = B*s this rank's tokens, E experts, k experts per token.

transformers' ``load_balancing_loss_func`` over the router logits of all layers, with the
padding mask ``m`` (1 = real token)::

    p    = softmax(logits)                        (L*T, E)
    c_e  = sum over tokens and layers of m * [e in top-k(p)]    (a count: no gradient)
    q_e  = sum over tokens and layers of m * p_e
    n    = sum of m over tokens and layers
    aux  = E * sum_e (c_e / n) * (q_e / n)

Under SP each rank holds T of the tokens, so the model's own ``aux_loss`` is the formula over the
shard: a different, nonlinear function. Every term above is a sum over tokens, so:

    1. c, n: all-reduced over the SP group (no gradient)
    2. this rank's share: E * sum_e (c_e / n) * (q_e(mine) / n), differentiable through p

The shares sum over the group to the one-process ``aux`` exactly, and their gradients to its
gradient (c and n carry none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def router_sums(
    router_logits: tuple[torch.Tensor, ...], top_k: int, valid_T: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(c (E,), q (E,), n ())`` of this rank's tokens (see the module docstring); ``q`` has a gradient.

    Args:
        router_logits: one ``(T, E)`` tensor per MoE layer, tokens in ``(B, s)`` order.
        top_k: experts per token.
        valid_T: ``(T,)`` bool or float, 1 for tokens that count (``None``: all).
    """
    E = router_logits[0].shape[-1]
    device = router_logits[0].device
    count, prob, num = torch.zeros(E, device=device), torch.zeros(E, device=device), torch.zeros((), device=device)
    for logits_TE in router_logits:
        p_TE = torch.softmax(logits_TE.to(device).float(), dim=-1)
        m_T = torch.ones(p_TE.shape[0], device=device) if valid_T is None else valid_T.to(device, torch.float32)
        chosen_Tk = torch.topk(p_TE.detach(), top_k, dim=-1).indices
        chosen = torch.zeros(E, device=device).scatter_add_(0, chosen_Tk.reshape(-1), m_T.repeat_interleave(top_k))
        count = count + chosen
        prob = prob + (p_TE * m_T[:, None]).sum(dim=0)
        num = num + m_T.sum()
    return count, prob, num


def aux_from_sums(count: torch.Tensor, prob: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """``E * sum_e (c_e / n) * (q_e / n)``; 0 when no token counts."""
    n = num.clamp_min(1.0)
    return count.numel() * torch.sum((count / n) * (prob / n))


def sp_router_aux_loss(
    router_logits: tuple[torch.Tensor, ...], top_k: int, valid_T: torch.Tensor | None, group: ProcessGroup | None
) -> torch.Tensor:
    """This rank's share of the group's load-balancing loss: the shares sum to the one-process value.

    Returns a scalar with a gradient through this rank's router logits. One all-reduce of
    ``E + 1`` numbers (``group`` ``None`` or of size 1: the local formula).
    """
    count, prob, num = router_sums(router_logits, top_k, valid_T)
    if group is not None and dist.get_world_size(group) > 1:
        totals = torch.cat([count, num.view(1)])
        dist.all_reduce(totals, group=group)
        count, num = totals[:-1], totals[-1]
    return aux_from_sums(count, prob, num)
