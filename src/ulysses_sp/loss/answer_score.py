"""Teacher-forced scores of answer tokens (passkey / needle retrieval) over a sequence-sharded batch.

Shape legend: B batch, s local shard (S/P), t scored positions of this rank (t <= s), V vocab.

Each rank scores only its own tokens: the logits of its shard (or only of the positions that hold an
answer token, ``answer_positions``: a model called with ``logits_to_keep=positions`` never forms the
``(B, s, V)`` logits) against the shard's ``shift_labels``. Per sample it sums::

    log_likelihood  sum over answer tokens of log softmax(logits)[label]       (fp32 softmax, fp64 sum)
    num_correct     answer tokens whose argmax is the label
    num_tokens      answer tokens (labels != ignore_index)

then one all-reduce over the SP group adds the shards' sums: every rank holds the numbers one
process computes on the whole sequence (sums of the same per-token terms; only their order differs).

    rank 0: filler .. needle "the pass key is 4721" .. filler     (no answer tokens: zeros)
    rank 1: filler .. "what is the pass key? the pass key is" 4 7 2 1
                                                                   ^ scored here, from rank 0's needle
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ulysses_sp.comm.collectives import all_reduce_sum
from ulysses_sp.config import IGNORE_INDEX


@dataclass(frozen=True)
class AnswerScores:
    """Per-sample answer scores of a batch (the same on every rank of the SP group).

    Attributes:
        log_likelihood: ``(B,)`` float64, sum of the answer tokens' log-probabilities.
        num_correct: ``(B,)`` int64, answer tokens predicted exactly (argmax == label).
        num_tokens: ``(B,)`` int64, answer tokens (0 for a sample without one).
    """

    log_likelihood: torch.Tensor
    num_correct: torch.Tensor
    num_tokens: torch.Tensor

    @property
    def exact_match(self) -> torch.Tensor:
        """``(B,)`` bool: every answer token of the sample is right (False without answer tokens)."""
        return (self.num_correct == self.num_tokens) & (self.num_tokens > 0)

    @property
    def token_accuracy(self) -> float:
        """Answer tokens predicted exactly over all answer tokens of the batch (0.0 without any)."""
        return float(self.num_correct.sum()) / max(int(self.num_tokens.sum()), 1)

    @property
    def mean_log_likelihood(self) -> torch.Tensor:
        """``(B,)`` float64 log-likelihood per answer token of each sample (0 without answer tokens)."""
        return self.log_likelihood / self.num_tokens.clamp_min(1)

    @staticmethod
    def cat(parts: list[AnswerScores]) -> AnswerScores:
        """The scores of several batches as one (samples in order)."""
        if not parts:
            raise ValueError("AnswerScores.cat needs at least one AnswerScores.")
        return AnswerScores(*(torch.cat([getattr(p, f) for p in parts]) for f in
                              ("log_likelihood", "num_correct", "num_tokens")))


def answer_positions(shift_labels_Bs: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``(t,)`` int64: the local positions where any sample of the shard has an answer token.

    Pass them to the model as ``logits_to_keep`` and gather ``shift_labels[:, positions]`` to score
    only those logits ``(B, t, V)``. Empty on a rank whose shard holds no answer.
    """
    if shift_labels_Bs.dim() != 2:
        raise ValueError(f"shift_labels must be (batch, seq), got {tuple(shift_labels_Bs.shape)}.")
    return (shift_labels_Bs != ignore_index).any(dim=0).nonzero().flatten()


def answer_scores(
    logits_BtV: torch.Tensor,
    shift_labels_Bt: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> AnswerScores:
    """Scores of the answer tokens of the whole SP group, from this rank's shard.

    Args:
        logits_BtV: ``(B, t, V)`` logits of this rank's tokens: the whole shard (t = s) or only the
            positions of :func:`answer_positions` (any float dtype; softmax in fp32).
        shift_labels_Bt: ``(B, t)`` targets of the same positions (``shard_batch``'s ``shift_labels``,
            already shifted), ``ignore_index`` outside the answer.
        group: the SP group whose shards make up the sequences (None: one process, no reduction).
            Every rank of the group must call this (one all-reduce).
        ignore_index: label value that is not an answer token.

    Returns:
        :class:`AnswerScores` of the B samples, identical on every rank of ``group``.
    """
    if logits_BtV.dim() != 3 or logits_BtV.shape[:2] != shift_labels_Bt.shape:
        raise ValueError(
            f"logits must be (batch, positions, vocab) and shift_labels (batch, positions) of the same tokens, got "
            f"{tuple(logits_BtV.shape)} and {tuple(shift_labels_Bt.shape)}; gather shift_labels[:, positions] when the "
            "model kept only those logits (logits_to_keep=positions)."
        )
    labels = shift_labels_Bt.to(logits_BtV.device)
    keep = labels != ignore_index
    logp = F.log_softmax(logits_BtV.detach().float(), dim=-1)
    target = labels.clamp_min(0).unsqueeze(-1)
    token_ll = logp.gather(-1, target).squeeze(-1).double().masked_fill(~keep, 0.0)
    correct = (logp.argmax(-1) == labels) & keep
    sums = torch.stack([token_ll.sum(1), correct.sum(1).double(), keep.sum(1).double()])  # (3, B)
    if group is not None:
        sums = all_reduce_sum(sums, group).to(logits_BtV.device)
    return AnswerScores(sums[0], sums[1].round().long(), sums[2].round().long())
