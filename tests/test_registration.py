"""UlyssesSP.register() as ordered, reversible steps: a failure at any step leaves the model as it was.

Reference: a snapshot of everything registration touches, taken before ``register()``: the
``state_dict``, every module's class and instance ``forward``, its forward hooks, the checkpoint
function of checkpointed layers, the attention implementation, ``use_cache`` and the registry's
keys, and the logits of one forward.
"""

import pytest
import torch
from transformers import AttentionInterface

from tiny_models import tiny_model
from ulysses_sp import UlyssesSPConfig
from ulysses_sp.integrations import registration
from ulysses_sp.integrations.registration import Registration
from ulysses_sp.integrations.transformers import UlyssesSP

STEPS = ["_offload", "_registry_key", "_call_mask_hook", "_vision_hook", "_kernel", "_no_cache", "_tiled_mlp",
         "_norms", "_mixers", "_rope_length"]


class FakeMesh:  # registration issues no collective: a one-process stand-in for a 2-rank SP group
    sp_size, dp_size, sp_rank, sp_group = 2, 1, 0, None


def snapshot(model):
    """Everything registration may change, in comparable form."""
    modules = {name: (type(m), m.__dict__.get("forward"), dict(m._forward_pre_hooks), dict(m._forward_hooks),
                      m.__dict__.get("_gradient_checkpointing_func")) for name, m in model.named_modules()}
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).view(1, 12)).logits
    return {"modules": modules, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "kernel": model.config._attn_implementation, "use_cache": model.config.use_cache,
            "registry": set(AttentionInterface._global_mapping), "logits": logits}


def assert_same(before, after):
    assert after["modules"] == before["modules"]  # classes, instance forwards, hooks, checkpoint functions
    assert after["kernel"] == before["kernel"] and after["use_cache"] == before["use_cache"]
    assert after["registry"] == before["registry"]
    assert after["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        torch.testing.assert_close(after["state"][key], value, rtol=0, atol=0)  # untouched: bit-equal
    torch.testing.assert_close(after["logits"], before["logits"], rtol=0, atol=0)  # same modules, same bits


def build():
    model = tiny_model("llama_dynamic")  # a length-dependent RoPE: step 9 hooks it
    model.activation_checkpointing_enable()  # step 1 (offload) wraps the checkpoint functions
    model.eval()
    config = UlyssesSPConfig(sp_size=2, tiled_mlp_tokens=4, offload_activations=True, recompute_norms=True)
    return model, UlyssesSP(model, FakeMesh(), config)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("as_context", [False, True])
def test_failure_after_any_step_leaves_the_model_as_it_was(monkeypatch, step, as_context):
    """Bug caught: a registration step that raises (after the steps before it changed the model)
    leaves the model half-registered: our kernel or registry key, use_cache=False, tiled MLPs, hooks or
    offloaded checkpoint functions stay, also under ``with UlyssesSP(...)`` whose ``__exit__`` never runs."""
    model, sp = build()
    before = snapshot(model)
    original = getattr(Registration, step)

    def failing(self, stack):
        original(self, stack)  # the step is done (its undo pushed) and then something raises
        raise RuntimeError(f"injected failure after {step}")

    monkeypatch.setattr(Registration, step, failing)
    with pytest.raises(RuntimeError, match="injected"):
        if as_context:
            with sp:
                pass
        else:
            sp.register()
    assert_same(before, snapshot(model))
    monkeypatch.undo()
    with sp:  # the same object registers cleanly afterwards, and unregisters to the same state
        assert model.config._attn_implementation == sp.key
    assert_same(before, snapshot(model))


def test_failure_inside_a_step_leaves_the_model_as_it_was(monkeypatch):
    """Bug caught: ``apply_tiled_mlp`` raising after the registry key, the kernel switch and
    ``use_cache`` were set (the example of issue 26) leaves them set."""
    model, sp = build()
    before = snapshot(model)

    def refuse(model, tile_tokens):
        raise ValueError("tiled MoE refuses this block")

    monkeypatch.setattr(registration, "apply_tiled_mlp", refuse)
    with pytest.raises(ValueError, match="refuses"):
        sp.register()
    assert_same(before, snapshot(model))


def test_unregister_undoes_in_reverse_order(monkeypatch):
    """Bug caught: unregister() undoing the steps in another order than reverse registration order."""
    model, sp = build()
    order = []
    for step in STEPS:
        original = getattr(Registration, step)

        def traced(self, stack, original=original, step=step):
            original(self, stack)
            stack.callback(order.append, step)  # runs just before this step's own undo

        monkeypatch.setattr(Registration, step, traced)
    sp.register()
    assert order == []
    sp.unregister()
    assert order == STEPS[::-1]
    sp.unregister()  # idempotent
    assert order == STEPS[::-1]
