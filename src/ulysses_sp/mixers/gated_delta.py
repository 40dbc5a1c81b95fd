"""Sequence-parallel forward of a gated delta net (Qwen3-Next, Qwen3.5 ``linear_attention`` layers).

Shape legend
    B batch, S global sequence, s local shard (S / P), P SP size, D hidden,
    V value heads, n value heads of this rank, K key heads, k key heads this rank needs,
    Hk key head dim, Hv value head dim, C conv channels of this rank (2*k*Hk + n*Hv).

The layer is ``in_proj -> causal depthwise conv (W taps) -> gated delta rule -> gated RMSNorm ->
out_proj``. Only the conv and the delta-rule recurrence mix tokens, and both are per channel / per
head: value head v reads key head ``v // (V/K)`` exactly as a query head reads its kv head. So the
same head all-to-all as attention makes them exact::

    x (B,s,D) -- in_proj (local) --> q,k (B,s,K,Hk)  v (B,s,V,Hv)  z (B,s,V,Hv)  b,a (B,s,V)
       |  ONE all-to-all: [v|b|a] by value heads (HeadPlan(V, K, P).q_ranges),
       |                  [q|k]   by key heads   (kv_ranges: a key head goes to every rank reading it)
       v
    q,k (B,S,k,Hk)  v (B,S,n,Hv)  beta, g (B,S,n)        all tokens, my heads
       |  conv over my channels only (the model's causal_conv1d_fn, weight rows sliced),
       |  q,k repeated to my value heads, the model's chunk_gated_delta_rule, per document
       v
    o (B,S,n,Hv) --all-to-all--> o (B,s,V,Hv) -- norm(o, z), out_proj (local) --> (B,s,D)

Why not pass states between ranks instead: the conv needs the W-1 previous tokens and the delta
rule a (Hk x Hv) state per head from the previous rank, which serialises the P ranks (rank r waits
for r-1's full scan) or needs a second correction pass; the all-to-all keeps the model's own kernel
on the whole sequence (bit-for-bit the same chunking), costs two collectives like attention, and
reuses HeadPlan's uneven splits (``V % P != 0``) and key-head duplication (``K < P``).

Parameters are used through the module (``conv1d.weight`` rows, ``A_log`` / ``dt_bias`` entries of
my heads), so ``state_dict`` keys do not change and DDP's gradient average is the full gradient.
Padding tokens are zeroed before the projections (the model's ``apply_mask_to_padding_states``),
so right or left padding leaves real tokens as without it. Packed documents restart the conv and
the state at each document start (``sequence.by_document``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.comm.all_to_all import head_to_seq_out
from ulysses_sp.comm.layout import HeadPlan
from ulysses_sp.mixers.exchange import seq_to_head_parts
from ulysses_sp.mixers.sequence import (
    MixerContext,
    by_document,
    depthwise_causal_conv,
    document_cuts,
    runs_own_forward,
    split_heads,
    zero_padding,
)

GATED_DELTA_CLASSES = frozenset({"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})


def head_plan(module: torch.nn.Module, sp_size: int) -> HeadPlan:
    """Value heads split like query heads, key heads like kv heads."""
    return split_heads(module, sp_size, module.num_v_heads, module.num_k_heads, "value heads")


def _project(module: torch.nn.Module, x_BsD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Local projections -> ``q, k (B,s,K,Hk)``, ``v, z (B,s,V,Hv)``, ``b, a (B,s,V)``."""
    B, s, _ = x_BsD.shape
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused, grouped by key head
        return module.fix_query_key_value_ordering(module.in_proj_qkvz(x_BsD), module.in_proj_ba(x_BsD))
    qkv = module.in_proj_qkv(x_BsD)  # Qwen3.5: [q | k | v] channels
    q, k, v = qkv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    Hk, Hv = module.head_k_dim, module.head_v_dim
    return (q.view(B, s, -1, Hk), k.view(B, s, -1, Hk), v.view(B, s, -1, Hv),
            module.in_proj_z(x_BsD).view(B, s, -1, Hv), module.in_proj_b(x_BsD), module.in_proj_a(x_BsD))


def _conv_channels(module: torch.nn.Module, plan: HeadPlan, rank: int) -> torch.Tensor:
    """The conv channels of my heads, in the order [q of my key heads | k of them | v of my value heads]."""
    (qa, qb), (ka, kb) = plan.q_ranges[rank], plan.kv_ranges[rank]
    Hk, Hv, key_dim = module.head_k_dim, module.head_v_dim, module.key_dim
    keys = torch.arange(ka * Hk, kb * Hk)
    return torch.cat([keys, key_dim + keys, 2 * key_dim + torch.arange(qa * Hv, qb * Hv)])


def gated_delta_forward(
    module: torch.nn.Module, ctx: MixerContext, hidden_states: torch.Tensor, cache: Any = None,
    attention_mask: torch.Tensor | None = None, ulysses_mask: GlobalMask | None = None, **kwargs: Any,
) -> torch.Tensor:
    """The layer's forward on my shard ``(B, s, D) -> (B, s, D)`` (see the module docstring)."""
    if runs_own_forward(module, ctx, ulysses_mask, cache, "linear-attention"):
        return type(module).forward(module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    kernels = sys.modules[type(module).__module__]  # the model's own kernels (hub kernel or torch fallback)
    B, s, _ = hidden_states.shape
    plan, rank = head_plan(module, ctx.size), ctx.rank
    (qa, qb), _ = plan.q_ranges[rank], plan.kv_ranges[rank]
    Hk, Hv = module.head_k_dim, module.head_v_dim

    x_BsD = zero_padding(hidden_states, ctx.local_valid(ulysses_mask, s))
    q_BsKH, k_BsKH, v_BsVH, z_BsVH, b_BsV, a_BsV = _project(module, x_BsD)
    vba_BsVF = torch.cat([v_BsVH, b_BsV[..., None], a_BsV[..., None]], dim=-1)
    qk_BsKF = torch.cat([q_BsKH, k_BsKH], dim=-1)
    vba_BSnF, qk_BSkF = seq_to_head_parts((vba_BsVF, qk_BsKF), (plan.q_ranges, plan.kv_ranges), ctx.group)

    S = vba_BSnF.shape[1]
    q_BSC, k_BSC, v_BSC = qk_BSkF[..., :Hk].flatten(2), qk_BSkF[..., Hk:].flatten(2), vba_BSnF[..., :Hv].flatten(2)
    mixed_BSC = torch.cat([q_BSC, k_BSC, v_BSC], dim=-1)
    beta_BSn = vba_BSnF[..., Hv].sigmoid()
    g_BSn = -module.A_log[qa:qb].float().exp() * F.softplus(vba_BSnF[..., Hv + 1].float() + module.dt_bias[qa:qb])
    channels = _conv_channels(module, plan, rank).to(mixed_BSC.device)
    kv_index = plan.local_kv_index(rank).to(mixed_BSC.device)

    def mix(mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        conv = depthwise_causal_conv(kernels.causal_conv1d_fn, module.conv1d, channels, mixed, module.activation)
        Bd, L, k = conv.shape[0], conv.shape[1], qk_BSkF.shape[2]
        q, kk, v = conv.split([k * Hk, k * Hk, (qb - qa) * Hv], dim=-1)
        q, kk = (t.view(Bd, L, k, Hk)[:, :, kv_index] for t in (q, kk))  # one key head per value head
        out, _ = kernels.torch_chunk_gated_delta_rule(
            q, kk, v.reshape(Bd, L, -1, Hv), g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        return out

    o_BSnH = by_document(mix, document_cuts(ulysses_mask, B), mixed_BSC, beta_BSn, g_BSn)
    assert o_BSnH.shape[:3] == (B, S, qb - qa)
    o_BsVH = head_to_seq_out(o_BSnH, plan, ctx.group)
    o_BsVH = module.norm(o_BsVH.reshape(-1, Hv), z_BsVH.reshape(-1, Hv)).reshape(B, s, -1)
    return module.out_proj(o_BsVH)
