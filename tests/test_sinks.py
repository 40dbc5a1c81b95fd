"""Attention sinks (GPT-OSS style: one learned logit per head in every softmax denominator).

The SP parity of a whole model with sinks (P = 1..4, uneven head splits, head chunks) is in
``test_hf_parity.py`` (family ``gpt_oss``). Here: the kernels that apply sinks against
transformers' own GPT-OSS eager attention, and the refusals for kernels / backends that cannot.
"""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from tiny_models import tiny_model
from ulysses_sp import UlyssesSPConfig
from ulysses_sp.attention import GlobalMask, get_kernel
from ulysses_sp.attention.kernels import _flash_sink_name
from ulysses_sp.integrations.transformers import check_model_support

B, n, k, S, H = 2, 4, 2, 24, 8


def _masks():
    pos = torch.cat([torch.arange(9), torch.arange(6), torch.arange(9)])[None].expand(B, -1)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, 20:] = False
    return {
        "causal": (GlobalMask(S), None),
        "window": (GlobalMask(S), 5),
        "packed+padding": (GlobalMask.from_position_ids(pos, valid), None),
        "packed+window": (GlobalMask.from_position_ids(pos), 4),
    }


def _inputs(dtype=torch.float64, grad=True):
    gen = torch.Generator().manual_seed(0)
    q, kk, v = (torch.randn(B, h, S, H, generator=gen, dtype=dtype) for h in (n, k, k))
    sinks = torch.randn(n, generator=gen, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, kk, v, sinks))


def _reference(q, kk, v, sinks, mask: GlobalMask, window):
    """transformers' GPT-OSS eager attention (sink column appended, softmax, dropped) with the
    global mask as its additive mask."""
    allowed = mask.dense(q.device, window)
    bias = torch.zeros(B, 1, S, S, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=n // k, training=False)
    o, _ = gpt_oss_eager(module, q, kk, v, bias, scaling=H**-0.5)
    return o  # (B, S, n, H)


@pytest.mark.parametrize("case", list(_masks()))
def test_eager_sinks_match_transformers_gpt_oss_forward_and_backward(case):
    """Bug caught: a sink added to the wrong head, or to the scores instead of the denominator, or a
    sink gradient of the wrong sign: eager with sinks equals GPT-OSS's own eager attention in
    output and in the gradients of q, k, v and the sinks, under causal, window, packed and padded masks."""
    mask, window = _masks()[case]
    ours = _inputs()
    ref = _inputs()
    o = get_kernel("eager")(*ours[:3], mask, scaling=H**-0.5, sliding_window=window, sinks=ours[3])
    o_ref = _reference(*ref, mask, window)
    g = torch.randn_like(o_ref)
    # eager's softmax runs in fp32 (the reference's in fp64): ~1e-7; a misplaced sink is ~1e-1
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(o, ours, g)
    grads_ref = torch.autograd.grad(o_ref, ref, g)
    for name, a, b in zip("q k v sinks".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{case} d{name}: {m}")
    assert grads[3].abs().min() > 0  # every head's sink takes part


@pytest.mark.parametrize("case", list(_masks()))
def test_flex_sinks_renormalise_like_eager(case):
    """Bug caught: a flex sink factor with the wrong sign or head order (sigmoid(lse - sink)): flex
    (forward only on CPU; its backward runs in the GPU tests) equals eager with sinks."""
    mask, window = _masks()[case]
    q, kk, v, sinks = _inputs(torch.float32, grad=False)
    o = get_kernel("flex_attention")(q, kk, v, mask, sliding_window=window, sinks=sinks)
    o_ref = get_kernel("eager")(q, kk, v, mask, sliding_window=window, sinks=sinks)
    # fp32, flex's online softmax vs eager's dense one: ~1e-6; a missing sink moves outputs by ~1e-1
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


def test_sdpa_refuses_sinks_and_flash_sink_argument_is_found_by_name():
    """Bug caught: sinks silently dropped by a kernel that cannot apply them (SDPA), and a flash build
    without a sink argument being called with one."""
    q, kk, v, sinks = _inputs(torch.float32, grad=False)
    with pytest.raises(ValueError, match="SDPA cannot apply attention sinks.*flex_attention"):
        get_kernel("sdpa")(q, kk, v, GlobalMask(S), sinks=sinks)

    def vllm_fa3(q, k, v, cu_q, cu_k, max_q, max_k, s_aux=None): ...
    def fa4(q, k, v, cu_q, cu_k, max_q, max_k, learnable_sink=None): ...
    def fa2(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0): ...

    assert _flash_sink_name(vllm_fa3, "m") == "s_aux" and _flash_sink_name(fa4, "m") == "learnable_sink"
    with pytest.raises(ValueError, match="takes no attention sinks"):
        _flash_sink_name(fa2, "flash_attn")


def test_models_with_sinks_are_checked_per_kernel_and_backend():
    """Bug caught: a GPT-OSS model accepted with a kernel or backend that would drop its sinks (SDPA,
    FA2 without sinks, ring attention), and one refused with the kernels that apply them."""
    model = tiny_model("gpt_oss")
    assert check_model_support(model, UlyssesSPConfig(sp_size=2)) == "eager"
    flex = UlyssesSPConfig(sp_size=2, sp_attn_implementation="flex_attention")
    assert check_model_support(model, flex) == "flex_attention"
    refusals = {
        "SDPA cannot apply attention sinks": UlyssesSPConfig(sp_size=2, sp_attn_implementation="sdpa"),
        "installed flash_attention_2 takes none":
            UlyssesSPConfig(sp_size=2, sp_attn_implementation="flash_attention_2"),
        "ring attention cannot apply: use sp_backend='ulysses'": UlyssesSPConfig(sp_size=2, sp_backend="ring"),
        "ring attention cannot apply: use sp_size <= num_attention_heads": UlyssesSPConfig(sp_size=12),
    }
    for message, config in refusals.items():
        with pytest.raises(ValueError, match=message):
            check_model_support(model, config)
