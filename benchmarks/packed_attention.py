"""Issue 24: packed-document attention, ours (sdpa kernel) against SDPA with a dense block-diagonal mask.

One process, attention alone: 8 heads of 64, forward + backward, S tokens in equal documents,
median of --repeats. Writes a markdown table with the load average and the command.

    python benchmarks/packed_attention.py --threads 2 --out benchmarks/results/issue24_cpu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ulysses_sp import GlobalMask, get_kernel


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (and the mask's plan, built once per step as in training)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def case(S: int, docs: int, heads: int, head_dim: int, repeats: int) -> tuple[float, float]:
    positions = torch.arange(S).remainder(S // docs)[None]
    mask = GlobalMask.from_position_ids(positions)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, S, head_dim, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(1, S, heads, head_dim, generator=g)
    sdpa = get_kernel("sdpa")
    dense = mask.dense(q.device)
    if dense is None:
        dense = torch.ones(1, 1, S, S, dtype=torch.bool).tril()

    def ours():  # a new step's mask: the bucket plan is built inside the timing
        (sdpa(q, k, v, GlobalMask.from_position_ids(positions)) * grad).sum().backward()

    def reference():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        (o.transpose(1, 2) * grad).sum().backward()

    return timed(reference, repeats), timed(ours, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--documents", default="1,16,256,1024")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows, single = [], None
    for docs in [int(d) for d in args.documents.split(",")]:
        dense_ms, ours_ms = case(args.seq_len, docs, args.heads, args.head_dim, args.repeats)
        single = ours_ms if docs == 1 else single
        ratio = f"{ours_ms / single:.3f}" if single else "-"
        rows.append(f"| {docs} | {args.seq_len // docs} | {dense_ms:.0f} ms | {ours_ms:.0f} ms | "
                    f"{dense_ms / ours_ms:.2f}x | {ours_ms * 1e3 / args.seq_len:.1f} us | {ratio} |")
        print(rows[-1], flush=True)
    load_after = os.getloadavg()
    text = "\n".join([
        "# Issue 24: packed documents, ours (sdpa, length buckets) vs dense block-diagonal SDPA (CPU)",
        "",
        f"`{' '.join([os.path.basename(sys.executable), *sys.argv])}` (PYTHONPATH=src)",
        "",
        f"{args.threads} threads, one process, {args.heads} heads of {args.head_dim}, fp32, forward + backward, "
        f"S={args.seq_len}, equal documents, median of {args.repeats}; torch {torch.__version__}.",
        f"Load average (1/5/15 min) before: {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}, "
        f"after: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} (2-core machine shared by agents).",
        "",
        "| documents | length | dense-mask SDPA | ours | ours vs dense | ours per token | ours / 1-doc |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
