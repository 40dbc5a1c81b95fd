"""``ulysses-sp check``: does a Transformers model train the same under Ulysses SP as on one process?

Runs one forward + loss + backward of MODEL on a random batch in one process (plain transformers)
and on ``--sp-size`` local processes (Ulysses SP), then prints the loss and the largest gradient
differences. Exit code: 0 match, 1 mismatch, 2 bad input (missing path, unsupported model).
The logic lives in ``ulysses_sp.cli.check.engine`` (imported only when the command runs, so
other subcommands do not import transformers).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ulysses_sp.cli.check.engine import CheckReport


CONFIG_FLAGS = ("sp_size", "sp_ring_size", "sp_head_chunks", "sp_head_chunk_mib", "sp_head_blocks",
                "tiled_loss_tokens", "tiled_mlp_tokens", "offload_activations", "recompute_norms")
"""The ``UlyssesSPConfig`` fields the SP run takes from the command line (flags made from the config, as
``train``'s; the backend is ``ulysses``, the kernel ``--attn-implementation``, in both runs)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ulysses-sp check``."""
    from ulysses_sp.cli.config_flags import add_config_flags

    parser.add_argument("--model", dest="model_flag", metavar="MODEL",
                        help="local model directory, path to a config.json, or a Hub name (needs network); as in "
                        "`train` and `plan`")
    parser.add_argument("model", nargs="?", help="the same, positionally (kept as an alias of --model)")
    add_config_flags(parser, CONFIG_FLAGS, required=("sp_size",))
    parser.add_argument("--random-init", action="store_true",
                        help="weights from the model's own initializer (seeded); a checkpoint is the stronger check")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    parser.add_argument("--batch-size", type=int, default=2, help="rows in the batch (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="global sequence length S, any value (default 128)")
    parser.add_argument("--padding", action="store_true", help="right-pad row 0 and left-pad row 1")
    parser.add_argument("--packed", action="store_true", help="several documents per row (position_ids restart)")
    parser.add_argument("--attn-implementation", default=None,
                        help="sdpa, eager, flex_attention, flash_attention_2 ... (default: the model's own)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch and of random weights (default 0)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the SP run checkpoints its layers; both runs then run in train mode with every "
                        "dropout probability of the config set to 0")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where both runs compute (default auto: CUDA with NCCL when there is a GPU per rank, "
                        "else CPU). cuda with fewer GPUs than --sp-size: the ranks share them over gloo (each holds "
                        "a model copy there); that checks the CUDA kernels, not NCCL")


def format_report(report: CheckReport) -> str:
    """The table ``ulysses-sp check`` prints."""
    o, c, t = report.options, report.comparison, report.comparison.tolerance
    S, P = o.seq_len, o.sp_size
    s = -(-S // P)
    docs = "+".join(str(len(d)) for d in report.batch.documents) + " documents" if o.packed else "one document per row"
    padding = ("right (row 0)" + (" + left (row 1)" if o.batch_size > 1 else "")) if o.padding else "none"
    lines = [
        f"ulysses-sp check: {report.model_class} ({report.num_params / 1e6:.2f}M parameters) from {o.model}"
        f"{' (random init)' if o.random_init else ''}",
        f"  kernel {report.kernel}, dtype {o.dtype}, seed {o.seed}; batch B={o.batch_size} S={S}: {docs}, "
        f"padding {padding}",
        f"  SP: P={P} {report.backend} processes, {s} tokens per rank (S padded to {s * P}); "
        f"time: reference {report.ref_seconds:.1f} s, SP {report.sp_seconds:.1f} s (with process start)",
        *([f"  SP memory features: tiled loss {o.tiled_loss_tokens or 'off'}, tiled MLP {o.tiled_mlp_tokens or 'off'}"
           f" (tokens per tile), head chunks {o.sp_head_chunks}"
           f"{f' (or {o.sp_head_chunk_mib:g} MiB a chunk)' if o.sp_head_chunk_mib else ''}"
           f"{' (head blocks where the module allows)' if o.sp_head_blocks else ' (attention calls)'}, "
           f"activation checkpointing "
           f"{'on (train mode, dropout 0 in both runs)' if o.gradient_checkpointing else 'off'}"
           f"{', offloaded' if o.offload_activations else ''}"
           f"{', norms recomputed' if o.recompute_norms else ''}"]
          if o.tiled_loss_tokens or o.tiled_mlp_tokens or o.sp_head_chunks > 1 or o.sp_head_chunk_mib
          or o.gradient_checkpointing or o.recompute_norms else []),
        "",
        f"  {'quantity':<22}{'reference':>14}{'SP':>14}{'abs diff':>11}{'rel diff':>11}{'tolerance':>11}  result",
        f"  {'loss':<22}{c.loss_ref:>14.6f}{c.loss_sp:>14.6f}{c.loss_abs:>11.2e}{c.loss_rel:>11.2e}"
        f"{t.loss_rel:>11.1e}  {_verdict(c.loss_rel <= t.loss_rel, c.loss_ok)}",
        f"  {f'grads ({c.num_grads} tensors)':<22}{'':>14}{'':>14}{c.grad_abs:>11.2e}{c.grad_rel:>11.2e}"
        f"{t.grad_rel:>11.1e}  {_verdict(c.grad_rel <= t.grad_rel, c.grads_ok)}",
        f"    largest abs diff in {c.grad_abs_name}",
        f"    largest rel diff in {c.grad_rel_name}   (rel = max |SP - ref| / max |grad| of that tensor)",
        f"  tolerance: {t.why}",
        *_noise_lines(c),
        f"RESULT: {'MATCH' if c.ok else 'MISMATCH'}",
    ]
    return "\n".join(lines)


def _verdict(within_tolerance: bool, ok: bool) -> str:
    return "ok" if within_tolerance else ("ok (bf16 rounding, see below)" if ok else "MISMATCH")


def _noise_lines(c) -> list[str]:
    """bf16: both runs against one fp32 process, the rule that accepts rounding."""
    n = c.noise
    if n is None:
        return []
    from ulysses_sp.cli.check.engine import NOISE_FACTOR, NOISE_SLACK

    return [
        "  bf16 against one fp32 process (the truth both bf16 runs round away from):",
        f"    loss: reference {n.loss_ref:.2e}, SP {n.loss_sp:.2e} rel; "
        f"{'ok' if n.loss_ok else 'MISMATCH'} when SP <= {NOISE_FACTOR:g} x reference + {NOISE_SLACK * 0.1:g}",
        f"    grads: worst {n.grad_worst_name}: reference {n.grad_ref:.2e}, SP {n.grad_sp:.2e} rel; "
        f"{'ok' if n.grads_ok else 'MISMATCH'} when SP <= {NOISE_FACTOR:g} x reference + {NOISE_SLACK:g} "
        "for every tensor",
    ]


def run(args: argparse.Namespace) -> int:
    """Run the check and print its table; the exit code (0 match, 1 mismatch, 2 bad input)."""
    from ulysses_sp.cli.check.engine import CheckInputError, CheckOptions, run_check

    if args.model and args.model_flag and args.model != args.model_flag:
        raise ValueError(f"two models given ({args.model} and --model {args.model_flag}); give one.")
    model = args.model_flag or args.model
    if not model:
        raise ValueError("give the model to check: ulysses-sp check --model DIR --sp-size P.")
    options = CheckOptions(
        model=model, random_init=args.random_init, dtype=args.dtype, batch_size=args.batch_size,
        seq_len=args.seq_len, padding=args.padding, packed=args.packed, attn_implementation=args.attn_implementation,
        seed=args.seed, device=args.device, gradient_checkpointing=args.gradient_checkpointing,
        **{name: getattr(args, name) for name in CONFIG_FLAGS},
    )
    try:
        report = run_check(options)
    except CheckInputError as err:
        print(f"ulysses-sp check: error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    return report.comparison.exit_code
