"""dp=2 x sp=2 (world 4, gloo, CPU) with real data-parallel wrappers against one process.

Global batch of the step: two different micro-batches, one per DP replica (different B and S).
Each replica shards its own batch over its 2 SP ranks (``sp.shard``), counts the valid tokens of
the whole step over the world (``global_num_items(..., group=None)``) and calls ``sp.loss`` with
its default ``grad_average_world`` (the world, 4). The gradient reduction is NOT done by hand:
DDP (all-reduce, average over its process group = the world) and FSDP2 (``fully_shard`` per
decoder layer and root on a 1-D world mesh: reduce-scatter, average over the world) do it.

Reference: one process, same initial weights, plain transformers (its own kernel, attention
mask) on each micro-batch; loss = sum of every token's CE over both micro-batches / all valid
tokens; its parameter gradients must equal the wrapped model's after backward, and its loss the
logged ``reported_loss``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dist_helper import spawn
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh, UlyssesSPConfig
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.loss import global_num_items, reported_loss

IGNORE = -100
SP_SIZE, WORLD = 2, 4


def micro_batches() -> list[dict]:
    """One global batch per DP replica: (B=2, S=23, right + left padding) and (B=1, S=21, odd S)."""
    return [tiny_batch("padding", seed=1), tiny_batch("odd", seed=2)]


def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, whole step: sum of token CE over both micro-batches / their valid tokens.

    Targets: ``labels`` (else ``input_ids``), shifted as transformers does; -100 and targets
    predicted FROM a padding position are ignored (the convention of ``data/sharding.py``).
    """
    model = tiny_model("llama", seed=0)
    total, count = torch.zeros(()), 0
    for batch in micro_batches():
        mask = batch.get("attention_mask")
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits
        shift = batch.get("labels", batch["input_ids"])[:, 1:]
        if mask is not None:
            shift = shift.masked_fill(mask[:, :-1] == 0, IGNORE)
        total = total + F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shift.reshape(-1),
                                        ignore_index=IGNORE, reduction="sum")
        count += int((shift != IGNORE).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def sp_step(wrapped: torch.nn.Module, sp: UlyssesSP, mesh: SPMesh) -> torch.Tensor:
    """One training step of this rank through ``wrapped``; returns the logged (global) loss."""
    shard = sp.shard(micro_batches()[mesh.dp_rank])
    num_items = global_num_items(shard["shift_labels"], group=None)  # the whole step: all 4 ranks
    # grad_average_world defaults to dp * sp = 4
    loss = sp.forward_loss(wrapped, shard, num_items)
    loss.backward()
    return reported_loss(loss, WORLD, group=None)


def check(where: str, loss: torch.Tensor, grads: dict[str, torch.Tensor], ref_loss, ref_grads) -> None:
    # fp32 everywhere: the SP run differs from the reference only in summation order (CE summed per
    # shard, then over ranks; weight grads summed per shard and averaged by DDP / FSDP2; attention
    # on head slices). Observed: loss identical, grads <= 1e-6 of each tensor's largest entry. The
    # tolerances leave >10x margin; the bugs guarded against are off by a factor (2 for a wrong
    # sp / dp factor, N / N_replica for a per-replica token count) or by >1e-2 (wrong mask / shift).
    assert grads.keys() == ref_grads.keys(), f"{where}: parameters {sorted(grads.keys() ^ ref_grads.keys())}"
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)  # per-tensor scale: grads of different layers differ by 100x
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{where} grad {name}: {m}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")


BLOCKS = UlyssesSPConfig(sp_size=SP_SIZE, sp_head_chunks=2, recompute_norms=True)  # two head blocks (llama N=8 K=2
# at P=2) and input-only RMSNorms (their weights unsharded by FSDP2 in backward)


def _ddp_case(mesh: SPMesh, ref_loss, ref_grads, config: UlyssesSPConfig | None = None) -> None:
    model = tiny_model("llama", seed=0)
    with UlyssesSP(model, mesh, config) as sp:  # registered on the inner model, before wrapping
        ddp = DistributedDataParallel(model)  # CPU, default process group = the whole world
        logged = sp_step(ddp, sp, mesh)
    grads = {name: p.grad for name, p in ddp.module.named_parameters()}
    check(f"DDP rank {dist.get_rank()} {config}", logged, grads, ref_loss, ref_grads)


def _ddp_tiled_case(mesh: SPMesh, ref_loss, ref_grads) -> None:
    """DDP with the tiled MLP and the tiled lm_head + loss (tiles that do not divide the shard)."""
    model = tiny_model("llama", seed=0)
    with UlyssesSP(model, mesh, UlyssesSPConfig(sp_size=mesh.sp_size, tiled_mlp_tokens=5, tiled_loss_tokens=7)) as sp:
        ddp = DistributedDataParallel(model)
        logged = sp_step(ddp, sp, mesh)
    grads = {name: p.grad for name, p in ddp.module.named_parameters()}
    check(f"DDP tiled rank {dist.get_rank()}", logged, grads, ref_loss, ref_grads)


def _fsdp2_case(mesh: SPMesh, ref_loss, ref_grads, config: UlyssesSPConfig | None = None) -> None:
    model = tiny_model("llama", seed=0)
    world_mesh = init_device_mesh("cpu", (WORLD,))  # 1-D: shard params / reduce grads over all ranks
    for layer in model.model.layers:
        fully_shard(layer, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)
    with UlyssesSP(model, mesh, config) as sp:  # found through the FSDP-wrapped class
        logged = sp_step(model, sp, mesh)
    grads = {}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{name}: FSDP2 left a plain tensor grad"
        grads[name] = p.grad.full_tensor()
    check(f"FSDP2 rank {dist.get_rank()} {config}", logged, grads, ref_loss, ref_grads)


def _worker(rank: int, world: int, cases: tuple[str, ...]) -> None:
    mesh = SPMesh.from_world(SP_SIZE)
    assert (mesh.dp_size, mesh.sp_size) == (2, 2)
    ref_loss, ref_grads = reference()
    for case in cases:
        {"ddp": _ddp_case, "ddp_tiled": _ddp_tiled_case, "fsdp2": _fsdp2_case,
         "ddp_blocks": lambda *a: _ddp_case(*a, BLOCKS),
         "fsdp2_blocks": lambda *a: _fsdp2_case(*a, BLOCKS)}[case](mesh, ref_loss, ref_grads)


def test_ddp_and_fsdp2_gradients_match_one_process_on_the_global_batch() -> None:
    """Bug caught: gradients sp times too large (or too small) after DDP's / FSDP2's world average
    (a wrong ``grad_average_world`` default, e.g. dp instead of dp * sp), tokens counted per replica
    or per SP group instead of over the whole step (replicas with different token counts then get
    wrong weights), a replica's micro-batch dropped or duplicated, UlyssesSP failing to find the
    model inside DDP / FSDP2 or its collectives interleaving badly with theirs, a logged loss
    that is a per-rank share instead of the global token mean, and head blocks whose summed
    parameter grads miss DDP's hooks or FSDP2's unsharded parameters."""
    spawn(_worker, WORLD, ("ddp", "ddp_tiled", "fsdp2", "ddp_blocks", "fsdp2_blocks"))
