"""Documents of a packed / padded batch grouped by length: the plan of bucketed attention.

Shape legend: B batch, S global sequence, T = B*S tokens of the flattened batch, m documents of a
bucket, L a bucket's padded length.

Attention inside documents costs each document's length squared, but one kernel call per
document also costs a fixed overhead per call. A :class:`Buckets` plan stacks documents of
similar length on the batch axis, padded at the END to the bucket's length ``L``, so one call
runs a whole bucket::

    row 0: [d0 d0 d0 d1 d1 p  p  d2]        bucket L=3: [d0 d0 d0]   <- one (m=2, L=3) call
    row 1: [d3 d3 d3 d3 d3 d3 d4 d4]                    [d1 d1 d2]   (d1, d2: contiguous after
                                            bucket L=6: [d3 ... d3]   the padding p is dropped)
                                                        ...

Causal attention never looks past a query, so the padding at a document's end is invisible to
its real queries: a bucket needs no mask at all. The grouping minimises a cost model, the
attention work ``m * L^2`` plus a fixed cost per call (:func:`plan_groups`). The plan is pure
index math, built once per mask (:meth:`GlobalMask.buckets`) and shared by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CALL_COST_TOKENS = 128  # one kernel call costs about the work of one document of this many tokens
_GRID = 1.125  # lengths are first rounded up to this geometric grid (<= 27% extra work), keeping the DP small


@dataclass(frozen=True)
class Bucket:
    """``num_docs`` documents padded at the end to ``length`` tokens.

    ``index`` ``(num_docs * length,)`` int64: the flat token (``b * S + i``) of each slot, a
    padded slot repeats its document's last token. ``slots`` ``(num_real,)``: the slots holding
    real tokens (``None`` when every document has ``length`` tokens). ``key_valid``
    ``(num_docs, length)`` bool, the real slots, for attention that is not causal.
    """

    length: int
    num_docs: int
    index: torch.Tensor
    slots: torch.Tensor | None
    key_valid: torch.Tensor


@dataclass(frozen=True)
class Buckets:
    """Every document of a ``(B, S)`` batch in buckets, and the way back.

    ``gather`` ``(sum of num_docs * length,)``: all buckets' ``index`` one after another (one
    ``index_select`` gathers q, k or v for every bucket). ``padding`` ``(num_pad,)``: the flat
    padding tokens (a padding query sees only itself: its output is its value). ``inverse``
    ``(T,)``: for each flat token, its row in ``cat([bucket outputs (num_docs * length rows
    each)..., padding rows])``, so one ``index_select`` puts every output back in place.
    ``contiguous``: no document has padding inside it (distances in a bucket are then the row's
    distances, which a sliding window needs).
    """

    buckets: tuple[Bucket, ...]
    gather: torch.Tensor
    padding: torch.Tensor
    inverse: torch.Tensor
    num_documents: int
    contiguous: bool

    @property
    def sizes(self) -> list[int]:
        """Rows of each bucket in ``gather`` (``num_docs * length``)."""
        return [b.num_docs * b.length for b in self.buckets]


def plan_groups(lengths: list[int], causal: bool = True, call_cost_tokens: int = CALL_COST_TOKENS) -> list[int]:
    """Padded bucket lengths for documents of ``lengths``: the grouping of least modelled cost.

    Cost of a bucket of ``m`` documents padded to ``L``: ``m * L^2 (/2 if causal) + m * L * c``
    (work linear in tokens) ``+ c^2`` (the call), ``c = call_cost_tokens``. Lengths are rounded
    up to a geometric grid, then an O(G^2) dynamic programme over the sorted grid points picks
    contiguous groups. Returns, for each group, its largest grid length (ascending); a document
    goes to the first group whose length is >= its own.
    """
    if not lengths:
        return []
    grid = sorted({_grid_round(L) for L in lengths})
    counts = [0] * len(grid)
    position = {g: i for i, g in enumerate(grid)}
    for L in lengths:
        counts[position[_grid_round(L)]] += 1
    half = 0.5 if causal else 1.0
    c = float(call_cost_tokens)
    best = [0.0] + [math.inf] * len(grid)  # best[j]: cost of grid points [0, j)
    cut = [0] * (len(grid) + 1)
    for j in range(1, len(grid) + 1):
        L = grid[j - 1]
        m = 0
        for i in range(j - 1, -1, -1):
            m += counts[i]
            cost = best[i] + m * (half * L * L + c * L) + c * c
            if cost < best[j]:
                best[j], cut[j] = cost, i
    ends, j = [], len(grid)
    while j > 0:
        ends.append(grid[j - 1])
        j = cut[j]
    return ends[::-1]


def _grid_round(L: int) -> int:
    """The smallest point of the grid ``1..16, ceil(16 * 1.125^k)`` that is >= ``L``."""
    if L <= 16:
        return L
    k = math.ceil(math.log(L / 16, _GRID) - 1e-9)
    while math.ceil(16 * _GRID**k) < L:
        k += 1
    return math.ceil(16 * _GRID**k)


def build_buckets(documents: list[torch.Tensor], padding: torch.Tensor, num_tokens: int, causal: bool,
                  device: torch.device, call_cost_tokens: int = CALL_COST_TOKENS) -> Buckets:
    """The plan for ``documents`` (each the int64 flat tokens of one document, in order) and the
    flat ``padding`` tokens of a batch of ``num_tokens`` tokens (see :class:`Buckets`)."""
    lengths = torch.tensor([len(d) for d in documents], dtype=torch.long)
    ends = plan_groups(lengths.tolist(), causal, call_cost_tokens)
    group = torch.bucketize(lengths, torch.tensor(ends, dtype=torch.long)) if ends else lengths
    tokens = torch.cat(documents) if documents else torch.zeros(0, dtype=torch.long)
    offsets = torch.cumsum(lengths, 0) - lengths
    inverse = torch.empty(num_tokens, dtype=torch.long)
    ends_at = tokens[offsets + lengths - 1] if documents else tokens
    contiguous = bool((ends_at - tokens[offsets] + 1 == lengths).all()) if documents else True
    buckets, gathers, base = [], [], 0
    for g in range(len(ends)):
        docs = (group == g).nonzero().flatten()
        if len(docs) == 0:
            continue
        L_m, L = lengths[docs], int(lengths[docs].max())
        j = torch.arange(L)
        key_valid = j[None, :] < L_m[:, None]  # (m, L)
        index = tokens[offsets[docs, None] + torch.minimum(j[None, :], L_m[:, None] - 1)].flatten()
        real = key_valid.flatten()
        inverse[index[real]] = base + real.nonzero().flatten()
        slots = None if bool(real.all()) else real.nonzero().flatten().to(device)
        buckets.append(Bucket(L, len(docs), index.to(device), slots, key_valid.to(device)))
        gathers.append(index)
        base += len(index)
    inverse[padding] = base + torch.arange(len(padding))
    gather = torch.cat(gathers) if gathers else torch.zeros(0, dtype=torch.long)
    return Buckets(tuple(buckets), gather.to(device), padding.to(device), inverse.to(device), len(documents),
                   contiguous)
