"""Memory ablation: the longest trainable sequence under a fixed memory budget per rank.

Ladder (every rung uses gradient checkpointing, as ALST does):

    plain       one process, Transformers' own loss (full (S, V) logits)
    tiled_loss  one process, lm_head + CE in token tiles (UlyssesSPConfig(tiled_loss_tokens=...))
    ulysses     + Ulysses SP over P=2 processes
    tiled_mlp   + MLPs in sequence tiles
    offload     + checkpointed layer inputs offloaded to host memory

For each rung: bracketing (x1.25 steps, starting where the memory model predicts the limit) then
bisection to 5%, to the longest S whose ONE forward + backward step has a measured peak <= budget
on every rank (see ``longest``). Each trial is a fresh set
of processes (forked from a server that has imported torch/transformers but never ran a step).

What "measured peak" is:
    cpu:  peak resident set size of the process during the step minus its RSS just before the
          step (Linux ``VmHWM`` after resetting it with ``/proc/self/clear_refs``). The process has
          built the model and run one short warm-up step (thread pools, lazy inits), then dropped
          its gradients, so the figure includes: activations, the autograd graph's saved tensors,
          temporaries, collective buffers and the gradient buffers of all parameters. glibc is
          told to serve every allocation >= 64 KiB by mmap (``MALLOC_MMAP_THRESHOLD_``) so freed
          tensors leave the RSS at once and the RSS tracks live tensor bytes. On CPU "offload"
          moves tensors to CPU memory, i.e. nowhere: that rung is measured but cannot gain here.
    cuda: ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` before the step
          (same content, exact allocator bytes); offloaded tensors are in host memory.

Next to every measurement the memory model (``ulysses_sp.estimate_peak_memory``)
prints its prediction for the same setting.

``--fsdp2``: every rung but ``plain`` (which stays the plain single process, the reference of the
ratios) shards the weights with FSDP2 (``fully_shard`` of the embeddings, each decoder layer,
lm_head and the root) over its P ranks, as long runs do; the prediction then uses
``state_shards=P``. The measured peak also holds what FSDP2 gathers during the step (the other
ranks' weight shards of the units in use) and the unsharded gradients before their
reduce-scatter. ``benchmarks/long_sequence.py --ladder-budget-mib`` runs this mode.

    .venv/bin/python benchmarks/memory_ablation.py --out benchmarks/results/memory_ablation_cpu.md
    .venv/bin/python benchmarks/memory_ablation.py --device cuda --budget-mib 4096   # P=2 ranks share one GPU over gloo if need be
    .venv/bin/python benchmarks/memory_ablation.py --fsdp2 --budget-mib 96 --tolerance 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the fork server starts: see docstring
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# the library's one peak measurement; the other memory benchmarks take it from here
from ulysses_sp import memory_mark, memory_peak, process_status_bytes  # noqa: E402,F401

MODEL = dict(vocab_size=32000, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=1 << 17, tie_word_embeddings=False)
RUNGS = ("plain", "tiled_loss", "ulysses", "tiled_mlp", "offload")
FEATURES = {  # rung -> (sp_size, tiled_loss, tiled_mlp, offload)
    "plain": (1, False, False, False),
    "tiled_loss": (1, True, False, False),
    "ulysses": (2, True, False, False),
    "tiled_mlp": (2, True, True, False),
    "offload": (2, True, True, True),
}
LOSS_TILE, MLP_TILE, GRANULE = 32, 256, 32


def rss_kib(field: str) -> int:
    """``field`` of ``/proc/self/status`` (VmRSS, VmHWM) in KiB; shared by the memory benchmarks."""
    return process_status_bytes(field) // 1024


def _build(device: str, fsdp2: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**MODEL)).to(device)
    model.config._attn_implementation = "sdpa"
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # earlier 5.x (e.g. 5.17 on the GPU machine) has only the older name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp2:  # the units of tests/test_sharded_memory.py, plus the embeddings as their own unit
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world_mesh = init_device_mesh(device, (dist.get_world_size(),))
        for unit in (model.model.embed_tokens, *model.model.layers, model.lm_head, model):
            fully_shard(unit, mesh=world_mesh)
    return model.train()


def _step(model, rung: str, seq_len: int, device: str) -> None:
    from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig, global_num_items

    sp_size, tiled_loss, tiled_mlp, offload = FEATURES[rung]
    ids = torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    if rung == "plain":
        ids = ids.to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        return
    mesh = SPMesh.from_world(sp_size, device_type=device)
    config = UlyssesSPConfig(sp_size=sp_size, tiled_mlp_tokens=MLP_TILE if tiled_mlp else None,
                             tiled_loss_tokens=LOSS_TILE if tiled_loss else None, offload_activations=offload)
    with UlyssesSP(model, mesh, config) as sp:
        shard = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sp.shard({"input_ids": ids}).items()}
        num_items = global_num_items(shard["shift_labels"], mesh.sp_group)
        sp.forward_loss(model, shard, num_items).backward()


def trial_worker(rank: int, world: int, rung: str, seq_len: int, device: str, out_dir: str, fsdp2: bool = False) -> None:
    """One trial on one rank: build, warm up, measure one step, write ``rank<r>.json``."""
    model = _build(device, fsdp2 and rung != "plain")
    _step(model, rung, 128, device)  # warm-up: lazy inits, thread pools
    for p in model.parameters():
        p.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    _step(model, rung, seq_len, device)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = rss_kib("VmHWM") * 1024 - base
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak, "seconds": time.perf_counter() - start}, f)


def measure(rung: str, seq_len: int, device: str, fsdp2: bool = False) -> dict:
    """Run one trial in fresh processes; the largest per-rank peak and the step time."""
    from ulysses_sp import local_backend, spawn

    world = FEATURES[rung][0]
    backend = local_backend(world, device)  # gloo on CUDA: ranks share a GPU; each rank's own CUDA peak counts
    if fsdp2 and device == "cuda" and backend == "gloo":  # gloo on CUDA: fewer GPUs than ranks
        raise SystemExit(f"--fsdp2 on CUDA needs a GPU per rank (NCCL); {rung} has P={world}: drop --fsdp2 or add GPUs.")
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(trial_worker, world, rung, seq_len, device, out_dir, fsdp2, backend=backend, device_type=device,
              timeout_s=900, preload=["transformers", "transformers.models.llama.modeling_llama", "ulysses_sp"])
        results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    return {"peak": max(r["peak"] for r in results), "seconds": max(r["seconds"] for r in results)}


def _shards(rung: str, fsdp2: bool) -> int:
    """Ranks that shard the weights in this rung (1: none)."""
    return FEATURES[rung][0] if fsdp2 and rung != "plain" else 1


def predict(rung: str, seq_len: int, device: str, fsdp2: bool = False) -> int:
    from ulysses_sp import MemoryFeatures, estimate_peak_memory

    sp_size, tiled_loss, tiled_mlp, offload = FEATURES[rung]
    features = MemoryFeatures(checkpointing=True, tiled_loss_tokens=LOSS_TILE if tiled_loss else None,
                              tiled_mlp_tokens=MLP_TILE if tiled_mlp else None, offload=offload,
                              host_is_device=device == "cpu")
    return estimate_peak_memory(MODEL, seq_len, sp_size, torch.float32, features,
                                state_shards=_shards(rung, fsdp2)).peak_bytes


def longest(rung: str, budget: int, device: str, log, fsdp2: bool = False, tolerance: float = 0.05) -> tuple[int, dict]:
    """The longest S (multiple of ``GRANULE * P``) whose measured peak fits ``budget``.

    Bracketing starts at the memory model's prediction and moves in x1.25 steps until one length
    fits and a longer one does not; then bisection until the bracket is within ``tolerance`` (5%)
    or one step. The model only picks where to look: every reported length is measured to fit,
    and a length at most ``tolerance`` longer is measured not to.
    """
    from ulysses_sp import MemoryFeatures, longest_sequence

    sp_size, tiled_loss, tiled_mlp, offload = FEATURES[rung]
    step = GRANULE * sp_size
    features = MemoryFeatures(tiled_loss_tokens=LOSS_TILE if tiled_loss else None,
                              tiled_mlp_tokens=MLP_TILE if tiled_mlp else None, offload=offload,
                              host_is_device=device == "cpu")
    guess = longest_sequence(MODEL, sp_size, torch.float32, features, budget, granule=GRANULE, include_static=False,
                             state_shards=_shards(rung, fsdp2))
    fits: dict[int, dict] = {}

    def fit(s: int) -> bool:
        m = measure(rung, s, device, fsdp2)
        m["predicted"] = predict(rung, s, device, fsdp2)
        ok = m["peak"] <= budget
        log(f"  {rung:<10} S={s:>7}  measured {m['peak'] / 2**20:7.1f} MiB  predicted {m['predicted'] / 2**20:7.1f} MiB"
            f"  ({(m['predicted'] - m['peak']) / m['peak']:+.1%})  step {m['seconds']:.1f}s  {'fits' if ok else 'over'}")
        if ok:
            fits[s] = m
        return ok

    def rounded(x: float) -> int:
        return max(step, int(x) // step * step)

    s = rounded(guess)
    if fit(s):
        lo, hi = s, rounded(s * 1.25) + step
        while fit(hi):
            lo, hi = hi, rounded(hi * 1.25) + step
    else:
        lo, hi = 0, s
        while hi > step:
            s = rounded(hi / 1.25)
            if fit(s):
                lo = s
                break
            hi = s
    while lo and hi - lo > step and hi > lo * (1 + tolerance):
        mid = rounded((lo + hi) / 2)
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    if not lo:
        raise RuntimeError(f"{rung}: not even S={step} fits the budget; raise --budget-mib.")
    return lo, fits[lo]


def run_ladder(budget: int, device: str, rungs: list[str], log, fsdp2: bool = False, tolerance: float = 0.05) -> list[str]:
    """The longest S of each rung (``longest``); logs and returns the table lines."""
    rows, base_len, t0 = [], None, time.time()
    for rung in rungs:
        length, m = longest(rung, budget, device, log, fsdp2, tolerance)
        base_len = base_len or length
        err = (m["predicted"] - m["peak"]) / m["peak"]
        wrapper = ("FSDP2 | " if rung != "plain" else "none | ") if fsdp2 else ""
        rows.append(f"| {rung} | {FEATURES[rung][0]} | {wrapper}{length} | {length / base_len:.1f}x | "
                    f"{m['peak'] / 2**20:.1f} | {m['predicted'] / 2**20:.1f} | {err:+.1%} | {m['seconds']:.1f} |")
    head = ("| rung | P | " + ("weights sharded by | " if fsdp2 else "") + "longest S | vs plain | measured peak MiB/rank | "
            "predicted MiB | error | step s |")
    table = ["", head, "|---" * head.count(" | ") + "|---|", *rows, "", f"total benchmark time {time.time() - t0:.0f} s"]
    for line in table:
        log(line)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget-mib", type=float, default=48.0, help="memory budget per rank (MiB) for one step (activations + grads)")
    parser.add_argument("--rungs", nargs="+", choices=RUNGS, default=list(RUNGS))
    parser.add_argument("--fsdp2", action="store_true", help="shard the weights with FSDP2 in every rung but plain")
    parser.add_argument("--tolerance", type=float, default=0.05, help="bisect until the bracket is within this fraction")
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * 2**20)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    log(f"model {MODEL}; budget {args.budget_mib} MiB per rank; device {args.device}; fp32; checkpointing on"
        + ("; FSDP2 on every rung but plain" if args.fsdp2 else ""))
    table = run_ladder(budget, args.device, args.rungs, log, args.fsdp2, args.tolerance)
    if args.out:
        with open(args.out, "w") as f:
            f.write("```\n" + "\n".join(lines[: -len(table)]) + "\n```\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
