"""SDPA on packed, padded and windowed rows without an S x S mask.

Shape legend: B batch, S global sequence, T = B*S flat tokens, n query heads, k kv heads, H head
dim, Hv value head dim, m documents of a bucket, L its padded length.

    sdpa_bucketed   documents grouped by length (:meth:`GlobalMask.buckets`), one SDPA call per
                    bucket with the documents on the batch axis:

        q (B,n,S,H) -> (n,T,H) -index_select(gather)-> per bucket (m,n,L,H) -SDPA-> (m,n,L,Hv)
        o (B,S,n,Hv) <-index_select(inverse)- cat[buckets' (n, m*L, Hv)..., padding values]

                    two gathers and one scatter-as-gather per call, all differentiable, so the
                    backward pass is bucketed too.
    sdpa_windowed   query blocks of ``t`` rows, keys ``[start - w + 1, end)``, one mask block each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ulysses_sp.attention.heads import repeat_kv
from ulysses_sp.attention.masks import GlobalMask


def _flat_heads(x_BnSH: torch.Tensor) -> torch.Tensor:
    """``(B, n, S, H)`` -> ``(n, B*S, H)`` (a view when B == 1)."""
    B, n, S, H = x_BnSH.shape
    return x_BnSH.transpose(0, 1).reshape(n, B * S, H)


def sdpa_bucketed(q, k, v, mask: GlobalMask, window: int | None = None, **kw) -> torch.Tensor:
    """``(B, n, S, Hv)`` attention inside documents, one SDPA call per length bucket.

    ``q`` ``(B, n, S, H)``, ``k``/``v`` ``(B, k, S, H/Hv)``; ``kw`` go to SDPA (``scale``,
    ``dropout_p``, ``enable_gqa``). A bucket's documents are padded at their ends: with causal
    attention the padded keys lie after every real query (no mask; padded query rows are
    dropped), otherwise a ``(m, 1, 1, L)`` key mask hides them. With a window ``w < L`` the
    bucket runs :func:`sdpa_windowed` on its own ``(m, ., L, .)`` batch. Padding tokens of the
    row see only themselves: their output is their value, as in the per-document path.
    """
    B, n, S, _ = q.shape
    plan = mask.buckets(B, q.device)
    q_f, k_f, v_f = (_flat_heads(t) for t in (q, k, v))
    parts = [t.index_select(1, plan.gather).split(plan.sizes, dim=1) for t in (q_f, k_f, v_f)]
    outs = []
    for bucket, q_b, k_b, v_b in zip(plan.buckets, *parts):
        m, L = bucket.num_docs, bucket.length
        q_b, k_b, v_b = (t.view(t.shape[0], m, L, t.shape[2]).transpose(0, 1) for t in (q_b, k_b, v_b))
        if window is not None and window < L:
            rule = GlobalMask(L, mask.causal, valid=None if mask.causal else bucket.key_valid)
            o = sdpa_windowed(q_b, k_b, v_b, rule, window, block_rows=min(max(window, 128), 1024), **kw)
        elif mask.causal:
            o = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, **kw)
        else:
            keys = None if bucket.slots is None else bucket.key_valid[:, None, None, :]
            o = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=keys, **kw)
        outs.append(o.transpose(0, 1).reshape(n, m * L, o.shape[3]))
    if len(plan.padding):
        outs.append(repeat_kv(v_f.index_select(1, plan.padding), n, dim=0))
    o_nTH = torch.cat(outs, dim=1).index_select(1, plan.inverse)
    return o_nTH.view(n, B, S, -1).transpose(0, 1)


def sdpa_windowed(q, k, v, mask: GlobalMask, window: int, *, block_rows: int, **kw) -> torch.Tensor:
    """``(B,n,S,Hv)`` sliding-window attention as query blocks, never an S x S mask.

    Query rows ``[a, e)`` can only reach keys ``[a - w + 1, e)`` (causal) or ``[a - w + 1, S)``
    (not causal); each block is one SDPA call with the ``(B or 1, 1, e - a, reach)`` block of
    the global rule (:meth:`GlobalMask.block`: window, documents, padding). Every query sees at
    least itself, so no row is empty. Work and memory O(S * (block_rows + w)).
    """
    S = q.shape[2]
    parts = []
    for a in range(0, S, block_rows):
        e = min(S, a + block_rows)
        c0, c1 = max(0, a - window + 1), e if mask.causal else S
        allowed = mask.block(a, c0, e - a, c1 - c0, q.device, window)[:, None]
        kv = k[:, :, c0:c1], v[:, :, c0:c1]
        parts.append(F.scaled_dot_product_attention(q[:, :, a:e], *kv, attn_mask=allowed, **kw))
    return torch.cat(parts, dim=2)
