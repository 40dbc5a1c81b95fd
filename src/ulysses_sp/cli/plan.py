"""``ulysses-sp plan``: predicted peak memory per rank and the settings that fit a budget.

    ulysses-sp plan --model llama-3-8b --seq-len 131072 --sp-size 8 --budget-gib 80 --state-shards 8
    ulysses-sp plan --model llama-3-8b --seq-len 3700000 --sp-size 8 --budget-gib 80 --state-shards 8 \
        --offload-optimizer --host-gib 237 --json          # ALST's one-node configuration
    ulysses-sp plan --model ./my_model_dir --seq-len 32768 --sp-size 2 --budget-gib 24 --dtype bfloat16

Prints, for each feature set of the ladder (checkpointing -> + tiled loss -> + tiled MLP ->
+ offload -> + head chunks -> + head blocks when P > 1: ``sp_head_chunks`` with ``sp_head_blocks``
False / True, the attention call / the whole attention module one chunk of heads at a time), the
predicted peak of one step (activations + grads), the static memory (weights,
optimizer states), the device bytes to budget, the host bytes per rank (offloaded activations,
optimizer, weights), whether it fits, and the longest sequence that fits; then recommends the
first (cheapest) feature set that fits. ``--json`` prints the same as one JSON record.

What real long runs use is an option: sharded weights / grads / optimizer states
(``--state-shards``: ZeRO-3 / FSDP2 over that many ranks), optimizer offload to CPU
(``--offload-optimizer``: CPU Adam, fp32 master weights and gradients in host memory), weight
offload (``--offload-params``), activation offload (the last rung) and ``--host-gib``, the host
memory one rank may use (offloads that exceed it do not fit). The device bytes are
``peak * --peak-scale + static + --reserve-gib``. GPU defaults (1.25 and 1 GiB) reproduce ALST's
three published Llama-8B runs on H100s within 3% (``docs/memory.md``: fitted to them, in-sample);
with ``--cpu`` the defaults are 1.0 and 0, the modelled terms only (the CPU calibration of
``benchmarks/memory_ablation.py``). Refuses what ``train`` refuses (a model that
cannot run with this ``--sp-size``, with the same message), and budgets that are not positive
finite numbers. Predictions come from :func:`ulysses_sp.estimate_peak_memory`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# what the modelled terms leave out on H100s (allocator, kernel temporaries; CUDA context, NCCL):
# fitted to ALST's three published Llama-8B runs (docs/memory.md)
ALST_PEAK_SCALE, ALST_RESERVE_GIB = 1.25, 1.0

# name -> config fields (public model cards' config.json values)
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, vocab_size=128256, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, vocab_size=128256, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, vocab_size=128256, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, vocab_size=152064, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128),
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, vocab_size=32000, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                         num_experts_per_tok=2),
    # the model of benchmarks/memory_ablation.py
    "bench-tiny": dict(hidden_size=128, intermediate_size=344, vocab_size=32000, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"a local model directory (config.json) or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence (S)")
    parser.add_argument("--sp-size", type=int, default=1, help="Ulysses SP degree (P)")
    parser.add_argument("--sp-ring-size", type=int, default=None,
                        help="Ulysses x ring: ring degree (default: 1, or the smallest the head count needs); the "
                        "memory per rank is the same per token")
    parser.add_argument("--budget-gib", type=float, required=True, help="device memory per rank (GiB)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "none"),
                        help="count Adam states as static memory")
    parser.add_argument("--state-shards", type=int, default=1,
                        help="ranks sharding weights/grads/optimizer (ZeRO-3 / FSDP); 1 = replicated")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="optimizer states, fp32 master weights and grads in host memory (ZeRO-Offload, CPU Adam)")
    parser.add_argument("--offload-params", action="store_true",
                        help="weight partitions in host memory (ZeRO-3 offload_param)")
    parser.add_argument("--host-gib", type=float, default=None,
                        help="host memory one rank may use for offloads (GiB); default: not checked")
    parser.add_argument("--peak-scale", type=float, default=None,
                        help=f"device bytes = step peak * this + static + reserve; default {ALST_PEAK_SCALE} (with "
                             f"--reserve-gib {ALST_RESERVE_GIB:g}: ALST's H100 runs, docs/memory.md), 1.0 with --cpu")
    parser.add_argument("--reserve-gib", type=float, default=None,
                        help="device memory held before any tensor: CUDA context, NCCL, cuBLAS workspaces "
                             f"(default {ALST_RESERVE_GIB:g} GiB, 0 with --cpu)")
    parser.add_argument("--tiled-loss-tokens", "--loss-tile", dest="loss_tile", type=int, default=1024,
                        help="tokens per tile of the tiled loss (UlyssesSPConfig.tiled_loss_tokens)")
    parser.add_argument("--tiled-mlp-tokens", "--mlp-tile", dest="mlp_tile", type=int, default=4096,
                        help="tokens per tile of the tiled MLP (UlyssesSPConfig.tiled_mlp_tokens)")
    parser.add_argument("--sp-head-chunks", type=int, default=None,
                        help="head chunks of the last rung (UlyssesSPConfig.sp_head_chunks); default: one query head "
                             "a chunk (the most chunks, the least attention memory)")
    parser.add_argument("--cpu", action="store_true", help="the device is the CPU (offload frees nothing)")
    parser.add_argument("--json", action="store_true", help="print one JSON record instead of the table")


def load_config(name: str) -> Any:
    """A preset's fields, or the text config of a local model directory (no download)."""
    if name in PRESETS:
        return PRESETS[name]
    if os.path.isdir(name):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name, local_files_only=True).get_text_config()
    raise ValueError(f"--model {name!r} is neither a directory with a config.json nor a preset ({', '.join(PRESETS)}).")


# preset name -> transformers model_type (to apply the same model-support rule as train and UlyssesSP)
PRESET_TYPES = {"llama-3.2-1b": "llama", "llama-3-8b": "llama", "llama-3-70b": "llama", "qwen2.5-7b": "qwen2",
                "mixtral-8x7b": "mixtral", "bench-tiny": "llama"}


def check_support(name: str, config: Any, sp_size: int, sp_ring_size: int | None = None) -> None:
    """``ValueError`` with UlyssesSP's own message if the model cannot train with ``sp_size`` (meta device:
    no weights are allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_sp import UlyssesSPConfig, check_model_support

    if name in PRESETS:
        config = AutoConfig.for_model(PRESET_TYPES[name], **config)
    elif os.path.isdir(name):
        config = AutoConfig.from_pretrained(name, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_model_support(model, UlyssesSPConfig(sp_size=sp_size, sp_ring_size=sp_ring_size))


def ladder(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from ulysses_sp import MemoryFeatures

    base = dict(checkpointing=True, host_is_device=args.cpu, kernel_workspace=not args.cpu,
                offload_optimizer=args.offload_optimizer, offload_params=args.offload_params)
    tiles = dict(tiled_loss_tokens=args.loss_tile, tiled_mlp_tokens=args.mlp_tile)
    chunks = args.sp_head_chunks or 1 << 16
    return [
        ("checkpointing", MemoryFeatures(**base)),
        ("+ tiled loss", MemoryFeatures(**base, tiled_loss_tokens=args.loss_tile)),
        ("+ tiled MLP", MemoryFeatures(**base, **tiles)),
        ("+ offload", MemoryFeatures(**base, **tiles, offload=True)),
        *([("+ head chunks", MemoryFeatures(**base, **tiles, offload=True, head_chunks=chunks, head_blocks=False)),
           ("+ head blocks", MemoryFeatures(**base, **tiles, offload=True, head_chunks=chunks))]
          if args.sp_size > 1 else []),
    ]


def _check_numbers(args: argparse.Namespace) -> None:
    """``ValueError`` for a count below 1 or a memory size that is not a positive finite number."""
    if args.sp_head_chunks is not None and args.sp_head_chunks < 1:
        raise ValueError(f"--sp-head-chunks must be >= 1, got {args.sp_head_chunks}.")
    for name in ("seq_len", "sp_size", "batch_size", "state_shards", "loss_tile", "mlp_tile"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0 < args.budget_gib < float("inf"):  # also NaN
        raise ValueError(f"--budget-gib must be a positive number of GiB per rank, got {args.budget_gib}.")
    if args.host_gib is not None and not 0 < args.host_gib < float("inf"):
        raise ValueError(f"--host-gib must be a positive number of GiB per rank, got {args.host_gib}.")
    if args.peak_scale is None:
        args.peak_scale = 1.0 if args.cpu else ALST_PEAK_SCALE
    if args.reserve_gib is None:
        args.reserve_gib = 0.0 if args.cpu else ALST_RESERVE_GIB
    if not 1 <= args.peak_scale < float("inf"):
        raise ValueError(f"--peak-scale must be a finite number >= 1, got {args.peak_scale}.")
    if not 0 <= args.reserve_gib < float("inf"):
        raise ValueError(f"--reserve-gib must be a finite number >= 0, got {args.reserve_gib}.")


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The record ``--json`` prints: the settings and, per rung, the prediction and the longest S."""
    from ulysses_sp import estimate_peak_memory, longest_sequence

    _check_numbers(args)
    config = load_config(args.model)
    check_support(args.model, config, args.sp_size, args.sp_ring_size)
    scale, reserve = args.peak_scale, int(args.reserve_gib * 2**30)
    budget = int(args.budget_gib * 2**30)
    host_budget = int(args.host_gib * 2**30) if args.host_gib is not None else None
    kw = dict(batch_size=args.batch_size, optimizer=args.optimizer, state_shards=args.state_shards)
    rungs = []
    for label, features in ladder(args):
        b = estimate_peak_memory(config, args.seq_len, args.sp_size, args.dtype, features, **kw)
        required = b.required_bytes(scale, reserve)
        fits = required <= budget and (host_budget is None or b.host_bytes <= host_budget)
        longest = longest_sequence(config, args.sp_size, args.dtype, features, budget, host_budget_bytes=host_budget,
                                   peak_scale=scale, reserve_bytes=reserve, **kw)
        rungs.append({"features": label, "step_peak_bytes": b.peak_bytes, "static_bytes": b.static_bytes,
                      "required_bytes": required, "host_bytes": b.host_bytes, "fits": fits, "peak_phase": b.phase,
                      "longest_seq_len": longest})
    settings = {k: getattr(args, k) for k in ("model", "seq_len", "sp_size", "budget_gib", "host_gib", "dtype",
                                              "batch_size", "optimizer", "state_shards", "offload_optimizer",
                                              "offload_params", "loss_tile", "mlp_tile", "sp_head_chunks", "cpu")}
    settings.update(peak_scale=scale, reserve_gib=reserve / 2**30)
    recommended = next((r["features"] for r in rungs if r["fits"]), None)
    return {**settings, "rungs": rungs, "recommended": recommended}


def run(args: argparse.Namespace) -> int:
    record = plan(args)
    if args.json:
        print(json.dumps(record, indent=1))
        return 0 if record["recommended"] else 1
    gib = 2**30
    host = "not checked" if args.host_gib is None else f"host {args.host_gib:g} GiB per rank"
    print(f"{args.model}: S={args.seq_len}, P={args.sp_size}, {args.dtype}, batch {args.batch_size}, "
          f"budget {args.budget_gib:g} GiB per rank ({host}); device = peak x {record['peak_scale']:g} + static + "
          f"{record['reserve_gib']:g} GiB")
    print(f"{'features':<15} {'step peak':>10} {'static':>8} {'device':>8} {'host':>8}  {'fits':<4} {'peak phase':<10} "
          f"{'longest S that fits':>20}")
    for r in record["rungs"]:
        print(f"{r['features']:<15} {r['step_peak_bytes'] / gib:9.2f}G {r['static_bytes'] / gib:7.2f}G "
              f"{r['required_bytes'] / gib:7.2f}G {r['host_bytes'] / gib:7.2f}G  {'yes' if r['fits'] else 'no':<4} "
              f"{r['peak_phase']:<10} {r['longest_seq_len']:>20}")
    if record["recommended"] is None:
        print(f"nothing fits S={args.seq_len}: raise --sp-size, shard states (--state-shards), offload the optimizer "
              "(--offload-optimizer) or shorten the sequence"
              + ("" if args.host_gib is None else "; or allow more --host-gib") + ".")
        return 1
    print(f"recommended: {record['recommended']} "
          "(the first rung of the ladder that fits; later rungs cost more compute)")
    return 0
