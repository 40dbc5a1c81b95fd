"""The checks of a global causal-LM batch before :func:`~ulysses_sp.data.shard_batch` cuts it, one message per
mistake: shapes and keys (:func:`validated_tensors`), what only the whole sequence may compute (images, the
multimodal rope index), packed rows without positions, and one batch per SP group (:func:`check_batch`,
:func:`validate_same_batch`: one small all-gather).

Shape legend: B batch, S global sequence, R rows of MRoPE positions (3 or 4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ulysses_sp.comm.collectives import check_same_across_ranks

SEQ_KEYS = ("attention_mask", "labels", "position_ids", "shift_labels", "token_type_ids")
_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs", "inputs_embeds")
"""Batch keys whose values the model merges into the embeddings of the WHOLE sequence (refused)."""
_GRID_KEYS = ("image_grid_thw", "video_grid_thw")
"""With them and no ``position_ids``, a VL model would compute its rope index on the local shard."""
_MROPE_ROWS = (3, 4)
VISION_KEYS = (*_MEDIA_KEYS, *_GRID_KEYS, "second_per_grid_ts")
"""The vision inputs of a VLM batch (``UlyssesSP.shard`` keeps them, with the full tokens, for the model)."""
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx", "max_length_q", "max_length_k")
"""Batch keys of packed-attention collators; their presence means the rows are packed documents."""



def check_sp(sp_rank: int, sp_size: int) -> None:
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}; use SPMesh.sp_size.")
    if not isinstance(sp_rank, int) or isinstance(sp_rank, bool) or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank!r}; use SPMesh.sp_rank.")


def validated_tensors(
    batch: Mapping[str, Any], sp_rank: int, sp_size: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None]:
    """``input_ids`` and the ``SEQ_KEYS`` tensors (None where absent), shapes checked."""
    check_sp(sp_rank, sp_size)
    input_ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(
            f"batch['input_ids'] must be a non-empty (batch, seq) tensor, got {shape}; collate "
            "sequences into a 2-D tensor (add a batch dim with input_ids[None] for one sequence)."
        )
    _check_multimodal(batch)
    found = []
    for key in SEQ_KEYS:
        t = batch.get(key)
        if key == "position_ids" and _is_mrope(t, input_ids):
            found.append(t)
            continue
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != input_ids.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"batch[{key!r}] must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape}; "
                "pass 2-D (batch, seq) tensors from one collator (4-D attention masks are not "
                "supported: give position_ids for packed documents instead; MRoPE position_ids may "
                "also be (3, batch, seq) or (4, batch, seq))."
            )
        found.append(t)
    return input_ids, *found  # type: ignore[return-value]


def _is_mrope(t: Any, input_ids_BS: torch.Tensor) -> bool:
    """``t`` is MRoPE ``position_ids`` ``(R, B, S)`` with R in (3, 4) for ``input_ids`` ``(B, S)``."""
    return (isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] in _MROPE_ROWS
            and t.shape[1:] == input_ids_BS.shape)


def _check_multimodal(batch: Mapping[str, Any]) -> None:
    """Refuse what a VL model would compute from the whole sequence while it only sees its shard."""
    media = [k for k in _MEDIA_KEYS if batch.get(k) is not None]
    if media:
        raise ValueError(
            f"batch carries {media}: under Ulysses SP each rank holds only its shard of input_ids, while a "
            "vision-language model merges ALL image / video features into the image tokens of its input (a "
            "feature-count mismatch, or features on the wrong tokens). Sequence-parallel training here covers "
            "the text tower here: shard batches with images through UlyssesSP.shard (it keeps the full tokens "
            "and pixels for the model, which merges the features on the whole sequence), or feed input_ids-only "
            "batches (3-D position_ids from get_rope_index are fine)."
        )
    grids = [k for k in _GRID_KEYS if batch.get(k) is not None]
    if grids and batch.get("position_ids") is None:
        raise ValueError(
            f"batch carries {grids} but no position_ids: the multimodal rope index needs the FULL sequence, "
            "and a sharded model would compute it from its shard only. Compute it on the full batch before "
            "sharding, e.g. batch['position_ids'] = model.model.get_rope_index(input_ids, "
            "mm_token_type_ids=..., image_grid_thw=..., video_grid_thw=..., attention_mask=...)[0] "
            "(packed rows: per document, concatenated on the last dim)."
        )


def validate_same_batch(input_ids_BS: torch.Tensor, group: ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold the same global batch.

    One ``all_gather`` of ``[B, S, checksum]`` (int64); the checksum weights each token by its
    position, so reordered batches differ too. Call it with the GLOBAL ``input_ids`` (before
    :func:`shard_batch`) and the SP group.
    """
    B, S = input_ids_BS.shape
    check_same_across_ranks([B, S, _checksum(input_ids_BS)], group, _different_batches)


def _checksum(t: torch.Tensor) -> int:
    """Position-weighted sum of an integer tensor (reordered values differ too)."""
    flat = t.reshape(-1).long()
    weights = torch.arange(flat.numel(), device=flat.device) % 1_000_003 + 1
    return int((flat * weights).sum())


_CHECKED_KEYS = ("labels", "shift_labels", "position_ids", "attention_mask")


def _validate_same_fields(batch: Mapping[str, Any], group: ProcessGroup | None,
                          agree: Mapping[str, Sequence[int]], agree_hint: str) -> None:
    """:func:`validate_same_batch` over ``input_ids`` and the fields that set targets and masks
    (``labels``, ``shift_labels``, ``position_ids``, ``attention_mask``), and ``agree``'s values,
    in one all-gather."""
    input_ids = batch["input_ids"]
    present = [(k, batch[k]) for k in _CHECKED_KEYS if isinstance(batch.get(k), torch.Tensor)]
    fields = [*input_ids.shape, _checksum(input_ids), *(_checksum(t) for _, t in present)]
    values = fields + [int(v) for vs in agree.values() for v in vs]

    def describe(rows: list[tuple[int, ...]]) -> str:
        differ, start = [], len(fields)
        for name, vs in agree.items():
            if len({row[start : start + len(vs)] for row in rows}) > 1:
                differ.append(name)
            start += len(vs)
        if differ:
            return f"the ranks of one SP group differ in: {'; '.join(differ)}. {agree_hint}"
        if len({row[:3] for row in rows}) > 1:
            return _different_batches([row[:3] for row in rows])
        keys = [k for i, (k, _) in enumerate(present) if len({row[3 + i] for row in rows}) > 1]
        return (f"all ranks of an SP group must see the same batch: input_ids agree but {keys} differ between "
                "the ranks (a collator with per-rank randomness, or fields built per rank?). Build the whole batch "
                "identically on every rank of the group (same seed), then let UlyssesSP.shard cut it.")

    check_same_across_ranks(values, group, describe)


def _different_batches(rows: list[tuple[int, ...]]) -> str:
    return (
        "all ranks of an SP group must see the same batch, got (B, S, checksum) per rank "
        f"{rows}. Split data over data-parallel replicas, not over the world: UlyssesTrainer / "
        "UlyssesSFTTrainer / UlyssesAccelerate.prepare do this for their loaders; an eval or custom batch "
        "must be the same on the ranks of a group (same length too); in a plain loop use UlyssesDataLoader "
        "with a sampler built from dp_sampler_kwargs(mesh) (num_replicas=dp_size, rank=dp_rank)."
    )


def check_batch(
    batch: Mapping[str, Any], sp_group: ProcessGroup | None = None, *, packed: bool = False,
    agree: Mapping[str, Sequence[int]] | None = None, agree_hint: str = "",
) -> None:
    """The checks every path runs before :func:`shard_batch`, with one message per mistake.

    1. A packed batch has ``position_ids``: ``packed=True`` (the caller knows the rows are packed,
       e.g. a dataset with ``position_ids`` or ``padding_free``) or a packed-attention key such as
       ``cu_seq_lens_q`` in the batch. Without positions, documents would attend to each other.
    2. With ``sp_group`` (of more than one rank): every rank holds the same global batch
       (:func:`validate_same_batch` on ``input_ids``, and the same ``labels`` / ``shift_labels`` /
       ``position_ids`` / ``attention_mask``: one tiny all-gather). ``agree``: further named
       integers the ranks must share (``UlyssesSP``: config, model shape, a weight checksum),
       compared in the same all-gather; ``agree_hint`` ends the message when they differ.
    """
    if not isinstance(batch, Mapping) or batch.get("input_ids") is None:
        validated_tensors(batch, 0, 1)  # raises with the input_ids message
    found = [k for k in PACKED_KEYS if k in batch]
    if (packed or found) and batch.get("position_ids") is None:
        why = f"{found[0]} present" if found else "the dataset rows carry position_ids, or padding_free=True"
        raise ValueError(
            f"the batch is packed ({why}) but has no position_ids: the collated batch has none, so documents "
            "would attend across their boundaries. Use a collator that keeps them, e.g. "
            "DataCollatorWithFlattening(return_position_ids=True) or TRL's collator with padding_free=True."
        )
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        _validate_same_fields(batch, sp_group, agree or {}, agree_hint)
