"""Forward swaps restore what was there before: ``instance_forward`` and every feature that uses it.

Reference: the module's ``forward`` before the swap (an instance forward, as Accelerate's hooks set,
or none: the class forward), compared by identity after the swap is undone.
"""

import torch
from accelerate.hooks import ModelHook, add_hook_to_module

from test_linear_mixers import hybrid_batch, hybrid_model
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import IGNORE_INDEX, UlyssesSPConfig
from ulysses_sp.integrations.transformers import UlyssesSP
from ulysses_sp.mixers import supported_mixers
from ulysses_sp.swaps import instance_forward


class FakeMesh:  # registration and a one-rank forward issue no collective
    sp_size, dp_size, sp_rank, sp_group = 1, 1, 0, None


class CountingHook(ModelHook):
    """An Accelerate hook: ``add_hook_to_module`` makes the module's forward an instance attribute."""

    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def test_instance_forward_restores_the_previous_forward():
    """Bug caught: undoing a swap deletes the instance forward that was there before (the class
    forward runs again and the other wrapper is silently gone), or leaves ours in place."""
    module = torch.nn.Linear(2, 2)
    with instance_forward(module, lambda x: x * 0):
        assert float(module(torch.ones(1, 2)).abs().sum()) == 0
    assert "forward" not in module.__dict__  # no instance forward before: the class forward again
    previous = add_hook_to_module(module, CountingHook()).forward
    handle = instance_forward(module, lambda x: x)
    inner = instance_forward(module, lambda x: x * 2)  # nested: last in, first out
    inner.remove()
    handle.remove()
    handle.remove()  # idempotent
    assert module.forward is previous


def test_mixer_swap_keeps_a_pre_existing_instance_forward():
    """Bug caught: unregister() pops the SP mixers' forward unconditionally, which deletes an
    instance forward Accelerate's hooks had set on the mixer before registration."""
    model = hybrid_model("qwen3_5")
    mixers = [m for m in model.modules() if type(m).__name__ in supported_mixers()]
    hooks = [CountingHook() for _ in mixers]
    previous = [add_hook_to_module(m, h).forward for m, h in zip(mixers, hooks)]
    with UlyssesSP(model, FakeMesh(), UlyssesSPConfig(sp_size=1)):
        assert all(m.forward is not p for m, p in zip(mixers, previous))  # the SP forward is installed
    assert all(m.forward is p for m, p in zip(mixers, previous))
    with torch.no_grad():
        model(input_ids=hybrid_batch("plain")["input_ids"])
    assert all(h.calls == 1 for h in hooks)  # Accelerate's hook still runs


def test_tiled_loss_keeps_a_pre_existing_lm_head_forward():
    """Bug caught: the tiled lm_head loss leaving its forward (or the class forward) in place of an
    instance forward that was on lm_head before the call."""
    model = tiny_model("llama")
    head = model.get_output_embeddings()
    hook = CountingHook()
    previous = add_hook_to_module(head, hook).forward
    with UlyssesSP(model, FakeMesh(), UlyssesSPConfig(sp_size=1, tiled_loss_tokens=4)) as sp:
        shard = sp.shard(tiny_batch("plain"))
        sp.forward_loss(model, shard, int((shard["shift_labels"] != IGNORE_INDEX).sum()))
    assert head.forward is previous
    model(input_ids=tiny_batch("plain")["input_ids"])
    assert hook.calls == 1
