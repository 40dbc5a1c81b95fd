"""``sp_token_loss``'s fused cross entropy (gradient formed in forward) against autograd's.

The reference is ``F.cross_entropy(logits.float(), reduction="sum") / N * W`` differentiated by
autograd, on one process: the formula every SP exactness test builds on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp.loss import sp_token_loss

IGNORE = -100


def _reference(logits, labels, count, world):
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="sum") / count * world


def _case(B=2, s=37, V=301, dtype=torch.float32, ignored=(0, 5, 36), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, s, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, (B, s), generator=gen)
    for j in ignored:
        labels[:, j] = IGNORE
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_count", [False, True])
def test_fused_matches_autograd(dtype, tensor_count):
    """Bug caught: a wrong target column, an ignored row with a gradient, a missing N / W scale or a
    dropped grad_out factor (the loss is multiplied by 2.5 before backward)."""
    logits, labels = _case(dtype=dtype)
    count = torch.tensor(61) if tensor_count else 61
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ref = _reference(a, labels, count, 3)
    out = sp_token_loss(b, labels, count, grad_average_world=3)
    (ref * 2.5).backward()
    (out * 2.5).backward()
    # fp32 math on both sides, different association of the same terms: a few ulp of O(1) values
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # bf16 gradients: the same fp32 value rounded once to bf16 on both sides (1 bf16 ulp at a tie)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, **tol)
    assert b.grad.dtype == dtype
    assert b.grad[:, 0].abs().max() == 0 and b.grad[:, 5].abs().max() == 0  # ignored rows


def test_extreme_logits_and_all_ignored():
    """Bug caught: a log-sum-exp that underflows (a target 200 below the row's top logit must cost ~200,
    not inf) and a rank without valid tokens getting NaN instead of an exact 0 in the graph."""
    logits = torch.zeros(1, 2, 5)
    logits[0, :, 0] = 200.0
    labels = torch.tensor([[1, 0]])
    x = logits.clone().requires_grad_()
    out = sp_token_loss(x, labels, 2, grad_average_world=1)
    out.backward()
    torch.testing.assert_close(out, _reference(logits, labels, 2, 1))  # (200 + log 1 ... ) / 2
    assert torch.isfinite(x.grad).all()
    x = logits.clone().requires_grad_()
    out = sp_token_loss(x, torch.full((1, 2), IGNORE), 0, grad_average_world=4)
    out.backward()
    assert out.item() == 0.0 and x.grad.abs().max() == 0 and out.grad_fn is not None


def test_retain_graph_twice_and_no_grad_path():
    """Bug caught: a backward that consumes its saved gradient (a second backward with retain_graph
    must add the same gradient again), and the no-grad path (eval) disagreeing with the fused one."""
    logits, labels = _case()
    x = logits.clone().requires_grad_()
    out = sp_token_loss(x, labels, 50, grad_average_world=2)
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first, rtol=0, atol=0)  # x + x is exact
    with torch.no_grad():
        value = sp_token_loss(x, labels, 50, grad_average_world=2)
    torch.testing.assert_close(value, out.detach(), rtol=1e-6, atol=1e-6)  # fp32, different association
    with pytest.raises(RuntimeError):  # first derivatives only: a Hessian would be silently wrong
        x2 = logits.clone().requires_grad_()
        (g,) = torch.autograd.grad(sp_token_loss(x2, labels, 50, grad_average_world=2), x2, create_graph=True)
        g.sum().backward()


def test_loss_paths_benchmark_runs(capsys):
    """Bug caught: benchmarks/loss_paths.py rotting (a renamed public name or a variant whose loss no
    longer equals autograd's: the script checks every variant before timing it)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "loss_paths.py"
    spec = importlib.util.spec_from_file_location("loss_paths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tokens", "64", "--hidden", "16", "--vocab", "50", "--tile", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| autograd |" in out and "| fused |" in out and "| tiled |" in out
