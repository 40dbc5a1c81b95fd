"""Entry point of the ``ulysses-sp`` command.

Each subcommand is a module under ``ulysses_sp.cli`` with ``add_arguments(parser)`` and
``run(args) -> int`` (exit status); modules keep heavy imports (transformers) inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help); one line per subcommand.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("ulysses_sp.cli.demo", "SP attention on local processes vs one process"),
    "check": ("ulysses_sp.cli.check", "a Transformers model: loss and grads under SP vs one process"),
    "plan": ("ulysses_sp.cli.plan", "predicted peak memory per rank and the memory features that fit a budget"),
    "bench": ("ulysses_sp.cli.bench", "step time, memory, bytes: our Ulysses vs DeepSpeed's, ring, one process"),
    "train": ("ulysses_sp.cli.train", "train a causal LM with SP (default: a long-range copy task, 2 processes)"),
    "eval-long": ("ulysses_sp.cli.eval_long",
                  "passkey retrieval of a saved model at long lengths and depths, under SP"),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``ulysses-sp`` parser with one subparser per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(prog="ulysses-sp",
                                     description="Ulysses sequence parallelism for HF language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a ``ValueError`` (bad input, named fix) becomes a message and exit 2."""
    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except ValueError as err:
        print(f"ulysses-sp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
