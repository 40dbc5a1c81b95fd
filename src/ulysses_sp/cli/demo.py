"""``ulysses-sp demo``: Ulysses attention on P local processes against one process.

Builds a packed batch of documents, runs q/k/v projections + attention + backward on each rank's
1/P shard, and compares the output and every gradient with the full-sequence computation on one
process. Prints the differences, the collectives and the bytes each rank sent.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ulysses_sp import CommCounter, GlobalMask, SPMesh, UlyssesAttention, spawn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sp-size", type=int, default=2, help="processes sharing the sequence (default 2)")
    parser.add_argument("--seq-len", type=int, default=4096, help="global sequence length S (default 4096)")
    parser.add_argument("--num-heads", type=int, default=12, help="query heads N (default 12)")
    parser.add_argument("--num-kv-heads", type=int, default=4, help="kv heads K (default 4)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--documents", type=int, default=3, help="packed documents in the sequence (default 3)")
    parser.add_argument("--kernel", default="sdpa", help="attention kernel (default sdpa)")


def _inputs(args: argparse.Namespace):
    gen = torch.Generator().manual_seed(0)
    S, D = args.seq_len, args.num_heads * args.head_dim
    x = torch.randn(1, S, D, generator=gen)
    heads = (args.num_heads, args.num_kv_heads, args.num_kv_heads)
    w = [torch.randn(D, h * args.head_dim, generator=gen) / D**0.5 for h in heads]
    cuts = torch.linspace(0, S, args.documents + 1).long().tolist()
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]
    return x, w, GlobalMask.from_position_ids(positions)


def _step(x, w, mask, attn: UlyssesAttention, args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    w = [t.clone().requires_grad_() for t in w]
    B, s, _ = x.shape
    heads = (args.num_heads, args.num_kv_heads, args.num_kv_heads)
    q, k, v = ((x @ wi).view(B, s, h, args.head_dim).transpose(1, 2) for wi, h in zip(w, heads))
    o = attn(q, k, v, mask)
    o.float().square().mean().mul(s).backward()
    return o.detach(), [x.grad] + [t.grad for t in w]


def _worker(rank: int, world: int, args: argparse.Namespace) -> None:
    mesh = SPMesh.from_world(world)
    x, w, mask = _inputs(args)
    s = args.seq_len // world
    attn = UlyssesAttention(mesh.sp_group, args.kernel)
    _step(x[:, rank * s : (rank + 1) * s], w, mask, attn, args)  # warm-up and cross-rank shape check
    with CommCounter() as counter:
        t0 = time.perf_counter()
        o, grads = _step(x[:, rank * s : (rank + 1) * s], w, mask, attn, args)
        seconds = time.perf_counter() - t0
    calls = [c.bytes_sent for c in counter.records]
    for g in grads[1:]:
        dist.all_reduce(g, group=mesh.sp_group)  # weight grads: sum of the shards' contributions
    outs = [torch.empty_like(o) for _ in range(world)]
    dist.all_gather(outs, o.contiguous(), group=mesh.sp_group)
    xg = [torch.empty_like(grads[0]) for _ in range(world)]
    dist.all_gather(xg, grads[0].contiguous(), group=mesh.sp_group)
    if rank == 0:
        _report(args, x, w, mask, torch.cat(outs, 1), [torch.cat(xg, 1)] + grads[1:], calls, seconds)


def _report(args, x, w, mask, o, grads, calls, seconds) -> None:
    t0 = time.perf_counter()
    ref_o, ref_grads = _step(x, w, mask, UlyssesAttention(None, args.kernel), args)
    ref_seconds = time.perf_counter() - t0
    print(f"Ulysses SP demo: S={args.seq_len} N={args.num_heads} K={args.num_kv_heads} H={args.head_dim} "
          f"P={args.sp_size} documents={args.documents} kernel={args.kernel}")
    print(f"  step (fwd+bwd of attention): SP {seconds:.3f} s per rank, one process {ref_seconds:.3f} s")
    print(f"  collectives per layer: {len(calls)} (2 forward + 2 backward); bytes sent by rank 0: {calls}")
    worst = 0.0
    for name, a, b in [("output", o, ref_o)] + list(zip(["dx", "dWq", "dWk", "dWv"], grads, ref_grads)):
        rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, rel)
        print(f"  {name:6s} max |SP - single| / max |single| = {rel:.2e}")
    # fp32 with different summation order only: 1e-4 relative is far above rounding (~1e-6)
    ok = worst < 1e-4
    print("  RESULT:", "exact to fp32 rounding" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


def run(args: argparse.Namespace) -> int:
    """Spawn ``--sp-size`` processes, compare with one process; the exit code (a ValueError: exit 2)."""
    for flag, value in (("--sp-size", args.sp_size), ("--seq-len", args.seq_len), ("--num-heads", args.num_heads),
                        ("--num-kv-heads", args.num_kv_heads), ("--head-dim", args.head_dim),
                        ("--documents", args.documents)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    if args.seq_len % args.sp_size:
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of --sp-size {args.sp_size}.")
    spawn(_worker, args.sp_size, args)
    return 0
