"""Peak memory per rank of one training step, term by term (a model, checked by a benchmark).

Symbols: ``S`` global sequence, ``P`` SP size, ``B`` batch, ``T = B * ceil(S / P)`` local tokens,
``D`` hidden, ``I`` MLP intermediate, ``V`` vocab, ``L`` layers, ``N``/``K`` query/kv heads,
``H`` head dim, ``e`` bytes per element of the model dtype, ``t`` tile tokens.

One step with gradient checkpointing passes three candidate peaks; the largest is the peak:

    loss phase   ckpt + loss buffers          untiled: logits, their log-softmax, its grad: 3*T*V*4
                 + 5*T*D*e hidden-sized       (+ T*V*e logits kept when e < 4)
                 (final norm in/out, hidden,  tiled:   one fp32 (t, V) tile buffer + the fp32 (V, D)
                 its grad, the norm's grad)            lm_head grad accumulator + the (V, D) matmul
                                                       result added into it per tile: V*D*(4 + e)
    layer phase  ckpt + one layer's backward  saved by the recompute: 4D + 3NH + 2KH per token
                 + lm_head grad V*D*e         (two norms' outputs, q/k after RoPE, v, attention
                                              output and its reshaped copy), plus the larger of
                                              MLP: 6*I live (gate, act, up, their grads) + 2D
                                              attention: grads of q/k/v/out 2NH + 2KH + D
                                              (+ NH + 2KH all-to-all buffers when P > 1)
    grads phase  all parameter grads + 2*T*D*e (the embedding's incoming grad)

    ckpt = L * T * D * e   the checkpointed layer inputs (0 on the device with offload: they are
                           in host memory; on a CPU-only machine the host IS the device)

Tiled MLP replaces the ``T`` of the MLP term by ``min(T, B * t)``. Without checkpointing every
layer keeps its saved tensors (``L`` times the layer term, no recompute). MoE blocks: ``I`` is
``top_k * moe_intermediate`` (+ the shared expert's), an estimate not checked by measurement.
The coefficients come from counting the tensors autograd keeps for a Llama layer (fp32 CPU run,
SDPA flash kernel: no S x S term); ``benchmarks/memory_ablation.py`` prints them against
measured peaks. Not modelled: allocator fragmentation / caching (CUDA reserves more than it
allocates), S x S attention masks (eager kernels, padding masks), CUDA workspaces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """The sizes the model needs, from a Transformers config or a mapping of the same names."""

    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    num_params: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: Any) -> ModelDims:
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        D, V, L, N = get("hidden_size"), get("vocab_size"), get("num_hidden_layers"), get("num_attention_heads")
        if None in (D, V, L, N):
            raise ValueError("the config needs hidden_size, vocab_size, num_hidden_layers and num_attention_heads.")
        K = get("num_key_value_heads") or N
        H = get("head_dim") or D // N
        experts = get("num_local_experts") or get("num_experts") or 0
        if experts:  # MoE: what one token's MLP work costs (top_k experts + the shared expert)
            moe_i = get("moe_intermediate_size") or get("intermediate_size")
            inter = get("num_experts_per_tok", 2) * moe_i + (get("shared_expert_intermediate_size") or 0)
            mlp_params = experts * 3 * D * moe_i + 3 * D * (get("shared_expert_intermediate_size") or 0) + experts * D
        else:
            inter = get("intermediate_size") or 4 * D
            mlp_params = 3 * D * inter
        tied = bool(get("tie_word_embeddings", False))
        layer_params = D * H * (2 * N + 2 * K) + mlp_params + 2 * D
        num_params = L * layer_params + V * D * (1 if tied else 2) + D
        return cls(D, inter, V, L, N, K, H, num_params, tied)


@dataclasses.dataclass(frozen=True)
class MemoryFeatures:
    """Which memory features are on.

    Attributes:
        checkpointing: gradient checkpointing of every decoder layer.
        tiled_loss_tokens: tile of the tiled lm_head + loss (None: full logits).
        tiled_mlp_tokens: tile of the tiled MLP (None: untiled).
        offload: checkpointed layer inputs in host memory (needs checkpointing).
        host_is_device: the "device" is the CPU (offload cannot free anything there).
    """

    checkpointing: bool = True
    tiled_loss_tokens: int | None = None
    tiled_mlp_tokens: int | None = None
    offload: bool = False
    host_is_device: bool = False


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes per rank. ``peak_bytes`` = the largest phase (``phase``) of one fwd + bwd step,
    activations and gradients (what the benchmark measures); ``static_bytes`` = weights and
    optimizer states, which exist before and after the step; ``total_bytes`` = both."""

    phases: dict[str, int]
    terms: dict[str, int]
    static: dict[str, int]
    host_bytes: int

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.phase]

    @property
    def static_bytes(self) -> int:
        return sum(self.static.values())

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.static_bytes


def _elem_bytes(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def estimate_peak_memory(
    config: Any, seq_len: int, sp_size: int, dtype: torch.dtype | str, features: MemoryFeatures, *,
    batch_size: int = 1, optimizer: str = "none", state_shards: int = 1,
) -> MemoryBreakdown:
    """Predict the per-rank memory of one training step (see the module docstring for the terms).

    Args:
        config: a Transformers config (or mapping) of a decoder-only LM.
        seq_len: ``S``, global tokens per sequence; sp_size: ``P``; dtype: the model's dtype.
        optimizer: ``"none"`` or ``"adam"`` (two fp32 states, plus fp32 master weights when e < 4).
        state_shards: ranks that shard weights / grads / optimizer states (ZeRO-3, FSDP); 1 = none.
    """
    if features.offload and not features.checkpointing:
        raise ValueError("offload needs checkpointing (it offloads the checkpointed layer inputs); enable both.")
    if optimizer not in ("none", "adam"):
        raise ValueError(f"optimizer must be 'none' or 'adam', got {optimizer!r}.")
    m, e = ModelDims.from_config(config), _elem_bytes(dtype)
    D, I, V, L, NH, KH = m.hidden, m.intermediate, m.vocab, m.layers, m.heads * m.head_dim, m.kv_heads * m.head_dim
    T = batch_size * math.ceil(seq_len / sp_size)
    t_mlp = min(T, batch_size * features.tiled_mlp_tokens) if features.tiled_mlp_tokens else T
    saved = (4 * D + 3 * NH + 2 * KH) * T * e
    mlp_live = (6 * I * t_mlp + 2 * D * T) * e
    attn_live = (2 * NH + 2 * KH + D + ((NH + 2 * KH) if sp_size > 1 else 0)) * T * e
    layer = saved + max(mlp_live, attn_live)
    ckpt = L * T * D * e if features.checkpointing else (L - 1) * (saved + 4 * I * T * e)
    ckpt_on_device = 0 if features.offload and not features.host_is_device else ckpt
    if features.tiled_loss_tokens:
        t = min(T, features.tiled_loss_tokens)
        loss = t * V * 4 + V * D * (4 + e) + 5 * T * D * e
    else:
        loss = 3 * T * V * 4 + (T * V * e if e < 4 else 0) + 5 * T * D * e
    grads = m.num_params * e // state_shards
    head_grad = V * D * e // state_shards
    terms = {"checkpointed_inputs": ckpt, "layer_backward": layer, "loss": loss, "lm_head_grad": head_grad,
             "all_grads": grads}
    phases = {
        "loss": ckpt_on_device + loss,
        "layer": ckpt_on_device + layer + head_grad,
        "grads": grads + 2 * T * D * e,
    }
    static = {"weights": m.num_params * e // state_shards}
    if optimizer == "adam":
        static["optimizer"] = m.num_params * (8 + (4 if e < 4 else 0)) // state_shards
    return MemoryBreakdown(phases, terms, static, host_bytes=ckpt - ckpt_on_device)


def longest_sequence(
    config: Any, sp_size: int, dtype: torch.dtype | str, features: MemoryFeatures, budget_bytes: int, *,
    granule: int = 64, include_static: bool = True, **kwargs: Any,
) -> int:
    """The longest ``S`` (multiple of ``granule * sp_size``) whose predicted peak fits ``budget_bytes``
    (0 if none); ``include_static`` counts weights and optimizer states too."""
    step = granule * sp_size

    def fits(s: int) -> bool:
        b = estimate_peak_memory(config, s, sp_size, dtype, features, **kwargs)
        return (b.total_bytes if include_static else b.peak_bytes) <= budget_bytes

    if not fits(step):
        return 0
    lo, hi = step, 2 * step
    while fits(hi) and hi < 1 << 34:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
