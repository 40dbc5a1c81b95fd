"""Sequence-parallel forward of a Mamba2 mixer (Bamba, GraniteMoeHybrid, NemotronH state-space layers).

Shape legend
    B batch, S global sequence, s local shard (S / P), P SP size, D hidden, I inner size (= M*Hd),
    M SSM heads, n SSM heads of this rank, G groups (of B / C), g groups this rank needs,
    Hd head dim, N state size.

The mixer is ``in_proj -> [gate | x B C | dt] -> causal depthwise conv on x B C -> SSD scan (per
head; head h reads group ``h // (M/G)`` of B and C) -> gated grouped RMSNorm -> out_proj``. The
groups play the kv heads, the SSM heads the query heads, so the head all-to-all of attention makes
the conv and the scan run on the whole sequence for this rank's heads::

    x (B,s,D) -- in_proj (local) --> gate (B,s,I)  x (B,s,M,Hd)  dt (B,s,M)  B, C (B,s,G,N)
       |  ONE all-to-all: [x|dt] by SSM heads (HeadPlan(M, G, P).q_ranges), [B|C] by groups (kv_ranges)
       v
    x (B,S,n,Hd)  dt (B,S,n)  B, C (B,S,g,N)                   all tokens, my heads
       |  conv over my channels (the model's causal_conv1d_fn), padding zeroed again,
       |  B, C repeated to my heads, the model's mamba2_chunk_scan (with D, dt_bias, dt_limit), per document
       v
    y (B,S,n,Hd) --all-to-all--> y (B,s,M,Hd) -- norm(y, gate), out_proj (local) --> (B,s,D)

The gated norm normalises over groups of ``I/G`` channels, i.e. across heads: it runs after the
exchange back, on all heads of my tokens. The state-passing alternative (each rank continues the
previous rank's conv tail and SSM state) would serialise the ranks; see ``gated_delta``.
Parameters are used through the module (``conv1d`` weight / bias rows, ``A_log``, ``D``,
``dt_bias`` entries of my heads), so ``state_dict`` keys do not change. Padding is zeroed before
``in_proj`` and after the conv (the model's two ``apply_mask_to_padding_states``). The training
shortcut of the model (``mamba_split_conv1d_scan_combined``, GPU kernels only) is not used: the
unfused path is the same function of the inputs.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

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

MAMBA2_CLASSES = frozenset({"BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer"})


def head_plan(module: torch.nn.Module, sp_size: int) -> HeadPlan:
    """SSM heads split like query heads, B/C groups like kv heads."""
    return split_heads(module, sp_size, module.num_heads, module.n_groups, "SSM heads")


def _conv_channels(module: torch.nn.Module, plan: HeadPlan, rank: int) -> torch.Tensor:
    """The conv channels of my heads: [x of my heads | B of my groups | C of my groups]."""
    (qa, qb), (ka, kb) = plan.q_ranges[rank], plan.kv_ranges[rank]
    Hd, N, I, G = module.head_dim, module.ssm_state_size, module.intermediate_size, module.n_groups
    groups = torch.arange(ka * N, kb * N)
    return torch.cat([torch.arange(qa * Hd, qb * Hd), I + groups, I + G * N + groups])


def mamba2_forward(
    module: torch.nn.Module, ctx: MixerContext, hidden_states: torch.Tensor, cache: Any = None,
    attention_mask: torch.Tensor | None = None, ulysses_mask: GlobalMask | None = None, **kwargs: Any,
) -> torch.Tensor:
    """The mixer's forward on my shard ``(B, s, D) -> (B, s, D)`` (see the module docstring)."""
    if runs_own_forward(module, ctx, ulysses_mask, cache, "state-space"):
        return type(module).forward(module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    kernels = sys.modules[type(module).__module__]  # the model's own kernels (hub kernel or torch fallback)
    B, s, _ = hidden_states.shape
    dtype = hidden_states.dtype
    plan, rank = head_plan(module, ctx.size), ctx.rank
    (qa, qb), _ = plan.q_ranges[rank], plan.kv_ranges[rank]
    M, G, Hd, N, I = module.num_heads, module.n_groups, module.head_dim, module.ssm_state_size, module.intermediate_size

    x_BsD = zero_padding(hidden_states, ctx.local_valid(ulysses_mask, s))
    gate_BsI, xBC_BsF, dt_BsM = module.in_proj(x_BsD).split([I, module.conv_dim, M], dim=-1)
    x_BsMH, B_BsGN, C_BsGN = xBC_BsF.split([I, G * N, G * N], dim=-1)
    xdt_BsMF = torch.cat([x_BsMH.view(B, s, M, Hd), dt_BsM[..., None]], dim=-1)
    bc_BsGF = torch.cat([B_BsGN.view(B, s, G, N), C_BsGN.view(B, s, G, N)], dim=-1)
    xdt_BSnF, bc_BSgF = seq_to_head_parts((xdt_BsMF, bc_BsGF), (plan.q_ranges, plan.kv_ranges), ctx.group)

    n, g = xdt_BSnF.shape[2], bc_BSgF.shape[2]
    xBC_BSC = torch.cat([xdt_BSnF[..., :Hd].flatten(2), bc_BSgF[..., :N].flatten(2), bc_BSgF[..., N:].flatten(2)], -1)
    dt_BSn = xdt_BSnF[..., Hd]
    channels = _conv_channels(module, plan, rank).to(xBC_BSC.device)
    head_group = plan.local_kv_index(rank).to(xBC_BSC.device)
    A_n = -torch.exp(module.A_log.float())[qa:qb]
    valid_BS = ulysses_mask.valid

    def mix(xBC: torch.Tensor, dt: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        conv = depthwise_causal_conv(kernels.causal_conv1d_fn, module.conv1d, channels, xBC, module.activation)
        conv = zero_padding(conv, valid)
        Bd, L = conv.shape[:2]
        x, Bm, Cm = conv.split([n * Hd, g * N, g * N], dim=-1)
        Bm, Cm = (t.view(Bd, L, g, N)[:, :, head_group] for t in (Bm, Cm))  # one group per head
        return kernels.mamba2_chunk_scan(
            x.view(Bd, L, n, Hd), dt, A_n, Bm, Cm, chunk_size=module.chunk_size, D=module.D[qa:qb], z=None,
            return_final_states=False, dt_bias=module.dt_bias[qa:qb], dt_softplus=True, initial_states=None,
            dt_limit=module.time_step_limit,
        )

    y_BSnH = by_document(mix, document_cuts(ulysses_mask, B), xBC_BSC, dt_BSn, valid_BS)
    y_BsMH = head_to_seq_out(y_BSnH.to(dtype), plan, ctx.group)
    y_BsI = module.norm(y_BsMH.reshape(B, s, I), gate_BsI)
    return module.out_proj(y_BsI.to(dtype))
