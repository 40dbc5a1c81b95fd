"""RingAttention on P gloo processes against a float64 single-process reference on the full sequence.

Each rank feeds its contiguous shard of the same q, k, v (same seed everywhere); the reference
is the definition of attention (dense scores, explicit mask built by loops, float64). Compared:
the output and the gradients of q, k and v under a random output gradient.
"""

import pytest
import torch

from dist_helper import spawn
from reference import allowed_reference, attention_reference
from ulysses_sp import GlobalMask, SPMesh
from ulysses_sp.attention import RingAttention

B, S, H = 2, 12, 8
# row 0: documents of length 5, 4, 3; row 1: 7, 5
POSITIONS = torch.tensor([list(range(5)) + list(range(4)) + list(range(3)), list(range(7)) + list(range(5))])
VALID = torch.tensor([[1] * 9 + [0] * 3, [0] * 2 + [1] * 10], dtype=torch.bool)  # right / left padding
MASKS = {"causal": (False, False, None), "docs": (True, False, None), "padding": (False, True, None),
         "window": (False, False, 5), "docs+padding+window": (True, True, 4)}


def make_case(N, K, seed, padding):
    """q, k, v and an output gradient g; padding queries get g = 0 (the loss ignores them, and
    their outputs are undefined: each mask implementation may let them see different keys)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, S, N, H, generator=gen)
    return {"q": torch.randn(B, N, S, H, generator=gen), "k": torch.randn(B, K, S, H, generator=gen),
            "v": torch.randn(B, K, S, H, generator=gen), "g": g * VALID[:, :, None, None] if padding else g}


def reference(case, mask_name):
    docs, padding, window = MASKS[mask_name]
    allowed = allowed_reference(POSITIONS, VALID, docs, padding, window)
    return attention_reference(case["q"], case["k"], case["v"], case["g"], allowed)


def run_ring(case, mask_name, mesh, dtype):
    docs, padding, window = MASKS[mask_name]
    s = S // mesh.sp_size
    sl = slice(mesh.sp_rank * s, (mesh.sp_rank + 1) * s)
    mask = GlobalMask(S, True, GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None,
                      VALID if padding else None)
    q, k, v = (case[n][:, :, sl].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    o = RingAttention(mesh.sp_group if mesh.sp_size > 1 else None)(q, k, v, mask, sliding_window=window)
    (o * case["g"][:, sl].to(dtype)).sum().backward()
    return o, q.grad, k.grad, v.grad


# fp32 against float64: scores, exp and the log-sum-exp merge each round to ~1e-7 relative, and
# sums run over <= 12 keys and 8 head dims of O(1) values, so errors stay ~1e-6; 2e-5 leaves a
# wide margin while a wrong block, mask or merge gives O(0.1) differences.
FP32_TOL = dict(rtol=2e-5, atol=2e-5)
# bf16 inputs (8-bit mantissa, eps 3.9e-3), fp32 math inside: the inputs' rounding alone moves
# scores of size ~3 by ~1e-2, so 5e-2 on O(1) outputs and grads.
BF16_TOL = dict(rtol=5e-2, atol=5e-2)


def _worker(rank, world, cases):
    mesh = SPMesh.from_world(world)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    for N, K, mask_name, dtype in cases:
        case = make_case(N, K, N * 10 + K, MASKS[mask_name][1])
        ref = reference(case, mask_name)
        got = run_ring(case, mask_name, mesh, dtype)
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        for name, a, b, dim in zip(("o", "dq", "dk", "dv"), got, ref, (1, 2, 2, 2)):
            b = b.narrow(dim, sl.start, s)
            if name == "o" and MASKS[mask_name][1]:  # padding queries' outputs are undefined; compare real ones
                a, b = a[VALID[:, sl]], b[VALID[:, sl]]
            try:
                torch.testing.assert_close(a.double(), b, **tol)
            except AssertionError as e:
                raise AssertionError(f"P={world} N={N} K={K} mask={mask_name} {dtype} {name}: {e}") from e


ALL_MASKS = [(8, 2, m, torch.float32) for m in MASKS] + [(4, 4, "causal", torch.float32), (4, 1, "docs", torch.float32)]
CASES = {1: [(8, 2, "causal", torch.float32), (8, 2, "docs+padding+window", torch.float32)],
         2: ALL_MASKS + [(8, 2, "causal", torch.bfloat16)],
         3: [(8, 2, "causal", torch.float32), (8, 2, "docs+padding+window", torch.float32),
             (4, 1, "docs", torch.float32)],
         4: [(8, 2, "causal", torch.float32), (4, 1, "docs+padding+window", torch.float32)]}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_attention_matches_single_process(world):
    """Bug caught: a wrong block order or source rank, a bad log-sum-exp merge, a skipped or extra
    block under causal / document / padding / window masks, GQA head grouping errors, and a
    backward whose dk/dv accumulators miss a hop or return to the wrong owner."""
    spawn(_worker, world, CASES[world])


def test_ring_attention_refuses_softcap():
    """Bug caught: silently ignoring logit softcapping (a model using it would train on wrong attention)."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcapping"):
        RingAttention(None)(q, q, q, softcap=1.0)


# -- Ulysses x ring (2-D): all-to-all inside groups of A ranks, ring across R segments ----------------
def _worker_2d(rank, world, cases):
    from ulysses_sp import UlyssesAttention, attention_comm
    from ulysses_sp.comm.counting import CommCounter

    mesh = SPMesh.from_world(world)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    groups = {}
    for N, K, mask_name, R, chunks in cases:
        if R not in groups:
            groups[R] = mesh.ulysses_ring_groups(R)
        a2a, ring = groups[R]
        docs, padding, window = MASKS[mask_name]
        case = make_case(N, K, N * 10 + K + R, padding)
        ref = reference(case, mask_name)
        mask = GlobalMask(S, True, GlobalMask.from_position_ids(POSITIONS).document_ids if docs else None,
                          VALID if padding else None)
        attention = UlyssesAttention(a2a, "sdpa", chunks, ring_group=ring)
        assert (attention.a2a_size, attention.ring_size, attention.sp_size) == (world // R, R, world)
        # the size words (attention.contract): sp_rank is the shard this rank holds, whatever the split
        assert attention.sp_rank == mesh.sp_rank and attention.a2a_rank == mesh.sp_rank % (world // R)
        for _ in range(2):  # the second call is counted: the first also checks shapes across ranks (all_gathers)
            q, k, v = (case[n][:, :, sl].clone().requires_grad_() for n in ("q", "k", "v"))
            with CommCounter() as counter:
                with counter.in_phase("forward"):
                    o = attention(q, k, v, mask, sliding_window=window)
                with counter.in_phase("backward"):
                    (o * case["g"][:, sl]).sum().backward()
        where = f"P={world} A={world // R} R={R} N={N} K={K} mask={mask_name} chunks={chunks}"
        for name, a, b, dim in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), ref, (1, 2, 2, 2)):
            b = b.narrow(dim, sl.start, s)
            if name == "o" and padding:  # padding queries' outputs are undefined; compare real ones
                a, b = a[VALID[:, sl]], b[VALID[:, sl]]
            torch.testing.assert_close(a.double(), b, **FP32_TOL, msg=lambda m, name=name: f"{where} {name}: {m}")
        if chunks == 1:  # bytes and collectives equal comm.cost's formula for this rank
            balanced = attention.ring.zigzag_applies(S // R, mask, window)  # causal, no window, even segment
            assert balanced or window is not None or (S // R) % 2, where  # the causal cases do run balanced
            model = attention_comm("ulysses_ring", world, B, S, N, K, H, 4, rank, ring_size=R, ring_balanced=balanced)
            for phase, nbytes, ops in (("forward", model.bytes_forward, model.collectives_forward),
                                       ("backward", model.bytes_backward, model.collectives_backward)):
                got = counter.select(phase=phase)
                assert (sum(c.bytes_sent for c in got), len(got)) == (nbytes, ops), (where, phase, got)


TWO_D_CASES = [(8, 2, "causal", 2, 1), (8, 2, "docs+padding+window", 2, 1), (3, 1, "docs", 2, 1),
               (4, 1, "padding", 4, 1), (6, 3, "window", 2, 1), (8, 2, "docs+padding+window", 2, 3)]


def test_ulysses_x_ring_attention_matches_single_process():
    """Bug caught: a 2-D split whose ring sees the wrong segment offsets (segment j holds tokens
    [j*A*s, (j+1)*A*s)), ring groups pairing ranks that hold different heads, uneven or irregular heads (3 or 6:3
    heads over A=2) or K < A breaking the ring's kv grouping, and bytes / collectives off the
    ``attention_comm("ulysses_ring")`` formula. P=4 as 2x2 and 1x4, every mask kind, head chunks."""
    spawn(_worker_2d, 4, TWO_D_CASES)


def _worker_balance(rank, world):
    import torch.distributed as dist

    import ulysses_sp.attention.ring as ring_module

    mesh = SPMesh.from_world(world)
    s = S // world
    sl = slice(rank * s, (rank + 1) * s)
    case = make_case(8, 2, 7, False)
    ref = reference(case, "causal")
    original, work = ring_module._block_forward, []

    def counted(q, k, *args):
        work.append(q.shape[2] * k.shape[2])  # query x key pairs of this block
        return original(q, k, *args)

    ring_module._block_forward = counted
    try:
        per_rank = {}
        for balance in (True, False):
            work.clear()
            q, k, v = (case[n][:, :, sl].clone().requires_grad_() for n in ("q", "k", "v"))
            o = RingAttention(mesh.sp_group, balance=balance)(q, k, v, GlobalMask(S))
            (o * case["g"][:, sl]).sum().backward()
            for name, a, b, dim in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), ref, (1, 2, 2, 2)):
                torch.testing.assert_close(a.double(), b.narrow(dim, sl.start, s), **FP32_TOL,
                                           msg=lambda m, name=name: f"balance={balance} {name}: {m}")
            totals = [None] * world
            dist.all_gather_object(totals, sum(work), group=mesh.sp_group)
            per_rank[balance] = totals
    finally:
        ring_module._block_forward = original
    # P=3, S=12: 6 chunks of 2 tokens; zigzag rank r holds chunks r and 5-r and computes 7 chunk blocks
    # (4 pairs each): 28 on every rank. Contiguous: rank r computes r+1 blocks of 4x4: 16, 32, 48.
    assert per_rank[True] == [28, 28, 28], per_rank
    assert per_rank[False] == [16, 32, 48], per_rank


def test_ring_is_causally_load_balanced():
    """Bug caught: contiguous causal ring blocks leave rank P-1 with P blocks and rank 0 with one
    (the slowest rank sets the step time). With the zigzag re-layout every rank computes the same
    number of query x key pairs, and the result (output, dq, dk, dv) is exact either way."""
    spawn(_worker_balance, 3)


def _worker_tiled(rank, world, cases):
    import ulysses_sp.attention.ring as ring_module

    ring_module.TILE_SCORES = 7  # a handful of query rows per tile: every explicit block runs in several tiles
    _worker(rank, world, cases)


def test_ring_explicit_blocks_in_row_tiles_match_single_process():
    """Bug caught: a masked block computing c x c scores at once (O(c^2) memory per block: 4 GiB a head
    at c = 32K), or row tiles that lose the causal-diagonal offset, a padding row, or the dk/dv
    accumulation across tiles. With tiles of one or two rows, every mask kind equals the reference."""
    spawn(_worker_tiled, 2, [(8, 2, m, torch.float32) for m in MASKS] + [(4, 1, "docs", torch.bfloat16)])


def test_explicit_causal_diagonal_block_in_row_tiles(monkeypatch):
    """Bug caught: the diagonal block's causal mask applied without the tile's row offset (GPU path;
    float64 inputs take the explicit fp32 path on CPU too). Row tiles of 3 equal one untiled block, forward and
    backward, and both equal autograd through a dense causal softmax."""
    import ulysses_sp.attention.ring as ring_module

    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 4, 10, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # GQA: 2 kv heads
    results = []
    for tile in (1 << 24, 3 * 2 * 4 * 10):  # untiled; 3 rows per tile (B * N * cols = 80 scores a row)
        monkeypatch.setattr(ring_module, "TILE_SCORES", tile)
        o, lse = ring_module._block_forward(q, k, v, None, True, 0.3)
        results.append((o, lse, *ring_module._block_backward(do, q, k, v, o, lse, None, True, 0.3)))
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    scores = (qr @ kr.repeat_interleave(2, 1).transpose(2, 3)) * 0.3
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ vr.repeat_interleave(2, 1)
    out.backward(do)
    for got in results:  # the kernel computes in fp32 (observed <= 2.3e-7 off the float64 reference); a
        # wrong diagonal offset unmasks future keys: O(0.1) differences
        for a, b in zip((got[0], got[2], got[3], got[4]), (out, qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
