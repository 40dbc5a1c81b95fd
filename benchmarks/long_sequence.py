"""Length on this machine: the longest sequence one training step completes at P=2, every feature on.

A Llama-like model built in code (random weights, V = 32000, D = 128, I = 344, L = 2, 2 heads of
64), fp32, SDPA, trains ONE step (forward + backward + AdamW step) on one sequence of S tokens
over 2 gloo processes (``ulysses_sp.spawn``) under

    fsdp2   torch.distributed.fsdp.fully_shard: embeddings, each decoder layer, lm_head, root
    zero3   DeepSpeed ZeRO-3 (``DS_ACCELERATOR=cpu``), the optimizer passed to ``deepspeed.initialize``

with activation checkpointing, ``UlyssesSPConfig(sp_size=2, tiled_loss_tokens=..., tiled_mlp_tokens=...,
offload_activations=True)`` and ``sp.forward_loss`` (the path of tests/test_sharded_memory.py).

Search (per wrapper): S doubles from ``--start`` while the trial fits the per-rank budget and the
next step's predicted time (x4 per doubling: attention is quadratic) stays under
``--max-step-s``; a trial that fails or exceeds the budget gets ONE bisection step between the
last length that fitted and it. ``--seq-lens`` takes explicit lengths instead (tried in order,
stopping at the first that does not fit).

Baseline: ``plain``, one process, no wrapper, no SP, Transformers' own loss (full ``(S, V)``
logits), checkpointing on, the same AdamW step; its longest S whose peak fits the LARGEST per-rank
peak the wrappers' longest runs measured (bracketing from the memory model's guess in x1.25 steps,
then bisection to 5%). The ratio "vs plain" is therefore within the same per-rank budget.

Each trial is fresh processes: build, one warm-up step at 128 tokens (lazy inits, thread pools,
optimizer states), then the measured step. Peak per rank = Linux ``VmHWM`` of the step (reset via
``/proc/self/clear_refs``) minus the RSS just before it, glibc serving allocations >= 64 KiB by
mmap so freed tensors leave the RSS (as benchmarks/memory_ablation.py): activations, saved and
offloaded tensors, temporaries, collective buffers, gathered weights and unsharded gradients;
not the weight shards and optimizer states that exist before the step. On a CPU-only machine the
offloaded activations land in the same RAM, so offload is on but cannot lower this figure.

``--ladder-budget-mib`` also runs memory_ablation.py's ladder (plain -> + tiled loss -> + Ulysses
-> + tiled MLP -> + offload) with its ``--fsdp2`` mode at that per-rank budget.

    .venv/bin/python benchmarks/long_sequence.py --max-step-s 480 --ladder-budget-mib 96 --out benchmarks/results/long_sequence_cpu.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the fork server starts: see docstring
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_ablation  # the ladder; its MODEL is the model here too

MODEL = dict(memory_ablation.MODEL, max_position_embeddings=1 << 21)
WRAPPERS = ("fsdp2", "zero3")
PLAIN_GRANULE = 32
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
             "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}


def _model():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**MODEL))
    model.config._attn_implementation = "sdpa"
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # earlier 5.x (e.g. 5.17 on the GPU machine) has only the older name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _ids(seq_len: int) -> torch.Tensor:
    return torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(seq_len))


class _Plain:
    """One process, no wrapper, no SP: Transformers' loss on the full logits."""

    def __init__(self, model):
        self.model, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self, seq_len: int) -> dict:
        ids = _ids(seq_len)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.item()}


class _Sharded:
    """UlyssesSP at sp = world with every memory feature, the weights sharded by FSDP2 or ZeRO-3."""

    def __init__(self, model, tiles, wrapper: str):
        import torch.distributed as dist

        from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig

        self.world, self.wrapper = dist.get_world_size(), wrapper
        self.mesh = SPMesh.from_world(self.world)
        config = UlyssesSPConfig(sp_size=self.world, tiled_loss_tokens=tiles[0], tiled_mlp_tokens=tiles[1],
                                 offload_activations=True)
        if wrapper == "fsdp2":  # as tests/test_sharded_memory.py: shard, then register
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            world_mesh = init_device_mesh("cpu", (self.world,))
            for unit in (model.model.embed_tokens, *model.model.layers, model.lm_head, model):
                fully_shard(unit, mesh=world_mesh)
            self.sp = UlyssesSP(model, self.mesh, config).register()
            self.engine, self.optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-4)  # the DTensor shards
        else:  # register, then deepspeed.initialize (tests/test_sharded_memory.py)
            import deepspeed

            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            self.sp = UlyssesSP(model, self.mesh, config).register()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.engine, self.optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)

    def step(self, seq_len: int) -> dict:
        from ulysses_sp import TiledMLP, global_num_items, reported_loss

        self.sp.offload.reset_stats()
        shard = self.sp.shard({"input_ids": _ids(seq_len)})
        loss = self.sp.forward_loss(self.engine, shard, global_num_items(shard["shift_labels"], group=None))
        if self.wrapper == "fsdp2":
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.engine.backward(loss)
            self.engine.step()
        stats = self.sp.offload.stats
        return {"loss": reported_loss(loss.detach(), self.world, group=None).item(),
                "offloaded_mib": stats.num_bytes / 2**20, "offloaded_tensors": stats.num_tensors,
                "tiled_mlps": sum(isinstance(m, TiledMLP) for m in self.sp.base.modules())}


def trial_worker(rank: int, world: int, mode: str, seq_len: int, tiles: tuple, out_dir: str) -> None:
    """One trial on one rank: build, wrap, warm up, measure one step, write ``rank<r>.json``."""
    model = _model()
    runner = _Plain(model) if mode == "plain" else _Sharded(model, tiles, mode)
    runner.step(128)  # warm-up: lazy inits, thread pools, optimizer states
    base = memory_ablation.memory_mark(torch.device("cpu"))  # VmHWM reset to the current RSS
    start = time.perf_counter()
    info = runner.step(seq_len)
    seconds = time.perf_counter() - start
    peak = memory_ablation.memory_peak(torch.device("cpu")) - base
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak, "base": base, "seconds": seconds, **info}, f)


def measure(mode: str, seq_len: int, tiles: tuple, timeout_s: float) -> dict:
    """One trial in fresh processes: per-rank peaks, the slowest rank's step time, or the error."""
    from ulysses_sp import spawn

    world = 1 if mode == "plain" else 2
    load = os.getloadavg()[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            spawn(trial_worker, world, mode, seq_len, tiles, out_dir, timeout_s=timeout_s,
                  preload=["transformers", "transformers.models.llama.modeling_llama", "ulysses_sp",
                           "ulysses_sp.integrations.transformers", "deepspeed"])
        except Exception as e:  # noqa: BLE001  (an OOM kill, a timeout, a wrapper error: reported, not hidden)
            return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
                    "wall": time.time() - t0, "load": load}
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return {"peaks": [r["peak"] for r in ranks], "peak": max(r["peak"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks), "wall": time.time() - t0, "load": load,
            **{k: v for k, v in ranks[0].items() if k not in ("peak", "base", "seconds")}}


def _describe(mode: str, s: int, m: dict, budget: int) -> str:
    if "error" in m:
        return f"  {mode:<6} S={s:>7}  FAILED after {m['wall']:.0f}s: {m['error']}"
    peaks = " / ".join(f"{p / 2**20:.1f}" for p in m["peaks"])
    extra = (f"  offloaded {m['offloaded_mib']:.1f} MiB in {m['offloaded_tensors']} tensors, {m['tiled_mlps']} tiled MLPs"
             if "offloaded_mib" in m else "")
    return (f"  {mode:<6} S={s:>7}  peak/rank {peaks} MiB  step {m['seconds']:.1f}s  loss {m['loss']:.4f}"
            f"  load {m['load']:.1f}{extra}  {'fits' if m['peak'] <= budget else 'OVER budget'}")


def longest_sharded(mode: str, args, budget: int, log) -> tuple[int, dict, dict]:
    """Doubling from ``--start`` (or ``--seq-lens``), one bisection step after a miss."""
    tiles, trials, best = (args.loss_tile, args.mlp_tile), {}, 0

    def fit(s: int) -> bool:
        trials[s] = m = measure(mode, s, tiles, args.timeout_s)
        log(_describe(mode, s, m, budget))
        return "error" not in m and m["peak"] <= budget

    lengths = list(args.seq_lens or [])
    s = lengths.pop(0) if lengths else args.start
    while s:
        if not fit(s):
            if best and not args.seq_lens:
                mid = (best + s) // 2 // 64 * 64
                if mid > best and fit(mid):
                    best = mid
            break
        best, secs = s, trials[s]["seconds"]
        if lengths:
            s = lengths.pop(0)
            continue
        if args.seq_lens or 2 * s > args.max_seq_len:
            break
        if secs * 4 > args.max_step_s:
            log(f"  {mode:<6} S={2 * s:>7}  not tried: predicted step {secs * 4:.0f}s > --max-step-s {args.max_step_s:.0f}")
            break
        s *= 2
    return best, trials.get(best, {}), trials


def _extrapolate(mode: str, trials: dict, budget: int, log) -> None:
    """Where the budget would be reached if memory stays linear in S (an extrapolation, said as such)."""
    ok = sorted(s for s, m in trials.items() if "error" not in m and m["peak"] <= budget)
    if len(ok) < 2:
        return
    (s0, m0), (s1, m1) = [(s, trials[s]) for s in ok[-2:]]
    slope = (m1["peak"] - m0["peak"]) / (s1 - s0)
    if slope <= 0:
        return
    s_mem = s1 + (budget - m1["peak"]) / slope
    log(f"  {mode:<6} per-rank peak grows {slope * 2 / 1024:.2f} KiB per local token between S={s0} and S={s1}; "
        f"linear extrapolation (not measured): the {budget / 2**20:.0f} MiB budget near S={s_mem / 1e6:.1f}M, where a "
        f"quadratic step time would be ~{m1['seconds'] * (s_mem / s1) ** 2 / 3600:.0f} h")


def longest_plain(budget: int, args, log) -> tuple[int, dict]:
    """Bracket from the memory model's guess (x1.25), then bisect to 5%: the longest plain S within ``budget``."""
    from ulysses_sp import MemoryFeatures, longest_sequence

    step, fits = PLAIN_GRANULE, {}

    def fit(s: int) -> bool:
        m = measure("plain", s, (None, None), args.timeout_s)
        log(_describe("plain", s, m, budget))
        ok = "error" not in m and m["peak"] <= budget
        if ok:
            fits[s] = m
        return ok

    def rounded(x: float) -> int:
        return max(step, int(x) // step * step)

    guess = longest_sequence(MODEL, 1, torch.float32, MemoryFeatures(), budget, granule=step, include_static=False)
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
    while lo and hi - lo > step and hi > lo * 1.05:
        mid = rounded((lo + hi) / 2)
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return lo, fits.get(lo, {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wrappers", nargs="+", choices=WRAPPERS, default=list(WRAPPERS))
    parser.add_argument("--start", type=int, default=16384, help="first S of the doubling search")
    parser.add_argument("--max-seq-len", type=int, default=1 << 20, help="the doubling stops here")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="explicit lengths instead of the search")
    parser.add_argument("--max-step-s", type=float, default=600.0,
                        help="do not try a length whose predicted step time (x4 per doubling) exceeds this")
    parser.add_argument("--budget-mib", type=float, default=10240.0, help="per-rank step-memory budget of the search")
    parser.add_argument("--loss-tile", type=int, default=256, help="tiled_loss_tokens")
    parser.add_argument("--mlp-tile", type=int, default=1024, help="tiled_mlp_tokens")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="collective timeout of one trial")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain single-process baseline")
    parser.add_argument("--ladder-budget-mib", type=float, help="also run memory_ablation.py --fsdp2 at this budget")
    parser.add_argument("--ladder-tolerance", type=float, default=0.1, help="the ladder's bisection stops within this fraction")
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * 2**20)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    command = ".venv/bin/python benchmarks/long_sequence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_start, t0 = os.getloadavg(), time.time()
    log(f"model {MODEL}; fp32; SDPA; checkpointing + tiled loss {args.loss_tile} + tiled MLP {args.mlp_tile} + "
        f"offload; P=2; budget {args.budget_mib:.0f} MiB per rank; torch {torch.__version__}")
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)}")
    results = {}
    for mode in args.wrappers:
        results[mode] = longest_sharded(mode, args, budget, log)
        _extrapolate(mode, results[mode][2], budget, log)
    plain_len, plain = 0, {}
    fitted = [r[1]["peak"] for r in results.values() if r[0]]
    if fitted and not args.no_plain:
        plain_budget = max(fitted)
        log(f"plain single process within the wrappers' largest measured peak, {plain_budget / 2**20:.1f} MiB:")
        plain_len, plain = longest_plain(plain_budget, args, log)
    ladder: list[str] = []
    if args.ladder_budget_mib:
        log(f"ladder under FSDP2 (memory_ablation.py --fsdp2 --budget-mib {args.ladder_budget_mib:g} "
            f"--tolerance {args.ladder_tolerance:g}; loss tile {memory_ablation.LOSS_TILE}, MLP tile {memory_ablation.MLP_TILE}):")
        ladder = memory_ablation.run_ladder(int(args.ladder_budget_mib * 2**20), "cpu", list(memory_ablation.RUNGS),
                                            log, fsdp2=True, tolerance=args.ladder_tolerance)
    load_end = os.getloadavg()
    log(f"load average at end: {' '.join(f'{x:.2f}' for x in load_end)}; total {time.time() - t0:.0f} s")

    table = ["| wrapper | P | longest S | tokens / rank | peak MiB per rank (r0 / r1) | step s | loss | vs plain |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, (length, m, _) in results.items():
        if not length:
            table.append(f"| {mode} | 2 | none fitted | | | | | |")
            continue
        ratio = f"{length / plain_len:.0f}x" if plain_len else ""
        table.append(f"| {mode} | 2 | {length} | {length // 2} | {' / '.join(f'{p / 2**20:.1f}' for p in m['peaks'])} | "
                     f"{m['seconds']:.1f} | {m['loss']:.4f} | {ratio} |")
    if fitted and not args.no_plain and not plain_len:
        table.append("| plain (no wrapper, no SP, HF loss) | 1 | none fitted | | | | | |")
    if plain_len:
        table.append(f"| plain (no wrapper, no SP, HF loss) | 1 | {plain_len} | {plain_len} | {plain['peak'] / 2**20:.1f} | "
                     f"{plain['seconds']:.1f} | {plain['loss']:.4f} | 1x |")
    trials = [line for line in lines if line not in set(ladder)]  # the trial log, without the ladder's table
    for line in ["", *table]:
        log(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Long sequences on this machine\n\n```\n$ {command}\n" + "\n".join(trials) + "\n```\n\n"
                    + "\n".join(table) + "\n" + ("\nLadder under FSDP2:\n" + "\n".join(ladder) + "\n" if ladder else ""))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
