"""The embedded long-range task and the default model of ``ulysses-sp train`` (no downloads).

Copy task: each row is ``[BOS] x_1 .. x_n [SEP] x_1 .. x_n`` with random content tokens ``x``,
length ``S = 2n + 2``. The loss and the accuracy count only the copied half: the token at
position ``n + 1 + i`` (``SEP`` or ``x_i``) must predict ``x_{i+1}``, which appears nowhere in the
second half before it. Under SP=2 the row splits exactly at ``SEP``::

    rank 0: [BOS] x_1 .. x_n          no targets
    rank 1: [SEP] x_1 .. x_n          targets x_1 .. x_n: only in rank 0's tokens

so every correct answer proves that attention spans the shards. Chance accuracy is
``1 / num_content_tokens``; a 2-layer attention model learns the task with an induction head
(find the previous occurrence of the current token, copy the token after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ulysses_sp import IGNORE_INDEX

PAD, BOS, SEP = 0, 1, 2
NUM_SPECIAL = 3


@dataclass(frozen=True)
class CopyTask:
    """Random copy rows of ``seq_len`` tokens over ``vocab_size`` ids (ids 0-2 are special).

    Attributes:
        seq_len: global row length S (even, >= 4).
        vocab_size: token ids ``[0, vocab_size)``; content tokens are ``[3, vocab_size)``.
    """

    seq_len: int = 512
    vocab_size: int = 64

    def __post_init__(self) -> None:
        if self.seq_len < 4 or self.seq_len % 2:
            raise ValueError(f"the copy task needs an even --seq-len >= 4, got {self.seq_len}.")
        if self.vocab_size < NUM_SPECIAL + 2:
            raise ValueError(f"the copy task needs --task-vocab-size >= {NUM_SPECIAL + 2}, got {self.vocab_size}.")

    @property
    def num_content(self) -> int:
        """Tokens copied per row (n)."""
        return self.seq_len // 2 - 1

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of guessing a content token uniformly."""
        return 1.0 / (self.vocab_size - NUM_SPECIAL)

    def rows(self, num_rows: int, seed: int) -> dict[str, torch.Tensor]:
        """``num_rows`` rows: ``input_ids`` ``(num_rows, S)`` and ``labels`` ``(num_rows, S)``
        (unshifted, as transformers expects; ``IGNORE_INDEX`` outside the copied half)."""
        n = self.num_content
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(NUM_SPECIAL, self.vocab_size, (num_rows, n), generator=gen)
        bos = torch.full((num_rows, 1), BOS)
        sep = torch.full((num_rows, 1), SEP)
        input_ids = torch.cat([bos, x, sep, x], dim=1)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, n + 2 :] = x
        return {"input_ids": input_ids, "labels": labels}

    def dataset(self, num_rows: int, seed: int) -> list[dict[str, torch.Tensor]]:
        """A map-style dataset (a list of per-row dicts) for the Trainer's DataLoader."""
        rows = self.rows(num_rows, seed)
        return [{"input_ids": rows["input_ids"][i], "labels": rows["labels"][i]} for i in range(num_rows)]


def default_model_config(task: CopyTask, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4):
    """A small Llama-style config for the task (random init): 2 layers, 4 heads, no tied embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=task.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max(task.seq_len, 1024), pad_token_id=PAD, bos_token_id=BOS, eos_token_id=SEP,
        tie_word_embeddings=False, rope_theta=10000.0,
    )


def embedded_model_config(margs):
    """The config of the embedded model (no ``--model``) for ``margs.task``.

    copy: :func:`default_model_config`. passkey: the same Llama over the built-in character tokenizer's
    ids, with ``max_position_embeddings = --seq-len`` (the length it is trained at: its native length,
    which a later run extends with RoPE scaling).
    """
    task = CopyTask(margs.seq_len if margs.seq_len % 2 == 0 else margs.seq_len + 1, margs.task_vocab_size)
    config = default_model_config(task, margs.hidden_size, margs.num_layers, margs.num_heads)
    if getattr(margs, "task", "copy") == "passkey":
        from ulysses_sp.cli.train.passkey import char_tokenizer

        config.vocab_size = len(char_tokenizer())
        config.max_position_embeddings = margs.seq_len
    return config
