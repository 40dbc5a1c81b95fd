"""Bucketed packed-document SDPA (attention/packed.py) against a float64 per-document reference.

The reference loops over documents in ORIGINAL positions with an explicit softmax, independent of
GlobalMask's compaction and of the bucket plan. Cases: documents of mixed lengths 1..S, padding
(at ends and inside a document), sliding window, GQA, causal and not, forward and backward, and
through UlyssesAttention on P = 1, 2, 3 gloo ranks (one spawned group per P for every case).
"""

import pytest
import torch

from dist_helper import spawn
from ulysses_sp import GlobalMask, SPMesh, UlyssesAttention, get_kernel
from ulysses_sp.attention.buckets import plan_groups

S, H = 48, 8
# row 0: documents 1, 2, 13, 31, 1 (1 to S); row 1: one document of S
LENGTHS = [[1, 2, 13, 31, 1], [S]]
POSITIONS = torch.stack([torch.cat([torch.arange(L) for L in row]) for row in LENGTHS])
VALID = torch.ones(2, S, dtype=torch.bool)
VALID[0, 3:5] = False  # padding at the start of the 13-token document
VALID[0, 20:22] = False  # padding INSIDE the 31-token document (positions 16..46)
VALID[1, 40:] = False  # right padding
CASES = [  # (name, padding, window, causal)
    ("docs", False, None, True), ("docs+padding", True, None, True), ("docs+window", False, 5, True),
    ("docs+padding+window", True, 4, True), ("bidirectional+padding", True, None, False),
    ("bidirectional+window", False, 6, False),
]


def reference(q, k, v, valid, window, causal):
    """(B, S, n, H) float64: per row and document, explicit masked softmax; padding query -> own value."""
    q, k, v = q.double(), k.double(), v.double()
    n, K = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(n // K, 1), v.repeat_interleave(n // K, 1)
    out = v.clone().transpose(1, 2)
    for b in range(q.shape[0]):
        doc = torch.cumsum((POSITIONS[b] == 0).long(), 0)
        for i in range(S):
            if not valid[b, i]:
                continue
            keys = [j for j in range(S) if doc[j] == doc[i] and valid[b, j] and (not causal or j <= i)
                    and (window is None or i - j < window)]
            scores = (k[b][:, keys] @ q[b, :, i, :, None])[..., 0] / H**0.5  # (n, len(keys))
            out[b, i] = (torch.softmax(scores, -1)[:, None, :] @ v[b][:, keys])[:, 0]
    return out


def make(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, S, H, generator=g) for heads in (N, K, K))
    return q, k, v, torch.randn(2, S, N, H, generator=g)


# fp32 kernels vs a float64 reference: ~1e-7 relative rounding grown by sums over <= 48 keys;
# 1e-5 leaves two orders of margin while a wrong gather / mask gives O(1) errors.
TOL = dict(rtol=1e-5, atol=1e-5)


def check_case(name, N, K, padding, window, causal, attend):
    """Runs ``attend(q, k, v, mask, window) -> (B, s, n, H)`` (this rank's rows) and its backward."""
    q, k, v, g = make(N, K, seed=N + 10 * K + len(name))
    valid = VALID if padding else torch.ones(2, S, dtype=torch.bool)
    mask = GlobalMask.from_position_ids(POSITIONS, valid if padding else None, causal=causal)
    leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, valid, window, causal)
    (ref * g.double() * valid[:, :, None, None]).sum().backward()
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    o, rows = attend(*mine, mask, window)
    (o * (g * valid[:, :, None, None])[:, rows]).sum().backward()
    where = f"{name} N={N} K={K}"
    torch.testing.assert_close(o.double()[valid[:, rows]], ref[:, rows][valid[:, rows]], **TOL, msg=where)
    for a, b in zip(mine, leaves):
        torch.testing.assert_close(a.grad.double()[:, :, rows], b.grad[:, :, rows], **TOL, msg=where)


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
def test_bucketed_sdpa_matches_float64_per_document_reference(N, K):
    """Bug caught: a bucket gathering the wrong tokens, padded keys seen by real queries, a window
    measured in compacted instead of row positions, GQA heads mixed up, or a wrong backward
    through the gather / scatter."""
    sdpa = get_kernel("sdpa")
    for name, padding, window, causal in CASES:
        check_case(name, N, K, padding, window, causal,
                   lambda q, k, v, m, w: (sdpa(q, k, v, m, sliding_window=w), slice(None)))


def test_bucket_plan_groups_short_documents_and_isolates_long_ones():
    """Bug caught: a cost model that pads short documents to a long one's length (quadratic waste)
    or gives every short document its own call (the per-call cost the buckets exist to avoid)."""
    ends = plan_groups([8] * 1000 + [8192])
    assert len(ends) == 2 and ends[0] == 8 and ends[1] >= 8192  # grid points: >= the longest length
    assert len(plan_groups(list(range(1, 1025)))) <= 32  # 1024 distinct lengths, a few dozen calls
    mask = GlobalMask.from_position_ids(torch.arange(64).remainder(8)[None])
    plan = mask.buckets(1, torch.device("cpu"))
    assert [(b.num_docs, b.length) for b in plan.buckets] == [(8, 8)]


def test_torch_varlen_is_refused_on_cpu_with_the_fix():
    """Bug caught: the varlen kernel silently running (or crashing obscurely) where it cannot."""
    q = torch.randn(1, 2, 8, 4)
    mask = GlobalMask.from_position_ids(torch.arange(8).remainder(4)[None])
    with pytest.raises(ValueError, match="'sdpa'"):
        get_kernel("torch_varlen")(q, q, q, mask)


def _ulysses_worker(rank, world):
    mesh = SPMesh.from_world(world)
    s = S // world
    rows = slice(rank * s, (rank + 1) * s)
    attention = UlyssesAttention(mesh.sp_group, "sdpa")

    def attend(q, k, v, mask, window):
        local = [t[:, :, rows].detach().requires_grad_() for t in (q, k, v)]
        o = attention(*local, mask, sliding_window=window)
        for leaf, part in zip((q, k, v), local):  # route this rank's grads into the full-size leaves
            part.register_hook(lambda grad, leaf=leaf: _add_rows(leaf, grad, rows))
        return o, rows

    for N, K in ((6, 3), (6, 1)):
        for name, padding, window, causal in CASES:
            try:
                check_case(name, N, K, padding, window, causal, attend)
            except AssertionError as e:
                raise AssertionError(f"P={world}: {e}") from e


def _add_rows(leaf, grad, rows):
    if leaf.grad is None:
        leaf.grad = torch.zeros_like(leaf)
    leaf.grad[:, :, rows] += grad


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucketed_sdpa_under_ulysses_matches_reference(world):
    """Bug caught: the bucket plan built from a shard's tokens instead of the global sequence, or
    heads / kv groups split across ranks breaking the bucketed gather (N=6, K=3 or 1 over P ranks)."""
    spawn(_ulysses_worker, world)
