"""Peak memory of one attention layer (forward + backward) with and without head chunks.

Only ``UlyssesAttention`` runs, on this rank's shard ``q (B,N,s,H)``, ``k, v (B,K,s,H)`` (leaves
that need gradients), its output held through the backward as the ``o_proj`` after it holds it in
a model: what is measured is what the layer itself allocates on top of its inputs (the output too):
the exchange buffers, the full-sequence q/k/v/o of the heads in flight, the kernel's saved
tensors and workspace, and the gradients it returns.

    CUDA: ``max_memory_allocated - memory_allocated`` around one forward + backward.
    CPU:  ``VmHWM - VmRSS`` around it, with glibc told (``mallopt``) to serve every allocation of
          64 KiB or more by ``mmap``, so freed tensors leave the resident set at once and the
          resident set follows the live tensor bytes.

The least of ``REPEATS`` measured passes (after a warm-up) is reported: page-level RSS readings
vary by a few MiB from pass to pass (one-off growth of collective and thread-pool buffers).
"""

from __future__ import annotations

import ctypes
import json
import os
import tempfile

import torch

from ulysses_sp import SPMesh, UlyssesAttention, local_backend, memory_mark, memory_peak, spawn

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
REPEATS = 3  # measured passes per chunk count after the warm-up; the least peak is reported


def _worker(rank: int, world: int, shape: tuple, dtype: str, chunks: list[int], out_path: str,
            device_type: str = "cpu") -> None:
    B, N, K, S, H = shape
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    mesh = SPMesh.from_world(world, device_type=device.type)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, h, S // world, H, generator=gen).to(device, getattr(torch, dtype)).requires_grad_()
               for h in (N, K, K))
    peaks = {}
    for C in chunks:
        attention = UlyssesAttention(mesh.sp_group, "sdpa", head_chunks=C)
        attention(q, k, v).sum().backward()  # warm-up: first-call checks, thread pools
        q.grad = k.grad = v.grad = None
        measured = []
        for _ in range(REPEATS):  # the least of a few: one-off growth (collective buffers) is not the layer's
            base = memory_mark(device)
            o = attention(q, k, v)  # held through the backward, as the o_proj after it saves it in a model
            o.sum().backward()
            measured.append(memory_peak(device) - base)
            del o
            q.grad = k.grad = v.grad = None
        peaks[C] = min(measured)
    table = [None] * world
    torch.distributed.all_gather_object(table, peaks, group=mesh.sp_group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({str(C): max(p[C] for p in table) for C in chunks}, f)


def attention_memory(P: int, S: int, chunks: list[int], *, B: int = 1, N: int = 8, K: int = 4, H: int = 32,
                     dtype: str = "float32", device_type: str = "cpu") -> list[dict]:
    """Per head-chunk count: the peak bytes (max over ranks) of one attention forward + backward.

    On ``"cuda"`` with fewer GPUs than ``P`` the ranks share them over gloo (``local_backend``):
    each rank's CUDA peak is its own allocator's, so the figures hold; the exchange is slower."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "peaks.json")
        spawn(_worker, P, (B, N, K, S, H), dtype, list(chunks), out_path, device_type,
              backend=local_backend(P, device_type), device_type=device_type)
        with open(out_path) as f:
            peaks = json.load(f)
    base = peaks[str(chunks[0])]
    return [{"mode": "attention_memory", "sp_size": P, "seq_len": S, "batch_size": B, "heads": N, "kv_heads": K,
             "head_dim": H, "dtype": dtype, "head_chunks": C, "peak_attention_bytes": peaks[str(C)],
             "vs_first": peaks[str(C)] / base if base else None} for C in chunks]
