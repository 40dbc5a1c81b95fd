"""Models that transform lm_head's output before the loss, under the tiled loss.

Cohere multiplies the logits by ``logit_scale`` and Granite divides them by ``logits_scaling``
after lm_head. The tiled loss replaces lm_head's forward, so it must apply the same constant in
its tiles; any other transform must be refused, not trained through silently.
"""

import pytest

from dist_helper import spawn
from test_hf_parity import check
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig
from ulysses_sp.loss import global_num_items


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    for family in ("cohere", "granite"):
        for kind in ("padding", "packed"):
            check(family, kind, mesh, tiled_loss_tokens=5)  # loss and every gradient vs one plain process


def test_tiled_loss_applies_the_models_logit_scale():
    """Bug caught: with tiled_loss_tokens the Cohere / Granite logit scale was skipped (the tiles
    computed the loss of the unscaled logits: a different loss and gradient, silently)."""
    spawn(_worker, 2)


def _unknown_transform_worker(rank, world):
    model = tiny_model("llama")
    model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out.logits + 1.0) or out)
    with UlyssesSP(model, SPMesh.from_world(world), UlyssesSPConfig(sp_size=world, tiled_loss_tokens=5)) as sp:
        shard = sp.shard(tiny_batch("plain"))
        with pytest.raises(ValueError, match="transforms lm_head's output before the loss.*unset tiled_loss_tokens"):
            sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], sp.mesh.sp_group))


def test_an_unknown_logit_transform_is_refused():
    """Bug caught: a model whose logits are changed after lm_head in a way the tiles do not apply (here
    an offset): the first tiled forward compares the model's output with the expected one and raises."""
    spawn(_unknown_transform_worker, 1)
