"""``ulysses-sp check``, steps 1 and 2: the options, the model (loaded and validated) and the batch.

Shape legend: B batch, S global sequence (any length), P SP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ulysses_sp import IGNORE_INDEX, UlyssesSPConfig, check_model_support

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckInputError(ValueError):
    """Bad input: a missing path, an unloadable model, or one that cannot be made sequence-parallel."""


@dataclass(frozen=True)
class CheckOptions:
    """What to check (the CLI flags of ``ulysses-sp check``)."""

    model: str
    sp_size: int
    random_init: bool = False
    dtype: str = "float32"
    batch_size: int = 2
    seq_len: int = 128
    padding: bool = False
    packed: bool = False
    attn_implementation: str | None = None
    seed: int = 0
    sp_ring_size: int | None = None  # Ulysses x ring degree (None: automatic, 1 while sp_size <= heads)
    device: str = "auto"  # "cpu", "cuda", or "auto": CUDA when there is a GPU per rank, else CPU
    tiled_loss_tokens: int | None = None  # the SP run with the tiled lm_head + loss (UlyssesSPConfig's field)
    tiled_mlp_tokens: int | None = None  # the SP run with tiled MLPs
    sp_head_chunks: int = 1  # the SP run's local heads in this many chunks (UlyssesSPConfig's field)
    sp_head_chunk_mib: float | None = None  # or as many chunks as this per-chunk MiB target needs
    sp_head_blocks: bool = True  # chunks of the whole attention block where the module allows it
    # the SP run with activation checkpointing (both runs in train mode, every dropout probability of
    # the config set to 0 so that train mode is deterministic); offload: its layer inputs on the CPU
    gradient_checkpointing: bool = False
    offload_activations: bool = False
    recompute_norms: bool = False  # the SP run's Llama-style RMSNorms save only their input (UlyssesSPConfig's)


@dataclass
class CheckBatch:
    """A global batch and, per row, the ``(start, end)`` documents of its real (non-padding) tokens."""

    tensors: dict[str, torch.Tensor]
    documents: list[list[tuple[int, int]]]


# 1. load and validate ---------------------------------------------------------------------------
def validate_options(opts: CheckOptions) -> None:
    """Numeric flags in range (a CheckInputError names the flag)."""
    if opts.sp_size < 1:
        raise CheckInputError(f"--sp-size must be >= 1, got {opts.sp_size}.")
    if opts.batch_size < 1:
        raise CheckInputError(f"--batch-size must be >= 1, got {opts.batch_size}.")
    least = 4 if opts.padding else 2
    if opts.seq_len < least:
        raise CheckInputError(f"--seq-len must be >= {least} (a row needs tokens and targets), got {opts.seq_len}.")
    if opts.dtype not in DTYPES:
        raise CheckInputError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}.")
    for flag, value in (("--tiled-loss-tokens", opts.tiled_loss_tokens), ("--tiled-mlp-tokens", opts.tiled_mlp_tokens)):
        if value is not None and value < 1:
            raise CheckInputError(f"{flag} must be >= 1, got {value}.")
    if opts.sp_head_chunks < 1:
        raise CheckInputError(f"--sp-head-chunks must be >= 1, got {opts.sp_head_chunks}.")
    if opts.offload_activations and not opts.gradient_checkpointing:
        raise CheckInputError("--offload-activations offloads the inputs of checkpointed layers; add "
                              "--gradient-checkpointing.")


def _model_source(model: str) -> tuple[str, bool]:
    """``(path or hub name, is a config file)``; a missing local path is a CheckInputError."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".json":
            raise CheckInputError(f"{model} is a file but not a .json config; give a model directory or a config.json.")
        return str(path), True
    if path.is_dir():
        return str(path), False
    looks_local = model.startswith((".", "/", "~")) or model.endswith(".json") or model.count("/") > 1
    if looks_local:
        raise CheckInputError(
            f"model path {model} does not exist; give a local model directory (save_pretrained), a config.json, "
            "or a Hugging Face Hub name (needs network)."
        )
    return model, False


def _without_dropout(config: Any, seen: set[int] | None = None) -> None:
    """Set every dropout probability of ``config`` and its sub-configs to 0 (in place): float fields
    named ``*dropout*`` / ``*pdrop*`` (``attention_dropout``, ``hidden_dropout``, ``resid_pdrop`` ...)."""
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _without_dropout(value, seen)
        elif isinstance(value, float) and not isinstance(value, bool) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)


def load_model(opts: CheckOptions, device: torch.device) -> PreTrainedModel:
    """The model on ``device``, identical in every process (seeded init): in eval mode (no dropout),
    or with ``gradient_checkpointing`` in train mode (what checkpointing needs) with every dropout
    probability of its config at 0."""
    source, is_config = _model_source(opts.model)
    kwargs: dict[str, Any] = {"dtype": DTYPES[opts.dtype], "attn_implementation": opts.attn_implementation}
    torch.manual_seed(opts.seed)  # random init (and any weight missing from a checkpoint) is seeded
    try:
        config = AutoConfig.from_pretrained(source)
        if opts.gradient_checkpointing:
            _without_dropout(config)
        if is_config or opts.random_init:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, config=config, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckInputError(f"could not load {opts.model!r} as a causal LM: {first}") from err
    model = model.to(device)
    return model.train() if opts.gradient_checkpointing else model.eval()


def validate_model(model: PreTrainedModel, sp_size: int, sp_ring_size: int | None = None) -> str:
    """The core kernel ``UlyssesSP`` would use (``check_model_support``); its ValueError becomes a CheckInputError."""
    try:
        return check_model_support(model, UlyssesSPConfig(sp_size=sp_size, sp_ring_size=sp_ring_size))
    except ValueError as err:
        raise CheckInputError(str(err)) from err


def _documents(first: int, end: int, packed: bool, gen: torch.Generator) -> list[tuple[int, int]]:
    """``(start, end)`` runs of the real tokens ``[first, end)``: one, or up to three when packed."""
    num_docs = min(3, end - first) if packed else 1
    cuts = (torch.randperm(end - first - 1, generator=gen)[: num_docs - 1] + first + 1).sort().values.tolist()
    bounds = [first, *cuts, end]
    return list(zip(bounds[:-1], bounds[1:]))


def make_batch(opts: CheckOptions, vocab_size: int, pad_token_id: int = 0) -> CheckBatch:
    """A random global batch: ``input_ids``, ``labels`` and, as asked, ``attention_mask`` / ``position_ids``.

    Labels ignore padding and targets predicted FROM padding (left padding's first real token),
    like ``shard_batch``. Packed rows restart ``position_ids`` at 0 for each document; padding on
    the right continues the last document's positions, on the left counts from 0.
    """
    gen = torch.Generator().manual_seed(opts.seed)
    B, S = opts.batch_size, opts.seq_len
    ids = torch.randint(0, vocab_size, (B, S), generator=gen)
    valid = torch.ones(B, S, dtype=torch.bool)
    if opts.padding:
        valid[0, S - max(1, S // 4) :] = False
        if B > 1:
            valid[1, : max(1, S // 6)] = False
    real = [row.nonzero().flatten() for row in valid]
    documents = [_documents(int(r[0]), int(r[-1]) + 1, opts.packed, gen) for r in real]
    ids = ids.masked_fill(~valid, pad_token_id)
    labels = ids.masked_fill(~valid, IGNORE_INDEX)
    labels[:, 1:] = labels[:, 1:].masked_fill(~valid[:, :-1], IGNORE_INDEX)
    tensors = {"input_ids": ids, "labels": labels}
    if opts.padding:
        tensors["attention_mask"] = valid.long()
    if opts.packed:
        position_ids = torch.arange(S).repeat(B, 1)
        for b, row in enumerate(documents):
            for a, e in row:
                position_ids[b, a:] = torch.arange(S - a)  # restart; later documents overwrite the tail
        tensors["position_ids"] = position_ids
    return CheckBatch(tensors, documents)


