"""The MoE router load-balancing loss under SP (``output_router_logits=True``).

Reference: one plain-transformers process on the global batch, whose ``loss`` is the token-mean
cross entropy plus ``router_aux_loss_coef * aux`` over ALL tokens (padding excluded through the
attention mask). Under SP the model's own ``aux_loss`` covers only the shard's tokens; the loss
must still equal the reference in value and in every gradient (router weights included).
"""

import pytest
import torch

from dist_helper import spawn
from test_hf_parity import sp_run
from test_rope_length import reference
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh, UlyssesSP
from ulysses_sp.loss import global_num_items

PLAN = {2: [("mixtral_aux", "plain"), ("mixtral_aux", "odd"), ("qwen3_moe_aux", "padding")],
        4: [("mixtral_aux", "padding"), ("qwen3_moe_aux", "odd")]}


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    cases = [(f, k, {}) for f, k in PLAN[world]]
    if world == 2:
        cases.append(("mixtral_aux", "padding", {"tiled_loss_tokens": 5}))  # the tiled-loss path adds it too
    for family, kind, options in cases:
        ref_loss, ref_grads = reference(family, kind)
        loss, grads = sp_run(family, kind, mesh, **options)
        where = f"{family}/{kind}/P={world}/{options}"
        # fp32, summation order only (as test_hf_parity.check); the shard-local aux loss is off by ~1e-2
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} loss: {m}")
        for name, ref in ref_grads.items():
            scale = ref.abs().max().clamp_min(1e-8)
            torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-4,
                                       msg=lambda m, name=name: f"{where} grad {name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_router_aux_loss_is_the_whole_sequence_loss(world):
    """Bug caught: the router aux loss was silently dropped under SP (our loss is built from the
    logits); computed per shard it would be a different, nonlinear function of the routing. Mixtral
    and Qwen3-MoE, plain / padding / S % P != 0, and the tiled-loss path."""
    spawn(_worker, world)


def _mismatch_worker(rank, world):
    model = tiny_model("mixtral_aux")
    model.config.num_experts_per_tok = 3  # the layers still route to 2: the model's aux is another formula
    with UlyssesSP(model, SPMesh.from_world(world)) as sp:
        shard = sp.shard(tiny_batch("plain"))
        with pytest.raises(ValueError, match="router aux loss is not the Switch-style.*output_router_logits = False"):
            sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], sp.mesh.sp_group))


def test_a_different_aux_rule_is_refused_not_replaced():
    """Bug caught: an aux loss silently replaced by ours for a model whose own rule differs: the first
    call compares our formula on the shard with the model's own aux_loss and raises."""
    spawn(_mismatch_worker, 2)
