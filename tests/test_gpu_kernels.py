"""GPU-only: the CUDA kernels (flex backward, flash-attention varlen) against eager on the same mask.

Skipped without CUDA (and each flash kernel without its package); never gates CI.
"""

import importlib.util

import pytest
import torch

from ulysses_sp.attention import GlobalMask, get_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
KERNELS = ["sdpa", "flex_attention"] + [
    name for name, pkg in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface"))
    if importlib.util.find_spec(pkg) is not None
] + (["torch_varlen"] if importlib.util.find_spec("torch.nn.attention.varlen") is not None else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_kernel_matches_eager_with_documents(kernel, window):
    """Bug caught: wrong cu_seqlens, window_size or block masks in the CUDA kernel adapters."""
    B, n, k, S, H = 2, 8, 2, 512, 64
    torch.manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (n, k, k))
    pos = torch.cat([torch.arange(200), torch.arange(312)]).expand(B, S).cuda()
    mask = GlobalMask.from_position_ids(pos)
    out = get_kernel(kernel)(q, kk, v, mask, sliding_window=window)
    grads = torch.autograd.grad(out.float().square().sum(), (q, kk, v))
    ref = get_kernel("eager")(*(t.float() for t in (q, kk, v)), mask, sliding_window=window)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, kk, v))
    # bf16 kernels against an fp32 eager reference: a few bf16 eps (3.9e-3) of O(1) values
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float() / r.abs().max(), r.float() / r.abs().max(), rtol=0, atol=3e-2)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k in ("sdpa", "torch_varlen")])
def test_cuda_packed_kernel_with_padding_matches_the_bucketed_cpu_path(kernel):
    """Bug caught: torch_varlen (also sdpa's CUDA path for packed rows) giving padding tokens other
    outputs or gradients than the bucketed sdpa path, or GQA heads grouped differently."""
    B, n, k, S, H = 2, 8, 2, 512, 64
    torch.manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (n, k, k))
    pos = torch.cat([torch.arange(7), torch.arange(200), torch.arange(305)]).expand(B, S).cuda()
    valid = torch.ones(B, S, dtype=torch.bool, device="cuda")
    valid[0, 480:] = False
    mask = GlobalMask.from_position_ids(pos, valid)
    out = get_kernel(kernel)(q, kk, v, mask)
    grads = torch.autograd.grad(out.float().square().sum(), (q, kk, v))
    cpu = [t.detach().float().cpu().requires_grad_() for t in (q, kk, v)]
    ref = get_kernel("sdpa")(*cpu, GlobalMask.from_position_ids(pos.cpu(), valid.cpu()))
    ref_grads = torch.autograd.grad(ref.square().sum(), cpu)
    # bf16 CUDA kernel against the fp32 CPU bucketed path: a few bf16 eps (3.9e-3) of O(1) values
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float().cpu() / r.abs().max(), r / r.abs().max(), rtol=0, atol=3e-2)


@pytest.mark.parametrize("window", [None, 64])
def test_cuda_ring_block_kernel_in_row_tiles_matches_eager(window, monkeypatch):
    """Bug caught: the ring's explicit block kernel (every block on CUDA, in tiles of query rows) going wrong
    on the device: one RingAttention block (no group) with packed documents against eager in fp32."""
    import ulysses_sp.attention.ring as ring_module
    from ulysses_sp.attention import RingAttention

    monkeypatch.setattr(ring_module, "TILE_SCORES", 1 << 16)  # several row tiles at this size
    B, n, k, S, H = 2, 8, 2, 512, 64
    torch.manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, device="cuda", requires_grad=True) for h in (n, k, k))
    pos = torch.cat([torch.arange(200), torch.arange(312)]).expand(B, S).cuda()
    mask = GlobalMask.from_position_ids(pos)
    out = RingAttention(None)(q, kk, v, mask, sliding_window=window)
    grads = torch.autograd.grad(out.square().sum(), (q, kk, v))
    ref = get_kernel("eager")(q, kk, v, mask, sliding_window=window)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, kk, v))
    # fp32 on both sides (TF32 matmuls may be on): 1e-3 relative of O(1) values
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g / r.abs().max(), r / r.abs().max(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_kernel_materialises_no_scores(kernel):
    """Bug caught: a kernel adapter that builds an S x S tensor on the GPU (e.g. flex_attention run
    uncompiled, whose reference path materialises the (B, n, S, S) scores, or a dense mask)."""
    B, n, k, S, H = 1, 4, 2, 16384, 64
    torch.manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (n, k, k))
    pos = torch.cat([torch.arange(S // 4), torch.arange(S - S // 4)]).expand(B, S).cuda()
    mask = GlobalMask.from_position_ids(pos)
    run = get_kernel(kernel)
    run(q, kk, v, mask).float().sum().backward()  # warm-up: compile, workspaces, block-mask cache
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(q, kk, v, mask).float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # one (S, S) bf16 matrix is 512 MiB and the scores of all heads 2 GiB; q/k/v/o and their
    # gradients are ~50 MiB: 256 MiB leaves room for kernel workspaces but not for any S x S tensor
    assert extra < 256 * 2**20, f"{kernel}: {extra / 2**20:.0f} MiB above the inputs at S={S}"


@pytest.mark.parametrize("window", [None, 64])
def test_cuda_flex_sinks_forward_and_backward_match_eager(window):
    """Bug caught: a flex sink renormalisation whose gradient is wrong on the device (the log-sum-exp
    gradient of compiled flex, the sinks' own gradient): compiled flex with sinks against eager
    with sinks in fp32, packed documents, output and the gradients of q, k, v and the sinks."""
    B, n, k, S, H = 2, 8, 2, 512, 64
    torch.manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, device="cuda", requires_grad=True) for h in (n, k, k))
    sinks = torch.randn(n, device="cuda", requires_grad=True)
    pos = torch.cat([torch.arange(200), torch.arange(312)]).expand(B, S).cuda()
    mask = GlobalMask.from_position_ids(pos)
    out = get_kernel("flex_attention")(q, kk, v, mask, sliding_window=window, sinks=sinks)
    grads = torch.autograd.grad(out.square().sum(), (q, kk, v, sinks))
    ref = get_kernel("eager")(q, kk, v, mask, sliding_window=window, sinks=sinks)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, kk, v, sinks))
    # fp32 on both sides (TF32 matmuls may be on): 1e-3 relative of O(1) values; a wrong sink is ~1e-1
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g / r.abs().max(), r / r.abs().max(), rtol=0, atol=1e-3)
