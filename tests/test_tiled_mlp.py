"""Tiled MLP against the untiled MLP: same loss and gradients, less saved activation memory.

Tolerances: tiling changes nothing but the split of the sequence dim; per-token matmuls are the
same, but BLAS may pick different blocking for a (B, t, D) than a (B, s, D) operand and parameter
grads are summed over tiles in a different order, so fp32 results agree to rounding (~1e-6
relative); atol/rtol 1e-5 is well above that and far below any real error (wrong tile, missing
tile, double-counted grad are O(1e-1) relative).
"""

import pytest
import torch
from torch import nn

from tiny_models import tiny_model
from ulysses_sp.memory import TiledMLP, TiledMLPFunction, apply_tiled_mlp, remove_tiled_mlp

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 rounding only; see module docstring
S = 23  # with tile_tokens=5: tiles 5,5,5,5,3 (the last tile is short)


class GatedMLP(nn.Module):
    def __init__(self, d=16, i=40):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, i), nn.Linear(d, i), nn.Linear(i, d)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def llama_loss_and_grads(tile_tokens=None, checkpointing=None, freeze=()):
    model = tiny_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_(not any(f in name for f in freeze))
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    if tile_tokens is not None:
        assert apply_tiled_mlp(model, tile_tokens) == model.config.num_hidden_layers
    ids = torch.randint(1, 128, (2, S), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # parameter names gain one level under the wrapper (.mlp.mlp.); state_dict keys do not
    return loss.detach(), {n.replace(".mlp.mlp.", ".mlp."): p.grad for n, p in model.named_parameters()}


def assert_same(ref, got):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert ref_grads.keys() == grads.keys()
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, f"{name}: frozen parameter received a gradient"
        else:
            torch.testing.assert_close(grads[name], g, **TOL, msg=name)


def test_llama_loss_and_every_grad_match_untiled():
    """Catches a dropped/duplicated last (short) tile, grads of only one tile, or param grads
    counted twice (returned and also accumulated into .grad by hand)."""
    assert_same(llama_loss_and_grads(), llama_loss_and_grads(tile_tokens=5))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_llama_with_gradient_checkpointing(use_reentrant):
    """Catches a Function that breaks under checkpoint recompute (non-reentrant: saved-tensor count
    mismatch between forward and recompute; reentrant: forward first run under no_grad)."""
    assert_same(llama_loss_and_grads(), llama_loss_and_grads(tile_tokens=5, checkpointing=use_reentrant))


def test_frozen_params_get_no_grad():
    """Catches a frozen MLP weight receiving a gradient (or a crash in backward's index mapping
    between the params that need grad and those returned)."""
    freeze = ("up_proj", "layers.0.mlp.down_proj")
    assert_same(llama_loss_and_grads(freeze=freeze), llama_loss_and_grads(tile_tokens=5, freeze=freeze))


@pytest.mark.parametrize("num_tiles", [1, 2, 5, S, 100])
def test_function_any_tile_count(num_tiles):
    """Catches wrong split arithmetic: one tile, uneven tiles, one token per tile, more tiles than tokens."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    x = torch.randn(3, S, 16, requires_grad=True)
    dy = torch.randn(3, S, 16)
    y_ref = mlp(x)
    ref = torch.autograd.grad(y_ref, [x, *mlp.parameters()], dy)
    y = TiledMLPFunction.apply(mlp, x, num_tiles, *mlp.parameters())
    got = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    torch.testing.assert_close(y, y_ref, **TOL)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, **TOL)


def test_param_grad_accumulates_once_per_backward():
    """Catches grads written into .grad per tile AND returned (doubling), and accumulation once
    per tile, which would make DDP/FSDP/ZeRO (hooks after grad accumulation) reduce once per tile."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    tiled = TiledMLP(mlp, tile_tokens=4)
    hook_calls = []
    mlp.up_proj.weight.register_post_accumulate_grad_hook(lambda p: hook_calls.append(1))
    x = torch.randn(2, S, 16)
    (ref_grad,) = torch.autograd.grad(mlp(x).square().sum(), mlp.up_proj.weight)
    tiled(x).square().sum().backward()
    assert len(hook_calls) == 1
    torch.testing.assert_close(mlp.up_proj.weight.grad, ref_grad, **TOL)
    first = mlp.up_proj.weight.grad.clone()
    tiled(x).square().sum().backward()
    torch.testing.assert_close(mlp.up_proj.weight.grad, 2 * first, **TOL)


def test_no_full_intermediate_activation_saved():
    """Catches the memory bug: (B, s, intermediate) activations kept for backward, in the forward
    or in the backward recompute. The untiled run proves the check can see them."""
    model = tiny_model("llama")
    inter = model.config.intermediate_size
    ids = torch.randint(1, 128, (2, S), generator=torch.Generator().manual_seed(0))

    def saved_shapes():
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.backward()
        return shapes

    assert (2, S, inter) in saved_shapes()
    apply_tiled_mlp(model, tile_tokens=5)
    shapes = saved_shapes()
    assert (2, S, inter) not in shapes
    assert any(s[:1] == (2,) and s[-1] == inter and s[1] <= 5 for s in shapes)  # tiles seen in the recompute


def test_apply_remove_keeps_state_dict_keys_and_outputs():
    """Catches renamed checkpoint keys (...mlp.mlp.up_proj) after wrapping, double wrapping on a
    second apply, and remove not restoring the original modules."""
    model = tiny_model("llama")
    keys, originals = list(model.state_dict()), [layer.mlp for layer in model.model.layers]
    assert apply_tiled_mlp(model, 7) == 2
    assert apply_tiled_mlp(model, 7) == 0
    assert list(model.state_dict()) == keys
    model.load_state_dict(tiny_model("llama", seed=3).state_dict())
    assert all(isinstance(layer.mlp, TiledMLP) for layer in model.model.layers)
    assert remove_tiled_mlp(model) == 2
    assert [layer.mlp for layer in model.model.layers] == originals
    torch.testing.assert_close(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                               tiny_model("llama", seed=3).state_dict()["model.layers.0.mlp.up_proj.weight"])


def test_invalid_tile_tokens():
    """Catches a silent zero/negative tile size (infinite loop or empty output)."""
    with pytest.raises(ValueError, match="tile_tokens"):
        TiledMLP(GatedMLP(), 0)


def test_input_without_grad_and_inference():
    """Catches backward assuming x requires grad (frozen layers below the MLP) and a crash or
    different output when tiled under torch.no_grad (inference)."""
    torch.manual_seed(0)
    mlp = GatedMLP()
    tiled = TiledMLP(mlp, tile_tokens=5)
    x = torch.randn(2, S, 16)
    (ref,) = torch.autograd.grad(mlp(x).sum(), mlp.down_proj.weight)
    (got,) = torch.autograd.grad(tiled(x).sum(), mlp.down_proj.weight)
    torch.testing.assert_close(got, ref, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), mlp(x), **TOL)
