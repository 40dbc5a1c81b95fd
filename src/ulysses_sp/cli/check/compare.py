"""``ulysses-sp check``, step 5: the reference and the SP step compared, with tolerances that say why.

Gradients are compared per tensor: ``max |SP - ref| / max |grad|`` of that tensor (with a floor of
the model's largest gradient, :data:`ZERO_GRAD_FLOOR`); bf16 runs are also measured against one fp32
process (:class:`NoiseFloor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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


