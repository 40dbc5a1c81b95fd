"""Entry point of the ``ulysses-sp`` command."""

from __future__ import annotations

import argparse
import sys

from ulysses_sp.cli import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ulysses-sp", description="Ulysses sequence parallelism for HF language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(sub.add_parser("demo", help="SP attention on local processes vs one process"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
