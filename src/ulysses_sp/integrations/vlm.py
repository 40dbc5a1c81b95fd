"""Vision-language models under SP: the text tower is sharded, the vision / audio towers are not.

With images, every rank runs the vision tower on all images and the model merges the features into
the embeddings of the FULL sequence; a pre-hook on the language model keeps this rank's slice::

    shard_with_images(batch)        text fields sharded; full padded input_ids + pixels kept
    model(input_ids=full, pixel_values=..., ...)
      vision tower (full inputs, its own kernel) -> merged embeddings (B, S, D)
      SlicedEmbeddings pre-hook on model.model.language_model -> (B, s, D) of my tokens
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from ulysses_sp.attention import GlobalMask
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.data import ShardedBatch, shard_batch
from ulysses_sp.data.checks import VISION_KEYS
from ulysses_sp.integrations.hf_internals import builds_bidirectional_blocks, config_attn_implementation


def language_model(model: PreTrainedModel) -> torch.nn.Module | None:
    """The text tower of a vision-language model (``model.model.language_model``), else None."""
    inner = getattr(model, "model", None)
    language_model = getattr(inner, "language_model", None) if inner is not None else None
    return language_model if isinstance(language_model, torch.nn.Module) else None


def tower_implementations(model: PreTrainedModel) -> dict[str, str]:
    """``{sub-config name: attention implementation}`` of a multimodal model's non-text towers."""
    config, text = model.config, model.config.get_text_config()
    towers = {}
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        implementation = config_attn_implementation(sub) if sub is not None and sub is not text else None
        if implementation is not None:
            towers[name] = implementation
    return towers


def uses_mrope(model: PreTrainedModel) -> bool:
    """Whether the text decoder applies multimodal rotary embeddings (``mrope_section`` in its rope config)."""
    config = model.config.get_text_config()
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope



def check_vision_batch(base: PreTrainedModel, forward_args: frozenset[str], batch: Mapping[str, Any]) -> None:
    """Refuse what a VLM batch would train silently wrong under SP (``ValueError`` with the fix).

    - ``position_ids`` ``(3, B, S)`` (MRoPE) for a model without ``mrope_section``;
    - image / prefix blocks (``token_type_ids`` / ``mm_token_type_ids`` not 0) that the model lets
      attend bidirectionally: the global mask is causal.
    """
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 3 and not uses_mrope(base):
        raise ValueError(
            f"position_ids of shape {tuple(positions.shape)} are multimodal (MRoPE) positions, but "
            f"{type(base).__name__} has no mrope_section in its rope config; give (batch, seq) position_ids."
        )
    for key in ("token_type_ids", "mm_token_type_ids"):
        types = batch.get(key)
        if (key in forward_args and isinstance(types, torch.Tensor) and bool((types != 0).any())
                and builds_bidirectional_blocks(base)):
            raise ValueError(
                f"batch[{key!r}] marks tokens that {type(base).__name__} lets attend bidirectionally "
                "(image / prefix blocks), but Ulysses SP's global mask is causal: those tokens would train "
                "differently than in one process. Train this model with sp_size=1, or on text-only batches "
                f"(all {key} 0)."
            )


def shard_with_images(
    base: PreTrainedModel, mesh: SPMesh, batch: Mapping[str, Any], ignore_index: int
) -> ShardedBatch | None:
    """A VLM batch with images: text fields sharded, the full padded tokens and pixels kept for the
    model in ``shard["vision_inputs"]`` (it merges the features on the whole sequence;
    :class:`SlicedEmbeddings` slices). None for a batch without pixel inputs."""
    media = {k: v for k, v in batch.items() if k in VISION_KEYS and v is not None}
    if media.get("pixel_values") is None and media.get("pixel_values_videos") is None:
        return None
    if language_model(base) is None:
        raise ValueError(f"the batch carries {sorted(media)} but {type(base).__name__} has no vision tower "
                         "(model.model.language_model); feed input_ids-only batches.")
    if batch.get("position_ids") is None:
        raise ValueError("a batch with images needs position_ids computed on the FULL batch (the multimodal rope "
                         "index), e.g. model.model.get_rope_index(input_ids, ..., image_grid_thw=...)[0].")
    if "inputs_embeds" in media or "mm_encoder_outputs" in media:
        raise ValueError("pass pixel inputs, not precomputed inputs_embeds / mm_encoder_outputs, under SP.")
    text = {k: v for k, v in batch.items() if k not in VISION_KEYS}
    shard = shard_batch(text, mesh.sp_rank, mesh.sp_size, ignore_index=ignore_index)
    ids = batch["input_ids"]
    pad = getattr(base.config.get_text_config(), "pad_token_id", None) or 0
    num_pad = -ids.shape[1] % mesh.sp_size  # never an image token: the model counts them
    full = torch.nn.functional.pad(ids, (0, num_pad), value=pad)
    shard["vision_inputs"] = {"input_ids": full, **{k: v for k, v in media.items() if k != "input_ids"}}
    return shard


class SlicedEmbeddings:
    """Pre-hook of a VLM's language model: keep my slice of the full-sequence merged embeddings.

    With images (:func:`shard_with_images`) every rank runs the vision tower on all images and
    merges the features into the embeddings of the FULL sequence; the text tower then gets this
    rank's ``s`` tokens of them (and of Qwen3-VL's deepstack features). Each image token lives in one
    rank's slice, so the vision tower's gradients, summed over the SP group by DDP, are those of one
    process. Text-only batches arrive sharded and pass unchanged.

    Args:
        mesh: the SP mesh (this rank's slice).
        current_mask: the ``ulysses_mask`` of the model call in progress (None outside one).
    """

    def __init__(self, mesh: SPMesh, current_mask: Callable[[], GlobalMask | None]) -> None:
        self.mesh, self.current_mask = mesh, current_mask

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        embeds = kwargs.get("inputs_embeds")
        mask = self.current_mask()
        if embeds is None or mask is None or embeds.shape[1] != mask.seq_len:
            return None
        s = mask.seq_len // self.mesh.sp_size
        a, b = self.mesh.sp_rank * s, (self.mesh.sp_rank + 1) * s
        kwargs = {**kwargs, "inputs_embeds": embeds[:, a:b]}
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:  # deepstack features: rows in the order of the full mask's True positions
            mine = torch.zeros_like(visual)
            mine[:, a:b] = visual[:, a:b]
            keep = mine[visual]
            kwargs["visual_pos_masks"] = visual[:, a:b]
            if kwargs.get("deepstack_visual_embeds") is not None:
                kwargs["deepstack_visual_embeds"] = [e[keep] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs
