"""Core attention kernels on the FULL sequence for this rank's heads.

Shape legend: B batch, S global sequence, n local query heads, k local kv heads (n % k == 0,
local query head i reads kv head i // (n/k)), H head dim, Hv value head dim.

Every kernel has the signature::

    kernel(q (B,n,S,H), k (B,k,S,H), v (B,k,S,Hv), mask: GlobalMask, *,
           scaling, sliding_window, softcap, dropout[, sinks]) -> o (B,S,n,Hv)

``sliding_window=w`` lets query i see keys with ``i - j < w`` (Transformers' convention).
``sinks`` (n,): learned per-head attention-sink logits (GPT-OSS style), passed only when the model
has them: one extra logit in each softmax denominator, no value. ``eager`` and ``flex_attention``
apply them, and flash-attention builds that take ``s_aux`` / ``learnable_sink``; SDPA cannot.
Kernels run unchanged: the Ulysses layer hands them the whole sequence, so the global mask is
all they need.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ulysses_sp.attention.heads import repeat_kv
from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.attention.packed import sdpa_bucketed, sdpa_windowed
from ulysses_sp.attention.varlen import torch_varlen, varlen_usable
from ulysses_sp.config import ATTN_IMPLEMENTATIONS

Kernel = Callable[..., torch.Tensor]
_FLEX_BLOCK = 128  # flex_attention's default sparse block size


SDPA_NO_SINKS = ("SDPA cannot apply attention sinks (it returns no log-sum-exp to renormalise with): load the model "
                 "with attn_implementation='flex_attention' (GPU) or 'eager', or a flash-attention build whose "
                 "varlen function takes s_aux / learnable_sink")


def sdpa(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0, sinks=None):
    """``torch.nn.functional.scaled_dot_product_attention``; no S x S mask on any path.

    1. plain causal (or nothing masked)    -> one call, ``is_causal`` (no mask tensor)
    2. packed documents and/or padding     -> on CUDA with ``varlen_attn`` (fp16/bf16, no dropout):
                                              one varlen call (:func:`torch_varlen`); else one call
                                              per length bucket (:func:`.packed.sdpa_bucketed`), or
                                              one ``is_causal`` call per document where every
                                              document is its own bucket anyway (no padding).
                                              A padding query sees only itself: its output is its value
    3. sliding window ``w`` (anything else) -> query blocks of ``t`` rows attend to keys
                                              ``[start - w + 1, end)`` with a ``(t, t + w - 1)``
                                              block of the global rule (:func:`.packed.sdpa_windowed`)

    Mask memory is O(B*S) plus one block; the kernels' own work is per call.
    """
    if softcap is not None:
        raise ValueError("sdpa cannot apply attention logit softcapping; "
                         "use 'eager', 'flex_attention' or flash-attention.")
    if sinks is not None:
        raise ValueError(SDPA_NO_SINKS)
    kw = dict(dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    B, _, S, _ = q.shape
    window = sliding_window if sliding_window is not None and sliding_window < S else None
    packed = mask.document_ids is not None or mask.valid is not None
    if packed and not dropout and varlen_usable(q, mask, v):
        return torch_varlen(q, k, v, mask, scaling=scaling, sliding_window=window)
    if packed:
        plan = mask.buckets(B, q.device)
        batched = mask.valid is not None or len(plan.buckets) < plan.num_documents
        if batched and (window is None or plan.contiguous):  # a window needs the row's own distances
            return sdpa_bucketed(q, k, v, mask, window, **kw).transpose(1, 2)
    if window is not None:
        o = sdpa_windowed(q, k, v, mask, window, block_rows=min(max(window, 128), 1024), **kw)
    elif not packed:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, **kw)
    else:
        rows = []
        for b, segments in enumerate(mask.segments()):
            parts = [
                F.scaled_dot_product_attention(
                    q[b : b + 1, :, a:e], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e], is_causal=mask.causal, **kw
                )
                for a, e in segments
            ]
            rows.append(torch.cat(parts, dim=2))
        o = torch.cat(rows, dim=0)
    return o.transpose(1, 2)


def eager(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0, sinks=None):
    """Explicit ``softmax(q k^T * scaling) v`` in fp32 softmax; supports softcapping and sinks (the
    sink logit joins each row's softmax as one more column, which is then dropped).

    The small-S fallback: it builds the dense ``(B, 1, S, S)`` mask (:meth:`GlobalMask.dense`) and
    ``(B, n, S, S)`` scores, O(S^2) memory by nature. Use sdpa, flex or flash-attention for long S.
    """
    n = q.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = mask.dense(q.device, sliding_window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        B, n, S, _ = scores.shape
        column = sinks.to(torch.float32).view(1, n, 1, 1).expand(B, n, S, 1)
        probs = torch.softmax(torch.cat([scores.float(), column], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).transpose(1, 2)


_COMPILED_FLEX: Callable | None = None


def _flex_function(device: torch.device) -> Callable:
    """flex_attention compiled on CUDA (one compiled function for the process; automatic dynamic
    shapes after the second sequence length). Uncompiled, flex runs an unfused reference that
    materialises the ``(B, n, S, S)`` scores: fine for CPU's forward-only use, never on a GPU."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex)
    return _COMPILED_FLEX


def flex_attention(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0,
                   sinks=None):
    """``torch.nn.attention.flex_attention`` with a block mask (no S x S tensor). Forward-only on CPU.

    Sinks: flex also returns each row's log-sum-exp ``L`` (differentiable), and the output is
    renormalised as if the sink were one more logit: ``o * sigmoid(L - sink)`` (fp32 factor).

    The block mask comes from :meth:`GlobalMask.flex_blocks` (128 query rows at a time), not from
    ``create_block_mask``, which evaluates ``mask_mod`` on a dense ``(B, 1, S, S)`` grid. On CUDA
    the kernel is ``torch.compile``-d (the fused Triton kernel; the first call per shape compiles).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if dropout:
        raise ValueError("flex_attention has no attention dropout; set attention_dropout=0.")
    S = q.shape[2]

    def build():
        doc = mask.document_ids.to(q.device) if mask.document_ids is not None else None
        valid = mask.valid.to(q.device) if mask.valid is not None else None

        def mask_mod(b, h, qi, ki):
            ok = qi >= ki if mask.causal else qi >= 0
            if sliding_window is not None:
                ok = ok & (qi - ki < sliding_window)
            if doc is not None:
                ok = ok & (doc[b, qi] == doc[b, ki])
            if valid is not None:
                ok = (ok & valid[b, ki] & valid[b, qi]) | ((qi == ki) & ~valid[b, qi])
            return ok

        blocks = mask.flex_blocks(q.device, sliding_window, _FLEX_BLOCK)
        return BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=_FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(S, S))

    block_mask = mask.cached(("flex", str(q.device), sliding_window), build)
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, qi, ki):
            return torch.tanh(score / softcap) * softcap
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    if sinks is None:
        return _flex_function(q.device)(q, k, v, **kw).transpose(1, 2)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9: the older keyword
        o, lse = _flex_function(q.device)(q, k, v, return_lse=True, **kw)
    else:
        o, aux = _flex_function(q.device)(q, k, v, return_aux=AuxRequest(lse=True), **kw)
        lse = aux.lse
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # (B, n, S): 1 - the sink's share
    return (o * keep.unsqueeze(-1).to(o.dtype)).transpose(1, 2)


def _flash_sink_name(function: Callable, module: str) -> str:
    """The keyword under which ``function`` (a flash varlen function) takes per-head sink logits."""
    import inspect

    names = inspect.signature(function).parameters
    for name in ("s_aux", "learnable_sink"):
        if name in names:
            return name
    raise ValueError(f"{module}.flash_attn_varlen_func takes no attention sinks (no 's_aux' / 'learnable_sink' "
                     "argument): load the model with attn_implementation='flex_attention' or 'eager', or install a "
                     "flash-attention build with sinks.")


def flash_supports_sinks(name: str) -> bool:
    """Whether the installed package of flash kernel ``name`` takes attention sinks (False if not installed)."""
    package = KERNELS[name][1]
    if package is None or importlib.util.find_spec(package) is None:
        return False
    try:
        _flash_sink_name(importlib.import_module(package).flash_attn_varlen_func, package)
    except (ValueError, ImportError, AttributeError):
        return False
    return True


def _flash_varlen(module: str):
    def kernel(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0, sinks=None):
        fa = importlib.import_module(module)
        B, n, S, H = q.shape
        cu, max_len = mask.cu_seqlens(B, q.device)
        if mask.document_ids is None and mask.valid is None:
            cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
            max_len = S
        flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3]) for t in (q, k, v)]
        kw = dict(softmax_scale=scaling, causal=mask.causal, softcap=softcap or 0.0)
        if sliding_window is not None:
            kw["window_size"] = (sliding_window - 1, 0)
        if module == "flash_attn":
            kw["dropout_p"] = dropout
        elif dropout:
            raise ValueError("flash_attention_3 has no attention dropout; set attention_dropout=0.")
        if sinks is not None:
            kw[_flash_sink_name(fa.flash_attn_varlen_func, module)] = sinks.to(q.dtype)
        out = fa.flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, **kw)
        out = out[0] if isinstance(out, tuple) else out
        return out.view(B, S, n, v.shape[3])

    kernel.__name__ = f"flash_varlen_{module}"
    return kernel


KERNELS: dict[str, tuple[Kernel, str | None]] = {
    "sdpa": (sdpa, None),
    "eager": (eager, None),
    "flex_attention": (flex_attention, None),
    "flash_attention_2": (_flash_varlen("flash_attn"), "flash_attn"),
    "flash_attention_3": (_flash_varlen("flash_attn_interface"), "flash_attn_interface"),
    "torch_varlen": (torch_varlen, None),  # torch >= 2.10 on CUDA; refused with the fix elsewhere
}


assert tuple(KERNELS) == ATTN_IMPLEMENTATIONS, "config.ATTN_IMPLEMENTATIONS lists the kernels of KERNELS"


def get_kernel(name: str) -> Kernel:
    """The kernel registered as ``name`` (one of ``KERNELS``), checking its package is installed."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}.")
    kernel, package = KERNELS[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"attention kernel {name!r} needs the '{package}' package; install it or use 'sdpa'.")
    return kernel
