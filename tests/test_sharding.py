"""shard_batch / UlyssesDataLoader without a process group: every rank's shard computed in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp import IGNORE_INDEX
from ulysses_sp.data import UlyssesDataLoader, shard_batch

IGNORE = -100  # the value users' data carries (transformers' collators); independent of the constant under test


def test_ignore_index_is_the_value_users_write():
    """Bug caught: ``IGNORE_INDEX`` (the one constant the library and the commands use) drifting from
    the -100 that transformers' collators write and ``torch.nn.functional.cross_entropy`` skips."""
    assert IGNORE_INDEX == IGNORE == torch.nn.CrossEntropyLoss().ignore_index


def _shards(batch: dict, sp_size: int, **kw) -> list[dict]:
    return [shard_batch(batch, r, sp_size, **kw) for r in range(sp_size)]


def _cat(shards: list[dict], key: str) -> torch.Tensor:
    return torch.cat([sh[key] for sh in shards], dim=1)


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4])
def test_shift_before_slice_keeps_boundary_targets(sp_size: int) -> None:
    """Bug caught: slicing before shifting, which drops (or mis-assigns) the target of each shard's
    last token, whose label lives on the next rank."""
    g = torch.Generator().manual_seed(sp_size)
    ids = torch.randint(1, 50, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, 3] = IGNORE
    shards = _shards({"input_ids": ids, "labels": labels}, sp_size)
    S = 12 + (-12 % sp_size)
    expected = F.pad(labels[:, 1:], (0, S - 11), value=IGNORE)
    assert torch.equal(_cat(shards, "shift_labels"), expected)
    assert torch.equal(_cat(shards, "input_ids")[:, :12], ids)
    s = S // sp_size
    for r in range(sp_size - 1):  # the last local target is the first token of the next shard
        assert torch.equal(shards[r]["shift_labels"][:, -1], labels[:, (r + 1) * s])


def test_padding_to_multiple_of_sp_size() -> None:
    """Bug caught: S not divisible by P (uneven shards, or padding that is attended to or trained on)."""
    ids = torch.arange(1, 8).repeat(2, 1)  # S = 7
    shards = _shards({"input_ids": ids}, 4, pad_token_id=99)
    assert all(sh["input_ids"].shape == (2, 2) for sh in shards)
    assert torch.equal(_cat(shards, "input_ids")[:, 7:], torch.full((2, 1), 99))
    assert torch.equal(_cat(shards, "shift_labels")[:, 6:], torch.full((2, 2), IGNORE))
    assert torch.equal(_cat(shards, "position_ids"), torch.arange(8).repeat(2, 1))  # padding continues
    mask = shards[0]["ulysses_mask"]
    assert mask.seq_len == 8
    assert torch.equal(mask.valid, torch.tensor([[True] * 7 + [False]] * 2))


def test_no_padding_needed_keeps_plain_causal_mask() -> None:
    """Bug caught: building a padding / document mask where the plain causal fast path applies."""
    shards = _shards({"input_ids": torch.ones(2, 8, dtype=torch.long)}, 2)
    assert all(sh["ulysses_mask"].is_plain_causal for sh in shards)
    assert set(shards[0]) == {"input_ids", "position_ids", "shift_labels", "ulysses_mask"}


def test_position_ids_and_labels_from_attention_mask() -> None:
    """Bug caught: default positions that differ from transformers' arange(S) (a sharded run would
    then rotate padded rows differently from one process) or padding tokens left as targets."""
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [0, 0, 5, 6, 7, 8]])
    am = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    shards = _shards({"input_ids": ids, "attention_mask": am}, 2)
    assert torch.equal(_cat(shards, "position_ids"), torch.arange(6).expand(2, 6))
    # 5 is predicted from padding
    shift = torch.tensor([[6, 7, 8, IGNORE, IGNORE, IGNORE], [IGNORE, IGNORE, 6, 7, 8, IGNORE]])
    assert torch.equal(_cat(shards, "shift_labels"), shift)
    assert torch.equal(shards[1]["ulysses_mask"].valid, am.bool())


def test_packed_position_ids_give_global_documents() -> None:
    """Bug caught: document boundaries derived per shard (local positions) instead of globally, or
    padding that starts a spurious document."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # docs of 3, 2, 4 tokens, S = 9
    ids = torch.arange(1, 10)[None]
    shards = _shards({"input_ids": ids, "position_ids": pos}, 2)
    assert torch.equal(_cat(shards, "position_ids"), torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]]))
    for sh in shards:
        assert torch.equal(sh["ulysses_mask"].document_ids, torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2]]))
        assert torch.equal(sh["ulysses_mask"].valid, torch.tensor([[True] * 9 + [False]]))
    # labels are shifted as transformers does: no extra masking at document starts
    assert torch.equal(_cat(shards, "shift_labels")[0, :9], torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, IGNORE]))


@pytest.mark.parametrize(
    "batch, sp_rank, sp_size, match",
    [
        ({"input_ids": torch.ones(8, dtype=torch.long)}, 0, 2, "input_ids"),
        ({"input_ids": torch.ones(1, 1, 8, dtype=torch.long)}, 0, 2, "input_ids"),
        ({"input_ids": torch.ones(2, 8), "labels": torch.ones(2, 7)}, 0, 2, "labels"),
        ({"input_ids": torch.ones(2, 8), "attention_mask": torch.ones(2, 1, 8, 8)}, 0, 2, "attention_mask"),
        ({"input_ids": torch.ones(2, 8), "position_ids": torch.ones(1, 8)}, 0, 2, "position_ids"),
        ({"input_ids": torch.ones(2, 8)}, 2, 2, "sp_rank"),
        ({"input_ids": torch.ones(2, 8)}, -1, 2, "sp_rank"),
        ({"input_ids": torch.ones(2, 8)}, 0, 0, "sp_size"),
    ],
)
def test_invalid_batches_raise(batch: dict, sp_rank: int, sp_size: int, match: str) -> None:
    """Bug caught: bad inputs failing later as shape errors or hangs inside collectives."""
    with pytest.raises(ValueError, match=match):
        shard_batch(batch, sp_rank, sp_size)


def test_dataloader_wrapper_shards_and_forwards_length() -> None:
    """Bug caught: the wrapper yielding unsharded batches, or hiding the loader's length / the
    DataLoader TypeError for unsized (iterable) datasets."""
    batches = [{"input_ids": torch.arange(6)[None] + i} for i in range(3)]
    loader = UlyssesDataLoader(batches, 1, 2, pad_token_id=0)
    assert len(loader) == 3
    out = list(loader)
    assert [b["input_ids"].tolist() for b in out] == [[[3 + i, 4 + i, 5 + i]] for i in range(3)]
    with pytest.raises(TypeError):
        len(UlyssesDataLoader(iter(batches), 0, 2))
    with pytest.raises(ValueError, match="sp_rank"):
        UlyssesDataLoader(batches, 2, 2)


def test_padding_to_multiple_of_sp_size_repeats_the_last_token_by_default() -> None:
    """Bug caught: S padded with the pad token, whose embedding row is all zeros in many models:
    Gemma3n takes the root of a mean square of it and its gradients became NaN under SP at S % P != 0
    although the padded position is masked and ignored. The default pads with each row's last token."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [4, 3, 2, 1, 11]])  # S = 5, P = 2: one padded position
    shards = [shard_batch({"input_ids": ids}, r, 2) for r in range(2)]
    assert torch.equal(_cat(shards, "input_ids")[:, 5:], torch.tensor([[9], [11]]))
    assert torch.equal(_cat(shards, "shift_labels")[:, 4:], torch.full((2, 2), IGNORE))
    assert torch.equal(shards[0]["ulysses_mask"].valid, torch.tensor([[True] * 5 + [False]] * 2))
    # the batch's own padding holds the row's first real token too (masked and ignored all the same)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    shards = [shard_batch({"input_ids": ids, "attention_mask": mask}, r, 2) for r in range(2)]
    assert torch.equal(_cat(shards, "input_ids"), torch.tensor([[5, 6, 7, 5, 5, 5], [2, 2, 2, 1, 11, 11]]))
    assert torch.equal(_cat(shards, "shift_labels"), torch.tensor([[6, 7, IGNORE, IGNORE, IGNORE, IGNORE],
                                                                   [IGNORE, IGNORE, 1, 11, IGNORE, IGNORE]]))


def test_pre_shifted_labels_are_used_and_token_types_sliced() -> None:
    """Bug caught: ``shift_labels`` (pre-shifted, as transformers' loss and Accelerate's context
    parallelism take them) being ignored for labels rebuilt from ``input_ids`` (completion-only
    masks lost: the loss of every token), and ``token_type_ids`` being dropped instead of sliced."""
    ids = torch.arange(1, 8)[None]  # S=7, P=2: padded to 8
    labels = ids.masked_fill(torch.arange(7)[None] < 4, -100)  # prompt 1 2 3 4 masked
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    types = torch.tensor([[0, 0, 1, 1, 1, 0, 1]])
    shards = [shard_batch({"input_ids": ids, "shift_labels": shift, "token_type_ids": types}, r, 2) for r in range(2)]
    assert torch.cat([s["shift_labels"] for s in shards], 1).tolist() == [[-100, -100, -100, 5, 6, 7, -100, -100]]
    assert torch.cat([s["token_type_ids"] for s in shards], 1).tolist() == [[0, 0, 1, 1, 1, 0, 1, 0]]
    # with both, the pre-shifted ones win, as in transformers' ForCausalLMLoss
    both = shard_batch({"input_ids": ids, "labels": ids, "shift_labels": shift}, 0, 2)
    assert both["shift_labels"].tolist() == [[-100, -100, -100, 5]]
    assert "token_type_ids" not in shard_batch({"input_ids": ids}, 0, 2)
    with pytest.raises(ValueError, match=r"batch\['shift_labels'\] must be a tensor of input_ids' shape"):
        shard_batch({"input_ids": ids, "shift_labels": shift[:, :-1]}, 0, 2)
