"""Entry point of the ``ulysses-sp`` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``ulysses-sp`` parser; each subcommand module keeps heavy imports (transformers) inside ``run``."""
    from ulysses_sp.cli import check, demo

    parser = argparse.ArgumentParser(prog="ulysses-sp", description="Ulysses sequence parallelism for HF language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="SP attention on local processes vs one process"))
    check.add_arguments(sub.add_parser("check", help="a Transformers model: loss and grads under SP vs one process"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ulysses_sp.cli import demo

        return demo.run(args)
    if args.command == "check":
        from ulysses_sp.cli import check

        return check.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
