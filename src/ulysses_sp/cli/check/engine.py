"""``ulysses-sp check``: one training step of a Transformers causal LM under Ulysses SP vs one process.

Shape legend: B batch, S global sequence (any length, ``S % P`` may be non-zero), V vocab, P SP size.

    1. load    the model (its weights, or --random-init from its config; same seed in every process)
               and validate it with ``UlyssesSP``: a ValueError is bad input (CheckInputError)
    2. batch   random (B, S) tokens; --padding: row 0 right-padded, row 1 left-padded;
               --packed: several documents per row in position_ids
    3. ref     one process, plain transformers: forward + mean token CE + backward
               (packed: each document on its own, logits concatenated: flash-attention varlen semantics)
    4. SP      P spawned processes (gloo on CPU; nccl when CUDA has >= P GPUs): UlyssesSP + shard +
               loss + backward, gradients all-reduced and averaged as DDP does; rank 0 torch.saves
               the loss and gradients into a temporary directory
    5. compare loss (relative) and every gradient (max |SP - ref| / max |grad| per tensor)

Steps 1-2 are in ``inputs.py``, step 5 in ``compare.py``; steps 3-4 and :func:`run_check` here.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel

from ulysses_sp import (
    IGNORE_INDEX,
    GlobalMask,
    SPMesh,
    UlyssesSP,
    UlyssesSPConfig,
    feed_global_length,
    global_num_items,
    local_backend,
    reported_loss,
    spawn,
)
from ulysses_sp.cli.check.compare import (
    NOISE_FACTOR,
    NOISE_SLACK,
    TOLERANCES,
    Comparison,
    StepResult,
    Tolerance,
    compare,
    noise_floor,
)
from ulysses_sp.cli.check.inputs import (
    CheckBatch,
    CheckInputError,
    CheckOptions,
    load_model,
    make_batch,
    validate_model,
    validate_options,
)

__all__ = [  # the command's steps; the names of inputs.py and compare.py are re-exported for one import
    "NOISE_FACTOR", "NOISE_SLACK", "TOLERANCES", "CheckBatch", "CheckInputError", "CheckOptions", "CheckReport",
    "Comparison", "StepResult", "Tolerance", "compare", "load_model", "make_batch", "noise_floor", "reference_step",
    "resolve_device", "run_check", "sp_step", "validate_model",
]

@dataclass
class CheckReport:
    """The outcome of :func:`run_check` (printed by ``ulysses_sp.cli.check.format_report``)."""

    options: CheckOptions
    model_class: str
    num_params: int
    kernel: str
    backend: str
    batch: CheckBatch
    comparison: Comparison
    ref_seconds: float = 0.0
    sp_seconds: float = 0.0


# 3. reference and 4. SP --------------------------------------------------------------------------
def _grads(model: PreTrainedModel, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """fp32 CPU gradient of every trainable parameter; with ``group``: summed, / group size (DDP)."""
    grads = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().clone()
        if group is not None:
            dist.all_reduce(g, group=group)
            g /= dist.get_world_size(group)
        grads[name] = g.cpu()
    return grads


def _per_document_logits(model: PreTrainedModel, batch: CheckBatch) -> torch.Tensor:
    """``(B, S, V)``: each document run alone (B=1, no mask), padding positions zero.

    A rotary embedding that picks its frequencies from the sequence length (LongRoPE, dynamic NTK)
    is fed the batch's largest position, as in padding-free training where one call sees the
    whole packed batch (``feed_global_length``), not each document's own length.
    """
    ids = batch.tensors["input_ids"]
    row_length = GlobalMask(ids.shape[1], max_position=int(batch.tensors["position_ids"].max()))
    hooks = feed_global_length(model, lambda: row_length)
    rows = []
    try:
        for b, documents in enumerate(batch.documents):
            pieces, cursor = [], 0
            for a, e in documents:
                pieces.append(model(input_ids=ids[b : b + 1, a:e], use_cache=False).logits)
                cursor = e
            logits = torch.cat(pieces, dim=1)
            before, after = documents[0][0], ids.shape[1] - cursor
            rows.append(F.pad(logits, (0, 0, before, after)))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(rows, dim=0)


def reference_step(model: PreTrainedModel, batch: CheckBatch) -> StepResult:
    """One process, plain transformers: mean token CE over the batch, then backward."""
    t0 = time.perf_counter()
    t = {k: v.to(model.device) for k, v in batch.tensors.items()}
    if "position_ids" in t:
        logits = _per_document_logits(model, CheckBatch(t, batch.documents))
        V, targets = logits.shape[-1], t["labels"][:, 1:].reshape(-1)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), targets, ignore_index=IGNORE_INDEX)
    else:
        mask = t.get("attention_mask")
        loss = model(input_ids=t["input_ids"], attention_mask=mask, labels=t["labels"], use_cache=False).loss
    loss.backward()
    return StepResult(loss.item(), _grads(model), time.perf_counter() - t0)


def _sp_worker(rank: int, world: int, opts: CheckOptions, tensors: dict[str, torch.Tensor], out_path: str) -> None:
    """One SP rank: the sharded step; rank 0 saves the loss and the DDP-averaged gradients."""
    transformers.logging.disable_progress_bar()  # this process only: P bars would bury the table
    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    mesh = SPMesh.from_world(world, device_type=device.type)
    model = load_model(opts, device)
    config = UlyssesSPConfig(sp_size=world, sp_ring_size=opts.sp_ring_size, tiled_loss_tokens=opts.tiled_loss_tokens,
                             tiled_mlp_tokens=opts.tiled_mlp_tokens, sp_head_chunks=opts.sp_head_chunks,
                             sp_head_chunk_mib=opts.sp_head_chunk_mib, sp_head_blocks=opts.sp_head_blocks,
                             offload_activations=opts.offload_activations, recompute_norms=opts.recompute_norms)
    if opts.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with UlyssesSP(model, mesh, config) as sp:
        shard = sp.shard({k: v.to(device) for k, v in tensors.items()})
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group))
        loss.backward()
    grads = _grads(model, mesh.sp_group)
    logged = reported_loss(loss, world, mesh.sp_group)
    if rank == 0:
        torch.save({"loss": logged.item(), "grads": grads}, out_path)


def resolve_device(opts: CheckOptions) -> str:
    """``"cuda"`` or ``"cpu"`` for ``opts.device``; a CheckInputError for CUDA without a GPU or for
    a ring over GPUs shared through gloo (its send/recv needs NCCL or CPU tensors)."""
    if opts.device not in ("auto", "cpu", "cuda"):
        raise CheckInputError(f"--device must be auto, cpu or cuda, got {opts.device!r}.")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise CheckInputError("--device cuda but torch sees no CUDA device; use --device cpu (or auto).")
    # auto: CUDA only with a GPU per rank (NCCL); sharing a GPU is asked for with --device cuda, since
    # every rank then holds a copy of the model on it
    auto_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= opts.sp_size
    device = "cuda" if opts.device == "cuda" or (opts.device == "auto" and auto_cuda) else "cpu"
    if device == "cuda" and local_backend(opts.sp_size, device) == "gloo" and (opts.sp_ring_size or 1) > 1:
        raise CheckInputError(
            f"--sp-ring-size {opts.sp_ring_size} on {torch.cuda.device_count()} GPU(s) for P={opts.sp_size}: the "
            "ring's send/recv over GPUs shared through gloo is not supported; use --device cpu, or one GPU per rank."
        )
    return device


def _backend_label(sp_size: int, device: str) -> str:
    """How the SP ranks talk, for the report: ``nccl``, ``gloo (CPU)`` or ``gloo (sharing N GPU(s))``."""
    backend = local_backend(sp_size, device)
    if device == "cpu":
        return "gloo (CPU)"
    return backend if backend == "nccl" else f"gloo (sharing {torch.cuda.device_count()} GPU(s))"


def sp_step(opts: CheckOptions, batch: CheckBatch) -> StepResult:
    """Spawn ``opts.sp_size`` processes and read rank 0's result back from a temporary file."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ulysses_sp_check_") as tmp:
        out_path = str(Path(tmp) / "sp_result.pt")
        spawn(_sp_worker, opts.sp_size, opts, batch.tensors, out_path, backend=local_backend(opts.sp_size, opts.device),
              device_type=opts.device)
        saved = torch.load(out_path, weights_only=True)
    return StepResult(saved["loss"], saved["grads"], time.perf_counter() - t0)


def run_check(opts: CheckOptions) -> CheckReport:
    """Steps 1-5 of the module docstring. Raises CheckInputError on bad input, before any spawn."""
    validate_options(opts)
    opts = replace(opts, device=resolve_device(opts))
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    model = load_model(opts, device)
    kernel = validate_model(model, opts.sp_size, opts.sp_ring_size)
    if opts.gradient_checkpointing and not model.supports_gradient_checkpointing:
        raise CheckInputError(f"{type(model).__name__} does not support activation checkpointing (transformers' "
                              "supports_gradient_checkpointing is False); check it without --gradient-checkpointing.")
    config = model.config.get_text_config()
    batch = make_batch(opts, config.vocab_size, getattr(config, "pad_token_id", None) or 0)
    ref = reference_step(model, batch)
    bad = [n for n, g in ref.grads.items() if g is not None and not bool(torch.isfinite(g).all())]
    if not math.isfinite(ref.loss) or bad:
        what = "loss" if not math.isfinite(ref.loss) else f"gradient of {bad[0]}"
        raise CheckInputError(
            f"the plain model (one process, no SP) already gives a non-finite {what} on this batch, so there is "
            "nothing to compare; check with another batch (e.g. without --padding: some models, such as Gemma3n, "
            "take the root of a zero padding embedding)."
        )
    model_class, num_params = type(model).__name__, sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # rank 0 shares this GPU
    sp = sp_step(opts, batch)
    comparison = compare(ref, sp, TOLERANCES[opts.dtype])
    if opts.dtype != "float32":  # the truth both bf16 runs round away from: one process in fp32
        truth = reference_step(load_model(replace(opts, dtype="float32"), device), batch)
        comparison.noise = noise_floor(truth, ref, sp)
    backend = _backend_label(opts.sp_size, opts.device)
    return CheckReport(opts, model_class, num_params, kernel, backend, batch, comparison, ref.seconds, sp.seconds)
