"""Command-line flags made from ``UlyssesSPConfig`` fields: the name, type, default and help are the
config's, declared once (``ulysses-sp train`` makes all of them through ``cli/train/options.py``;
an ``argparse`` command takes the ones it uses through :func:`add_config_flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any

from ulysses_sp import UlyssesSPConfig


def _value_type(hint: Any) -> type:
    """``int`` for ``int`` and ``int | None`` (the one non-None member of an optional)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (member,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return member
    return hint


def add_config_flags(parser: argparse.ArgumentParser, names: Iterable[str], required: Iterable[str] = (),
                     note: str = "") -> None:
    """Add ``--field-name`` for each ``UlyssesSPConfig`` field in ``names`` (``required`` ones without default).

    bool fields that default to False become ``store_true`` flags, those that default to True a
    ``--name`` / ``--no-name`` pair; ``note`` is appended to every help.
    """
    fields = {f.name: f for f in dataclasses.fields(UlyssesSPConfig)}
    hints = typing.get_type_hints(UlyssesSPConfig)
    required = set(required)
    for name in names:
        f, kind = fields[name], _value_type(hints[name])
        flag, help_text = "--" + name.replace("_", "-"), f.metadata["help"] + note
        if kind is bool:
            if f.default is True:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=help_text)
            else:
                parser.add_argument(flag, action="store_true", help=help_text)
        elif name in required:
            parser.add_argument(flag, type=kind, required=True, help=help_text)
        else:
            shown = "" if f.default is None else f" (default {f.default})"
            parser.add_argument(flag, type=kind, default=f.default, help=help_text + shown)
