"""What every sequence-parallel mixer forward shares: its SP context, padding and document runs.

Shape legend: B batch, S global sequence, s local shard (S / P), C conv channels, W conv width.

A mixer runs its token mixing (causal depthwise conv + recurrence) over the whole sequence of one
document at a time: the state of a packed batch starts from zero at every document start, as if
each document were its own sequence (flash-attention varlen / ``cu_seqlens`` semantics). With
documents of the same boundaries in every row, one call covers all rows per document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ulysses_sp.attention.masks import GlobalMask
from ulysses_sp.comm.layout import HeadPlan


@dataclass(frozen=True)
class MixerContext:
    """The SP group a mixer forward exchanges over: ``group`` (None for P=1), this rank, P."""

    group: ProcessGroup | None
    rank: int
    size: int

    def local_valid(self, mask: GlobalMask, s: int) -> torch.Tensor | None:
        """``(B, s)`` bool: which of my tokens ``[rank*s, (rank+1)*s)`` are real (None: all)."""
        if mask.valid is None:
            return None
        return mask.valid[:, self.rank * s : (self.rank + 1) * s]


def split_heads(module: torch.nn.Module, sp_size: int, num_heads: int, num_groups: int, heads: str) -> HeadPlan:
    """A mixer's ``num_heads`` split over ``sp_size`` ranks like query heads, its ``num_groups`` like kv heads;
    ``ValueError`` (naming the ``heads``, e.g. ``"SSM heads"``) when there are fewer heads than ranks."""
    if sp_size > num_heads:
        raise ValueError(
            f"sp_size {sp_size} > {num_heads} {heads} of {type(module).__name__}: the {heads} are "
            f"split over ranks, so use sp_size <= {num_heads} (and data parallelism for the rest)"
        )
    return HeadPlan(num_heads, num_groups, sp_size)


def runs_own_forward(module: torch.nn.Module, ctx: MixerContext, ulysses_mask: GlobalMask | None, cache: object,
                     layer: str) -> bool:
    """Whether a mixer call is a plain one-process call (no global mask): its class forward then runs.

    Raises ``ValueError`` for a call without the global mask under SP (it would mix only its shard)
    and for a cache (generation is not sequence-parallel). ``layer`` names the kind in the message.
    """
    if ulysses_mask is None:
        if ctx.size > 1:
            raise ValueError(
                f"{type(module).__name__} was called without `ulysses_mask`: feed batches through "
                "UlyssesSP.shard(batch) and call model(**sp.model_inputs(batch))."
            )
        return True
    if cache is not None:
        raise ValueError(f"a cache was passed to a {layer} layer under Ulysses SP: call sp.unregister() "
                         "before generate(), or pass use_cache=False.")
    return False


def zero_padding(x_BLD: torch.Tensor, valid_BL: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states``: padding tokens' features set to 0."""
    if valid_BL is None:
        return x_BLD
    return (x_BLD * valid_BL.to(x_BLD.device)[:, :, None]).to(x_BLD.dtype)


def document_cuts(mask: GlobalMask, batch_size: int) -> list[list[int]] | None:
    """Per row, ``[0, start_1, ..., S]``: where documents begin (None: one document per row)."""
    if mask.document_ids is None:
        return None

    def build() -> list[list[int]]:  # once per step (cached on the mask), not per layer
        cuts = []
        for row in mask.document_ids.cpu().expand(batch_size, -1):
            starts = (row[1:] != row[:-1]).nonzero().flatten().add(1).tolist()
            cuts.append([0, *starts, mask.seq_len])
        return cuts

    return mask.cached(("mixer_document_cuts", batch_size), build)


def by_document(
    fn: Callable[..., torch.Tensor], cuts: list[list[int]] | None, *xs_BS: torch.Tensor | None
) -> torch.Tensor:
    """``fn(*xs)`` with every document of every row on its own, outputs joined back along S.

    ``xs_BS``: ``(B, S, ...)`` tensors (or None, passed through), sliced along dim 1 per document.
    """
    if cuts is None:
        return fn(*xs_BS)

    def run(rows: slice, row_cuts: list[int]) -> torch.Tensor:
        docs = zip(row_cuts[:-1], row_cuts[1:])
        outs = [fn(*(x[rows, a:e] if x is not None else None for x in xs_BS)) for a, e in docs]
        return torch.cat(outs, dim=1)

    if all(c == cuts[0] for c in cuts):
        return run(slice(None), cuts[0])
    return torch.cat([run(slice(b, b + 1), c) for b, c in enumerate(cuts)], dim=0)


def depthwise_causal_conv(
    conv_fn: Callable[..., torch.Tensor], conv1d: torch.nn.Conv1d, channels: torch.Tensor, x_BSC: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """The layer's causal depthwise conv on the channels ``channels`` of it: ``(B, S, C) -> (B, S, C)``.

    ``conv_fn``: the model's own ``causal_conv1d_fn(x (B,C,S), weight (C,W), bias, activation=...)``.
    A depthwise conv is per channel, so a subset of channels gives exactly those channels' outputs;
    their weight (and bias) gradients reach only those rows of the parameters.
    """
    weight_CW = conv1d.weight.squeeze(1)[channels]
    bias_C = conv1d.bias[channels] if conv1d.bias is not None else None
    return conv_fn(x_BSC.transpose(1, 2), weight_CW, bias_C, activation=activation).transpose(1, 2)
