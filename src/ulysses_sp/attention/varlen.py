"""``torch_varlen``: PyTorch's own variable-length flash kernel, ``torch.nn.attention.varlen.varlen_attn``.

Shape legend: B batch, S global sequence, T = B*S flat tokens, n query heads, k kv heads, H head dim.

One call for the whole batch over the ``cu_seqlens`` that :meth:`GlobalMask.cu_seqlens` builds for
flash-attention (documents and padding runs are segments), so packed documents cost their work,
not their count, without the flash-attn package. CUDA only (fp16 / bf16), torch >= 2.10; GQA
without repeating kv where the installed function takes ``enable_gqa``.

    q (B,n,S,H) -> (T,n,H) -varlen_attn(cu, cu)-> (T,n,H) -> o (B,S,n,H)

Padding queries are then given their own value (their padding-run segment is overwritten), the
output of the sdpa path, so the two agree everywhere, gradients included.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ulysses_sp.attention.heads import repeat_kv
from ulysses_sp.attention.masks import GlobalMask

_HALF = (torch.float16, torch.bfloat16)


def varlen_function() -> Callable | None:
    """``varlen_attn`` of this torch, or ``None`` (torch < 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_usable(q: torch.Tensor, mask: GlobalMask, v: torch.Tensor | None = None) -> bool:
    """Whether :func:`torch_varlen` can run ``q``'s batch: CUDA, fp16/bf16, ``varlen_attn`` present,
    a head dim flash kernels take (<= 256, v's the same) and padding only at document ends (what
    ``cu_seqlens`` needs)."""
    if q.device.type != "cuda" or q.dtype not in _HALF or varlen_function() is None:
        return False
    if q.shape[-1] > 256 or (v is not None and v.shape[-1] != q.shape[-1]):
        return False
    try:
        mask.cu_seqlens(q.shape[0], q.device)
    except ValueError:
        return False
    return True


def _check(q: torch.Tensor, softcap, dropout, sinks) -> Callable:
    function = varlen_function()
    if function is None:
        raise ValueError(f"attention kernel 'torch_varlen' needs torch.nn.attention.varlen.varlen_attn (torch >= 2.10, "
                         f"this is {torch.__version__}): upgrade torch, or use 'sdpa' or 'flash_attention_2'.")
    if q.device.type != "cuda":
        raise ValueError(f"attention kernel 'torch_varlen' runs on CUDA only (the tensors are on {q.device.type}): "
                         "use 'sdpa' (one call per length bucket of packed documents) or flash-attention.")
    if q.dtype not in _HALF:
        raise ValueError(f"attention kernel 'torch_varlen' takes float16 / bfloat16, got {q.dtype}: load the model "
                         "in bf16 (torch_dtype=torch.bfloat16) or use 'sdpa'.")
    for name, value in (("softcapping", softcap), ("attention sinks", sinks)):
        if value is not None:
            raise ValueError(f"'torch_varlen' cannot apply {name}; use 'eager', 'flex_attention' or flash-attention.")
    if dropout:
        raise ValueError("'torch_varlen' has no attention dropout; set attention_dropout=0 or use 'sdpa'.")
    return function


def torch_varlen(q, k, v, mask: GlobalMask, *, scaling=None, sliding_window=None, softcap=None, dropout=0.0,
                 sinks=None) -> torch.Tensor:
    """``(B, S, n, Hv)``: one ``varlen_attn`` call over every document of the batch (module docstring)."""
    function = _check(q, softcap, dropout, sinks)
    B, n, S, H = q.shape
    cu, max_len = mask.cu_seqlens(B, q.device)
    if mask.document_ids is None and mask.valid is None:
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
        max_len = S
    names = inspect.signature(function).parameters
    if "enable_gqa" not in names:
        k, v = repeat_kv(k, n), repeat_kv(v, n)
    flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3]) for t in (q, k, v)]
    kw: dict = dict(scale=scaling)
    if "enable_gqa" in names:
        kw["enable_gqa"] = k.shape[1] != n
    if "window_size" in names:
        kw["window_size"] = (sliding_window - 1 if sliding_window is not None else -1, 0 if mask.causal else -1)
    elif sliding_window is not None and sliding_window < S:
        raise ValueError("this torch's varlen_attn takes no window_size: upgrade torch, or use 'sdpa'.")
    else:
        kw["is_causal"] = mask.causal
    out = function(*flat, cu, cu, max_len, max_len, **kw)
    out = out[0] if isinstance(out, tuple) else out
    if mask.valid is not None:
        padding = _padding_tokens(mask, B, q.device)
        out = out.index_copy(0, padding, repeat_kv(flat[2].index_select(0, padding), n))
    return out.view(B, S, n, v.shape[3])


def _padding_tokens(mask: GlobalMask, batch_size: int, device: torch.device) -> torch.Tensor:
    """The flat ``b * S + i`` indices of the padding tokens (int64, on ``device``)."""

    def build() -> torch.Tensor:
        valid = mask.valid.to(device).expand(batch_size, mask.seq_len)
        return (~valid).flatten().nonzero().flatten()

    return mask.cached(("padding", batch_size, str(device)), build)
