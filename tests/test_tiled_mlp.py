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
    """Bug caught: a dropped/duplicated last (short) tile, grads of only one tile, or param grads
    counted twice (returned and also accumulated into .grad by hand)."""
    assert_same(llama_loss_and_grads(), llama_loss_and_grads(tile_tokens=5))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_llama_with_gradient_checkpointing(use_reentrant):
    """Bug caught: a Function that breaks under checkpoint recompute (non-reentrant: saved-tensor count
    mismatch between forward and recompute; reentrant: forward first run under no_grad)."""
    assert_same(llama_loss_and_grads(), llama_loss_and_grads(tile_tokens=5, checkpointing=use_reentrant))


def test_frozen_params_get_no_grad():
    """Bug caught: a frozen MLP weight receiving a gradient (or a crash in backward's index mapping
    between the params that need grad and those returned)."""
    freeze = ("up_proj", "layers.0.mlp.down_proj")
    assert_same(llama_loss_and_grads(freeze=freeze), llama_loss_and_grads(tile_tokens=5, freeze=freeze))


@pytest.mark.parametrize("num_tiles", [1, 2, 5, S, 100])
def test_function_any_tile_count(num_tiles):
    """Bug caught: wrong split arithmetic: one tile, uneven tiles, one token per tile, more tiles than tokens."""
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
    """Bug caught: grads written into .grad per tile AND returned (doubling), and accumulation once
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
    """Bug caught: the memory bug: (B, s, intermediate) activations kept for backward, in the forward
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
    """Bug caught: renamed checkpoint keys (...mlp.mlp.up_proj) after wrapping, double wrapping on a
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
    """Bug caught: a silent zero/negative tile size (infinite loop or empty output)."""
    with pytest.raises(ValueError, match="tile_tokens"):
        TiledMLP(GatedMLP(), 0)


def test_input_without_grad_and_inference():
    """Bug caught: backward assuming x requires grad (frozen layers below the MLP) and a crash or
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


# ---- MoE blocks (router + experts tiled whole) -------------------------------------------------
MOE_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, output_router_logits=True,
                  router_aux_loss_coef=0.5)


def moe_model(family):
    import transformers as tf

    if family == "mixtral":
        config = tf.MixtralConfig(**MOE_COMMON, num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen2_moe":  # shared expert + its sigmoid gate; layer 0 dense (mlp_only_layers)
        config = tf.Qwen2MoeConfig(**MOE_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=40, mlp_only_layers=[0])
    else:
        config = tf.Qwen3MoeConfig(**MOE_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                   head_dim=8, norm_topk_prob=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model.train()


def moe_run(family, tile_tokens=None, checkpointing=False):
    model = moe_model(family)
    if checkpointing:
        model.activation_checkpointing_enable()
    if tile_tokens is not None:
        assert apply_tiled_mlp(model, tile_tokens) == model.config.num_hidden_layers
        assert type(model.model.layers[1].mlp).__name__ == "TiledMoE"
    ids = torch.randint(1, 128, (2, S), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n.replace(".mlp.mlp.", ".mlp."): p.grad for n, p in model.named_parameters()}
    return out, grads


@pytest.mark.parametrize("family,checkpointing", [("mixtral", False), ("qwen2_moe", True), ("qwen3_moe", False)])
def test_moe_loss_aux_loss_router_logits_and_grads_match_untiled(family, checkpointing):
    """Bug caught: router logits recorded once per tile or without a grad path (aux loss gradient to
    the router lost: the gate weight grad would differ), rows of the (B*S, E) logits in the wrong
    order (tile boundaries crossing batch rows), a dropped last tile, and expert grads counted
    twice. Tiles of 2*4 rows do not divide B*S = 46."""
    ref, ref_grads = moe_run(family)
    got, grads = moe_run(family, tile_tokens=4, checkpointing=checkpointing)
    assert len(got.router_logits) == len(ref.router_logits)  # one (B*S, E) tensor per MoE layer, not per tile
    for r, g in zip(ref.router_logits, got.router_logits):
        assert g.shape == r.shape == (2 * S, 4) and g.requires_grad
        torch.testing.assert_close(g, r, **TOL)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, **TOL)
    torch.testing.assert_close(got.loss, ref.loss, **TOL)
    assert ref_grads.keys() == grads.keys()
    for name, g in ref_grads.items():
        assert (g is None) == (grads[name] is None), name
        if g is not None:
            torch.testing.assert_close(grads[name], g, **TOL, msg=name)
    assert ref_grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0  # router grads are really compared


def test_moe_tiles_run_keys_kept_and_router_jitter_refused():
    """Bug caught: a tiled MoE that silently runs untiled (the experts must see tile-sized inputs),
    changed state_dict keys (e.g. the router registered twice), and jitter noise (random, not
    recomputable) accepted."""
    from ulysses_sp.memory import TiledMoE

    model = moe_model("mixtral")
    keys = list(model.state_dict())
    apply_tiled_mlp(model, 3)
    assert list(model.state_dict()) == keys
    sizes = []
    model.model.layers[0].mlp.mlp.experts.register_forward_pre_hook(lambda m, a: sizes.append(a[0].shape[0]))
    model(input_ids=torch.ones(2, 10, dtype=torch.long))
    assert sizes == [6, 6, 6, 2]  # 20 tokens in tiles of B*3 = 6 rows
    block = moe_model("mixtral").model.layers[0].mlp
    block.jitter_noise = 0.1
    with pytest.raises(ValueError, match="jitter"):
        TiledMoE(block, 4)


def _moe_batch(r):  # different lengths per rank -> different tile counts (6 and 9 tiles of 2*4 rows)
    return torch.randint(1, 128, (2, 23 + 12 * r), generator=torch.Generator().manual_seed(r))


def _ddp_moe_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = moe_model("mixtral")
    sum(ref(input_ids=_moe_batch(r), labels=_moe_batch(r)).loss for r in range(world)).div(world).backward()
    model = moe_model("mixtral")
    apply_tiled_mlp(model, 4)
    ddp = DDP(model)
    calls = []
    expert = model.model.layers[0].mlp.mlp.experts.gate_up_proj
    expert.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    ddp(input_ids=_moe_batch(rank), labels=_moe_batch(rank)).loss.backward()
    assert len(calls) == 1  # accumulated once per backward, not once per tile
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        # DDP's bucketed all-reduce vs one-process sum: fp32 summation order only
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)
    model = moe_model("mixtral")  # FSDP2: params sharded, unsharded around each layer's fwd / bwd
    apply_tiled_mlp(model, 4)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(input_ids=_moe_batch(rank), labels=_moe_batch(rank)).loss.backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        # reduce-scatter average vs one-process sum: fp32 summation order only
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-4, atol=1e-5, msg=name)
    dist.barrier()


def test_moe_under_ddp_and_fsdp2_different_tile_counts_per_rank():
    """Bug caught: a deadlock or wrong reduction when DDP / FSDP2 ranks run different numbers of MoE
    tiles (a collective per tile would hang; grads accumulated per tile would trigger the
    reduction hooks more than once; FSDP2 resharding between forward and the tiled backward
    would break the recompute) and averaged grads differing from one process on both batches."""
    from dist_helper import spawn

    spawn(_ddp_moe_worker, 2)
