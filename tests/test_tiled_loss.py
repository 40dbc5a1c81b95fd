"""tiled_token_loss == sp_token_loss(F.linear(hidden, W, bias)) in value and gradients (one process).

Reference: the untiled path autograd differentiates. Inputs are small (B*s <= 26 tokens, V = 37)
so every case runs in milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp.loss import sp_token_loss, tiled_token_loss

IGNORE = -100
B, S, D, V = 2, 13, 16, 37  # 26 tokens: no tile size below except 26/64 divides it evenly
WORLD = 4

# fp32: tiled and untiled sum the same <= 26 O(1) CE terms (and grad_W's 26 outer products) in a
# different order, relative error ~1e-7 per op; 1e-5 leaves headroom, while a wrong scale, a
# dropped tile, a missing softcap derivative or a lost bias grad change results by > 1e-2.
RTOL, ATOL = 1e-5, 1e-6


def _inputs(dtype=torch.float32, ignore_from=None, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) / D**0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, 3] = IGNORE  # an ignored token inside a tile
    if ignore_from is not None:
        labels[:, ignore_from:] = IGNORE
    return hidden, weight, b, labels


def _reference(hidden, weight, b, labels, num_items, cap=None):
    logits = F.linear(hidden, weight, b)
    if cap is not None:
        logits = torch.tanh(logits.float() / cap) * cap
    return sp_token_loss(logits, labels, num_items, grad_average_world=WORLD)


def _loss_and_grads(fn, tensors):
    loss = fn()
    params = [t for t in tensors if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads


@pytest.mark.parametrize("tile", [1, 5, 7, 26, 64])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_tiled_matches_untiled_fp32(tile, cap):
    """Bug caught: wrong tile bounds (tiles not dividing T dropping or repeating tokens), a wrong
    softmax-minus-onehot gradient, ignored tokens leaking gradient, a missing softcap derivative
    (1 - tanh^2), grad_W summed over only one tile, and a missing or unscaled bias gradient."""
    hidden, weight, b, labels = _inputs()
    num_items = int((labels != IGNORE).sum()) + 5  # N counts other ranks' tokens too
    ref, ref_grads = _loss_and_grads(lambda: _reference(hidden, weight, b, labels, num_items, cap), (hidden, weight, b))
    got, got_grads = _loss_and_grads(
        lambda: tiled_token_loss(
            hidden, weight, labels, num_items, grad_average_world=WORLD, tile_tokens=tile,
            lm_head_bias=b, final_logit_softcapping=cap,
        ),
        (hidden, weight, b),
    )
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    for name, g, r in zip(("hidden", "weight", "bias"), got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"grad {n}: {m}")


def test_tensor_num_items_and_frozen_weight():
    """Bug caught: a crash or wrong scale when N is a 0-d tensor (no host sync path), and grads
    computed for / returned to a frozen lm_head (LoRA: W.requires_grad=False, hidden still needs one)."""
    hidden, weight, _, labels = _inputs(bias=False, ignore_from=10)
    weight.requires_grad_(False)
    num_items = (labels != IGNORE).sum() + 3
    ref, (ref_h,) = _loss_and_grads(lambda: _reference(hidden, weight, None, labels, num_items), (hidden,))
    got, (got_h,) = _loss_and_grads(
        lambda: tiled_token_loss(hidden, weight, labels, num_items, grad_average_world=WORLD, tile_tokens=4),
        (hidden,),
    )
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_h, ref_h, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_items", [0, 7])
def test_all_ignored_is_exact_zero(num_items):
    """Bug caught: NaN (0/0) on a rank whose tokens are all ignored, and a loss detached from the graph
    (backward must still run there: under SP it carries the all-to-alls)."""
    hidden, weight, b, labels = _inputs(ignore_from=0, seed=1)
    loss = tiled_token_loss(
        hidden, weight, labels, num_items, grad_average_world=WORLD, tile_tokens=5, lm_head_bias=b,
        final_logit_softcapping=2.0,
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    for t in (hidden, weight, b):
        assert torch.equal(t.grad, torch.zeros_like(t)), "ignored tokens must give exactly zero gradient"


def test_tiled_matches_untiled_bf16():
    """Bug caught: dtype bugs in the low-precision path: CE not upcast to fp32, grads returned in the
    wrong dtype, or grad_W accumulated across tiles with a large rounding error."""
    hidden, weight, b, labels = _inputs(dtype=torch.bfloat16)
    num_items = int((labels != IGNORE).sum())
    ref, ref_grads = _loss_and_grads(lambda: _reference(hidden, weight, b, labels, num_items), (hidden, weight, b))
    got, got_grads = _loss_and_grads(
        lambda: tiled_token_loss(
            hidden, weight, labels, num_items, grad_average_world=WORLD, tile_tokens=6, lm_head_bias=b,
        ),
        (hidden, weight, b),
    )
    # Both compute the bf16 logits with the same matmul per row and CE in fp32: the loss agrees to
    # fp32 summation order. Gradients are rounded to bf16 (8 mantissa bits, ~4e-3 relative) at
    # least once in each path and at different points, so 2e-2 / 1e-2 allow a few bf16 ulps while a
    # wrong scale or missing term is still off by > 10%.
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for name, g, r in zip(("hidden", "weight", "bias"), got_grads, ref_grads):
        assert g.dtype == torch.bfloat16, f"grad {name} dtype {g.dtype}"
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-2, msg=lambda m, n=name: f"grad {n}: {m}")


def _saved_numels(fn):
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, numels


def test_no_full_logits_saved_for_backward():
    """Bug caught: the tiled path keeping (T, V)-sized tensors alive until backward (logits, their fp32
    copy or the softmax), i.e. the memory saving silently lost. The untiled reference is checked to
    save such a tensor, proving the hook sees what it should."""
    hidden, weight, b, labels = _inputs()
    tokens_x_vocab = B * S * V
    _, ref_numels = _saved_numels(lambda: _reference(hidden, weight, b, labels, 10))
    assert max(ref_numels) >= tokens_x_vocab
    loss, numels = _saved_numels(
        lambda: tiled_token_loss(
            hidden, weight, labels, 10, grad_average_world=WORLD, tile_tokens=5, lm_head_bias=b,
            final_logit_softcapping=3.0,
        )
    )
    assert numels and max(numels) < tokens_x_vocab, numels
    loss.backward()  # the saved inputs suffice for backward


def test_bad_arguments_raise():
    """Bug caught: silent misuse: mismatched label shape, a (D, V) weight, or a non-positive tile size."""
    hidden, weight, _, labels = _inputs(bias=False)
    with pytest.raises(ValueError, match="shift_labels"):
        tiled_token_loss(hidden, weight, labels[:, 1:], 5, grad_average_world=1)
    with pytest.raises(ValueError, match="lm_head weight"):
        tiled_token_loss(hidden, weight.t(), labels, 5, grad_average_world=1)
    with pytest.raises(ValueError, match="tile_tokens"):
        tiled_token_loss(hidden, weight, labels, 5, grad_average_world=1, tile_tokens=0)


def test_grad_out_retain_graph_and_no_grad():
    """Bug caught: gradients formed in forward that ignore grad_out (the loss scaled by 0.3 before
    backward), that a first backward consumes (retain_graph: a second backward adds them again),
    and an evaluation forward (no_grad) that disagrees with the training one."""
    hidden, weight, b, labels = _inputs()

    def tiled():
        return tiled_token_loss(hidden, weight, labels, 20, grad_average_world=WORLD, tile_tokens=5, lm_head_bias=b,
                                final_logit_softcapping=3.0)

    ref, ref_grads = _loss_and_grads(lambda: _reference(hidden, weight, b, labels, 20, 3.0) * 0.3, (hidden, weight, b))
    got, got_grads = _loss_and_grads(lambda: tiled() * 0.3, (hidden, weight, b))
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=RTOL, atol=ATOL)
    loss = tiled()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (hidden, weight, b)]
    loss.backward()
    for t, f in zip((hidden, weight, b), first):
        torch.testing.assert_close(t.grad, 2 * f, rtol=0, atol=0)  # f + f is exact
    with torch.no_grad():
        torch.testing.assert_close(tiled(), loss.detach(), rtol=RTOL, atol=ATOL)
