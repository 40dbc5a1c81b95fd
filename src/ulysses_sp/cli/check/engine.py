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
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ulysses_sp import (
    IGNORE_INDEX,
    GlobalMask,
    SPMesh,
    UlyssesSP,
    UlyssesSPConfig,
    check_model_support,
    feed_global_length,
    global_num_items,
    local_backend,
    reported_loss,
    spawn,
)

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
    # the SP run with activation checkpointing (both runs in train mode, every dropout probability of
    # the config set to 0 so that train mode is deterministic); offload: its layer inputs on the CPU
    gradient_checkpointing: bool = False
    offload_activations: bool = False


@dataclass(frozen=True)
class Tolerance:
    """Largest accepted relative differences, and why they are that size."""

    loss_rel: float
    grad_rel: float
    why: str


# fp32: reference and SP differ only in summation order (shard-wise weight-grad sums, per-document
#   kernel calls, the all-reduce); observed <= 2e-6 relative on the tiny test models. 1e-4 leaves
#   margin for deeper models, while a wrong mask, shift or loss scale gives > 1e-2.
# bf16: 8 significant bits, rounding up to 2^-9 = 2e-3 per op, and reference and SP round DIFFERENT
#   partial results (per-rank grads before the all-reduce, whole-row vs per-document attention);
#   the differences grow through the layers. Observed on 2-layer Llama / Mistral / Qwen3 / Gemma2 with
#   padding and packing: loss <= 2e-4, grads <= 1.5e-2. Tolerances 2e-3 / 5e-2 keep a 10x / 3x
#   margin; forgetting document boundaries moved the loss by 4e-2 and the grads by > 1 (bf16 too).
#   Deeper models drift further in bf16: use fp32 for a strict check.
TOLERANCES = {
    "float32": Tolerance(1e-4, 1e-4, "fp32: only summation order differs (~1e-6); a wrong mask or scale gives > 1e-2"),
    "bfloat16": Tolerance(2e-3, 5e-2, "bf16 rounding (2e-3 per op) compounds over layers; fp32 is the strict check"),
}


@dataclass
class CheckBatch:
    """A global batch and, per row, the ``(start, end)`` documents of its real (non-padding) tokens."""

    tensors: dict[str, torch.Tensor]
    documents: list[list[tuple[int, int]]]


@dataclass
class StepResult:
    """Loss value and fp32 CPU gradient of every trainable parameter (by name) of one step."""

    loss: float
    grads: dict[str, torch.Tensor]
    seconds: float = 0.0


@dataclass
class Comparison:
    """Reference vs SP: loss and the worst gradient tensors."""

    loss_ref: float
    loss_sp: float
    grad_abs: float
    grad_abs_name: str
    grad_rel: float
    grad_rel_name: str
    num_grads: int
    tolerance: Tolerance
    noise: NoiseFloor | None = None  # bf16: both runs against an fp32 one-process run

    @property
    def loss_abs(self) -> float:
        """``|loss_sp - loss_ref|``."""
        return abs(self.loss_sp - self.loss_ref)

    @property
    def loss_rel(self) -> float:
        """``loss_abs / |loss_ref|``."""
        return self.loss_abs / max(abs(self.loss_ref), 1e-30)

    @property
    def loss_ok(self) -> bool:
        """Within tolerance of the reference, or (bf16) no further from fp32 than the reference's rounding."""
        return self.loss_rel <= self.tolerance.loss_rel or (self.noise is not None and self.noise.loss_ok)

    @property
    def grads_ok(self) -> bool:
        """Like :attr:`loss_ok`, every gradient tensor (NaN never is)."""
        return self.grad_rel <= self.tolerance.grad_rel or (self.noise is not None and self.noise.grads_ok)

    @property
    def ok(self) -> bool:
        """Loss and gradients within tolerance (NaN never is)."""
        return self.loss_ok and self.grads_ok

    @property
    def exit_code(self) -> int:
        """0 on a match, 1 on a mismatch."""
        return 0 if self.ok else 1


NOISE_FACTOR, NOISE_SLACK = 3.0, 1e-2
"""bf16: SP passes a tensor when ``rel(SP, fp32) <= NOISE_FACTOR * rel(one process bf16, fp32) + NOISE_SLACK``
(and the loss likewise, with ``NOISE_SLACK * 0.1``). The bf16 one-process run is itself off the fp32
truth by its rounding (on tiny random models up to 0.6 of a tensor's largest gradient: 2 layers of
chaotic attention), so a fixed bf16-vs-bf16 tolerance both flags rounding and could hide a bug. SP
rounds other partial sums and runs its own kernels (fp32 softmax; sinks as an fp32 column), so on
single tensors its bf16 error differs from transformers': the largest ratio seen over the 120
exact families was 2.2x (GPT-OSS sink logits, the same at P=1: the kernel, not the split), hence 3x.
A wrong mask or scale moves every tensor by O(1), far beyond 3x the rounding of the
best-conditioned tensors (norms, lm_head: ~0.02-0.05)."""


@dataclass
class NoiseFloor:
    """bf16 only: the reference's and SP's distance from an fp32 one-process run (the truth)."""

    loss_ref: float  # |loss_ref_bf16 - loss_fp32| / |loss_fp32|
    loss_sp: float  # |loss_sp_bf16 - loss_fp32| / |loss_fp32|
    grad_worst: float  # max over tensors of rel(SP, fp32) - NOISE_FACTOR * rel(ref, fp32) (<= NOISE_SLACK passes)
    grad_worst_name: str
    grad_ref: float  # rel(ref, fp32) and rel(SP, fp32) of that tensor
    grad_sp: float

    @property
    def loss_ok(self) -> bool:
        return self.loss_sp <= NOISE_FACTOR * self.loss_ref + NOISE_SLACK * 0.1

    @property
    def grads_ok(self) -> bool:
        return self.grad_worst <= NOISE_SLACK


def noise_floor(truth: StepResult, ref: StepResult, sp: StepResult) -> NoiseFloor:
    """How far the bf16 reference and the bf16 SP run each are from the fp32 run (per gradient tensor,
    relative to that tensor's largest fp32 gradient, with the :data:`ZERO_GRAD_FLOOR` of the model's)."""
    floor = _zero_grad_floor(truth)
    worst = (-math.inf, "-", 0.0, 0.0)
    for name, g in truth.grads.items():
        _, r_ref = _grad_diffs(g, ref.grads.get(name), floor)
        _, r_sp = _grad_diffs(g, sp.grads.get(name), floor)
        excess = _severity(r_sp) - NOISE_FACTOR * r_ref if math.isfinite(r_ref) else math.inf
        if excess > worst[0]:
            worst = (excess, name, r_ref, r_sp)
    scale = max(abs(truth.loss), 1e-30)
    return NoiseFloor(abs(ref.loss - truth.loss) / scale, abs(sp.loss - truth.loss) / scale, *worst)


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


# 1. load and validate ---------------------------------------------------------------------------
def _validate_options(opts: CheckOptions) -> None:
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
                             offload_activations=opts.offload_activations)
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


# 5. compare -------------------------------------------------------------------------------------
ZERO_GRAD_FLOOR = 1e-2
"""Relative gradient differences are taken against at least this fraction of the model's largest
gradient. The gradient of a key-projection bias is exactly zero in theory (softmax ignores a shift
shared by all keys), so both runs hold fp32 rounding noise (~1e-8 against a largest gradient of
0.35 in biogpt at P=2, ~1e-7 of the largest at P=8) whose ratio would read as a 20 % mismatch.
With the floor, a difference is missed only if it is below 1e-4 x 1e-2 = 1e-6 of the largest
gradient: fp32 noise level of a sum over the sequence."""


def _zero_grad_floor(ref: StepResult) -> float:
    """:data:`ZERO_GRAD_FLOOR` x the largest gradient of ``ref`` (0 if that is not finite)."""
    largest = max((g.abs().max().item() for g in ref.grads.values() if g is not None and g.numel()), default=0.0)
    return ZERO_GRAD_FLOOR * largest if math.isfinite(largest) else 0.0


def _grad_diffs(ref: torch.Tensor | None, sp: torch.Tensor | None, floor: float = 0.0) -> tuple[float, float]:
    """``(max |SP - ref|, that / max(max |ref|, max |SP|, floor))``; a missing or misshapen tensor is inf."""
    if ref is None or sp is None or ref.shape != sp.shape:
        return math.inf, math.inf
    diff = (sp.float() - ref.float()).abs().max().item()
    scale = max(ref.abs().max().item(), sp.abs().max().item(), floor)
    return diff, (diff / scale if scale > 0 else diff)


def _severity(diff: float) -> float:
    """A difference for ranking: NaN ranks worst (it compares False with everything)."""
    return math.inf if math.isnan(diff) else diff


def compare(ref: StepResult, sp: StepResult, tolerance: Tolerance) -> Comparison:
    """Loss and per-tensor gradient differences; the worst tensor by abs and by relative diff."""
    worst_abs, worst_rel = (0.0, "-"), (0.0, "-")
    names = sorted(set(ref.grads) | set(sp.grads))
    floor = _zero_grad_floor(ref)
    for name in names:
        d_abs, d_rel = _grad_diffs(ref.grads.get(name), sp.grads.get(name), floor)
        if _severity(d_abs) > _severity(worst_abs[0]):
            worst_abs = (d_abs, name)
        if _severity(d_rel) > _severity(worst_rel[0]):
            worst_rel = (_severity(d_rel), name)
    return Comparison(ref.loss, sp.loss, worst_abs[0], worst_abs[1], worst_rel[0], worst_rel[1], len(names), tolerance)


def run_check(opts: CheckOptions) -> CheckReport:
    """Steps 1-5 of the module docstring. Raises CheckInputError on bad input, before any spawn."""
    _validate_options(opts)
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
