"""``ulysses-sp plan``: predicted peak memory per rank and the settings that fit a budget.

    ulysses-sp plan --model llama-3-8b --seq-len 131072 --sp-size 8 --budget-gib 80
    ulysses-sp plan --model ./my_model_dir --seq-len 32768 --sp-size 2 --budget-gib 24 --dtype bfloat16

Prints, for each feature set of the ladder (checkpointing -> + tiled loss -> + tiled MLP ->
+ offload), the predicted peak of one step (activations + grads), the static memory (weights,
optimizer states), whether it fits, and the longest sequence that fits; then recommends the
first (cheapest) feature set that fits. Predictions come from
:func:`ulysses_sp.estimate_peak_memory` (see ``docs/memory.md`` for its terms and
its measured accuracy).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

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
    parser.add_argument("--model", required=True, help=f"a local model directory (config.json) or a preset: {', '.join(PRESETS)}")
    parser.add_argument("--seq-len", type=int, required=True, help="global tokens per sequence (S)")
    parser.add_argument("--sp-size", type=int, default=1, help="Ulysses SP degree (P)")
    parser.add_argument("--budget-gib", type=float, required=True, help="memory per rank (GiB)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "none"), help="count Adam states as static memory")
    parser.add_argument("--state-shards", type=int, default=1,
                        help="ranks sharding weights/grads/optimizer (ZeRO-3 / FSDP); 1 = replicated")
    parser.add_argument("--loss-tile", type=int, default=1024, help="tokens per tile of the tiled loss")
    parser.add_argument("--mlp-tile", type=int, default=4096, help="tokens per tile of the tiled MLP")
    parser.add_argument("--cpu", action="store_true", help="the device is the CPU (offload frees nothing)")


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


def check_support(name: str, config: Any, sp_size: int) -> None:
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
    check_model_support(model, UlyssesSPConfig(sp_size=sp_size))


def ladder(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from ulysses_sp import MemoryFeatures

    base = dict(checkpointing=True, host_is_device=args.cpu)
    return [
        ("checkpointing", MemoryFeatures(**base)),
        ("+ tiled loss", MemoryFeatures(**base, tiled_loss_tokens=args.loss_tile)),
        ("+ tiled MLP", MemoryFeatures(**base, tiled_loss_tokens=args.loss_tile, tiled_mlp_tokens=args.mlp_tile)),
        ("+ offload", MemoryFeatures(**base, tiled_loss_tokens=args.loss_tile, tiled_mlp_tokens=args.mlp_tile, offload=True)),
    ]


def run(args: argparse.Namespace) -> int:
    from ulysses_sp import estimate_peak_memory, longest_sequence

    for name in ("seq_len", "sp_size", "batch_size", "state_shards", "loss_tile", "mlp_tile"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0 < args.budget_gib < float("inf"):  # also NaN
        raise ValueError(f"--budget-gib must be a positive number of GiB per rank, got {args.budget_gib}.")
    config = load_config(args.model)
    check_support(args.model, config, args.sp_size)
    budget = int(args.budget_gib * 2**30)
    kw = dict(batch_size=args.batch_size, optimizer=args.optimizer, state_shards=args.state_shards)
    gib = 2**30
    print(f"{args.model}: S={args.seq_len}, P={args.sp_size}, {args.dtype}, batch {args.batch_size}, "
          f"budget {args.budget_gib:g} GiB per rank")
    print(f"{'features':<15} {'step peak':>10} {'static':>8} {'total':>8}  {'fits':<4} {'peak phase':<10} "
          f"{'host (offload)':>14} {'longest S that fits':>20}")
    recommended = None
    for label, features in ladder(args):
        b = estimate_peak_memory(config, args.seq_len, args.sp_size, args.dtype, features, **kw)
        fits = b.total_bytes <= budget
        longest = longest_sequence(config, args.sp_size, args.dtype, features, budget, **kw)
        print(f"{label:<15} {b.peak_bytes / gib:9.2f}G {b.static_bytes / gib:7.2f}G {b.total_bytes / gib:7.2f}G  "
              f"{'yes' if fits else 'no':<4} {b.phase:<10} {b.host_bytes / gib:13.2f}G {longest:>20}")
        if fits and recommended is None:
            recommended = label
    if recommended is None:
        print(f"nothing fits S={args.seq_len}: raise --sp-size, shard states (--state-shards) or shorten the sequence.")
        return 1
    print(f"recommended: {recommended} (the first rung of the ladder that fits; later rungs cost more compute)")
    return 0
