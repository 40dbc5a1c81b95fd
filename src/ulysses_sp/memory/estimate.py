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
                           in host memory, and the layer being recomputed brings its input back:
                           + T*D*e in the layer phase; on a CPU-only machine the host IS the device)

GPU terms (``MemoryFeatures.kernel_workspace``, what CUDA attention kernels allocate in backward):
an fp32 ``dq`` accumulator ``4*NH`` and, with GQA (K < N), ``dk``/``dv`` expanded to the N query
heads ``2*NH*e`` per token (flash-attention 2's ``mha_bwd``; under Ulysses on ``N/P`` heads x ``S``
tokens, the same bytes per local token). Sharded states (``state_shards > 1`` or
``offload_params``): the wrapper gathers one layer's weights for the layer phase and lm_head's
for the loss phase. ``offload_optimizer`` (ZeRO-Offload / CPU Adam): fp32 master weights, Adam
states and the fp32 gradient partition live in host memory; the device keeps no gradients between
buckets. ``offload_params``: the weight partitions live in host memory too. ``host_bytes`` sums
everything offloaded per rank.

Head-chunked attention (``head_chunks = C > 1``, ``P > 1``, ``comm.head_chunked``): the kernel's
full-length output is no longer saved (``saved`` loses ``NH``); the attention backward holds the
sharded grads of q/k/v and of the output ``2NH + 2KH``, ``D``, and ONE chunk's full-length tensors
``chunk_live_bytes(HeadPlan(N, K, A), C, B, A*s, H, H, e)`` (q, o, k, v and their grads of the
chunk's heads over the all-to-all group's ``A*s`` tokens) instead of all heads' exchange buffers;
the kernel workspace shrinks by ``C``.

Head blocks (``head_blocks``, ``G = len(head_block_ranges(N, K, A, C)) > 1``, ``memory.head_blocks``): the
attention module saves its input and the sharded attention output only, so ``saved`` loses the
q/k/v and the output's copy ``NH + 2KH + NH``; its backward holds the ``D`` input-gradient buffer,
``(3NH + 4KH) / G`` (a block's sharded q/k/v grads, output grad and exchange buffers; the block now
frees them as it goes, and the term stands for the post-attention norm / tiled-MLP tail the MLP term
under-counts: within 1% of the measured peak of ``benchmarks/alst_longest.py``), and the
block's full-length tensors ``chunk_live_bytes(HeadPlan(N_g, K_g, A), 1, ...)`` (a block with fewer
kv heads than ``A`` ranks sends each of them to several ranks, so they count per rank).

Tiled MLP replaces the ``T`` of the MLP term by ``min(T, B * t)``. Without checkpointing every
layer keeps its saved tensors (``L`` times the layer term, no recompute). MoE blocks: ``I`` is
``top_k * moe_intermediate`` (+ the shared expert's), an estimate not checked by measurement.
The coefficients come from counting the tensors autograd keeps for a Llama layer (fp32 CPU run,
SDPA flash kernel: no S x S term); ``benchmarks/memory_ablation.py`` prints them against
measured peaks. Not modelled term by term: allocator fragmentation / caching (CUDA reserves more
than it allocates), the eager kernel's S x S mask and scores (the other kernels keep masks O(S)),
CUDA context and library workspaces; :meth:`MemoryBreakdown.required_bytes` covers them with a
scale and a reserve (``ulysses-sp plan`` calibrates both on GPU runs, ``docs/memory.md``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from ulysses_sp.comm.cost import chunk_live_bytes, head_block_ranges
from ulysses_sp.comm.layout import HeadPlan


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
        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)

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
        kernel_workspace: count the CUDA attention kernels' backward workspace (module docstring).
        offload_optimizer: optimizer states, fp32 master weights and gradients in host memory.
        offload_params: weight partitions in host memory (ZeRO-3 ``offload_param``).
        head_chunks: ``UlyssesSPConfig.sp_head_chunks`` (1 = unchunked attention; used when ``P > 1``).
        head_blocks: ``UlyssesSPConfig.sp_head_blocks``: the chunks are head blocks (projections
            included) where the model has at least two kv-group blocks (module docstring).
    """

    checkpointing: bool = True
    tiled_loss_tokens: int | None = None
    tiled_mlp_tokens: int | None = None
    offload: bool = False
    host_is_device: bool = False
    kernel_workspace: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    head_chunks: int = 1
    head_blocks: bool = True


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

    def required_bytes(self, peak_scale: float = 1.0, reserve_bytes: int = 0) -> int:
        """Device bytes to budget: ``peak * peak_scale + static + reserve``. ``peak_scale`` covers
        what the terms leave out (allocator fragmentation, kernel temporaries; 1.0 is the CPU
        calibration), ``reserve_bytes`` what the process holds before any tensor (CUDA context,
        NCCL and cuBLAS workspaces)."""
        return math.ceil(self.peak_bytes * peak_scale) + self.static_bytes + reserve_bytes


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
    D, V, L = m.hidden, m.vocab, m.layers
    T = batch_size * math.ceil(seq_len / sp_size)
    layer, ckpt = _layer_terms(m, T, e, sp_size, batch_size, features)
    offloaded = features.offload and not features.host_is_device
    ckpt_on_device = 0 if offloaded else ckpt
    restored = T * D * e if offloaded else 0  # the recomputed layer's input, back from the host
    if features.tiled_loss_tokens:
        t = min(T, features.tiled_loss_tokens)
        loss = t * V * 4 + V * D * (4 + e) + 5 * T * D * e
    else:
        loss = 3 * T * V * 4 + (T * V * e if e < 4 else 0) + 5 * T * D * e
    grads = 0 if features.offload_optimizer else m.num_params * e // state_shards
    head_grad = 0 if features.offload_optimizer else V * D * e // state_shards
    gathered = state_shards > 1 or features.offload_params
    layer_weights = (m.num_params - V * D * (1 if m.tied_embeddings else 2) - D) // L * e if gathered else 0
    terms = {"checkpointed_inputs": ckpt, "layer_backward": layer, "loss": loss, "lm_head_grad": head_grad,
             "all_grads": grads, "gathered_weights": max(layer_weights, V * D * e if gathered else 0)}
    phases = {
        "loss": ckpt_on_device + loss + (V * D * e if gathered else 0),
        "layer": ckpt_on_device + restored + layer + head_grad + layer_weights,
        "grads": grads + 2 * T * D * e,
    }
    weights = m.num_params * e // state_shards
    adam = m.num_params * (8 + (4 if e < 4 else 0)) // state_shards if optimizer == "adam" else 0
    static = {"weights": 0 if features.offload_params else weights}
    if adam and not features.offload_optimizer:
        static["optimizer"] = adam
    host = ckpt - ckpt_on_device
    if features.offload_optimizer:
        host += adam + m.num_params * 4 // state_shards  # + the fp32 gradient partition
    if features.offload_params:
        host += weights
    return MemoryBreakdown(phases, terms, static, host_bytes=host)


def _layer_terms(
    m: ModelDims, T: int, e: int, sp_size: int, batch_size: int, features: MemoryFeatures
) -> tuple[int, int]:
    """(one layer's backward bytes, checkpointed-inputs bytes) for ``T`` local tokens."""
    D, I, L, NH, KH = m.hidden, m.intermediate, m.layers, m.heads * m.head_dim, m.kv_heads * m.head_dim
    t_mlp = min(T, batch_size * features.tiled_mlp_tokens) if features.tiled_mlp_tokens else T
    blocks = _head_block_bytes(m, T, e, sp_size, batch_size, features)
    chunked = blocks or _chunked_attention_bytes(m, T, e, sp_size, batch_size, features)
    not_saved = (2 * NH + 2 * KH) if blocks is not None else NH if chunked is not None else 0
    saved = (4 * D + 3 * NH + 2 * KH - not_saved) * T * e
    mlp_live = (6 * I * t_mlp + 2 * D * T) * e
    if chunked is not None:
        attn_live = chunked
    else:
        attn_live = (2 * NH + 2 * KH + D + ((NH + 2 * KH) if sp_size > 1 else 0)) * T * e
        if features.kernel_workspace:
            attn_live += (4 * NH + (2 * NH * e if KH < NH else 0)) * T
    layer = saved + max(mlp_live, attn_live)
    ckpt = L * T * D * e if features.checkpointing else (L - 1) * (saved + 4 * I * T * e)
    return layer, ckpt


def _a2a_size(m: ModelDims, sp_size: int) -> int:
    """The all-to-all degree: ``sp_size`` over the smallest ring the head count needs."""
    return sp_size // next(r for r in range(1, sp_size + 1) if sp_size % r == 0 and sp_size // r <= m.heads)


def _head_block_bytes(m: ModelDims, T: int, e: int, sp_size: int, batch_size: int,
                      features: MemoryFeatures) -> int | None:
    """The head blocks' backward bytes (module docstring), or None without blocks."""
    if features.head_chunks <= 1 or sp_size == 1 or not features.head_blocks:
        return None
    A = _a2a_size(m, sp_size)
    if A != sp_size:  # Ulysses x ring: no head blocks
        return None
    blocks = head_block_ranges(m.heads, m.kv_heads, A, features.head_chunks)
    if len(blocks) < 2:
        return None
    NH, KH, H, G = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.head_dim, len(blocks)
    group = m.heads // m.kv_heads
    live = max(chunk_live_bytes(HeadPlan((b - a) * group, b - a, A), 1, batch_size, A * (T // batch_size), H, H, e)
               for a, b in blocks)
    if features.kernel_workspace:
        live += (4 * NH + (2 * NH * e if KH < NH else 0)) * T // G
    return (m.hidden + (3 * NH + 4 * KH) // G) * T * e + live


def _chunked_attention_bytes(
    m: ModelDims, T: int, e: int, sp_size: int, batch_size: int, features: MemoryFeatures
) -> int | None:
    """The head-chunked attention's backward bytes (module docstring), or None when unchunked."""
    if features.head_chunks <= 1 or sp_size == 1:
        return None
    A = _a2a_size(m, sp_size)
    plan = HeadPlan(m.heads, m.kv_heads, A)
    C = plan.num_chunks(features.head_chunks)
    if C == 1:
        return None
    NH, KH, H = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.head_dim
    live = chunk_live_bytes(plan, C, batch_size, A * (T // batch_size), H, H, e)
    if features.kernel_workspace:
        live += (4 * NH + (2 * NH * e if KH < NH else 0)) * T // C
    return (2 * NH + 2 * KH + m.hidden) * T * e + live


def longest_sequence(
    config: Any, sp_size: int, dtype: torch.dtype | str, features: MemoryFeatures, budget_bytes: int, *,
    granule: int = 64, include_static: bool = True, host_budget_bytes: int | None = None, peak_scale: float = 1.0,
    reserve_bytes: int = 0, **kwargs: Any,
) -> int:
    """The longest ``S`` (multiple of ``granule * sp_size``) whose predicted peak fits ``budget_bytes``
    (0 if none); ``include_static`` counts weights and optimizer states too (and then
    ``peak_scale`` / ``reserve_bytes``, see :meth:`MemoryBreakdown.required_bytes`), and
    ``host_budget_bytes`` caps what is offloaded to host memory per rank."""
    step = granule * sp_size

    def fits(s: int) -> bool:
        b = estimate_peak_memory(config, s, sp_size, dtype, features, **kwargs)
        device = b.required_bytes(peak_scale, reserve_bytes) if include_static else b.peak_bytes
        return device <= budget_bytes and (host_budget_bytes is None or b.host_bytes <= host_budget_bytes)

    if not fits(step):
        return 0
    lo, hi = step, 2 * step
    while fits(hi) and hi < 1 << 34:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
