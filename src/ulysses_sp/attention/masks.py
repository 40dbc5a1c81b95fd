"""The mask of the GLOBAL sequence, described compactly and shared by every layer of one step.

Shape legend: B batch, S global sequence length.

A :class:`GlobalMask` holds O(B*S) data (document ids, padding), never an S x S matrix. Kernels ask
it for the form they can use, each built once per step and cached on the object:

    ============  ==========================================================  =====================
    kernel        form                                                        mask memory
    ============  ==========================================================  =====================
    flash varlen  ``cu_seqlens`` over the flattened batch                     O(docs)
    sdpa          per-document calls (:meth:`segments`, :meth:`compacted`);   O(B*S)
                  with a window: query blocks, one :meth:`block` each         + O(B*t*(t+w)) a block
    flex          block counts (:meth:`flex_blocks`), built 128 rows a time   O(B*S^2/128^2)
    eager         dense bool mask (:meth:`dense`), the small-S fallback       O(B*S^2)
    ============  ==========================================================  =====================

Only :meth:`dense` builds an S x S tensor; every other form is O(B*S) plus one block at a time.

Documents come from global ``position_ids``: a new document starts wherever a position is not the
previous one plus one (the convention of padding-free / packing collators).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ulysses_sp.attention.buckets import Buckets, build_buckets

T = TypeVar("T")


def document_ids_from_position_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` positions -> ``(B, S)`` document index per row (0, 0, 0, 1, 1, 2, ...)."""
    if position_ids_BS.dim() != 2:
        raise ValueError(f"position_ids must be (batch, seq), got shape {tuple(position_ids_BS.shape)}.")
    starts = torch.ones_like(position_ids_BS, dtype=torch.bool)
    starts[:, 1:] = position_ids_BS[:, 1:] != position_ids_BS[:, :-1] + 1
    return starts.long().cumsum(dim=1) - 1


@dataclass(eq=False)
class GlobalMask:
    """Who may attend to whom in the global ``(B, S)`` batch.

    Args:
        seq_len: global sequence length S.
        causal: query i sees keys j <= i.
        document_ids: optional ``(B, S)`` ints; tokens only see keys of the same document.
        valid: optional ``(B, S)`` bool; ``False`` marks padding keys. A padding query sees only
            itself (finite output, ignored by the loss) so no row is fully masked.
        max_position: the largest position id of the batch before it was padded for sharding
            (``None``: unknown). RoPE variants that choose their frequencies from the sequence
            length (dynamic NTK, LongRoPE) must see this, not their shard's largest position.
    """

    seq_len: int
    causal: bool = True
    document_ids: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    max_position: int | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("document_ids", "valid"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 2 or t.shape[1] != self.seq_len):
                raise ValueError(f"{name} must be (batch, {self.seq_len}), got {tuple(t.shape)}.")
        if self.valid is not None and self.valid.dtype != torch.bool:
            self.valid = self.valid.bool()
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None

    @classmethod
    def from_position_ids(
        cls, position_ids_BS: torch.Tensor, valid_BS: torch.Tensor | None = None, causal: bool = True,
        max_position: int | None = None,
    ) -> GlobalMask:
        """Mask of a (possibly packed) batch from its GLOBAL ``position_ids`` and padding mask."""
        doc = document_ids_from_position_ids(position_ids_BS)
        has_docs = bool((doc[:, -1] > 0).any())
        return cls(position_ids_BS.shape[1], causal, doc if has_docs else None, valid_BS, max_position)

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is just causal (kernels use their built-in causal path)."""
        return self.causal and self.document_ids is None and self.valid is None

    def cached(self, key: tuple, build: Callable[[], T]) -> T:
        """``build()`` once per ``key`` for this mask (kernels keep their mask forms here, per step)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def dense(self, device: torch.device, sliding_window: int | None = None) -> torch.Tensor | None:
        """``(B or 1, 1, S, S)`` bool, True = may attend; ``None`` when nothing is masked."""
        if not self.causal and self.document_ids is None and self.valid is None and sliding_window is None:
            return None
        return self.cached(("dense", str(device), sliding_window), lambda: self._build_dense(device, sliding_window))

    def _build_dense(self, device: torch.device, window: int | None) -> torch.Tensor:
        return self.block(0, 0, self.seq_len, self.seq_len, device, window)[:, None]

    def block(
        self, row0: int, col0: int, num_rows: int, num_cols: int, device: torch.device, window: int | None = None
    ) -> torch.Tensor:
        """``(B or 1, num_rows, num_cols)`` bool: may query ``row0 + a`` attend to key ``col0 + b``.

        The rule of :meth:`dense` restricted to one block (ring attention builds one per step):
        causal, sliding window, same document, and padding queries see only themselves.
        """
        i = torch.arange(row0, row0 + num_rows, device=device)[:, None]
        j = torch.arange(col0, col0 + num_cols, device=device)[None, :]
        allowed = torch.ones(1, num_rows, num_cols, dtype=torch.bool, device=device)
        if self.causal:
            allowed = allowed & (j <= i)
        if window is not None:
            allowed = allowed & (i - j < window)
        if self.document_ids is not None:
            doc = self.document_ids.to(device)
            allowed = allowed & (doc[:, row0 : row0 + num_rows, None] == doc[:, None, col0 : col0 + num_cols])
        if self.valid is not None:
            valid = self.valid.to(device)
            valid_rows = valid[:, row0 : row0 + num_rows, None]
            allowed = (allowed & valid_rows & valid[:, None, col0 : col0 + num_cols]) | ((i == j) & ~valid_rows)
        return allowed

    def segments(self) -> list[list[tuple[int, int]]]:
        """Per row, the ``(start, end)`` runs of one document and one padding state."""
        return self.cached(("segments",), self._build_segments)

    def _build_segments(self) -> list[list[tuple[int, int]]]:
        keys = []
        if self.document_ids is not None:
            keys.append(self.document_ids.cpu())
        if self.valid is not None:
            keys.append(self.valid.cpu().long())
        B = keys[0].shape[0] if keys else 1
        rows = []
        for b in range(B):
            change = torch.zeros(self.seq_len, dtype=torch.bool)
            change[0] = True
            for key in keys:
                change[1:] |= key[b, 1:] != key[b, :-1]
            starts = change.nonzero().flatten().tolist() + [self.seq_len]
            rows.append(list(zip(starts[:-1], starts[1:])))
        return rows

    def compacted(self, device: torch.device) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """Per row, the real (non-padding) tokens side by side and their documents among them.

        Returns, for each row, ``(index, runs)``: ``index`` the int64 positions of the row's valid
        tokens on ``device`` (in order) and ``runs`` the ``(start, end)`` spans of one document in
        that compacted order. Dropping the padding keys keeps the order of the rest, so "causal
        within the document, valid keys only" is plain causal attention inside each run, wherever
        the padding sat (left, right or inside a document). Padding queries are not in ``index``:
        they see only themselves.
        """
        return self.cached(("compacted", str(device)), lambda: self._build_compacted(device))

    def _build_compacted(self, device: torch.device) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        valid = self.valid.cpu() if self.valid is not None else torch.ones(1, self.seq_len, dtype=torch.bool)
        docs = self.document_ids.cpu() if self.document_ids is not None else torch.zeros_like(valid, dtype=torch.long)
        valid, docs = torch.broadcast_tensors(valid, docs)
        rows = []
        for b in range(valid.shape[0]):
            index = valid[b].nonzero().flatten()
            doc = docs[b, index]
            starts = [0] + (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist() + [len(index)]
            rows.append((index.to(device), list(zip(starts[:-1], starts[1:])) if len(index) else []))
        return rows

    def flex_blocks(
        self, device: torch.device, window: int | None = None, block_size: int = 128
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block sparsity of flex attention without the S x S mask.

        Returns ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` with shapes
        ``(B or 1, 1, Qb)`` / ``(B or 1, 1, Qb, Kb)`` (int32, ``Qb = Kb = ceil(S / block_size)``),
        the arguments of ``BlockMask.from_kv_blocks`` and what ``create_block_mask`` computes, but
        one row of blocks at a time: :meth:`block` over ``block_size`` query rows and only the key
        columns they can reach (causal: up to the block's end; window: from ``start - w + 1``), so
        the largest temporary is ``(B, block_size, reach)`` bools. A block is *full* when every
        entry is allowed (a ragged last block never is, as in ``create_block_mask``).
        """
        S, t = self.seq_len, block_size
        num = -(-S // t)
        rows = max(t.shape[0] if t is not None else 1 for t in (self.document_ids, self.valid))
        partial = torch.zeros(rows, num, num, dtype=torch.int8, device=device)
        full = torch.zeros_like(partial)
        for qb in range(num):
            r0, r1 = qb * t, min(S, qb * t + t)
            c0 = 0 if window is None else max(0, r0 - window + 1) // t * t
            c1 = min(S, r1) if self.causal else S
            allowed = self.block(r0, c0, r1 - r0, c1 - c0, device, window)
            padded = torch.zeros(allowed.shape[0], t, -(-(c1 - c0) // t) * t, dtype=torch.bool, device=device)
            padded[:, : r1 - r0, : c1 - c0] = allowed
            count = padded.view(allowed.shape[0], t, -1, t).sum(dim=(1, 3))  # (B or 1, key blocks in reach)
            kb = slice(c0 // t, c0 // t + count.shape[1])
            partial[:, qb, kb] = ((count > 0) & (count < t * t)).to(torch.int8)
            full[:, qb, kb] = (count == t * t).to(torch.int8)

        def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            order = torch.argsort(blocks, dim=-1, descending=True, stable=True)
            return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

        return (*ordered(partial), *ordered(full))

    def cu_seqlens(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(int32 offsets, max length)`` of the segments over the flattened ``(B*S)`` tokens.

        Padding runs become their own segments, so a varlen kernel never mixes them with real
        tokens. Used by flash-attention's ``*_varlen_func``.
        """

        def build():
            rows = self.segments()
            self._check_no_split_documents(rows)
            if len(rows) == 1 and batch_size > 1:
                rows = rows * batch_size
            lengths = [e - a for row in rows for a, e in row]
            offsets = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            return offsets.to(device), max(lengths)

        return self.cached(("cu", batch_size, str(device)), build)

    def _check_no_split_documents(self, rows: list[list[tuple[int, int]]]) -> None:
        if self.valid is None:
            return
        doc = self.document_ids if self.document_ids is not None else torch.zeros_like(self.valid, dtype=torch.long)
        for b, row in enumerate(rows):
            docs = [int(doc[b, a]) for a, _ in row if bool(self.valid[b, a])]
            if len(docs) != len(set(docs)):
                raise ValueError(
                    "padding sits inside a document (row %d); varlen kernels need padding at the "
                    "ends of documents. Pad at the end of each sequence, or use sdpa / eager." % b
                )

    def buckets(self, batch_size: int, device: torch.device) -> Buckets:
        """The documents of the ``(batch_size, S)`` batch grouped by length (:mod:`.buckets`).

        Documents are the runs of :meth:`compacted` (padding dropped, so padding inside a
        document is fine), over every row; the flat token of row ``b``, position ``i`` is
        ``b * S + i``. Built once per mask and device.
        """

        def build() -> Buckets:
            rows = self.compacted(torch.device("cpu"))
            if len(rows) == 1 and batch_size > 1:
                rows = rows * batch_size
            S, documents = self.seq_len, []
            valid = torch.zeros(batch_size * S, dtype=torch.bool)
            for b, (index, runs) in enumerate(rows):
                flat = index + b * S
                valid[flat] = True
                documents.extend(flat[a:e] for a, e in runs)
            padding = (~valid).nonzero().flatten()
            return build_buckets(documents, padding, batch_size * S, self.causal, device)

        return self.cached(("buckets", batch_size, str(device)), build)
