"""Cut one collated causal-LM batch into the contiguous sequence shard of one SP rank.

Shape legend: B batch, S global sequence (padded to a multiple of P), s = S / P local shard,
P sequence-parallel size, r this rank's SP index.

Every rank of an SP group receives the SAME global batch and keeps tokens ``[r*s, (r+1)*s)``::

    input_ids     a b c d e f g          S=7, P=2
    labels        a b c d e f g
    1. position_ids (if missing)         0 1 2 3 4 5 6
    2. shift labels BEFORE slicing       b c d e f g -        (- = ignore_index)
    3. pad S to a multiple of P          a b c d e f g 0      labels ... g - -, positions ... 6 7
    4. global mask (once, whole S)       causal + documents (from positions) + padding
    5. slice                             rank 0: a b c d -> b c d e    rank 1: e f g 0 -> f g - -

Shifting before slicing keeps the target of a shard's last token (``e`` for rank 0), which lives on
the next rank. Padding added in step 3 gets positions that continue the row's last document
(``last+1, last+2, ...``); it is excluded from attention by the mask's ``valid`` and from the loss
by ``ignore_index``, so its positions only need to be finite and not to start a spurious pattern.

The mask is built from GLOBAL positions and handed to the attention layer as ``ulysses_mask``; the
model never builds a mask of its own (no ``attention_mask`` is passed on).

Multimodal rotary positions (MRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL text towers) come as
``position_ids`` of shape ``(R, B, S)``, R = 3 (temporal, height, width) or 4 (a row of TEXT
positions first, then the three MRoPE rows, as transformers' VL text models accept). They are
padded and sliced along their LAST dim, all rows alike; documents come from the text row::

    R = 4   documents from row 0, by the 1-D rule (a position that is not the previous + 1)
    R = 3   a document starts where all three rows restart at 0 (vision tokens repeat and jump
            inside a row, so the 1-D rule would split images); give R = 4 to be explicit

Batches with images or videos (``pixel_values``...) are refused here: the model would merge ALL image
features into the image tokens of its local shard. ``UlyssesSP.shard`` handles them (the model gets
the full tokens and pixels, and its language model keeps this rank's slice of the merged
embeddings). Their rope index needs the full sequence too: compute ``position_ids`` with the
model's ``get_rope_index`` on the FULL batch before sharding.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.config import IGNORE_INDEX
from ulysses_sp.data.checks import check_batch, check_sp, validated_tensors

if TYPE_CHECKING:
    from ulysses_sp.comm.mesh import SPMesh

class _ShardedBatchKeys(TypedDict):
    """The keys every :class:`ShardedBatch` has (a base class: ``typing.Required`` is Python >= 3.11)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    ulysses_mask: GlobalMask


class ShardedBatch(_ShardedBatchKeys, total=False):
    """What :func:`shard_batch` returns: a plain ``dict``, so ``model(**batch)`` works and
    Trainer / Accelerate device moves keep it intact.

    input_ids:     ``(B, s)`` this rank's tokens ``[r*s, (r+1)*s)`` of the padded sequence.
    position_ids:  ``(B, s)`` their GLOBAL positions (RoPE is applied locally with them);
                   ``(R, B, s)`` for MRoPE positions given as ``(R, B, S)``, R = 3 or 4.
    shift_labels:  ``(B, s)`` the target of each local token (the next global token), already
                   shifted, ``ignore_index`` for padding and the last token of each row.
    ulysses_mask:  the :class:`GlobalMask` of the whole padded ``(B, S)`` batch, equal on all
                   ranks; ``ulysses_mask.seq_len`` is the padded global length S.
    token_type_ids: ``(B, s)`` this rank's slice of the batch's ``token_type_ids`` (only when the
                   batch has them; the S padding gets type 0).
    """

    token_type_ids: torch.Tensor


def shard_batch(
    batch: Mapping[str, Any],
    sp_rank: int,
    sp_size: int,
    *,
    pad_token_id: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> ShardedBatch:
    """This rank's shard of a global causal-LM batch (flow in the module docstring).

    Args:
        batch: ``input_ids`` ``(B, S)`` and optionally ``attention_mask`` ``(B, S)`` of 0/1,
            ``labels`` ``(B, S)`` (default: ``input_ids`` with padding set to ``ignore_index``) or
            ``shift_labels`` ``(B, S)``, labels already shifted (the target of each position, as
            transformers' loss and Accelerate's context parallelism take them; with both, these
            win, as in transformers), ``token_type_ids`` ``(B, S)`` (sliced like the tokens) and
            ``position_ids`` ``(B, S)`` (packed batches: restarting at 0 for each document;
            default: ``arange(S)`` per row, as transformers does) or, for MRoPE models, ``(3, B, S)``
            / ``(4, B, S)`` computed on the full batch (module docstring). Other keys
            (e.g. flash-attention ``cu_seq_lens_*``) are dropped: the global mask replaces them.
        sp_rank: this rank's index in its SP group, ``0 <= sp_rank < sp_size``.
        sp_size: ranks sharing the sequence (P).
        pad_token_id: token used to pad S up to a multiple of P; None (default): each row's last
            token repeated, and the batch's own padding (``attention_mask`` 0) replaced by the
            row's first real token. Padding is ignored by the mask and the loss, but its
            activations still flow: the padding row of an embedding is often all zeros, and a
            model taking the root of a mean square of it (Gemma3n's altup) gets NaN gradients
            (plain transformers avoids them only because its padded queries attend to every key).
        ignore_index: label value the loss skips.

    Labels are shifted exactly like transformers' ``ForCausalLMLoss`` (no extra masking at document
    boundaries: packing collators mark document starts with ``ignore_index`` themselves), except
    that a target predicted FROM a padding position is ignored (with left padding transformers
    counts the first real token predicted from padding, a value that depends on the kernel).
    """
    tensors = validated_tensors(batch, sp_rank, sp_size)
    input_ids, attention_mask, labels, position_ids, shift_labels, token_type_ids = tensors
    B, S = input_ids.shape
    if position_ids is None:
        position_ids = _default_position_ids(input_ids, attention_mask)
    if shift_labels is None:
        if labels is None:
            labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, ignore_index)
        shift_labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    if attention_mask is not None:
        # a padding position predicting the next token (left padding: the first real token) has
        # no defined context; transformers counts it with a kernel-dependent value, we ignore it
        shift_labels = shift_labels.masked_fill(attention_mask == 0, ignore_index)

    num_pad = -S % sp_size
    max_position = int(position_ids.max())  # before the padding: what one process's RoPE would see
    valid = None if attention_mask is None else attention_mask.bool()
    if valid is not None and pad_token_id is None:
        # padding holds a real token of its row: masked out of attention and the loss either way, but
        # never the pad embedding, which is all zeros in many models (see ``pad_token_id`` below)
        first_BS1 = input_ids.gather(1, valid.int().argmax(dim=1, keepdim=True))
        input_ids = torch.where(valid, input_ids, first_BS1)
    if num_pad:
        if pad_token_id is None:
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, num_pad)], dim=1)
        else:
            input_ids = F.pad(input_ids, (0, num_pad), value=pad_token_id)
        shift_labels = F.pad(shift_labels, (0, num_pad), value=ignore_index)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, num_pad), value=0)
        steps = torch.arange(1, num_pad + 1, device=position_ids.device, dtype=position_ids.dtype)
        position_ids = torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)
        if valid is None:
            valid = torch.ones(B, S, dtype=torch.bool, device=input_ids.device)
        valid = F.pad(valid, (0, num_pad), value=False)
    mask = _global_mask(position_ids, valid, max_position)

    s = (S + num_pad) // sp_size
    local = slice(sp_rank * s, (sp_rank + 1) * s)
    shard = ShardedBatch(
        input_ids=input_ids[:, local].contiguous(),
        position_ids=position_ids[..., local].contiguous(),
        shift_labels=shift_labels[:, local].contiguous(),
        ulysses_mask=mask,
    )
    if token_type_ids is not None:
        shard["token_type_ids"] = token_type_ids[:, local].contiguous()
    return shard


def _global_mask(position_ids: torch.Tensor, valid_BS: torch.Tensor | None, max_position: int) -> GlobalMask:
    """Causal mask with the documents of ``(B, S)`` or MRoPE ``(R, B, S)`` positions (module docstring)."""
    if position_ids.dim() == 2:
        return GlobalMask.from_position_ids(position_ids, valid_BS=valid_BS, causal=True, max_position=max_position)
    if position_ids.shape[0] == 4:  # row 0: text positions, as the VL text models use for their own mask
        return GlobalMask.from_position_ids(position_ids[0], valid_BS=valid_BS, causal=True, max_position=max_position)
    starts_BS = (position_ids == 0).all(dim=0)
    starts_BS[:, 0] = True
    doc_BS = starts_BS.long().cumsum(dim=1) - 1
    has_docs = bool((doc_BS[:, -1] > 0).any())
    return GlobalMask(position_ids.shape[-1], True, doc_BS if has_docs else None, valid_BS, max_position)


def _default_position_ids(input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None) -> torch.Tensor:
    """``(B, S)`` positions ``arange(S)``: what transformers uses when a batch has none (padding
    tokens included), so a sharded run sees the same rotary / absolute positions as one process."""
    B, S = input_ids_BS.shape
    return torch.arange(S, device=input_ids_BS.device).expand(B, S)


def dp_sampler_kwargs(mesh: SPMesh) -> dict[str, int]:
    """``DistributedSampler(dataset, **dp_sampler_kwargs(mesh))``: shard data by DP replica.

    The ranks of one SP group must read the same batches, so the sampler splits the dataset over
    ``dp_size`` replicas (``rank=dp_rank``), not over the world.
    """
    return {"num_replicas": mesh.dp_size, "rank": mesh.dp_rank}


class UlyssesDataLoader:
    """Iterate a DataLoader of global batches, yielding this rank's :func:`shard_batch` of each.

    Args:
        dataloader: any iterable of collated batches (dicts with ``input_ids`` ...); it must yield
            the same batches on all ranks of an SP group (see :func:`dp_sampler_kwargs`).
        sp_rank, sp_size: this rank's SP index and the SP size.
        sp_group: if given, every batch is checked with :func:`validate_same_batch` (one tiny
            all-gather per step); packed batches without ``position_ids`` are refused either way
            (:func:`check_batch`).
        **shard_kwargs: ``pad_token_id``, ``ignore_index`` for :func:`shard_batch`.
    """

    def __init__(
        self,
        dataloader: Iterable[Mapping[str, Any]],
        sp_rank: int,
        sp_size: int,
        *,
        sp_group: ProcessGroup | None = None,
        **shard_kwargs: Any,
    ) -> None:
        check_sp(sp_rank, sp_size)
        self.dataloader = dataloader
        self.sp_rank = sp_rank
        self.sp_size = sp_size
        self.sp_group = sp_group
        self.shard_kwargs = shard_kwargs

    def __len__(self) -> int:
        """Batches per epoch, as the wrapped loader (``TypeError`` if it has no length)."""
        return len(self.dataloader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[ShardedBatch]:
        for batch in self.dataloader:
            check_batch(batch, self.sp_group)
            yield shard_batch(batch, self.sp_rank, self.sp_size, **self.shard_kwargs)
