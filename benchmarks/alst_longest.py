"""Longest sequence within a per-rank memory budget: DeepSpeed's ALST stack vs ulysses_sp, same P=2, same model.

A Llama built in code (random init, seed 0, fp32, SDPA; default V = 2048, D = 256, I = 688, L = 2,
8 heads of 32, 8 kv heads; ``--kv-heads 2`` for GQA) trains ONE step (forward + loss + backward +
gradient averaging over the SP group + SGD) on one sequence of S tokens over 2 gloo processes
(``ulysses_sp.spawn``, 1 torch thread each). The weights are plain and replicated (no ZeRO / FSDP)
in every system, so the systems differ only in what they keep per token:

    alst     DeepSpeed 0.19.x ALST, wired as ArcticTraining / HF do it (``DS_ACCELERATOR=cpu``):
             ``UlyssesSPAttentionHF.register_with_transformers`` (Ulysses attention on the model's
             SDPA key), ``UlyssesSPDataLoaderAdapter`` (shift labels, shard), DeepSpeed's ``TiledMLP``
             as every decoder layer's MLP forward (the docstring's ``tiled_mlp_forward``: shards agreed
             by an all-reduce MAX), ``model.model(...)`` + ``TiledFusedLogitsLoss`` for lm_head + loss
             (ArcticTraining's ``fused_logits_loss_fn``, ``output_reduction="sum"``, then the differentiable
             token-weighted all-gather aggregation of the SP group's losses), and non-reentrant
             activation checkpointing of every decoder layer.
    ours     ``UlyssesSPConfig(sp_size=2, tiled_loss_tokens=T1, tiled_mlp_tokens=T2,
             offload_activations=True, recompute_norms=True, sp_head_chunks=C)``, C = heads per rank
             (one head per chunk, ``--head-chunks``), checkpointing, ``sp.shard`` + ``sp.forward_loss``
             (long_sequence.py's path). The attention modules run as head blocks (``sp_head_blocks``,
             default): q/k/v projections, RoPE, attention and o_proj one chunk of heads at a time; the
             RMSNorms save only their input (``recompute_norms``).
    ours_calls  the same with ``sp_head_blocks=False``: only the attention call is chunked.
    ours_c1  the same with ``sp_head_chunks=1``: the head chunking's own effect.

Both systems tile the MLP and the loss at the SAME token counts (``--mlp-tile``, ``--loss-tile``).
ALST's own defaults would be MLP shards of ``hidden_size`` tokens (= 256 here, the default
``--mlp-tile``) and loss shards of ~1 GiB of fp32 logits, i.e. ONE shard (no tiling) at every
length this machine reaches; we pass the same loss tile as ours instead, so neither is handicapped.
ALST's checkpoint offload to CPU (ArcticTraining's ``activation_checkpoint_cpu_offload``) and our
``offload_activations`` are moot here: on a CPU-only machine host memory IS device memory, so
offloading cannot lower the measured peak (ours keeps it on; ALST's is not enabled).

Search (per system): S (a multiple of 128) doubles from ``--start`` while the step's max-over-ranks
peak fits ``--budget-mib``, then bisects between the last fit and the first miss until they are
within ``--tolerance`` (3%). Every trial is fresh processes: build, a warm-up step at 256 tokens
(lazy inits, thread pools), then the measured step. Peak per rank = ``VmHWM`` of the step (reset
via ``/proc/self/clear_refs``) minus the RSS just before it, glibc serving allocations >= 64 KiB by
mmap so freed tensors leave the RSS (as long_sequence.py): activations, saved tensors, temporaries,
collective buffers and the gradients (SGD has no state); not the weights. ``fwd`` = the same up
to the end of the forward + loss (for ALST that includes lm_head's backward, which
``TiledFusedLogitsLoss`` runs inside its forward).

Check: at ``--check-seq-len`` all systems run the same weights and batch; the losses must agree
to rel 1e-4 (fp32, different reduction orders) and the gradient norms (lm_head, embeddings, the
decoder layers) are printed side by side.

    timeout 1500 .venv/bin/python benchmarks/alst_longest.py --out benchmarks/results/issue23_longest_cpu.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import types

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before the fork server starts: see docstring
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_ablation  # noqa: E402  (its rss_kib, memory_mark / memory_peak)

SYSTEMS = ("alst", "ours", "ours_calls", "ours_c1")
GRANULE = 128  # 2 ranks x 64
WARMUP_LEN = 256
LOSS_RTOL = 1e-4  # fp32; the systems sum the same token losses in different orders and tiles


def model_config(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.hidden // args.heads, max_position_embeddings=1 << 21, tie_word_embeddings=False,
                use_cache=False)


def _model(cfg: dict):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg, attn_implementation="sdpa"))
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _ids(cfg: dict, seq_len: int) -> torch.Tensor:
    """``(1, S)`` token ids, the same on every rank and in every system."""
    return torch.randint(1, cfg["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(seq_len))


def _average_grads(model, group) -> None:
    """DDP-style averaging over the SP group, in place per parameter (no flat buffer: same for all systems)."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dist.get_world_size(group))


def _grad_norms(model) -> dict:
    """Gradient norms of the parts whose scaling differs between loss paths (lm_head) and the rest."""
    norm = lambda ps: float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ps)))  # noqa: E731
    layers = [p for p in model.model.layers.parameters()]
    return {"lm_head": norm([model.lm_head.weight]), "embed": norm([model.model.embed_tokens.weight]),
            "layers": norm(layers)}


class _Alst:
    """DeepSpeed ALST: its Ulysses attention, data adapter, TiledMLP and TiledFusedLogitsLoss."""

    def __init__(self, model, args) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        self.model, self.args, self.world = model, args, dist.get_world_size()
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=self.world,
            micro_batch_size=1, seq_length_is_variable=True)
        self.group = self.mpu.get_sequence_parallel_group()
        group, tile = self.group, args.mlp_tile

        def tiled_mlp_forward(mlp, x):  # TiledMLP's docstring example, per instance, tile from --mlp-tile
            num_shards = torch.tensor(math.ceil(x.shape[-2] / tile), device=x.device)
            dist.all_reduce(num_shards, op=dist.ReduceOp.MAX, group=group)  # all ranks agree (deadlock-free)
            compute_params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]

            def mlp_fn(self, x):
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

            return TiledMLP.apply(mlp_fn, mlp, x, int(num_shards.item()), compute_params)

        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(tiled_mlp_forward, layer.mlp)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def _batch(self, ids: torch.Tensor) -> dict:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        row = {"input_ids": ids[0], "labels": ids[0], "position_ids": torch.arange(ids.shape[1])}
        loader = torch.utils.data.DataLoader([row], batch_size=1)
        adapter = UlyssesSPDataLoaderAdapter(loader, self.mpu.get_sequence_parallel_rank(), self.group, self.world,
                                             ids.device)
        return next(iter(adapter))  # every rank holds the same batch: micro-batch 0 is it, sharded

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """ArcticTraining's SFT loss under SP, with TiledFusedLogitsLoss at ``--loss-tile`` tokens per shard."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        batch = self._batch(ids)
        shift_labels = batch.pop("shift_labels")
        model = self.model
        hidden_states = model.model(**batch, use_cache=False).last_hidden_state
        num_shards = math.ceil(shift_labels.shape[1] / self.args.loss_tile)

        def fused_logits_loss_fn(model_with_head, hidden_states, shift_labels):
            logits = model_with_head.lm_head(hidden_states)
            if (shift_labels == -100).all():
                return (logits.sum() * 0.0).float()
            good_items = (shift_labels != -100).sum()
            vocab_size = model_with_head.config.vocab_size
            loss = model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab_size,
                                                 shift_labels=shift_labels)
            return loss * good_items

        total_loss_sum = TiledFusedLogitsLoss.apply(fused_logits_loss_fn, model, hidden_states, shift_labels, None,
                                                    num_shards, [model.lm_head.weight], "sum")
        loss = total_loss_sum / (shift_labels != -100).sum()
        # differentiable weighted per-shard-loss aggregation across ranks (as deepspeed_step / ArcticTraining)
        losses = torch.distributed.nn.functional.all_gather(loss, group=self.group)
        good = (shift_labels != -100).view(-1).sum()
        goods = torch.distributed.nn.functional.all_gather(good, group=self.group)
        return sum(losses[r] * goods[r] for r in range(self.world)) / sum(goods)

    def report(self, loss: torch.Tensor) -> float:
        return float(loss.detach())


class _Ours:
    """ulysses_sp with every memory feature, plain replicated weights (long_sequence.py's _Sharded without FSDP)."""

    def __init__(self, model, args, head_chunks: int, head_blocks: bool = True) -> None:
        import torch.distributed as dist

        from ulysses_sp import SPMesh, UlyssesSP, UlyssesSPConfig

        self.model, self.world = model, dist.get_world_size()
        self.mesh = SPMesh.from_world(self.world)
        self.group = self.mesh.sp_group
        config = UlyssesSPConfig(sp_size=self.world, tiled_loss_tokens=args.loss_tile, tiled_mlp_tokens=args.mlp_tile,
                                 offload_activations=True, recompute_norms=True, sp_head_chunks=head_chunks,
                                 sp_head_blocks=head_blocks)
        self.sp = UlyssesSP(model, self.mesh, config).register()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        from ulysses_sp import global_num_items

        shard = self.sp.shard({"input_ids": ids})
        return self.sp.forward_loss(self.model, shard, global_num_items(shard["shift_labels"], group=self.group))

    def report(self, loss: torch.Tensor) -> float:
        from ulysses_sp import reported_loss

        return float(reported_loss(loss.detach(), self.world, group=self.group))


def _step(runner, cfg: dict, seq_len: int, grads: bool) -> dict:
    """One training step; ``fwd_kib``: VmHWM after forward + loss (the caller reset it before)."""
    loss = runner.loss(_ids(cfg, seq_len))
    fwd_kib = memory_ablation.rss_kib("VmHWM")
    loss.backward()
    _average_grads(runner.model, runner.group)
    info = {"loss": runner.report(loss), "fwd_kib": fwd_kib, **({"grads": _grad_norms(runner.model)} if grads else {})}
    runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=True)
    return info


def trial_worker(rank: int, world: int, system: str, seq_len: int, args, out_dir: str, grads: bool) -> None:
    """One trial on one rank: build, wire the system, warm up, measure one step, write ``rank<r>.json``."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn.functional.all_gather
    torch.set_num_threads(1)
    cfg = model_config(args)
    model = _model(cfg)
    if system == "alst":
        runner = _Alst(model, args)
    else:
        runner = _Ours(model, args, 1 if system == "ours_c1" else args.head_chunks, system != "ours_calls")
    if not grads:  # the check compares the FIRST step from identical weights: no warm-up update before it
        _step(runner, cfg, WARMUP_LEN, False)  # warm-up: lazy inits, thread pools, autograd/collective buffers
    base = memory_ablation.memory_mark(torch.device("cpu"))
    start = time.perf_counter()
    info = _step(runner, cfg, seq_len, grads)
    seconds = time.perf_counter() - start
    peak = memory_ablation.memory_peak(torch.device("cpu")) - base
    info["fwd_peak"] = info.pop("fwd_kib") * 1024 - base
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak": peak, "seconds": seconds, **info}, f)


def measure(system: str, seq_len: int, args, grads: bool = False) -> dict:
    """One trial in fresh processes: per-rank peaks, the slowest rank's step time, or the error."""
    from ulysses_sp import spawn

    t0 = time.time()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            spawn(trial_worker, 2, system, seq_len, args, out_dir, grads, timeout_s=args.timeout_s,
                  preload=["transformers", "transformers.models.llama.modeling_llama", "ulysses_sp",
                           "ulysses_sp.integrations.transformers", "deepspeed",
                           "deepspeed.runtime.sequence_parallel.ulysses_sp"])
        except Exception as e:  # noqa: BLE001  (an OOM kill, a timeout, a library error: reported, not hidden)
            text = str(e).strip()
            return {"error": f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}", "trace": text,
                    "wall": time.time() - t0}
        ranks = []
        for r in range(2):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return {"peaks": [r["peak"] for r in ranks], "peak": max(r["peak"] for r in ranks),
            "fwd_peak": max(r["fwd_peak"] for r in ranks), "seconds": max(r["seconds"] for r in ranks),
            "wall": time.time() - t0, "loss": ranks[0]["loss"], "grads": ranks[0].get("grads")}


def _describe(system: str, s: int, m: dict, budget: int) -> str:
    if "error" in m:
        return f"  {system:<8} S={s:>6}  FAILED after {m['wall']:.0f}s: {m['error']}"
    peaks = " / ".join(f"{p / 2**20:.1f}" for p in m["peaks"])
    return (f"  {system:<8} S={s:>6}  peak/rank {peaks} MiB (fwd {m['fwd_peak'] / 2**20:.1f})  "
            f"{m['peak'] / 2**10 / (s // 2):.2f} KiB/local token  step {m['seconds']:.1f}s  "
            f"loss {m['loss']:.6f}  {'fits' if m['peak'] <= budget else 'OVER'}")


def longest(system: str, args, budget: int, log) -> tuple[int, dict]:
    """Double from ``--start`` while it fits (halve if the start does not), then bisect to ``--tolerance``."""
    trials: dict[int, dict] = {}

    def fits(s: int) -> bool:
        trials[s] = m = measure(system, s, args)
        log(_describe(system, s, m, budget))
        if "error" in m and "Killed" not in m["error"] and "signal" not in m["error"]:
            log("    " + "\n    ".join(m["trace"].splitlines()[-25:]))
        return "error" not in m and m["peak"] <= budget

    lo, hi, s = 0, 0, args.start
    if fits(s):
        lo = s
        while 2 * lo <= args.max_seq_len and fits(2 * lo):
            lo *= 2
        hi = 2 * lo if 2 * lo <= args.max_seq_len else 0
    else:
        hi = s
        while hi > GRANULE:
            s = max(GRANULE, hi // 2 // GRANULE * GRANULE)
            if fits(s):
                lo = s
                break
            hi = s
    while lo and hi and hi - lo > GRANULE and hi > lo * (1 + args.tolerance):
        mid = (lo + hi) // 2 // GRANULE * GRANULE
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, trials.get(lo, {})


def check(args, log) -> list[str]:
    """Same weights, same batch, one step at ``--check-seq-len``: the losses (rel 1e-4) and gradient norms."""
    s, out = args.check_seq_len, []
    results = {system: measure(system, s, args, grads=True) for system in args.systems}
    ref_sys = "ours" if "ours" in results else args.systems[0]
    ref = results[ref_sys]
    for system, m in results.items():
        if "error" in m:
            out.append(f"  check S={s}: {system} FAILED: {m['error']}")
            log(out[-1])
            log("    " + "\n    ".join(m["trace"].splitlines()[-25:]))
            continue
        rel = abs(m["loss"] - ref["loss"]) / abs(ref["loss"]) if "error" not in ref else float("nan")
        g, g0 = m["grads"], ref["grads"]
        norms = "  ".join(f"{k} {g[k]:.5e} (x{g[k] / g0[k]:.4f})" for k in g)
        out.append(f"  check S={s}: {system:<8} loss {m['loss']:.7f}  rel diff vs {ref_sys} {rel:.1e} "
                   f"({'agree' if rel <= LOSS_RTOL else 'DISAGREE'} at {LOSS_RTOL:g});  grad norms (x vs {ref_sys}): "
                   f"{norms}")
        log(out[-1])
        if system == "alst" and "error" not in ref and abs(g["lm_head"] / g0["lm_head"] - 1) > 1e-3:
            ratio = g["lm_head"] / g0["lm_head"]
            out.append(f"  NOTE: alst's lm_head gradient is x{ratio:.1f} {ref_sys}'s, (S-1)/P = "
                       f"{(s - 1) / 2:.1f}: TiledFusedLogitsLoss accumulates lm_head's gradient INSIDE its forward "
                       f"with incoming gradient 1 and its backward rescales only x's gradient by the real incoming "
                       f"gradient "
                       f"(here P / global tokens, from ArcticTraining's '/ good_items' + SP aggregation). Same loss, "
                       f"same memory; the other gradients agree.")
            log(out[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--budget-mib", type=float, default=64.0, help="per-rank step-memory budget")
    parser.add_argument("--start", type=int, default=4096, help="first S of the doubling (multiple of 128)")
    parser.add_argument("--max-seq-len", type=int, default=1 << 17, help="the doubling stops here")
    parser.add_argument("--tolerance", type=float, default=0.03, help="the bisection stops within this fraction")
    parser.add_argument("--loss-tile", type=int, default=256, help="tokens per lm_head + loss tile (both systems)")
    parser.add_argument("--mlp-tile", type=int, default=256, help="tokens per MLP tile (both systems)")
    parser.add_argument("--head-chunks", type=int, help="ours: sp_head_chunks (default: heads per rank)")
    parser.add_argument("--check-seq-len", type=int, default=2048, help="S of the loss / gradient agreement check")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout of one trial")
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    if args.start % GRANULE:
        parser.error(f"--start must be a multiple of {GRANULE}")
    args.head_chunks = args.head_chunks or args.heads // 2
    budget = int(args.budget_mib * 2**20)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    command = ("timeout 1500 .venv/bin/python benchmarks/alst_longest.py "
               + " ".join(sys.argv[1:] if argv is None else argv))
    import deepspeed
    import transformers

    load_start, t0 = os.getloadavg(), time.time()
    log(f"model {model_config(args)}; fp32; SDPA; P=2 gloo, 1 thread per rank; budget {args.budget_mib:g} MiB per "
        f"rank; loss tile {args.loss_tile}, MLP tile {args.mlp_tile} tokens (both systems); ours: recompute_norms, sp_head_chunks="
        f"{args.head_chunks} (head blocks; ours_calls: attention calls only), ours_c1: 1; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"deepspeed {deepspeed.__version__}")
    log("offload: moot on this CPU-only machine (host = device); ours keeps offload_activations=True, ALST's "
        "checkpoint offload is not enabled")
    log(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)}")
    check(args, log)
    results = {}
    for system in args.systems:
        results[system] = longest(system, args, budget, log)
    load_end = os.getloadavg()
    log(f"load average at end: {' '.join(f'{x:.2f}' for x in load_end)}; total {time.time() - t0:.0f} s")

    base = results.get("alst", (0, {}))[0]
    table = ["| system | longest S | tokens / rank | peak MiB per rank (r0 / r1) | fwd peak MiB | step s | loss "
             "| vs alst |",
             "|---|---|---|---|---|---|---|---|"]
    for system, (length, m) in results.items():
        if not length:
            table.append(f"| {system} | none fitted | | | | | | |")
            continue
        ratio = f"{length / base:.2f}x" if base else ""
        table.append(f"| {system} | {length} | {length // 2} | {' / '.join(f'{p / 2**20:.1f}' for p in m['peaks'])} | "
                     f"{m['fwd_peak'] / 2**20:.1f} | {m['seconds']:.1f} | {m['loss']:.4f} | {ratio} |")
    for line in ["", *table]:
        log(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Longest S within {args.budget_mib:g} MiB per rank: DeepSpeed ALST vs ulysses_sp (P=2, CPU)\n\n"
                    f"```\n$ {command}\n" + "\n".join(lines) + "\n```\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
