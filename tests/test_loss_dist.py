"""Sharded loss + DDP-style gradient averaging == single-process token-mean CE (gloo, CPU).

Model: token-wise ``logits = E[input_ids] @ W`` (no attention needed: the loss path is what is
tested). Each case builds the same global data on every rank from one seed, shards it with
``shard_batch``, runs ``sp_token_loss``, averages gradients over the world as DDP does, and
compares with the one-process reference on the full, unsharded batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_helper import spawn
from ulysses_sp.comm.mesh import SPMesh
from ulysses_sp.data import UlyssesDataLoader, shard_batch, validate_same_batch
from ulysses_sp.loss import global_num_items, reported_loss, sp_token_loss

IGNORE = -100
V, D = 11, 8

# fp32 throughout: the sharded and reference losses sum the same <= 100 O(1) terms in a different
# order (relative error ~1e-7 per op); 1e-5 leaves headroom, while a wrong scale (a factor P or W),
# a lost boundary token or a wrong count changes results by more than 1e-2.
RTOL, ATOL = 1e-5, 1e-6

# (name, sp_size, B, S, micro_steps, ignore labels from this position on, use attention_mask)
CASES_2 = [
    ("sp2 uneven S", 2, 2, 13, 1, None, False),
    ("sp2 rank 1 all ignored", 2, 2, 16, 1, 9, False),
    ("sp2 padded batch, labels from attention_mask", 2, 3, 10, 1, None, True),
    ("sp2 nothing to learn", 2, 1, 8, 1, 0, False),
    ("dp2 sp1", 1, 2, 9, 1, None, False),
]
CASES_4 = [
    ("sp4 uneven S", 4, 2, 14, 1, None, False),
    ("sp4 ranks 2, 3 all ignored", 4, 1, 16, 1, 9, False),
    ("dp2 sp2, 2 micro-steps", 2, 2, 11, 2, None, True),
]


def _make_batch(g: torch.Generator, B: int, S: int, ignore_from: int | None, use_mask: bool) -> dict:
    ids = torch.randint(0, V, (B, S), generator=g)
    batch = {"input_ids": ids}
    if use_mask:  # right padding of random length; labels derived by shard_batch
        lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
        batch["attention_mask"] = (torch.arange(S)[None] < lengths[:, None]).long()
    else:
        labels = ids.clone()
        labels[torch.rand(B, S, generator=g) < 0.2] = IGNORE
        if ignore_from is not None:
            labels[:, ignore_from:] = IGNORE
        batch["labels"] = labels
    return batch


def _reference(E: torch.Tensor, W: torch.Tensor, batches: list[dict]) -> tuple[torch.Tensor, ...]:
    """Single process, transformers-style: shift, sum CE over all batches' valid tokens / count."""
    E, W = E.detach().requires_grad_(), W.detach().requires_grad_()
    total, count = torch.zeros(()), 0
    for b in batches:
        labels = b.get("labels")
        if labels is None:
            labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, IGNORE)
        shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        logits = E[b["input_ids"]] @ W
        total = total + F.cross_entropy(logits.reshape(-1, V), shift.reshape(-1), ignore_index=IGNORE, reduction="sum")
        count += int((shift != IGNORE).sum())
    loss = total / max(count, 1)
    loss.backward()
    return loss.detach(), E.grad, W.grad


def _run_case(rank: int, world: int, seed: int, case: tuple) -> None:
    name, sp_size, B, S, micro_steps, ignore_from, use_mask = case
    mesh = SPMesh.from_world(sp_size)
    g = torch.Generator().manual_seed(seed)  # same data on every rank
    E0, W0 = torch.randn(V, D, generator=g), torch.randn(D, V, generator=g)
    # batches[step][dp_rank]: a different global batch for every replica and micro-step
    batches = [[_make_batch(g, B, S, ignore_from, use_mask) for _ in range(mesh.dp_size)] for _ in range(micro_steps)]
    ref_loss, ref_dE, ref_dW = _reference(E0, W0, [b for step in batches for b in step])

    E, W = E0.clone().requires_grad_(), W0.clone().requires_grad_()
    shards = [shard_batch(step[mesh.dp_rank], mesh.sp_rank, sp_size) for step in batches]
    num_items = global_num_items([sh["shift_labels"] for sh in shards], group=None)
    logged = torch.zeros(())
    for sh in shards:
        loss = sp_token_loss(E[sh["input_ids"]] @ W, sh["shift_labels"], num_items, grad_average_world=world)
        assert torch.isfinite(loss), f"{name}: rank {rank} loss {loss}"
        if bool((sh["shift_labels"] == IGNORE).all()):
            assert loss.item() == 0.0 and loss.requires_grad, f"{name}: rank {rank} without tokens gave {loss}"
        loss.backward()
        logged += reported_loss(loss, world, group=None)
    for grad in (E.grad, W.grad):  # what DDP / FSDP do: all-reduce SUM, divide by their world
        dist.all_reduce(grad)
        grad /= world
    torch.testing.assert_close(logged, ref_loss, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} loss: {m}")
    torch.testing.assert_close(E.grad, ref_dE, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} dE: {m}")
    torch.testing.assert_close(W.grad, ref_dW, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} dW: {m}")


def _worker(rank: int, world: int, cases: list[tuple]) -> None:
    for seed, case in enumerate(cases):
        _run_case(rank, world, seed, case)


def test_sharded_loss_matches_single_process_world2() -> None:
    """Bug caught: per-rank mean instead of global token mean, a missing or wrong world factor
    (grads off by P after DDP's average), shard-boundary targets lost, padding trained on, NaN from
    a rank (or a whole batch) with no valid tokens, tokens counted over the wrong group (dp2 sp1)."""
    spawn(_worker, 2, CASES_2)


def test_sharded_loss_matches_single_process_world4() -> None:
    """Bug caught: as world 2 at P=4, plus dp x sp: the count must cover every replica's batch and
    every gradient-accumulation micro-step, and SP ranks' contributions must be summed, not averaged."""
    spawn(_worker, 4, CASES_4)


def _validate_worker(rank: int, world: int) -> None:
    same = [{"input_ids": torch.arange(12).reshape(2, 6) + i} for i in range(2)]
    validate_same_batch(same[0]["input_ids"], None)
    assert len(list(UlyssesDataLoader(same, rank, world, sp_group=dist.group.WORLD))) == 2
    per_rank = [{"input_ids": same[0]["input_ids"].roll(rank, dims=1)}]  # same tokens, other order on rank 1
    try:
        list(UlyssesDataLoader(per_rank, rank, world, sp_group=dist.group.WORLD))
    except ValueError as err:
        assert "same batch" in str(err)
    else:
        raise AssertionError(f"rank {rank}: different batches in one SP group were not detected")


def test_validate_same_batch_detects_divergent_ranks() -> None:
    """Bug caught: a sampler keyed by world rank feeding the SP ranks of one group different
    batches (silently wrong attention), missed on some rank (which would then hang)."""
    spawn(_validate_worker, 2)
