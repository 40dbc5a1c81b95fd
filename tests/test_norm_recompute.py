"""``UlyssesSPConfig(recompute_norms=True)``: Llama-style RMSNorms save only their input (``memory.rms_norm``).

One process: the function against the module's own autograd (fp32, bf16, fp32 weights on a bf16 input,
tiled and untiled backward), whole models against themselves unswapped (llama, qwen3 with its per-head
q/k norms), which modules qualify, and what a model saves. Several processes: with SP, head blocks,
tiled MLP and checkpointing against plain transformers in one process.
"""

import pytest
import torch
import torch.distributed as dist
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dist_helper import spawn
from reference import document_starts, reference_step
from tiny_models import tiny_batch, tiny_model
from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig, global_num_items, reported_loss
from ulysses_sp.integrations.norms import fusable, fuse_rms_norms
from ulysses_sp.memory.rms_norm import rms_norm


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("tile_elements", [1 << 22, 3 * 16])  # one tile; tiles of 3 tokens (the last one short)
def test_rms_norm_equals_the_modules_output_and_gradients(x_dtype, w_dtype, tile_elements):
    """Bug caught: the output differing from LlamaRMSNorm's by a bit (other ops or order), the input or
    weight gradient off (a sign, a missing mean term, autograd's intermediate casts not followed), or a
    tile boundary dropping or double-counting tokens."""
    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(16, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=gen) + 1)
    x = (torch.randn(2, 7, 16, generator=gen) * 3).to(x_dtype)
    dy = torch.randn(2, 7, 16, generator=gen).to(torch.promote_types(x_dtype, w_dtype))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = norm(x_ref)
    y_ref.backward(dy)
    w_ref, norm.weight.grad = norm.weight.grad, None
    y = rms_norm(x_ours, norm.weight, norm.variance_epsilon, tile_elements)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)  # the same ops in the same order
    y.backward(dy)
    # the same sums in another order: float32 a few eps; bf16 gradients one bf16 rounding (2^-8 relative)
    tol = 1e-5 if x_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x_ours.grad.float(), x_ref.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(norm.weight.grad.float(), w_ref.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_models_with_fused_norms_equal_themselves_and_save_less(family):
    """Bug caught: a swapped norm changing a model's loss or gradients, a norm left saving its normalised
    input, or removing the swaps not restoring the model's own forwards."""
    batch = tiny_batch("plain")
    results = []
    for swap in (False, True):
        model, saved = tiny_model(family), []
        handles = fuse_rms_norms(model) if swap else []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        hidden, tokens = model.config.hidden_size, batch["input_ids"].numel()
        big = {t.untyped_storage().data_ptr() for t in saved
               if t.dim() and t.shape[-1] == hidden and t.numel() == tokens * hidden}
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(big), len(handles)))
        for handle in reversed(handles):
            handle.remove()
        assert not any("forward" in m.__dict__ for m in model.modules())
    (ref_loss, ref_grads, ref_big, _), (loss, grads, big, swapped) = results
    layers = model.config.num_hidden_layers
    # 2 a decoder layer + the final norm (+ q/k norms per layer in qwen3, of head_dim: not (B, S, D))
    assert swapped == 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)
    assert big <= ref_big - (2 * layers + 1), (big, ref_big)  # each decoder-width norm saved xn: gone
    # fp32, the norms' gradients up to a few eps: the model's loss and grads to 1e-5 (a wrong term is O(1))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, ref in ref_grads.items():
        scale = ref.abs().max().clamp_min(1e-8)
        torch.testing.assert_close(grads[name] / scale, ref / scale, rtol=0, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_only_llama_rms_norm_code_qualifies():
    """Bug caught: fusing a norm whose forward is other code (Gemma's 1 + weight, a LayerNorm), whose
    output would then silently change."""
    assert all(fusable(m) for m in tiny_model("llama").modules() if type(m).__name__.endswith("RMSNorm"))
    assert not any(fusable(m) for m in tiny_model("gemma2").modules())  # (1 + weight), float32 throughout
    assert not any(fusable(m) for m in tiny_model("gpt2").modules())  # nn.LayerNorm


def _worker(rank, world):
    mesh = SPMesh.from_world(world)
    batch = tiny_batch("packed")
    ref_loss, ref_grads = reference_step(tiny_model("llama"), {"input_ids": batch["input_ids"],
                                                               "position_ids": batch["position_ids"]},
                                         batch["input_ids"], starts=document_starts(batch["position_ids"][0]),
                                         checkpointing=True)
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    model.train()
    config = UlyssesSPConfig(sp_size=world, sp_head_chunks=2, tiled_mlp_tokens=4, recompute_norms=True)
    with UlyssesSP(model, mesh, config) as sp:
        assert sum("forward" in m.__dict__ for m in model.modules() if fusable(m)) == 2 * 2 + 1  # 2 a layer + final
        shard = sp.shard(batch)
        loss = sp.forward_loss(model, shard, global_num_items(shard["shift_labels"], mesh.sp_group),
                               grad_average_world=world)
        loss.backward()
    assert not any("forward" in m.__dict__ for m in model.modules() if fusable(m))  # unregistered
    # fp32 against one process: summation order only (as tests/test_head_blocks.py)
    torch.testing.assert_close(reported_loss(loss.detach(), world, mesh.sp_group), ref_loss, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        scale = ref_grads[name].abs().max().clamp_min(1e-8)
        torch.testing.assert_close(p.grad / world / scale, ref_grads[name] / scale, rtol=0, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_fused_norms_under_sp_match_one_process():
    """Bug caught: input-only norms breaking exactness with SP, head blocks, tiled MLP and activation
    checkpointing together (the norm inside the checkpoint's recompute), or registration not swapping /
    restoring the norms."""
    spawn(_worker, 2)


def test_config_rejects_a_non_bool():
    """Bug caught: ``recompute_norms="no"`` read as true."""
    with pytest.raises(ValueError, match="recompute_norms must be True or False"):
        UlyssesSPConfig(recompute_norms="no")
