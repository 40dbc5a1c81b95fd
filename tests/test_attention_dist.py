"""UlyssesAttention on P gloo processes against one process on the full sequence.

Every case: same inputs and projection weights on all ranks (same seed); the reference runs a
naive attention with an independently built mask on the whole sequence; the SP run feeds each
rank its contiguous shard. Compared: output, grads of x, q, k, v and of the projection weights
(weight grads summed over the SP group, as the data-parallel reduction would).
"""

import pytest
import torch
import torch.distributed as dist

from dist_helper import spawn
from reference import allowed_reference, naive_attention
from ulysses_sp import GlobalMask, SPMesh, UlyssesAttention

B, S, D, H = 2, 12, 16, 8
HEADS = {1: [(8, 8), (8, 2), (8, 1)], 2: [(8, 8), (8, 2), (8, 1)], 3: [(12, 4), (8, 2), (8, 1), (3, 1)],
         4: [(8, 8), (8, 2), (8, 1), (6, 2)]}
# row 0: documents of length 5, 4, 3; row 1: 7, 5
POSITIONS = torch.tensor([list(range(5)) + list(range(4)) + list(range(3)), list(range(7)) + list(range(5))])
# row 0: right padding (last 3), row 1: left padding (first 2)
VALID = torch.tensor([[1] * 9 + [0] * 3, [0] * 2 + [1] * 10], dtype=torch.bool)
MASKS = {  # name -> (uses docs, uses padding, sliding window, softcap)
    "causal": (False, False, None, None),
    "docs": (True, False, None, None),
    "padding": (False, True, None, None),
    "window": (False, False, 5, None),
    "docs+padding+window": (True, True, 4, None),
    "softcap": (False, False, None, 0.5),
}


def make_case(N, K, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    t = lambda *shape: (torch.randn(*shape, generator=gen) * 0.5).to(dtype)  # noqa: E731
    return {"x": t(B, S, D), "wq": t(D, N * H), "wk": t(D, K * H), "wv": t(D, K * H), "g": t(B, S, N, H)}


def run_reference(case, N, K, mask_name):
    docs, padding, window, softcap = MASKS[mask_name]
    leaves = {name: val.double().requires_grad_(name != "g") for name, val in case.items()}
    x = leaves["x"]
    q = (x @ leaves["wq"]).view(B, S, N, H).transpose(1, 2)
    k = (x @ leaves["wk"]).view(B, S, K, H).transpose(1, 2)
    v = (x @ leaves["wv"]).view(B, S, K, H).transpose(1, 2)
    for t in (q, k, v):
        t.retain_grad()
    o = naive_attention(q, k, v, allowed_reference(POSITIONS, VALID, docs, padding, window), softcap)
    g = leaves["g"] * VALID[:, :, None, None] if padding else leaves["g"]
    (o * g).sum().backward()
    return o, {"x": x.grad, "wq": leaves["wq"].grad, "wk": leaves["wk"].grad, "wv": leaves["wv"].grad,
               "q": q.grad, "k": k.grad, "v": v.grad}


def run_sp(case, N, K, mask_name, kernel, mesh):
    docs, padding, window, softcap = MASKS[mask_name]
    P, r = mesh.sp_size, mesh.sp_rank
    s = S // P
    sl = slice(r * s, (r + 1) * s)
    mask = GlobalMask(S, True, GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None,
                      VALID if padding else None)
    x = case["x"][:, sl].clone().requires_grad_()
    w = {n: case[n].clone().requires_grad_() for n in ("wq", "wk", "wv")}
    q = (x @ w["wq"]).view(B, s, N, H).transpose(1, 2)
    k = (x @ w["wk"]).view(B, s, K, H).transpose(1, 2)
    v = (x @ w["wv"]).view(B, s, K, H).transpose(1, 2)
    for t in (q, k, v):
        t.retain_grad()
    o = UlyssesAttention(mesh.sp_group, kernel)(q, k, v, mask, sliding_window=window, softcap=softcap)
    g = case["g"][:, sl] * VALID[:, sl, None, None] if padding else case["g"][:, sl]
    (o * g).sum().backward()
    grads = {"x": x.grad, "q": q.grad, "k": k.grad, "v": v.grad}
    for n, p in w.items():
        dist.all_reduce(p.grad, group=mesh.sp_group)
        grads[n] = p.grad
    return o, grads


def compare(o, grads, ref_o, ref_grads, sl, valid_q, tol):
    rows = valid_q[:, sl]
    torch.testing.assert_close(o.double()[rows], ref_o[:, sl][rows], **tol)
    torch.testing.assert_close(grads["x"].double(), ref_grads["x"][:, sl], **tol)
    for n in ("q", "k", "v"):
        torch.testing.assert_close(grads[n].double(), ref_grads[n][:, :, sl], **tol)
    for n in ("wq", "wk", "wv"):
        torch.testing.assert_close(grads[n].double(), ref_grads[n], **tol)


# fp32 vs a float64 reference: ~1e-7 relative rounding, grown by sums over <= 24 tokens and
# 16 hidden units; 1e-5 leaves two orders of margin while any layout bug gives O(1) errors.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 has an 8-bit mantissa (eps 3.9e-3); projections, scores, softmax and output each round
# once and weight grads sum 24 bf16 products, so a few eps of the O(1) values: 3e-2.
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


def _parity_worker(rank, world, heads):
    mesh = SPMesh.from_world(world)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    for N, K in heads:
        for mask_name in MASKS:
            for kernel in ("sdpa", "eager"):
                if kernel == "sdpa" and MASKS[mask_name][3] is not None:
                    continue
                case = make_case(N, K, seed=N * 10 + K, dtype=torch.float32)
                ref_o, ref_g = run_reference(case, N, K, mask_name)
                o, grads = run_sp(case, N, K, mask_name, kernel, mesh)
                valid_q = VALID if MASKS[mask_name][1] else torch.ones(B, S, dtype=torch.bool)
                try:
                    compare(o, grads, ref_o, ref_g, sl, valid_q, FP32_TOL)
                except AssertionError as e:
                    raise AssertionError(f"N={N} K={K} P={world} mask={mask_name} kernel={kernel}: {e}") from e
        for mask_name in ("causal", "docs"):
            case = make_case(N, K, seed=N * 10 + K + 1, dtype=torch.bfloat16)
            ref_o, ref_g = run_reference(case, N, K, mask_name)
            o, grads = run_sp(case, N, K, mask_name, "sdpa", mesh)
            assert o.dtype == torch.bfloat16
            compare(o, grads, ref_o, ref_g, sl, torch.ones(B, S, dtype=torch.bool), BF16_TOL)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ulysses_attention_matches_single_process(world):
    """Bug caught: any error in head split, exchange, kv regrouping, global masks (causal, packed
    documents, padding, sliding window, softcap) or their backward, for N % P != 0 and K < P."""
    spawn(_parity_worker, world, HEADS[world])


def _documents_worker(rank, world):
    mesh = SPMesh.from_world(world)
    N, K = 8, 2
    case = make_case(N, K, seed=7, dtype=torch.float32)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    x, wq, wk, wv = (case[n].double() for n in ("x", "wq", "wk", "wv"))
    # reference: every document of every row through plain causal SDPA on its own
    alone = torch.zeros(B, S, N, H, dtype=torch.float64)
    for b in range(B):
        starts = (POSITIONS[b] == 0).nonzero().flatten().tolist() + [S]
        for a, e in zip(starts[:-1], starts[1:]):
            L = e - a
            q = (x[b, a:e] @ wq).view(1, L, N, H).transpose(1, 2)
            k = (x[b, a:e] @ wk).view(1, L, K, H).transpose(1, 2).repeat_interleave(N // K, 1)
            v = (x[b, a:e] @ wv).view(1, L, K, H).transpose(1, 2).repeat_interleave(N // K, 1)
            alone[b, a:e] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)

    def sp_out(mask):
        xs = x[:, sl]
        q = (xs @ wq).view(B, s, N, H).transpose(1, 2)
        k = (xs @ wk).view(B, s, K, H).transpose(1, 2)
        v = (xs @ wv).view(B, s, K, H).transpose(1, 2)
        return UlyssesAttention(mesh.sp_group, "sdpa")(q, k, v, mask)

    # float64 throughout: only summation order differs
    torch.testing.assert_close(sp_out(GlobalMask.from_position_ids(POSITIONS)), alone[:, sl], rtol=1e-10, atol=1e-10)
    # the same check notices attention across a boundary: plain causal over the packed rows differs
    leaked = sp_out(GlobalMask(S))
    first_doc_end = 5
    if rank * s + s > first_doc_end:  # this shard holds tokens after the first boundary
        assert (leaked - alone[:, sl]).abs().max() > 1e-3, "cross-document attention went unnoticed"


def test_packed_documents_equal_each_document_alone():
    """Bug caught: attention leaking across packed-document boundaries, and proves the comparison
    would see such a leak (the unmasked run must differ)."""
    spawn(_documents_worker, 3)


def _flex_worker(rank, world):
    mesh = SPMesh.from_world(world)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    for mask_name in ("causal", "docs+padding+window", "softcap"):
        case = make_case(8, 2, seed=3, dtype=torch.float32)
        ref_o, _ = run_reference(case, 8, 2, mask_name)
        with torch.no_grad():
            o, _ = run_sp_forward_only(case, mask_name, mesh)
        valid_q = VALID if MASKS[mask_name][1] else torch.ones(B, S, dtype=torch.bool)
        rows = valid_q[:, sl]
        torch.testing.assert_close(o.double()[rows], ref_o[:, sl][rows], **FP32_TOL)


def run_sp_forward_only(case, mask_name, mesh):
    docs, padding, window, softcap = MASKS[mask_name]
    s = S // mesh.sp_size
    sl = slice(mesh.sp_rank * s, (mesh.sp_rank + 1) * s)
    mask = GlobalMask(S, True, GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None,
                      VALID if padding else None)
    x = case["x"][:, sl]
    q = (x @ case["wq"]).view(B, s, 8, H).transpose(1, 2)
    k = (x @ case["wk"]).view(B, s, 2, H).transpose(1, 2)
    v = (x @ case["wv"]).view(B, s, 2, H).transpose(1, 2)
    attention = UlyssesAttention(mesh.sp_group, "flex_attention")
    return attention(q, k, v, mask, sliding_window=window, softcap=softcap), None


def test_flex_attention_forward_matches_on_cpu():
    """Bug caught: a wrong block mask (documents, padding, window) or softcap in the flex adapter.
    flex_attention has no CPU backward in torch 2.13; its backward runs in the GPU test."""
    spawn(_flex_worker, 2)
