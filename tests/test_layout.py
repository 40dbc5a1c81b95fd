"""Pure layout tests: the all-to-all simulated in one process, no process group.

Each P-rank exchange is simulated by handing chunk j of every sender's buffer to receiver j.
"""

import itertools

import pytest
import torch

from ulysses_sp.comm import layout
from ulysses_sp.comm.layout import HeadPlan

CONFIGS = [(8, 8, 1), (8, 8, 2), (8, 2, 4), (8, 1, 4), (6, 2, 4), (12, 4, 3), (8, 2, 3), (7, 7, 3), (9, 3, 4),
           (4, 1, 3)]


def _simulate(send: list[tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
    """all_to_all_single over P simulated ranks: receiver j gets chunk j of every sender, in order."""
    P = len(send)
    chunks = [list(torch.split(buf, sizes)) for buf, sizes in send]
    return [torch.cat([chunks[i][j] for i in range(P)]) for j in range(P)]


def _inputs(N, K, P, B=2, s=3, H=4, Hv=5):
    S = s * P
    gen = torch.Generator().manual_seed(N * 100 + K * 10 + P)
    q = torch.randn(B, N, S, H, generator=gen, dtype=torch.float64)
    k = torch.randn(B, K, S, H, generator=gen, dtype=torch.float64)
    v = torch.randn(B, K, S, Hv, generator=gen, dtype=torch.float64)
    return q, k, v, (B, s, H, Hv)


@pytest.mark.parametrize("N,K,P", CONFIGS)
def test_qkv_exchange_delivers_exactly_the_heads_each_rank_uses(N, K, P):
    """Bug caught: a wrong head split or a receiver placing a source's tokens at the wrong offset."""
    plan = HeadPlan(N, K, P)
    q, k, v, (B, s, H, Hv) = _inputs(N, K, P)
    shard = lambda t, r: t[:, :, r * s : (r + 1) * s]  # noqa: E731
    recv = _simulate([layout.pack_qkv(shard(q, r), shard(k, r), shard(v, r), plan) for r in range(P)])
    g = N // K
    for r in range(P):
        (qa, qb), (ka, kb) = plan.q_ranges[r], plan.kv_ranges[r]
        assert set(range(ka, kb)) == {h // g for h in range(qa, qb)}, "kv heads beyond those used"
        q_r, k_r, v_r = layout.unpack_qkv(recv[r], plan, r, B, s, H, Hv)
        torch.testing.assert_close(q_r, q[:, qa:qb], rtol=0, atol=0)  # pure data movement: exact
        torch.testing.assert_close(k_r, k[:, ka:kb], rtol=0, atol=0)
        torch.testing.assert_close(v_r, v[:, ka:kb], rtol=0, atol=0)
        idx = plan.local_kv_index(r)
        assert torch.equal(ka + idx, torch.arange(qa, qb) // g)


@pytest.mark.parametrize("N,K,P", CONFIGS)
def test_out_exchange_restores_token_layout(N, K, P):
    """Bug caught: an output exchange that mixes up heads or token shards on the way back."""
    plan = HeadPlan(N, K, P)
    B, s, Hv = 2, 3, 5
    o = torch.randn(B, P * s, N, Hv, dtype=torch.float64)
    recv = _simulate([layout.pack_out(o[:, :, qa:qb], plan) for qa, qb in plan.q_ranges])
    for r in range(P):
        got = layout.unpack_out(recv[r], plan, B, s, Hv)
        torch.testing.assert_close(got, o[:, r * s : (r + 1) * s], rtol=0, atol=0)


def _dot(xs, ys):
    return sum((x * y).sum() for x, y in zip(xs, ys))


@pytest.mark.parametrize("N,K,P", CONFIGS)
def test_backward_layouts_are_exact_adjoints(N, K, P):
    """Bug caught: a backward that drops or double-counts the gradient of a kv head sent to several
    ranks (dot-product test <A x, y> == <x, A^T y>)."""
    plan = HeadPlan(N, K, P)
    q, k, v, (B, s, H, Hv) = _inputs(N, K, P)
    shard = lambda t, r: t[:, :, r * s : (r + 1) * s]  # noqa: E731
    fwd = _simulate([layout.pack_qkv(shard(q, r), shard(k, r), shard(v, r), plan) for r in range(P)])
    ys = []
    for r in range(P):
        n, kk = plan.num_local_heads(r)
        ys.append((torch.randn(B, n, P * s, H, dtype=torch.float64), torch.randn(B, kk, P * s, H, dtype=torch.float64),
                   torch.randn(B, kk, P * s, Hv, dtype=torch.float64)))
    lhs = sum(_dot(layout.unpack_qkv(fwd[r], plan, r, B, s, H, Hv), ys[r]) for r in range(P))
    bwd = _simulate([layout.pack_qkv_grad(*ys[r], plan) for r in range(P)])
    rhs = sum(_dot(layout.unpack_qkv_grad(bwd[r], plan, B, s, H, Hv), (shard(q, r), shard(k, r), shard(v, r)))
              for r in range(P))
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)  # float64 sums of a few hundred terms

    o = torch.randn(B, P * s, N, Hv, dtype=torch.float64)
    g = torch.randn(B, P * s, N, Hv, dtype=torch.float64)
    fwd = _simulate([layout.pack_out(o[:, :, qa:qb], plan) for qa, qb in plan.q_ranges])
    lhs = sum(_dot([layout.unpack_out(fwd[r], plan, B, s, Hv)], [g[:, r * s : (r + 1) * s]]) for r in range(P))
    bwd = _simulate([layout.pack_out_grad(g[:, r * s : (r + 1) * s], plan) for r in range(P)])
    rhs = sum(_dot([layout.unpack_out_grad(bwd[r], plan, r, B, s, Hv)], [o[:, :, qa:qb]])
              for r, (qa, qb) in enumerate(plan.q_ranges))
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_uneven_split_sizes_differ_by_at_most_one():
    """Bug caught: an uneven split that overloads one rank (or leaves one without heads)."""
    for N, P in itertools.product(range(1, 17), range(1, 9)):
        if P > N:
            continue
        sizes = [b - a for a, b in HeadPlan(N, 1, P).q_ranges]
        assert sum(sizes) == N and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize(
    "N,K,P,match",
    [(4, 4, 8, "all-to-all over 8 ranks is larger.*sp_ring_size"), (6, 4, 2, "multiple of num_kv_heads"),
     (8, 8, 0, "sp_size must be >= 1")],
)
def test_invalid_plans_raise_with_the_fix(N, K, P, match):
    """Bug caught: silently accepting a head layout Ulysses cannot split."""
    with pytest.raises(ValueError, match=match):
        HeadPlan(N, K, P)


def test_irregular_local_grouping_is_detected():
    """Bug caught: an irregular local grouping taken for a uniform GQA group (N=8, K=2, P=3: rank 1
    holds q3..q5, reading kv0 once and kv1 twice)."""
    plan = HeadPlan(8, 2, 3)
    assert plan.q_ranges == ((0, 3), (3, 6), (6, 8))
    assert plan.local_group_size(0) == 3 and plan.local_group_size(1) is None and plan.local_group_size(2) == 2


def test_the_exchanges_refuse_mixed_dtypes_with_one_message():
    """Bug caught: a q/k/v (or mixer parts) buffer packed from tensors of different dtypes, which
    ``torch.cat`` would silently promote; the fused exchange and the mixers' exchange give one message."""
    from ulysses_sp.comm.checks import check_one_dtype

    plan = HeadPlan(4, 2, 2)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"q, k and v must share one dtype for the fused exchange, got "
                                         r"torch.float32, torch.float32, torch.bfloat16; cast them"):
        layout.pack_qkv(q, k, k.bfloat16(), plan)
    with pytest.raises(ValueError, match=r"the exchanged parts must share one dtype, got torch.float16, "
                                         r"torch.float32; cast them"):
        check_one_dtype("the exchanged parts", q.half(), k)
    check_one_dtype("one tensor", q)  # nothing to disagree with
