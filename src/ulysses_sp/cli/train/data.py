"""Real data for ``ulysses-sp train``: load, tokenize (chat templates), pack, collate, as TRL's SFT does.

    1. load      .txt/.md (one row per line), .json/.jsonl, .parquet, .csv files, a save_to_disk
                 directory, or a ``datasets`` name (needs network) -> one split
    2. tokenize  by row format (TRL's conventions):
                   {"messages": [...]}                 chat template of the tokenizer
                   {"prompt": ..., "completion": ...}  prompt + completion (loss on the completion
                                                       only with --completion-only-loss); both may
                                                       be plain text or message lists
                   {"text": ...}                       text + EOS (--dataset-text-field)
    3. pack      TRL's ``pack_dataset`` (best-fit decreasing) into rows of at most --seq-len
                 tokens with per-document ``seq_lengths``; without --packing: truncate
    4. collate   (B, S) input_ids / labels / attention_mask, and position_ids restarting at 0 for
                 every packed document (document boundaries for the SP attention mask); the first
                 token of a packed document is not predicted from the previous document
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ulysses_sp import IGNORE_INDEX as IGNORE

_BUILDERS = {".txt": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class DataInputError(ValueError):
    """The data cannot be used: a missing file, an unknown format, rows without a known field."""


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix.lower() in _BUILDERS or name.count("/") > 1


def local_files(specs: list[str]) -> list[Path] | None:
    """The paths when every spec is an existing local data file, else None (a name or a directory)."""
    paths = [Path(s).expanduser() for s in specs]
    missing = [s for s, p in zip(specs, paths) if not p.exists() and _looks_local(s)]
    if missing:
        raise DataInputError(f"dataset file(s) {missing} do not exist; give existing .txt/.jsonl/.json/.parquet/.csv "
                             "files, a save_to_disk directory, or a datasets name.")
    return paths if paths and all(p.is_file() for p in paths) else None


def load_raw(specs: list[str], config: str | None = None, split: str = "train"):
    """The un-tokenized ``datasets.Dataset`` named by ``specs`` (see the module docstring)."""
    import datasets

    paths = [Path(s).expanduser() for s in specs]
    missing = [s for s, p in zip(specs, paths) if not p.exists() and _looks_local(s)]
    if missing:
        raise DataInputError(f"dataset file(s) {missing} do not exist; give existing .txt/.jsonl/.json/.parquet/.csv "
                             "files, a save_to_disk directory, or a datasets name.")
    saved = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes
    if len(paths) == 1 and paths[0].is_dir() and any((paths[0] / name).exists() for name in saved):
        loaded = datasets.load_from_disk(str(paths[0]))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    if all(p.is_file() for p in paths):
        kinds = {_BUILDERS.get(p.suffix.lower()) for p in paths}
        if None in kinds or len(kinds) != 1:
            raise DataInputError(f"cannot tell the format of {specs}: use one kind of file among {sorted(_BUILDERS)}.")
        return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in paths], split="train")
    if len(specs) != 1:
        raise DataInputError(f"give either files or ONE dataset name/directory, got {specs}.")
    try:
        return datasets.load_dataset(specs[0], config, split=split)
    except Exception as err:  # network, unknown name, wrong split: all are bad input here
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataInputError(f"could not load dataset {specs[0]!r} (split {split!r}): {first}") from err


def row_format(row: dict[str, Any], text_field: str) -> str:
    """``"messages"``, ``"prompt-completion"`` or ``"text"`` (DataInputError otherwise)."""
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    if text_field in row:
        return "text"
    raise DataInputError(f"rows have columns {sorted(row)}; expected 'messages', 'prompt' + 'completion', or "
                         f"{text_field!r} (set --dataset-text-field).")


def load_tokenizer(model: str | None):
    """The model's tokenizer (a pad token is set to EOS if it has none)."""
    from transformers import AutoTokenizer

    if model is None:
        raise DataInputError("training on --dataset needs a tokenizer: give --model (a directory with a tokenizer).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataInputError(f"could not load a tokenizer from {model!r}: {first}") from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _ids(tokenizer, value: Any, **kwargs: Any) -> list[int]:
    """Token ids of plain text or of a message list (through the chat template)."""
    if isinstance(value, list):
        if tokenizer.chat_template is None:
            raise DataInputError("conversational rows need a tokenizer with a chat template; this one has none.")
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])
    return tokenizer(value, add_special_tokens=False)["input_ids"]


def tokenize_row(row: dict[str, Any], tokenizer, fmt: str, text_field: str, completion_only: bool) -> dict[str, list]:
    """``{"input_ids", "labels"}`` of one row (labels ``-100`` on the prompt if ``completion_only``)."""
    eos = tokenizer.eos_token or ""
    if fmt == "messages":
        ids = _ids(tokenizer, row["messages"])
        return {"input_ids": ids, "labels": list(ids)}
    if fmt == "prompt-completion":
        chat = isinstance(row["prompt"], list)
        prompt = _ids(tokenizer, row["prompt"], add_generation_prompt=True) if chat else _ids(tokenizer, row["prompt"])
        full = (_ids(tokenizer, row["prompt"] + row["completion"]) if chat
                else _ids(tokenizer, row["prompt"] + row["completion"] + eos))
        n = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        labels = [IGNORE] * n + full[n:] if completion_only else list(full)
        return {"input_ids": full, "labels": labels}
    text = row[text_field]
    ids = _ids(tokenizer, text if text.endswith(eos) else text + eos)
    return {"input_ids": ids, "labels": list(ids)}


def prepare_dataset(margs: Any, tokenizer, seed: int):
    """Load, tokenize and pack (or truncate) the user's data; rows of at most ``margs.seq_len`` tokens."""
    from trl.data_utils import maybe_convert_to_chatml, pack_dataset

    raw = load_raw(margs.dataset, margs.dataset_config, margs.dataset_split)
    if len(raw) == 0:
        raise DataInputError(f"dataset {margs.dataset} has no rows.")
    memory = {"keep_in_memory": True}  # every rank prepares the same rows: no shared cache files to race on
    if "conversations" in raw.column_names:
        raw = raw.map(maybe_convert_to_chatml, **memory)
    fmt = row_format(raw[0], margs.dataset_text_field)
    fn_kwargs = dict(tokenizer=tokenizer, fmt=fmt, text_field=margs.dataset_text_field,
                     completion_only=margs.completion_only_loss)
    data = raw.map(tokenize_row, fn_kwargs=fn_kwargs, remove_columns=raw.column_names, desc="tokenize", **memory)
    data = data.filter(lambda r: len(r["input_ids"]) > 1 and any(x != IGNORE for x in r["labels"][1:]), **memory)
    if margs.packing:
        data = pack_dataset(data.shuffle(seed=seed, **memory), margs.seq_len, "bfd", memory)
    else:
        data = data.map(lambda r: {k: r[k][: margs.seq_len] for k in ("input_ids", "labels")}, **memory)
    return data


@dataclass
class LMCollator:
    """Collate rows ``{"input_ids", "labels", ["seq_lengths"]}`` into a right-padded global batch.

    Returns ``input_ids`` / ``labels`` / ``attention_mask`` / ``position_ids``, each ``(B, S)``
    with S the longest row; ``position_ids`` restart at 0 at each packed document and the label of
    a document's first token is ``-100`` (it would be predicted from the previous document).
    """

    pad_token_id: int = 0

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        S = max(len(r["input_ids"]) for r in rows)
        B = len(rows)
        batch = {"input_ids": torch.full((B, S), self.pad_token_id, dtype=torch.long),
                 "labels": torch.full((B, S), IGNORE, dtype=torch.long),
                 "attention_mask": torch.zeros(B, S, dtype=torch.long),
                 "position_ids": torch.zeros(B, S, dtype=torch.long)}
        for i, row in enumerate(rows):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            n = ids.numel()
            batch["input_ids"][i, :n] = ids
            batch["labels"][i, :n] = torch.as_tensor(row.get("labels", row["input_ids"]), dtype=torch.long)
            batch["attention_mask"][i, :n] = 1
            lengths = [int(x) for x in row.get("seq_lengths", [n])]
            positions = torch.cat([torch.arange(length) for length in lengths])
            batch["position_ids"][i, :n] = positions
            batch["position_ids"][i, n:] = torch.arange(1, S - n + 1) + (positions[-1] if n else -1)
            starts = torch.tensor(lengths[:-1]).cumsum(0) if len(lengths) > 1 else torch.zeros(0, dtype=torch.long)
            batch["labels"][i, starts] = IGNORE
        return batch
