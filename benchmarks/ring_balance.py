"""Ring attention with and without the causal load balance (zigzag chunks), side by side.

    python benchmarks/ring_balance.py --sp-size 2 --seq-lens 4096 8192

One attention call (forward + backward, causal, B=1, N=8, K=2, H=64, fp32) per configuration on
``--sp-size`` gloo processes with one thread each; the two variants alternate in the same
processes, so background load hits both alike. Prints the median step of each and the ratio
contiguous / balanced (> 1: the balance helps). The balance only pays when every rank has its own
core (or GPU): with more ranks than cores the total work, not the slowest rank, sets the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ulysses_sp import GlobalMask, RingAttention, SPMesh, spawn


def _worker(rank: int, world: int, S: int, repeats: int) -> None:
    torch.set_num_threads(1)
    mesh = SPMesh.from_world(world)
    s, B, N, K, H = S // world, 1, 8, 2, 64
    gen = torch.Generator().manual_seed(rank)
    q, k, v = torch.randn(B, N, s, H, generator=gen), torch.randn(B, K, s, H, generator=gen), torch.randn(B, K, s, H, generator=gen)
    times: dict[bool, list[float]] = {True: [], False: []}
    for it in range(repeats + 1):
        for balance in (True, False):
            attention = RingAttention(mesh.sp_group, balance=balance)
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            dist.barrier()
            t0 = time.perf_counter()
            attention(qq, kk, vv, GlobalMask(S)).sum().backward()
            dist.barrier()
            if it:  # the first round warms up
                times[balance].append(time.perf_counter() - t0)
    if rank == 0:
        bal, contig = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {S} | {world} | {bal:.3f} | {contig:.3f} | {contig / bal:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp-size", type=int, default=2)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}")
    print("| S | P | balanced s | contiguous s | contiguous / balanced |\n|---|---|---|---|---|")
    for S in args.seq_lens:
        spawn(_worker, args.sp_size, S, args.repeats)


if __name__ == "__main__":
    main()
