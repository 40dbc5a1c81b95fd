"""Real data for ``ulysses-sp train``: load, tokenize (chat templates), pack, collate, as TRL's SFT does.

    1. load      .txt/.md (one row per line, paragraph or file: --text-sample-by), .json/.jsonl,
                 .parquet, .csv files, a save_to_disk directory, or a ``datasets`` name (needs
                 network) -> one split; --eval-split holds out a fraction of the documents
    2. tokenize  by row format (TRL's conventions):
                   {"messages": [...]}                 chat template of the tokenizer (loss on the
                                                       assistant turns only with --assistant-only-loss)
                   {"prompt": ..., "completion": ...}  prompt + completion (loss on the completion
                                                       only with --completion-only-loss); both may
                                                       be plain text or message lists
                   {"text": ...}                       text + EOS (--dataset-text-field)
    3. pack      TRL's ``pack_dataset`` into rows of at most --seq-len tokens with per-document
                 ``seq_lengths`` (--packing-strategy: bfd_split, the default, splits documents
                 longer than --seq-len into chunks and keeps every token; bfd truncates them;
                 wrapped ignores documents); without --packing: one document per row, truncated.
                 The tokens in the data and in the training rows are counted (run.json).
                 Local rank 0 of each node tokenizes first into the datasets cache; the other
                 ranks then read the same cache files (memory-mapped, so memory per rank does not
                 grow with the data)
    4. collate   (B, S) input_ids / labels / attention_mask, and position_ids restarting at 0 for
                 every packed document (document boundaries for the SP attention mask); the first
                 token of a packed document is not predicted from the previous document
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ulysses_sp import IGNORE_INDEX

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


def load_raw(specs: list[str], config: str | None = None, split: str = "train", sample_by: str = "line",
             keep_in_memory: bool = False):
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
        kind = kinds.pop()
        extra = {"sample_by": sample_by} if kind == "text" else {}
        return datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train",
                                     keep_in_memory=keep_in_memory, **extra)
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


def tokenize_row(row: dict[str, Any], tokenizer, fmt: str, text_field: str, completion_only: bool,
                 assistant_only: bool = False) -> dict[str, list]:
    """``{"input_ids", "labels"}`` of one row (labels ``-100`` on the prompt if ``completion_only``,
    outside the assistant turns if ``assistant_only``)."""
    eos = tokenizer.eos_token or ""
    if fmt == "messages" and assistant_only:
        out = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}
    if fmt == "messages":
        ids = _ids(tokenizer, row["messages"])
        return {"input_ids": ids, "labels": list(ids)}
    if fmt == "prompt-completion":
        chat = isinstance(row["prompt"], list)
        prompt = _ids(tokenizer, row["prompt"], add_generation_prompt=True) if chat else _ids(tokenizer, row["prompt"])
        full = (_ids(tokenizer, row["prompt"] + row["completion"]) if chat
                else _ids(tokenizer, row["prompt"] + row["completion"] + eos))
        n = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        labels = [IGNORE_INDEX] * n + full[n:] if completion_only else list(full)
        return {"input_ids": full, "labels": labels}
    text = row[text_field]
    ids = _ids(tokenizer, text if text.endswith(eos) else text + eos)
    return {"input_ids": ids, "labels": list(ids)}


@dataclass
class PreparedData:
    """The training rows (and eval rows) and how many tokens the data had and the rows keep."""

    train: Any
    eval: Any | None
    tokens_in_data: int
    tokens_per_epoch: int
    documents: int

    def summary(self) -> dict[str, int]:
        return {"documents": self.documents, "tokens_in_data": self.tokens_in_data,
                "tokens_per_epoch": self.tokens_per_epoch}


def _tokenize(raw, margs: Any, tokenizer, map_kwargs: dict[str, Any]):
    from trl.data_utils import maybe_convert_to_chatml

    if "conversations" in raw.column_names:
        raw = raw.map(maybe_convert_to_chatml, **map_kwargs)
    fmt = row_format(raw[0], margs.dataset_text_field)
    assistant_only = bool(getattr(margs, "assistant_only_loss", False))
    if assistant_only and fmt != "messages":
        raise DataInputError(f"--assistant-only-loss applies to chat ('messages') rows; these rows are {fmt!r} "
                             "(prompt/completion rows: --completion-only-loss).")
    fn_kwargs = dict(tokenizer=tokenizer, fmt=fmt, text_field=margs.dataset_text_field,
                     completion_only=margs.completion_only_loss, assistant_only=assistant_only)
    data = raw.map(tokenize_row, fn_kwargs=fn_kwargs, remove_columns=raw.column_names, desc="tokenize", **map_kwargs)
    data = data.filter(lambda r: len(r["input_ids"]) > 1 and any(x != IGNORE_INDEX for x in r["labels"][1:]),
                       **map_kwargs)
    if len(data) == 0:
        raise DataInputError("no row has a token to train on (every label is masked: rows of one token, or "
                             "--assistant-only-loss / --completion-only-loss masking everything).")
    return data


def _rows(data, margs: Any, seed: int, map_kwargs: dict[str, Any]):
    """Packed rows (``--packing-strategy``) or one truncated document per row."""
    from trl.data_utils import pack_dataset

    if margs.packing:
        strategy = getattr(margs, "packing_strategy", "bfd_split")
        return pack_dataset(data.shuffle(seed=seed, **map_kwargs), margs.seq_len, strategy, map_kwargs)
    return data.map(lambda r: {k: r[k][: margs.seq_len] for k in ("input_ids", "labels")}, **map_kwargs)


def _num_tokens(data) -> int:
    return sum(len(ids) for batch in data.iter(batch_size=4096) for ids in batch["input_ids"])


def prepare_data(margs: Any, tokenizer, seed: int, keep_in_memory: bool = True) -> PreparedData:
    """Load, tokenize, split off eval documents (--eval-split / --eval-dataset) and pack the user's data.

    ``keep_in_memory=False`` writes the datasets cache files (the worker lets local rank 0 of a node
    go first, so the other ranks read its cache instead of tokenizing again).
    """
    map_kwargs = {"keep_in_memory": keep_in_memory}
    sample_by = getattr(margs, "text_sample_by", "line")
    raw = load_raw(margs.dataset, margs.dataset_config, margs.dataset_split, sample_by, keep_in_memory)
    if len(raw) == 0:
        raise DataInputError(f"dataset {margs.dataset} has no rows.")
    data = _tokenize(raw, margs, tokenizer, map_kwargs)
    eval_docs = None
    split = getattr(margs, "eval_split", None)
    if split:
        parts = data.train_test_split(test_size=split, seed=seed, **({"keep_in_memory": True} if keep_in_memory
                                                                     else {}))
        data, eval_docs = parts["train"], parts["test"]
    elif getattr(margs, "eval_dataset", None):
        eval_raw = load_raw(margs.eval_dataset, margs.dataset_config, margs.dataset_split, sample_by, keep_in_memory)
        eval_docs = _tokenize(eval_raw, margs, tokenizer, map_kwargs)
    rows = _rows(data, margs, seed, map_kwargs)
    eval_rows = _rows(eval_docs, margs, seed, map_kwargs) if eval_docs is not None else None
    return PreparedData(rows, eval_rows, _num_tokens(data), _num_tokens(rows), len(data))


def prepare_dataset(margs: Any, tokenizer, seed: int):
    """The training rows of :func:`prepare_data` (rows of at most ``margs.seq_len`` tokens)."""
    return prepare_data(margs, tokenizer, seed).train


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
                 "labels": torch.full((B, S), IGNORE_INDEX, dtype=torch.long),
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
            batch["labels"][i, starts] = IGNORE_INDEX
        return batch
