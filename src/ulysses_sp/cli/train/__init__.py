"""``ulysses-sp train``: train a causal LM with Ulysses SP (default: a copy task on 2 local processes).

All options are parsed by ``HfArgumentParser`` in :func:`run` (``ulysses_sp.cli.train.options``): the
command's own and every ``TrainingArguments`` option; ``ulysses-sp train --help`` lists them.
Exit codes: 0 done, 2 bad input (nothing launched, nothing written), 1 a worker failed (the
message names the rank and why: its error, the signal that killed it, or a collective timeout),
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument is handed to :func:`run` unparsed (HfArgumentParser owns them)."""
    parser.add_argument("options", nargs=argparse.REMAINDER, help="see `ulysses-sp train --help`")
    parser.prefix_chars = "\0"  # so that argparse hands over --options (and --help) instead of rejecting them


def run(args: argparse.Namespace) -> int:
    """Validate, launch, print the summary; the exit code."""
    argv = list(args.options)
    from ulysses_sp.cli.train import options

    if any(a in ("-h", "--help") for a in argv):
        options.build_parser().print_help()
        return 0
    from ulysses_sp.cli.train.launch import TrainInputError, launch, plan

    try:
        p = plan(argv)
    except TrainInputError as err:
        print(f"ulysses-sp train: error: {err}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # once, also when every rank of a torchrun runs this
        print(describe(p), flush=True)
    try:
        summary = launch(p)
    except TrainInputError as err:  # e.g. another run holds the output directory
        print(f"ulysses-sp train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(p), file=sys.stderr)
        return 130
    except Exception as err:  # ChildFailedError carries each failed rank's error
        if type(err).__name__ == "SignalException":  # the launcher got SIGINT / SIGTERM
            print(_interrupted(p, str(getattr(err, "sigval", "a signal"))), file=sys.stderr)
            return 130
        print(f"ulysses-sp train: a worker failed; {p.output_dir} was not written.\n{describe_failure(err)}",
              file=sys.stderr)
        return 1
    if summary is not None:
        print(format_summary(summary, p.output_dir))
    return 0


def _interrupted(p, signal_name: str = "Ctrl-C") -> str:
    staging = p.output_dir.with_name(p.output_dir.name + ".incomplete")
    return (f"ulysses-sp train: interrupted ({signal_name}); the workers were stopped and {p.output_dir} was not "
            f"written. Checkpoints saved so far stay in {staging} (resume with --resume-from-checkpoint "
            f"{staging}/checkpoint-N).")


def describe_failure(err: BaseException) -> str:
    """One line per failed rank: its last error line, or the signal / exit code that ended it."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(err)
    lines = []
    for rank, failure in sorted(failures.items()):
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        last = next((line.strip() for line in reversed(message.splitlines()) if line.strip()), "")
        if failure.exitcode is not None and failure.exitcode < 0:
            why = f"killed by {failure.signal_name()}"
        elif last and not last.startswith("To enable traceback"):
            why = last
        else:
            why = f"exited with code {failure.exitcode}"
        lines.append(f"  rank {rank}: {why}")
    return "\n".join(lines)


def describe(p) -> str:
    """The line printed before launching: model, data, layout, backend, output directory."""
    what = f"{p.margs.task} task" if p.margs.uses_task else ", ".join(p.margs.dataset or [])
    return (f"ulysses-sp train: {p.margs.model or 'embedded Llama'} on {what}, S={p.margs.seq_len}, "
            f"SP={p.spargs.sp_size} x DP={p.spargs.dp_size} ({p.world_size} processes, "
            f"{'NCCL on GPUs' if p.use_cuda else 'gloo on CPU'}); output {p.output_dir}")


def format_summary(summary: dict, output_dir) -> str:
    """The lines printed when a run completes."""
    final, first = summary.get("final") or {}, summary.get("first") or {}
    lines = [f"done in {summary['train_seconds']:.0f} s: {output_dir}/ (model, metrics.jsonl, metrics.png, run.json)"]
    if final:
        speed = f", {final['tokens_per_second']:.0f} tokens/s" if "tokens_per_second" in final else ""
        lines.append(f"  loss {first.get('loss', float('nan')):.3f} -> {final['loss']:.3f}{speed}, peak memory/rank "
                     + ", ".join(f"{m / 2**30:.2f}" for m in final["peak_memory_bytes_per_rank"]) + " GiB")
    if summary.get("final_eval"):
        evals = {k: v for k, v in summary["final_eval"].items() if k.endswith("_loss")}
        lines.append("  " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items())
                     + f" (step {summary['final_eval']['step']})")
    if summary.get("data"):
        d = summary["data"]
        lines.append(f"  data: {d['documents']} documents, {d['tokens_in_data']} tokens; "
                     f"{d['tokens_per_epoch']} tokens trained per epoch")
    if "accuracy" in final:
        chance = summary.get("chance_accuracy")
        lines.append(f"  {summary.get('task') or 'copy'}-task accuracy "
                     f"{first['accuracy']:.3f} -> {final['accuracy']:.3f}"
                     + (f" (chance {chance:.3f})" if chance is not None else " (answer tokens of held-out rows)"))
    if summary.get("passkey"):
        first, final = summary["passkey"]["first"], summary["passkey"]["final"]
        keys = [k for k in final if k.startswith("passkey_exact_match_")]
        lines.append("  passkey exact match " + ", ".join(
            f"S={k.rsplit('_', 1)[1]}: {first.get(k, float('nan')):.2f} -> {final[k]:.2f}" for k in keys)
            + f" (steps {first['step']} -> {final['step']})")
    return "\n".join(lines)
