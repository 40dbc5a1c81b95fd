"""Grouped-query attention: kv heads shared by groups of query heads.

Shape legend: k kv heads, n query heads (n % k == 0); query head i reads kv head i // (n / k).
"""

from __future__ import annotations

import torch


def repeat_kv(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """``x`` with its ``k`` kv heads on ``dim`` repeated to ``n`` query heads (``x`` itself when k == n).

    ``(B, k, S, H)`` -> ``(B, n, S, H)`` with the default ``dim=1``; head ``i`` of the result is kv
    head ``i // (n / k)``, the order of ``enable_gqa`` in SDPA and of Transformers' ``repeat_kv``.
    """
    k = x.shape[dim]
    if n % k:
        raise ValueError(f"{n} query heads cannot share {k} kv heads; the query heads must be a multiple.")
    return x if k == n else x.repeat_interleave(n // k, dim=dim)
