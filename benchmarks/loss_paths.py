"""The loss step side by side: plain autograd cross entropy, ``sp_token_loss`` and ``tiled_token_loss``.

One process, one lm_head + loss forward and backward on the same hidden states and weights:

    autograd   logits = F.linear(h, W); F.cross_entropy(logits.float(), reduction="sum") / N   (what
               Transformers' loss does)
    fused      logits = F.linear(h, W); ulysses_sp.sp_token_loss(logits, ...)  (gradient formed in
               the forward, backward only scales it)
    tiled      ulysses_sp.tiled_token_loss(h, W, ...): token tiles, logits never whole, gradients
               formed per tile in the forward

Prints median step time and the peak memory above the inputs (CPU: RSS high-water mark with glibc
serving >= 64 KiB by mmap, so RSS follows live tensors; CUDA: max_memory_allocated), and the
ratios to autograd. Every variant's loss is checked against autograd's first.

    .venv/bin/python benchmarks/loss_paths.py --tokens 4096 --hidden 512 --vocab 32000
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from ulysses_sp import sp_token_loss, tiled_token_loss  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _variants(args):
    N = args.tokens

    def autograd(h, w, labels):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="sum") / N

    def fused(h, w, labels):
        return sp_token_loss(F.linear(h, w), labels, N, grad_average_world=1)

    def tiled(h, w, labels):
        return tiled_token_loss(h, w, labels, N, grad_average_world=1, tile_tokens=args.tile)

    return {"autograd": autograd, "fused": fused, "tiled": tiled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tile", type=int, default=1024, help="tile_tokens of the tiled variant")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if not cuda:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(1, args.tokens, args.hidden, generator=gen).to(args.device, dtype)
    w = (torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden**-0.5).to(args.device, dtype)
    w.requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(args.device)

    def step(fn):
        h = h0.clone().requires_grad_()
        w.grad = None
        loss = fn(h, w, labels)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return loss.detach()

    variants = _variants(args)
    ref = step(variants["autograd"])
    rows = []
    for name, fn in variants.items():
        loss = step(fn)  # warm-up
        # fp32 math everywhere, summed in different orders: 1e-5 relative; a wrong loss is far off
        torch.testing.assert_close(loss, ref, rtol=1e-5 if args.dtype == "float32" else 1e-2, atol=0)
        w.grad = None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _status("VmRSS")
        step(fn)
        peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - base
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step(fn)
            times.append(time.perf_counter() - start)
        rows.append((name, statistics.median(times), min(times), peak))
    base_t, base_m = rows[0][1], rows[0][3]
    print(f"loss step, T={args.tokens} D={args.hidden} V={args.vocab} {args.dtype} on {args.device}, "
          f"tile {args.tile}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    print("| variant | median (min) s | vs autograd time | peak MiB above inputs | vs autograd memory |")
    print("|---|---|---|---|---|")
    for name, med, low, peak in rows:
        memory_ratio = f"{peak / base_m:.2f}" if base_m > 0 else "-"  # tiny shapes: below RSS page granularity
        print(f"| {name} | {med:.3f} ({low:.3f}) | {med / base_t:.2f} | {peak / 2**20:.0f} | {memory_ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
