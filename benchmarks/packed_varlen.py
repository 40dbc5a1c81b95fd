"""torch_varlen (and sdpa's bucketed path) against per-document SDPA: exactness and time, fwd + bwd.

    python benchmarks/packed_varlen.py --device cuda --out varlen.json        # S=32K, 1/64/1024 docs
    python benchmarks/packed_varlen.py --device cpu --seq-len 256 --out x.json  # the same code, tiny

Per document count: the per-document reference (one ``scaled_dot_product_attention`` call per
document, ``is_causal``), ``sdpa`` (bucketed, or varlen on CUDA) and ``torch_varlen`` (CUDA only;
recorded as skipped elsewhere). Max abs differences of the output and of the q/k/v gradients
against the reference, median times of --repeats. Exit code 1 when a difference exceeds the
tolerance (bf16: 2e-2, a few bf16 eps of O(1) values; fp32: 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ulysses_sp import GlobalMask, get_kernel


def per_document(q, k, v, S: int, docs: int) -> torch.Tensor:
    """``(1, S, n, H)``: one causal SDPA call per equal document (the reference)."""
    L = S // docs
    parts = [F.scaled_dot_product_attention(q[:, :, a:a + L], k[:, :, a:a + L], v[:, :, a:a + L], is_causal=True,
                                            enable_gqa=True) for a in range(0, S, L)]
    return torch.cat(parts, dim=2).transpose(1, 2)


def measure(fn, inputs, grad, repeats: int, device: torch.device) -> tuple[float, list[torch.Tensor]]:
    """Median ms of forward + backward, and (output, q/k/v grads) of the last run."""
    times, result = [], []
    for _ in range(repeats + 1):
        for t in inputs:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = fn(*inputs)
        (o * grad).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        result = [o.detach()] + [t.grad for t in inputs]
    return statistics.median(times[1:]) * 1e3, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--documents", default="1,64,1024")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    S, rows, ok = args.seq_len, [], True
    for docs in [int(d) for d in args.documents.split(",")]:
        g = torch.Generator(device=device).manual_seed(docs)
        shapes = [(1, h, S, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
        inputs = [torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_() for s in shapes]
        grad = torch.randn(1, S, args.heads, args.head_dim, generator=g, device=device, dtype=dtype)
        positions = torch.arange(S, device=device).remainder(S // docs)[None]
        row = {"documents": docs, "length": S // docs, "seq_len": S, "dtype": str(dtype)}
        row["reference_ms"], ref = measure(lambda q, k, v: per_document(q, k, v, S, docs), inputs, grad,
                                           args.repeats, device)
        for name in ("sdpa", "torch_varlen"):
            kernel = get_kernel(name)
            try:
                ms, got = measure(lambda q, k, v: kernel(q, k, v, GlobalMask.from_position_ids(positions)),
                                  inputs, grad, args.repeats, device)
            except ValueError as e:  # torch_varlen off CUDA / on an older torch: refused with the fix
                row[name] = {"status": f"skipped: {e}"}
                continue
            diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]
            row[name] = {"status": "ok" if max(diffs) <= tol else "mismatch", "ms": round(ms, 2),
                         "max_abs_diff_out_dq_dk_dv": diffs, "speedup_vs_reference": round(row["reference_ms"] / ms, 2)}
            ok = ok and max(diffs) <= tol
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "tolerance": tol,
                   "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
