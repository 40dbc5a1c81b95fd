"""Peak memory of one attention module (projections + attention + o_proj), forward + backward, per head-chunk mode.

A one-layer Llama built in code (random init, fp32, SDPA; default D = N*H = 256, N = 8 query heads of
32, K kv heads) under ``UlyssesSP`` on P gloo processes; only its ``self_attn`` runs, on this rank's
shard ``x (B, s, D)`` (a leaf that needs its gradient), its output held through the backward (as the
residual add after it does in a model), ``backward(dy)`` with a ``dy`` made beforehand:

    unchunked        sp_head_chunks=1
    calls C=2, 4     sp_head_chunks=C, sp_head_blocks=False: the attention call chunked
                     (``comm.head_chunked``; the sharded q/k/v are saved)
    blocks C=2, 4    sp_head_chunks=C (head blocks, the default): the whole module one block of heads
                     at a time (``memory.head_blocks``)

Two peaks per rank, max over ranks:

- measured: on CPU ``VmHWM - VmRSS`` around one forward + backward, glibc serving allocations >= 64 KiB
  by mmap (so the RSS follows the live tensors, counting the pages written); with ``--device cuda``
  ``max_memory_allocated - memory_allocated`` (ranks share the GPUs over gloo where there are fewer
  than P). The least of 3 passes after a warm-up.
- tracked: one more pass under ``live_tensors.LiveTensors``, which follows every storage an op
  allocates until it is freed and says what is alive at the peak: "full-length" (tensors with a dim
  of S, i.e. head-sharded q/k/v/o and their grads) and the flat "exchange" buffers (all-to-all
  payloads and rebuilt kernel inputs: full-length data too) against "sharded" (the output, x's
  gradient, the sharded attention output, per-block sequence-sharded tensors, weight grads).

The goal of issue 23 in these terms, for a mode running C chunks: its tracked peak at most what else
is alive at that peak (sharded tensors, the log-sum-exp) plus ``1/C`` of the unchunked module's
full-length share ("peak goal"); and, stronger, the most full-length bytes (full-length + exchange)
alive at ANY moment at most ``1/C`` of the unchunked module's ("full-length max"). With grouped kv
heads neither can hold once C exceeds the kv heads a rank holds: each chunk needs a whole kv head.

    .venv/bin/python benchmarks/head_block_memory.py --seq-lens 8192 16384 --sp-sizes 2 4 --kv-heads 8 4
    python benchmarks/head_block_memory.py --device cuda --dtype bfloat16 --seq-lens 32768 65536 --sp-sizes 2 \
        --kv-heads 8 --json out.json                          # scripts/gpu_check.py --steps head_blocks
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from live_tensors import LiveTensors, sequence_classifier  # noqa: E402
from memory_ablation import memory_mark, memory_peak  # noqa: E402  (the memory benchmarks' one measurement)

MODES = (("unchunked", 1, True), ("calls C=2", 2, False), ("calls C=4", 4, False), ("blocks C=2", 2, True),
         ("blocks C=4", 4, True))
REPEATS = 3
FULL = ("full-length", "exchange")  # the per-head-chunk share: full-length tensors and the exchange buffers


def _worker(rank: int, world: int, args, S: int, K: int, out_path: str) -> None:
    import transformers

    from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig

    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    if not cuda:
        torch.set_num_threads(1)
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors leave the RSS at once
    mesh = SPMesh.from_world(world, device_type=device.type)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=args.heads * args.head_dim, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=args.heads, num_key_value_heads=K,
                                      head_dim=args.head_dim, max_position_embeddings=S, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    attention = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(rank)
    s, D = S // world, config.hidden_size
    x = torch.randn(1, s, D, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(1, s, D, generator=gen).to(device, dtype)
    peaks = {}
    for name, chunks, blocks in MODES:
        sp_config = UlyssesSPConfig(sp_size=world, sp_head_chunks=chunks, sp_head_blocks=blocks)
        with UlyssesSP(model, mesh, sp_config) as sp:
            inputs = sp.model_inputs(sp.shard({"input_ids": torch.zeros(1, S, dtype=torch.long, device=device)}))
            position_embeddings = model.model.rotary_emb(x, inputs["position_ids"])

            def step() -> None:
                y, _ = attention(hidden_states=x, position_embeddings=position_embeddings, attention_mask=None,
                                 ulysses_mask=inputs["ulysses_mask"])
                y.backward(dy)  # y held through the backward
                del y

            step()  # warm-up: first-call checks, thread pools, collective buffers
            measured = []
            for _ in range(REPEATS):
                x.grad = None
                model.zero_grad(set_to_none=True)
                base = memory_mark(device)
                step()
                measured.append(memory_peak(device) - base)
            x.grad = None
            model.zero_grad(set_to_none=True)
            with LiveTensors(sequence_classifier(S), combined=FULL) as live:
                step()
            peaks[name] = {"measured": min(measured), "tracked": live.peak, "full_max": live.max_combined,
                           "at_peak": live.peak_by_category}
    table = [None] * world
    torch.distributed.all_gather_object(table, peaks, group=mesh.sp_group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({name: max((p[name] for p in table), key=lambda r: r["tracked"]) for name, _, _ in MODES}, f)


def main(argv: list[str] | None = None) -> int:
    from ulysses_sp import spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--sp-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", help="also write the records (MiB per mode and cell) here")
    args = parser.parse_args(argv)
    from ulysses_sp import local_backend

    records = []
    print(f"load average at start: {os.getloadavg()}; torch {torch.__version__}; {args.device} {args.dtype}",
          flush=True)
    from ulysses_sp import attention_comm

    header = ("| K | P | S | mode | C run | measured | tracked peak | at the peak: full-length / the rest | "
              "peak goal | full-length max | / unchunked's |")
    rows = [header, "|" + "---|" * 11]
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    for K in args.kv_heads:
        for P in args.sp_sizes:
            for S in args.seq_lens:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "peaks.json")
                    spawn(_worker, P, args, S, K, out, backend=local_backend(P, args.device),
                          device_type=args.device)
                    with open(out) as f:
                        peaks = json.load(f)
                base = peaks["unchunked"]["full_max"]
                for name, chunks, blocks in MODES:
                    rec = peaks[name]
                    run = attention_comm("ulysses", P, 1, S, args.heads, K, args.head_dim, itemsize,
                                         head_chunks=chunks, head_blocks=blocks).collectives_forward // 2
                    full = sum(v for k, v in rec["at_peak"].items() if k in FULL)
                    rest = rec["tracked"] - full
                    goal = rest + base / run  # the rest alive at this peak + 1/C of the unchunked full-length share
                    met = "met" if rec["tracked"] <= goal else "NOT met"
                    verdict = "-" if run == 1 else f"{goal / 2**20:.1f}: {met}"
                    ratio = rec["full_max"] / base
                    bound = "" if run == 1 else f" (<= {1 / run:.2f}: {'met' if ratio <= 1 / run else 'NOT met'})"
                    row = (f"| {K} | {P} | {S} | {name} | {run} | {rec['measured'] / 2**20:.1f} | "
                           f"{rec['tracked'] / 2**20:.1f} | {full / 2**20:.1f} / {rest / 2**20:.1f} | {verdict} | "
                           f"{rec['full_max'] / 2**20:.1f} | {ratio:.2f}{bound} |")
                    rows.append(row)
                    print(row, flush=True)
                    records.append({"kv_heads": K, "sp_size": P, "seq_len": S, "device": args.device,
                                    "dtype": args.dtype, "mode": name, "chunks_run": run, "goal": goal, **rec})
    print("\nMiB per rank (max over ranks; measured: the least of 3 passes)\n" + "\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
