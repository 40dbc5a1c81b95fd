"""Check every row of local data files before any worker starts (streamed: memory independent of size).

One ``DataInputError`` per problem, naming the file, the line and the fix:

    empty file / no rows              "FILE has no rows"
    not UTF-8 text (binary)           "FILE is not UTF-8 text (a binary file?) near line N"
    broken JSON line                  "FILE:N is not valid JSON (...)"
    a row that is not an object       "FILE:N is a list, not a JSON object"
    unknown columns                   "FILE:N has columns [...]; expected 'messages', 'prompt' + 'completion' or 'text'"
    empty text / messages / completion  "FILE:N has an empty 'text'"
    files of different kinds          "FILE1 has 'messages' rows but FILE2 has 'text' rows"

Datasets given by name or as a ``save_to_disk`` directory are checked by loading them (``launch``).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ulysses_sp.cli.train.data import DataInputError, row_format

_TEXT_LINE_FORMATS = (".txt", ".md")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file, streamed; binary content is a DataInputError."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                raise DataInputError(f"{path} is not UTF-8 text (a binary file?) near line {number}; give text, "
                                     "JSON Lines, JSON, CSV or Parquet data.")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataInputError(f"{path}:{number} is not UTF-8 text ({err.reason}); convert the file to "
                                     "UTF-8 (or remove the line).") from err


def _check_row(row: Any, where: str, text_field: str) -> str:
    """The row's format (``row_format``), after checking it is an object with non-empty content."""
    if not isinstance(row, dict):
        raise DataInputError(f"{where} is a JSON {type(row).__name__}, not an object; each row must be an object "
                             f"such as {{\"{text_field}\": \"...\"}} or {{\"messages\": [...]}}.")
    try:
        fmt = row_format(row, text_field)
    except DataInputError as err:
        raise DataInputError(f"{where}: {err}") from err
    fields = {"messages": ["messages"], "prompt-completion": ["prompt", "completion"], "text": [text_field]}[fmt]
    for name in fields:
        value = row.get(name)
        if value is None or (isinstance(value, (str, list)) and len(value) == 0):
            raise DataInputError(f"{where} has an empty {name!r}; remove the row or fill it in.")
        if fmt == "text" and not isinstance(value, str):
            raise DataInputError(f"{where}: {name!r} is a {type(value).__name__}, not text.")
    if fmt == "messages" and not all(isinstance(m, dict) and "role" in m and "content" in m for m in row["messages"]):
        raise DataInputError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} objects.")
    return fmt


def _jsonl_rows(path: Path, text_field: str) -> Iterator[str]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataInputError(f"{path}:{number} is not valid JSON ({err.msg} at column {err.colno}); fix or "
                                 "remove the line.") from err
        yield _check_row(row, f"{path}:{number}", text_field)


def _json_rows(path: Path, text_field: str) -> Iterator[str]:
    first = ""
    for _, line in _lines(path):  # also the UTF-8 / binary check
        first = first or line.strip()
    if not first.startswith("["):
        yield from _jsonl_rows(path, text_field)  # JSON Lines with a .json name
        return
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))  # one JSON array: it has to be read whole
    except json.JSONDecodeError as err:
        raise DataInputError(f"{path}:{err.lineno} is not valid JSON ({err.msg}); fix the file.") from err
    for i, row in enumerate(rows):
        yield _check_row(row, f"{path} row {i}", text_field)


def _csv_rows(path: Path, text_field: str) -> Iterator[str]:
    reader = csv.DictReader(line for _, line in _lines(path))
    for i, row in enumerate(reader, start=2):
        yield _check_row(dict(row), f"{path}:{i}", text_field)


def _text_rows(path: Path, text_field: str) -> Iterator[str]:
    for _, line in _lines(path):
        if line.strip():
            yield "text"


def _parquet_rows(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise DataInputError(f"{path} is not a Parquet file ({type(err).__name__}); give a valid .parquet.") from err
    for batch in parquet.iter_batches(batch_size=1024):
        for i, row in enumerate(batch.to_pylist()):
            yield _check_row(row, f"{path} row {i}", text_field)


_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows,
            **{suffix: _text_rows for suffix in _TEXT_LINE_FORMATS}}


def validate_files(paths: list[Path], text_field: str) -> dict[str, int]:
    """Check every row of every file; ``{format: rows}``. All files must hold one kind of row."""
    kinds: dict[str, Path] = {}
    counts: dict[str, int] = {}
    for path in paths:
        reader = _READERS.get(path.suffix.lower())
        if reader is None:
            raise DataInputError(f"{path}: unknown file type {path.suffix!r}; use one of {sorted(_READERS)}.")
        rows = 0
        for fmt in reader(path, text_field):
            if fmt not in kinds and kinds:
                other, first = next(iter(kinds.items()))
                raise DataInputError(f"{first} has {other!r} rows but {path} has {fmt!r} rows; train on one kind of "
                                     "data at a time (chat 'messages', 'prompt' + 'completion', or text).")
            kinds.setdefault(fmt, path)
            counts[fmt] = counts.get(fmt, 0) + 1
            rows += 1
        if rows == 0:
            raise DataInputError(f"{path} has no rows; give a file with data (or drop it from --dataset).")
    return counts
