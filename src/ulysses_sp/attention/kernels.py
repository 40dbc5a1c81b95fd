"""Core attention kernels on the FULL sequence for this rank's heads.

Shape legend: B batch, S global sequence, n local query heads, k local kv heads (n % k == 0,
local query head i reads kv head i // (n/k)), H head dim, Hv value head dim.

Every kernel has the signature::

    kernel(q (B,n,S,H), k (B,k,S,H), v (B,k,S,Hv), mask: GlobalMask, *,
           scaling, sliding_window, softcap, dropout) -> o (B,S,n,Hv)

``sliding_window=w`` lets query i see keys with ``i - j < w`` (Transformers' convention).
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

from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.config import ATTN_IMPLEMENTATIONS

Kernel = Callable[..., torch.Tensor]


def _repeat_kv(x_BkSH: torch.Tensor, n: int) -> torch.Tensor:
    k = x_BkSH.shape[1]
    return x_BkSH if k == n else x_BkSH.repeat_interleave(n // k, dim=1)


def sdpa(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0):
    """``torch.nn.functional.scaled_dot_product_attention``.

    Plain causal -> ``is_causal=True`` (no mask tensor); packed documents without padding or window
    -> one ``is_causal`` call per document (no S x S mask); otherwise a dense bool mask.
    """
    if softcap is not None:
        raise ValueError("sdpa cannot apply attention logit softcapping; use 'eager', 'flex_attention' or flash-attention.")
    gqa = q.shape[1] != k.shape[1]
    kw = dict(dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    if sliding_window is None and mask.is_plain_causal:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    elif sliding_window is None and mask.causal and mask.valid is None:
        rows = []
        for b, segments in enumerate(mask.segments()):
            parts = [
                F.scaled_dot_product_attention(q[b : b + 1, :, a:e], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e], is_causal=True, **kw)
                for a, e in segments
            ]
            rows.append(torch.cat(parts, dim=2))
        o = torch.cat(rows, dim=0)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device, sliding_window), **kw)
    return o.transpose(1, 2)


def eager(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0):
    """Explicit ``softmax(q k^T * scaling) v`` in fp32 softmax; supports softcapping."""
    n = q.shape[1]
    k, v = _repeat_kv(k, n), _repeat_kv(v, n)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = mask.dense(q.device, sliding_window)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).transpose(1, 2)


def flex_attention(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0):
    """``torch.nn.attention.flex_attention`` with a block mask (no S x S tensor). Forward-only on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    if dropout:
        raise ValueError("flex_attention has no attention dropout; set attention_dropout=0.")
    B, S = q.shape[0], q.shape[2]

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
                ok = (ok & valid[b, ki]) | ((qi == ki) & ~valid[b, qi])
            return ok

        per_row = doc is not None or valid is not None
        return create_block_mask(mask_mod, B if per_row else None, None, S, S, device=q.device)

    block_mask = mask.cached(("flex", str(q.device), sliding_window, B), build)
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, qi, ki):
            return torch.tanh(score / softcap) * softcap
    o = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2)


def _flash_varlen(module: str):
    def kernel(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0):
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
