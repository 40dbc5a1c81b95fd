"""What crosses the wire, and what happens with bad input."""

import pytest
import torch
import torch.distributed as dist

from dist_helper import spawn
from ulysses_sp import GlobalMask, RingAttention, SPMesh, UlyssesAttention


class CollectiveLog:
    """Wraps the torch.distributed collectives to record each call and the bytes sent to others."""

    NAMES = ("all_to_all_single", "all_gather", "all_reduce", "broadcast", "all_gather_into_tensor",
             "reduce_scatter_tensor")

    def __init__(self, rank):
        self.rank, self.calls, self._orig = rank, [], {}

    def __enter__(self):
        for name in self.NAMES:
            self._orig[name] = orig = getattr(dist, name)
            setattr(dist, name, self._wrap(name, orig))
        return self

    def _wrap(self, name, orig):
        def wrapped(*args, **kwargs):
            sent = None
            if name == "all_to_all_single":
                inp = args[1] if len(args) > 1 else kwargs["input"]
                sizes = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                sent = sum(n for j, n in enumerate(sizes) if j != self.rank) * inp.element_size()
            self.calls.append((name, sent))
            return orig(*args, **kwargs)
        return wrapped

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def expected_bytes(N, K, P, r, B, s, H, itemsize):
    """What the receiving ranks need, derived here from first principles (not from HeadPlan):
    rank j owns query heads of an even split and the kv heads h // (N/K) those heads read."""
    heads = []
    start = 0
    for j in range(P):
        n = N // P + (1 if j < N % P else 0)
        heads.append(range(start, start + n))
        start += n
    kv = [len({h // (N // K) for h in hs}) for hs in heads]
    qkv_fwd = sum(B * s * (len(heads[j]) + 2 * kv[j]) * H for j in range(P) if j != r)
    out_fwd = (P - 1) * B * s * len(heads[r]) * H
    qkv_bwd = (P - 1) * B * s * (len(heads[r]) + 2 * kv[r]) * H
    out_bwd = sum(B * s * len(heads[j]) * H for j in range(P) if j != r)
    return [qkv_fwd * itemsize, out_fwd * itemsize, out_bwd * itemsize, qkv_bwd * itemsize]


def _count_worker(rank, world):
    mesh = SPMesh.from_world(world)
    B, s, H = 2, 5, 8
    for N, K in [(8, 8), (8, 2), (8, 1), (6, 2), (12, 4)]:
        if world > N:
            continue
        attn = UlyssesAttention(mesh.sp_group, "sdpa")
        shapes = [(B, N, s, H), (B, K, s, H), (B, K, s, H)]
        qkv = [torch.randn(*shape, requires_grad=True) for shape in shapes]
        attn(*qkv).sum().backward()  # first call: validates shapes with one all_gather
        with CollectiveLog(rank) as log:
            o = attn(*qkv, GlobalMask(s * world))
            forward_calls = list(log.calls)
            o.square().sum().backward()
        assert [c[0] for c in forward_calls] == ["all_to_all_single"] * 2, forward_calls
        assert [c[0] for c in log.calls] == ["all_to_all_single"] * 4, log.calls
        sent = [c[1] for c in log.calls]
        assert sent == expected_bytes(N, K, world, rank, B, s, H, 4), (N, K, sent)
        plan = attn.plan(N, K)
        by_plan = plan.bytes_sent_per_rank(rank, B, s, H, H, 4)
        assert by_plan == {"qkv": sent[0], "out": sent[1]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_two_collectives_each_way_and_bytes_match_the_formula(world):
    """Bug caught: extra collectives per layer (e.g. separate q/k/v exchanges, a per-layer position
    gather) and sending kv heads a rank does not use."""
    spawn(_count_worker, world)


def _bad_input_worker(rank, world):
    mesh = SPMesh.from_world(world)
    B, N, K, H = 1, 4, 2, 8

    def qkv(s, dtype=torch.float32, kdtype=None):
        return (torch.randn(B, N, s, H, dtype=dtype), torch.randn(B, K, s, H, dtype=kdtype or dtype),
                torch.randn(B, K, s, H, dtype=kdtype or dtype))

    with pytest.raises(ValueError, match="different attention inputs"):
        UlyssesAttention(mesh.sp_group)(*qkv(4 + rank))  # ranks hold shards of different lengths
    with pytest.raises(ValueError, match="same dtype|one floating dtype|different attention inputs"):
        UlyssesAttention(mesh.sp_group)(*qkv(4, torch.float32 if rank == 0 else torch.bfloat16))
    with pytest.raises(ValueError, match="one floating dtype"):
        UlyssesAttention(mesh.sp_group)(*qkv(4, torch.float32, kdtype=torch.float32 if rank else torch.bfloat16))
    with pytest.raises(ValueError, match="all-to-all over 2 ranks is larger than the number of query heads \\(1\\)"):
        UlyssesAttention(mesh.sp_group)(torch.randn(B, 1, 4, H), torch.randn(B, 1, 4, H), torch.randn(B, 1, 4, H))
    with pytest.raises(ValueError, match="pad the batch to a multiple of sp_size"):
        UlyssesAttention(mesh.sp_group)(*qkv(4), GlobalMask(9))  # S=9 is not 2 shards of 4
    with pytest.raises(ValueError, match="unknown attention kernel"):
        UlyssesAttention(mesh.sp_group, "sdpa2")
    # the ring shares the prologue: the same mask message; a dtype or head mismatch raises on every rank
    # (it once checked q/k/v dtypes on the local rank before the all-gather, so the other rank hung in it)
    with pytest.raises(ValueError, match="pad the batch to a multiple of sp_size"):
        RingAttention(mesh.sp_group)(*qkv(4), GlobalMask(9))
    with pytest.raises(ValueError, match="one floating dtype"):
        RingAttention(mesh.sp_group)(*qkv(4, torch.float32, kdtype=torch.float32 if rank else torch.bfloat16))
    with pytest.raises(ValueError, match="N a multiple of K"):
        RingAttention(mesh.sp_group)(torch.randn(B, 3, 4, H), *qkv(4)[1:])
    # after all of this the group still works
    o = UlyssesAttention(mesh.sp_group)(*qkv(4))
    assert o.shape == (B, 4, N, H)
    assert RingAttention(mesh.sp_group)(*qkv(4)).shape == (B, 4, N, H)


def test_bad_input_raises_on_every_rank_instead_of_hanging():
    """Bug caught: a mismatch across ranks reaching the all-to-all (gloo aborts, NCCL hangs)."""
    spawn(_bad_input_worker, 2, timeout_s=60)


def _mesh_errors_worker(rank, world):
    for sp_size, match in [(2, "not a multiple of sp_size 2"), (0, "positive integer"), (4, "not a multiple")]:
        with pytest.raises(ValueError, match=match):
            SPMesh.from_world(sp_size)
    mesh = SPMesh.from_world(3)
    assert (mesh.dp_size, mesh.sp_size, mesh.sp_rank, mesh.dp_rank) == (1, 3, rank, 0)
    from ulysses_sp.integrations.setup_checks import ensure_process_group

    ensure_process_group(3)  # already initialised with 3 ranks: nothing to do
    with pytest.raises(ValueError, match="torch.distributed has 3 ranks but the Accelerator 2"):
        ensure_process_group(2, who="the Accelerator")


def _mesh_layout_worker(rank, world):
    mesh = SPMesh.from_world(2)
    assert (mesh.dp_size, mesh.sp_rank, mesh.dp_rank) == (2, rank % 2, rank // 2)  # contiguous SP groups
    assert dist.get_process_group_ranks(mesh.sp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]


def test_mesh_rejects_sp_size_not_dividing_world():
    """Bug caught: a dp x sp split that silently drops ranks or orders SP groups non-contiguously."""
    spawn(_mesh_errors_worker, 3)
    spawn(_mesh_layout_worker, 4)


def test_mesh_needs_an_initialised_world():
    """Bug caught: a confusing torch error when the user forgot to launch with torchrun."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torchrun"):
        SPMesh.from_world(2)


def test_local_backend_and_spawn_refusals(monkeypatch):
    """Bug caught: nccl chosen (or accepted) with fewer GPUs than ranks, which NCCL refuses only after
    every rank started ("Duplicate GPU detected"), and CUDA asked for where torch has none."""
    from ulysses_sp import local_backend, spawn

    assert local_backend(4, "cpu") == "gloo"
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        local_backend(2, "mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            local_backend(2, "cuda")
        with pytest.raises(ValueError, match="nccl needs a GPU per rank: 2 ranks, 0 GPUs"):
            spawn(print, 2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert local_backend(1, "cuda") == "nccl"
    assert local_backend(2, "cuda") == "gloo"  # two ranks share the one GPU


def _close_world_worker(rank, world):
    from ulysses_sp import close_world

    t = torch.ones(3)
    dist.all_reduce(t)
    close_world()
    assert not dist.is_initialized()
    close_world()  # a second call (world already closed) is a no-op


def test_close_world_destroys_the_world_and_is_idempotent():
    """Bug caught: close_world leaving the world initialised (the next init_process_group in the
    process would fail) or raising when called on a closed world."""
    from ulysses_sp.comm import spawn as spawn_fresh

    spawn_fresh(_close_world_worker, 2)
