"""No S x S mask on the SDPA and flex paths: exact at small S, far below S^2 bytes at S = 32K.

The SDPA kernel runs packed documents with padding as one call per document over the gathered
valid tokens, and a sliding window as query blocks with one small block mask each; flex builds
its block mask 128 rows at a time. Only ``GlobalMask.dense`` (the eager fallback) is S x S.

Exactness: float64 inputs against float64 attention with an explicitly looped mask (independent
of ``GlobalMask``); paths differ only in summation order, so 1e-10 (float64 eps is 2.2e-16; sums
over <= 64 keys and 8 head dims stay many orders below) while a wrong mask gives O(0.1) errors.

Memory: each long case runs in a fresh interpreter (``ru_maxrss`` is a high-water mark, so one
process per case) with ``GlobalMask.dense`` patched to raise, and reports how far forward +
backward raised the peak resident memory. A control case that does build the dense mask proves
the meter sees it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp import GlobalMask
from ulysses_sp.attention.kernels import sdpa, sdpa_windowed

S_SMALL, N, K, H = 64, 4, 2, 8
# row 0: documents 20 / 25 / 19, padding inside the first document and at the end of the last
# row 1: documents 30 / 34, left padding
POSITIONS = torch.tensor([list(range(20)) + list(range(25)) + list(range(19)), list(range(30)) + list(range(34))])
VALID = torch.ones(2, S_SMALL, dtype=torch.bool)
VALID[0, 8:12] = False
VALID[0, 58:] = False
VALID[1, :5] = False
CASES = {  # name -> (documents, padding, sliding window)
    "padding": (False, True, None),
    "docs+padding": (True, True, None),
    "window": (False, False, 6),
    "docs+window": (True, False, 6),
    "docs+padding+window": (True, True, 6),
    "window wider than S": (True, True, 100),
}
EXACT64 = dict(rtol=1e-10, atol=1e-10)  # float64, summation order only (module docstring)


def looped_allowed(docs: bool, padding: bool, window: int | None, causal: bool) -> torch.Tensor:
    """(B, 1, S, S) bool by explicit loops: same document, valid key, window; padding queries see
    only themselves (GlobalMask's documented rule)."""
    B, S = POSITIONS.shape
    allowed = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        doc, d = [], -1
        for i in range(S):
            d += int(POSITIONS[b, i] == 0)
            doc.append(d)
        for i in range(S):
            for j in range(S):
                ok = (j <= i or not causal) and (window is None or i - j < window)
                ok = ok and (not docs or doc[i] == doc[j]) and (not padding or bool(VALID[b, j]))
                allowed[b, 0, i, j] = (i == j) if padding and not VALID[b, i] else ok
    return allowed


def make_mask(docs: bool, padding: bool, causal: bool = True) -> GlobalMask:
    doc = GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None
    return GlobalMask(S_SMALL, causal, doc, VALID if padding else None)


def qkv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, N, S_SMALL, H), (2, K, S_SMALL, H), (2, K, S_SMALL, H)]
    return [torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_() for shape in shapes]


def out_and_grads(fn, tensors, seed: int):
    for t in tensors:
        t.grad = None
    o = fn(*tensors)
    g = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=o.dtype)
    (o * g).sum().backward()
    return o.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_blocked_and_per_document_sdpa_equal_dense_attention(name, causal):
    """Bug caught: a per-document or per-block path that drops keys (a block's key range starting
    too late for the window, padding inside a document splitting it in two), lets a query see a
    padding key or another document, or gets the padding queries' outputs wrong; in forward or in
    the gradients of q, k and v (GQA: 4 query heads on 2 kv heads)."""
    docs, padding, window = CASES[name]
    mask = make_mask(docs, padding, causal)
    ref_mask = looped_allowed(docs, padding, window, causal)
    tensors = qkv(seed=len(name) + causal)

    def reference(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, enable_gqa=True).transpose(1, 2)

    ref_o, ref_grads = out_and_grads(reference, tensors, seed=1)
    with mock.patch.object(GlobalMask, "dense", side_effect=AssertionError("sdpa built the dense S x S mask")):
        o, grads = out_and_grads(lambda q, k, v: sdpa(q, k, v, mask, sliding_window=window), tensors, seed=1)
        torch.testing.assert_close(o, ref_o, **EXACT64)
        for which, g, ref in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(g, ref, **EXACT64, msg=lambda m, which=which: f"grad {which}: {m}")
        if window is not None:  # block sizes that do not divide S, smaller and larger than w
            for rows in (1, 5, 7, 64):
                def blocked(q, k, v, rows=rows):
                    return sdpa_windowed(q, k, v, mask, window, block_rows=rows, enable_gqa=True).transpose(1, 2)

                o, grads = out_and_grads(blocked, tensors, seed=1)
                torch.testing.assert_close(o, ref_o, **EXACT64, msg=lambda m, rows=rows: f"block_rows={rows}: {m}")
                for g, ref in zip(grads, ref_grads):
                    torch.testing.assert_close(g, ref, **EXACT64)


@pytest.mark.parametrize("name", ["causal", "docs+padding", "window", "docs+padding+window", "non-causal window"])
def test_flex_block_counts_equal_create_block_mask(name):
    """Bug caught: a flex block mask built row-block by row-block that misses reachable key blocks
    (window reach, ragged last block), marks a partial block full (flex then skips mask_mod there
    and leaks across documents or padding), or orders indices differently from torch's own
    ``create_block_mask`` on the dense mask (the reference here, at S=300 with 32-token blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    S, t = 300, 32
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 100, 50, 80]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].repeat(2, 1)
    valid = torch.rand(2, S, generator=gen) > 0.2
    docs, padding = "docs" in name, "padding" in name
    window = 45 if "window" in name else None
    causal = "non-causal" not in name
    mask = GlobalMask(S, causal, GlobalMask.from_position_ids(positions).document_ids if docs else None,
                      valid if padding else None)
    dense = mask.block(0, 0, S, S, torch.device("cpu"), window)

    def mask_mod(b, h, qi, ki):
        return dense[b if dense.shape[0] > 1 else 0, qi, ki]

    ref = create_block_mask(mask_mod, dense.shape[0], 1, S, S, device="cpu", BLOCK_SIZE=t)
    got = mask.flex_blocks(torch.device("cpu"), window, block_size=t)
    expected = (ref.kv_num_blocks, ref.kv_indices, ref.full_kv_num_blocks, ref.full_kv_indices)
    for what, g, e in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), got, expected):
        assert torch.equal(g, e), f"{name}: {what} differs"


# --------------------------------------------------------------------------------------------
# S = 32K in a fresh process: peak resident memory far below the S x S mask

S_LONG, DOC, PAD, WINDOW = 32768, 4096, 300, 128


def _long_case(case: str) -> dict:
    """Run one case and report the rise of the peak RSS (bytes) over the inputs."""
    torch.manual_seed(0)
    positions = (torch.arange(S_LONG) % DOC)[None]
    valid = torch.ones(1, S_LONG, dtype=torch.bool)
    for start in range(0, S_LONG, DOC):  # the last PAD tokens of every document are padding
        valid[0, start + DOC - PAD : start + DOC] = False
    mask = GlobalMask.from_position_ids(positions, valid)
    window = None if case == "docs+padding" else WINDOW
    if case == "window":
        mask = GlobalMask(S_LONG)
    q = torch.randn(1, 2, S_LONG, 8, requires_grad=True)
    k, v = (torch.randn(1, 1, S_LONG, 8, requires_grad=True) for _ in range(2))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if case == "control: dense mask":  # at S / 2 (256 MiB): the full-size one would peak at ~3 GiB
        half = GlobalMask.from_position_ids(positions[:, : S_LONG // 2], valid[:, : S_LONG // 2])
        finite = bool(half.dense(torch.device("cpu"))[0, 0, -1, -1])
    elif case == "flex block counts":
        with mock.patch.object(GlobalMask, "dense", side_effect=AssertionError("dense mask built")):
            blocks = mask.flex_blocks(torch.device("cpu"), WINDOW)
        finite = bool(blocks[0].sum() > 0)
    else:
        with mock.patch.object(GlobalMask, "dense", side_effect=AssertionError("dense mask built")):
            o = sdpa(q, k, v, mask, sliding_window=window)
            o.sum().backward()
        finite = bool(torch.isfinite(o).all() and torch.isfinite(q.grad).all())
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"rise_bytes": rise, "finite": finite}


def run_long_case(case: str) -> dict:
    out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


MASK_BYTES = S_LONG * S_LONG  # one (1, 1, S, S) bool mask: 1 GiB; SDPA's float form would be 4 GiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's convention")
def test_sdpa_at_32k_tokens_stays_far_below_the_dense_mask():
    """Bug caught: packed documents with padding, or a sliding window, falling back to a dense
    (B, 1, S, S) mask (or any S x S temporary: SDPA's float mask, full scores) at S = 32K; the
    control case proves the meter sees a dense mask (at S / 2: 256 MiB). Budget S^2 / 8 bytes (128 MiB): the blocked
    window path keeps O(S * (t + w)) fp32 scores for backward (~64 MiB at t = w = 128, 2 heads),
    the per-document path a few MiB."""
    control = run_long_case("control: dense mask")
    assert control["rise_bytes"] > 0.8 * MASK_BYTES / 4, f"the meter missed a (S/2)^2 dense mask: {control}"
    for case in ("docs+padding", "window", "docs+padding+window", "flex block counts"):
        result = run_long_case(case)
        assert result["finite"], case
        assert result["rise_bytes"] < MASK_BYTES / 8, f"{case}: peak rose by {result['rise_bytes'] / 2**20:.0f} MiB"


if __name__ == "__main__":
    print(json.dumps(_long_case(sys.argv[1])))
