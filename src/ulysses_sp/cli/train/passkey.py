"""Passkey (needle) retrieval rows: a key planted at depth d of filler text, asked for at the end.

One row of ``length`` tokens (the model's own tokenizer; the embedded model uses the built-in
character tokenizer, :func:`char_tokenizer`, saved with it)::

    [BOS] filler[:k] NEEDLE filler[k:n] QUESTION ANSWER         k = round(d * n), n fills the row
    NEEDLE   " the pass key is 4721. remember it. 4721 is the pass key. "
    QUESTION " what is the pass key? the pass key is"      ANSWER " 4721"

``labels`` are ``-100`` except on the answer tokens (unshifted, as transformers expects; a leading
token that is only the space before the key is not scored), so the teacher-forced scores of
``ulysses_sp.answer_scores`` are those of the key alone. Filler is the user's text (a .txt file, or
.jsonl / .json rows with a ``text`` field) or a built-in generator of random digit-free sentences
(:func:`builtin_filler`); each row reads it from a random offset.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ulysses_sp import IGNORE_INDEX

NEEDLE = " the pass key is {key}. remember it. {key} is the pass key. "
QUESTION = " what is the pass key? the pass key is"
ANSWER = " {key}"
_CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,?!'-:;"
_WORDS = {
    "subject": ["the grass", "the sky", "the river", "a small bird", "the old road", "the wind", "the city",
                "a quiet house", "the forest", "the sea", "the mountain", "the garden", "a tall tree", "the moon"],
    "verb": ["is", "looks", "seems", "stays", "turns", "feels", "grows"],
    "adjective": ["green", "blue", "calm", "bright", "dark", "warm", "cold", "quiet", "wide", "still", "soft",
                  "golden", "grey", "clear"],
    "tail": ["today", "in the morning", "at night", "after the rain", "all year", "in the spring", "again",
             "for now", "as always", "by the shore"],
}


def char_tokenizer():
    """The built-in tokenizer of the embedded model: one token per character (lowercased).

    Ids: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (the copy task's PAD / BOS / SEP), ``<unk>`` 3, then
    space, a-z, 0-9 and ``.,?!'-:;`` (49 in all). A ``PreTrainedTokenizerFast``: it saves with the
    model and ``AutoTokenizer.from_pretrained`` reloads it.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *_CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def builtin_filler(num_sentences: int = 2000, seed: int = 0) -> str:
    """Random sentences without digits ("the sky looks calm at night. ..."), ``num_sentences`` of them."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_WORDS['subject'])} {rng.choice(_WORDS['verb'])} {rng.choice(_WORDS['adjective'])} "
                    f"{rng.choice(_WORDS['tail'])}." for _ in range(num_sentences))


def load_filler(path: str | None, max_chars: int = 4_000_000) -> str:
    """Filler text: the file at ``path`` (.txt as is; .jsonl / .json rows' ``text`` joined) or the built-in one.

    Raises:
        ValueError: a missing file, an unknown suffix, rows without ``text``, or no text at all.
    """
    if path is None:
        return builtin_filler()
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"filler file {path} does not exist; give a .txt or .jsonl file (or omit it for the built-in "
                         "filler).")
    suffix = file.suffix.lower()
    if suffix in (".txt", ".md"):
        text = file.read_text(errors="replace")[:max_chars]
    elif suffix in (".jsonl", ".json"):
        raw = file.read_text(errors="replace")
        rows = json.loads(raw) if suffix == ".json" else [json.loads(line) for line in raw.splitlines() if line.strip()]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in rows):
            raise ValueError(f"filler file {path}: every row must be an object with a 'text' string.")
        text = " ".join(r["text"] for r in rows)[:max_chars]
    else:
        raise ValueError(f"filler file {path}: unknown format {suffix!r}; use .txt, .md, .jsonl or .json.")
    if not text.strip():
        raise ValueError(f"filler file {path} holds no text.")
    return text


@dataclass
class PasskeyTask:
    """Passkey rows for one tokenizer and one filler text.

    Attributes:
        tokenizer: the model's tokenizer (``__call__`` with ``add_special_tokens``, ``bos_token_id``).
        filler: the filler text (tokenized once, at the first row).
        digits: digits of the key.
    """

    tokenizer: Any
    filler: str
    digits: int = 4

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"the passkey needs at least 1 digit, got {self.digits}.")
        self._filler_ids: list[int] | None = None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def filler_ids(self, at_least: int) -> list[int]:
        """The filler's token ids, repeated until there are ``at_least`` of them."""
        if self._filler_ids is None:
            self._filler_ids = self._ids(self.filler)
            if not self._filler_ids:
                raise ValueError("the filler text has no tokens.")
        ids = self._filler_ids
        return ids * (-(-at_least // len(ids))) if len(ids) < at_least else ids

    def min_length(self) -> int:
        """The shortest row: BOS, needle, question and answer without filler."""
        key = "9" * self.digits
        bos = 1 if self.tokenizer.bos_token_id is not None else 0
        return bos + len(self._ids(NEEDLE.format(key=key))) + len(self._ids(QUESTION + ANSWER.format(key=key)))

    def sample(self, length: int, depth: float, rng: random.Random) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one row of exactly ``length`` tokens, needle at ``depth`` in [0, 1]."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"passkey depths are fractions in [0, 1], got {depth}.")
        key = "".join(rng.choice("0123456789") for _ in range(self.digits))
        head = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        needle = self._ids(NEEDLE.format(key=key))
        question = self._ids(QUESTION)
        tail = self._ids(QUESTION + ANSWER.format(key=key))
        shared = next((i for i, (a, b) in enumerate(zip(question, tail)) if a != b), min(len(question), len(tail)))
        while shared < len(tail) and not self.tokenizer.decode(tail[shared:shared + 1]).strip():
            shared += 1  # a token of the space before the key is not part of the answer
        num_filler = length - len(head) - len(needle) - len(tail)
        if num_filler < 0 or shared == len(tail):
            raise ValueError(f"a passkey row needs at least {self.min_length()} tokens with this tokenizer; got "
                             f"length {length}.")
        stream = self.filler_ids(2 * num_filler + 1)
        start = rng.randrange(len(stream) - num_filler + 1)
        filler = stream[start:start + num_filler]
        cut = round(depth * num_filler)
        ids = head + filler[:cut] + needle + filler[cut:] + tail
        labels = [IGNORE_INDEX] * (length - len(tail) + shared) + tail[shared:]
        return ids, labels

    def rows(self, length: int, depths: list[float], seed: int) -> dict[str, torch.Tensor]:
        """One row per depth: ``input_ids`` / ``labels`` ``(len(depths), length)``."""
        rng = random.Random(seed)
        pairs = [self.sample(length, d, rng) for d in depths]
        return {"input_ids": torch.tensor([p[0] for p in pairs]), "labels": torch.tensor([p[1] for p in pairs])}

    def dataset(self, num_rows: int, length: int, seed: int) -> list[dict[str, torch.Tensor]]:
        """Training rows at uniformly random depths (a map-style dataset of per-row dicts)."""
        rng = random.Random(seed)
        depths = [rng.random() for _ in range(num_rows)]
        rows = self.rows(length, depths, seed + 1)
        return [{"input_ids": rows["input_ids"][i], "labels": rows["labels"][i]} for i in range(num_rows)]


@torch.no_grad()
def passkey_scores(model: torch.nn.Module, rows: dict[str, torch.Tensor], ulysses: Any,
                   batch_size: int = 4) -> Any:
    """Teacher-forced ``AnswerScores`` of ``rows`` under SP: a forward pass only, sharded like training.

    Args:
        rows: global ``input_ids`` / ``labels`` ``(R, S)``, the same on every rank of the SP group.
        ulysses: the registered ``UlyssesSP``; each rank keeps the logits of its answer positions
            only (``logits_to_keep``, ``(b, t, V)`` with t <= a few tokens) where the model accepts it.

    Returns:
        ``AnswerScores`` of the R rows (every rank of the SP group holds the same).
    """
    import inspect

    from ulysses_sp import AnswerScores, answer_positions, answer_scores

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    group = ulysses.mesh.sp_group if ulysses.mesh.sp_size > 1 else None
    keeps = "logits_to_keep" in inspect.signature(ulysses.base.forward).parameters
    parts = []
    for start in range(0, rows["input_ids"].shape[0], batch_size):
        batch = {k: v[start:start + batch_size].to(device) for k, v in rows.items()}
        shard = ulysses.shard(batch)
        labels = shard["shift_labels"]
        if keeps:
            positions = answer_positions(labels)
            logits = model(**ulysses.model_inputs(shard), logits_to_keep=positions).logits
            labels = labels[:, positions]
        else:
            logits = model(**ulysses.model_inputs(shard)).logits
        parts.append(answer_scores(logits, labels, group))
    model.train(was_training)
    return AnswerScores.cat(parts)


def passkey_task(margs: Any, filler_path: str | None) -> tuple[PasskeyTask, Any]:
    """``(task, tokenizer)`` of a train run: ``--model``'s own tokenizer, or the built-in one without ``--model``."""
    from ulysses_sp.cli.train.data import load_tokenizer

    tokenizer = load_tokenizer(margs.model) if margs.model is not None else char_tokenizer()
    return PasskeyTask(tokenizer, load_filler(filler_path), margs.passkey_digits), tokenizer


def check_passkey_options(margs: Any, vocab_size: int) -> None:
    """Before launch: the rows fit ``--seq-len`` and every eval length, the tokenizer fits the model.

    Raises:
        ValueError: with the option to change.
    """
    wants_eval = bool(margs.eval_passkey_lengths)
    if not (margs.uses_task and margs.task == "passkey") and not wants_eval:
        return
    if wants_eval and margs.eval_passkey_samples < 1:
        raise ValueError(f"--eval-passkey-samples must be >= 1, got {margs.eval_passkey_samples}.")
    bad = [d for d in margs.eval_passkey_depths if not 0.0 <= d <= 1.0]
    if wants_eval and (bad or not margs.eval_passkey_depths):
        raise ValueError(f"--eval-passkey-depths are fractions in [0, 1], got {margs.eval_passkey_depths}.")
    task, tokenizer = passkey_task(margs, margs.eval_passkey_filler or margs.passkey_filler)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}; "
                         "give a --model whose tokenizer matches it.")
    lengths = ([margs.seq_len] if margs.uses_task and margs.task == "passkey" else []) + list(
        margs.eval_passkey_lengths or [])
    short = [n for n in lengths if n < task.min_length()]
    if short:
        raise ValueError(f"passkey rows need at least {task.min_length()} tokens with this tokenizer and "
                         f"--passkey-digits {margs.passkey_digits}; raise --seq-len / --eval-passkey-lengths {short}.")


def cell_rows(task: PasskeyTask, length: int, depth: float, samples: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The ``samples`` rows :func:`passkey_grid` scores for one (length, depth) cell (its own seed)."""
    return task.rows(length, [depth] * samples, seed=seed * 1_000_003 + length * 1009 + round(depth * 1000))


def passkey_grid(model: torch.nn.Module, ulysses: Any, task: PasskeyTask, lengths: list[int], depths: list[float],
                 samples: int, seed: int = 0) -> list[dict[str, float]]:
    """Scores of ``samples`` rows per (length, depth) cell under SP (every rank of the group calls this).

    Returns:
        One dict per cell: ``length``, ``depth``, ``exact_match`` (fraction of rows whose whole key is
        predicted), ``token_accuracy`` (key tokens), ``mean_log_likelihood`` (per key token, mean over rows).
    """
    cells = []
    for length in lengths:
        batch_size = max(1, 8192 // length)
        for depth in depths:
            rows = cell_rows(task, length, depth, samples, seed)
            scores = passkey_scores(model, rows, ulysses, batch_size=batch_size)
            cells.append({"length": length, "depth": depth,
                          "exact_match": float(scores.exact_match.double().mean()),
                          "token_accuracy": scores.token_accuracy,
                          "mean_log_likelihood": float(scores.mean_log_likelihood.mean())})
    return cells


def format_grid(cells: list[dict[str, float]]) -> str:
    """A length x depth table of exact-match accuracy (mean log-likelihood per key token in brackets)."""
    depths = sorted({c["depth"] for c in cells})
    lines = ["length  " + "".join(f"{'depth ' + format(d, 'g'):>17}" for d in depths) + f"{'mean':>17}"]
    for length in sorted({c["length"] for c in cells}):
        row = [c for c in cells if c["length"] == length]
        by_depth = {c["depth"]: c for c in row}
        mean = {k: sum(c[k] for c in row) / len(row) for k in ("exact_match", "mean_log_likelihood")}
        items = [by_depth[d] for d in depths if d in by_depth] + [mean]
        lines.append(f"{length:<8}" + "".join(f"{c['exact_match']:>8.2f} ({c['mean_log_likelihood']:6.2f})"
                                            for c in items))
    return "\n".join(lines)
