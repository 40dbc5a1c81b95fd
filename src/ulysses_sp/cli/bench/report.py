"""Turn benchmark records into a markdown report, a scaling table and PNG plots."""

from __future__ import annotations

import os
from collections.abc import Sequence

MiB = 1024 * 1024


def _key(r: dict) -> tuple:
    return r["seq_len"], r["sp_size"], r["system"]


def _find(records: Sequence[dict], system: str, P: int, S: int) -> dict | None:
    return next((r for r in records if r["system"] == system and r["sp_size"] == P and r["seq_len"] == S), None)


# fp32 steps differ only in summation order (~1e-7 relative per op over a few layers): 1e-4 is far
# above that and far below any real bug (wrong mask, missing tokens). bf16 rounds every op to
# 8 mantissa bits (eps 3.9e-3), so different shardings may differ by a few eps: 2e-2.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


def check_records(records: Sequence[dict], bytes_rtol: float = 0.05) -> list[str]:
    """Problems worth a failing exit code: losses that differ from one process, bytes off the formula, wrong counts."""
    problems = []
    records = [r for r in records if r.get("mode") != "paired"]
    for r in records:
        loss_rtol = LOSS_RTOL.get(r.get("dtype", "float32"), 2e-2)
        name = f"{r['system']} P={r['sp_size']} S={r['seq_len']}"
        ref = _find(records, "single", 1, r["seq_len"]) or next(
            (x for x in records if x["seq_len"] == r["seq_len"] and x["system"] == "ulysses"), None)
        if ref is not None and abs(r["loss"] - ref["loss"]) > loss_rtol * abs(ref["loss"]):
            problems.append(f"{name}: loss {r['loss']} != {ref['system']} {ref['loss']}")
        formula = r["formula_bytes_sent_per_rank"]
        if abs(r["bytes_sent_per_rank"] - formula) > bytes_rtol * max(formula, 1):
            problems.append(f"{name}: {r['bytes_sent_per_rank']} bytes vs formula {formula}")
        if r["sp_size"] > 1 and r["collectives_per_layer"] != r["formula_collectives_per_layer"]:
            problems.append(f"{name}: {r['collectives_per_layer']} collectives "
                            f"per layer vs {r['formula_collectives_per_layer']}")
    return problems


def markdown(records: Sequence[dict], command: str = "") -> str:
    """The full report: machine, model, per-configuration table, scaling table, formulas."""
    records = [r for r in records if r.get("mode") != "paired"]
    if not records:
        return "no records\n"
    first = records[0]
    m, spec = first["machine"], first["model"]
    lines = ["# ulysses-sp bench", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Machine: {m['platform']}, {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}"
        + (f", GPU {m['gpu']} x{m['gpu_count']}" if "gpu" in m else "")
        + f"; 1-min load average at start {m['load_average_1min']:.1f}.",
        f"Model: Llama, {spec['num_hidden_layers']} layers, hidden {spec['hidden_size']}, "
        f"N={spec['num_attention_heads']} "
        f"query / K={spec['num_key_value_heads']} kv heads of H={spec['head_dim']}, vocab {spec['vocab_size']}, "
        f"{first['num_params'] / 1e6:.2f}M parameters, {first['dtype']}, batch {first['batch_size']}.",
        f"Step: forward + loss + backward + SP gradient average + SGD; median of {first['repeats']} steps after "
        f"{first['warmup']} warm-up; time of the slowest rank. Memory: peak over the run minus the resident size "
        "before the first step (CPU: VmHWM - VmRSS; CUDA: max_memory_allocated - allocated), max over ranks.",
        "Bytes: sent by one rank per attention layer per step (forward + backward), counted by wrapping the "
        "torch.distributed calls; formula in the last column.",
        "",
        "| S | P | system | median (min) step s | step / ulysses step | peak MiB | attn bytes/layer | formula "
        "| meas/formula "
        "| collectives/layer fwd (bwd) | loss | formula |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=_key):
        ours = _find(records, "ulysses", r["sp_size"], r["seq_len"])
        if r["system"] == "single":
            ratios = [f"P={u['sp_size']}: {r['median_step_seconds'] / u['median_step_seconds']:.2f}"
                      for u in sorted(records, key=_key) if u["system"] == "ulysses" and u["seq_len"] == r["seq_len"]]
            speed = ", ".join(ratios) or "-"
        else:
            speed = f"{r['median_step_seconds'] / ours['median_step_seconds']:.2f}" if ours else "-"
        f = r["formula_bytes_sent_per_rank"]
        lines.append(
            f"| {r['seq_len']} | {r['sp_size']} | {r['system']} | {r['median_step_seconds']:.3f} "
            f"({r.get('min_step_seconds', r['median_step_seconds']):.3f}) | {speed} "
            f"| {r['peak_memory_bytes'] / MiB:.0f} | {r['bytes_sent_per_rank']:,} | {f:,} "
            f"| {(r['bytes_sent_per_rank'] / f if f else 1.0):.3f} "
            f"| {r['collectives_per_layer']:g} ({r['collectives_per_layer_backward']:g}) | {r['loss']:.6f} "
            f"| {r['formula']} |"
        )
    lines += ["", *scaling_table(records)]
    problems = check_records(records)
    lines += ["", "Checks (loss vs one process, bytes within 5% of the formula, collectives per layer): "
              + ("all pass." if not problems else "; ".join(problems))]
    return "\n".join(lines) + "\n"


def scaling_table(records: Sequence[dict]) -> list[str]:
    """Median step seconds: one row per S, one column per (system, P)."""
    cols = sorted({(r["system"], r["sp_size"]) for r in records}, key=lambda c: (c[1], c[0]))
    lens = sorted({r["seq_len"] for r in records})
    lines = ["Scaling (median step seconds; peak MiB in brackets):", "",
             "| S | " + " | ".join(f"{s} P={p}" for s, p in cols) + " |", "|---|" + "---|" * len(cols)]
    for S in lens:
        cells = []
        for s, p in cols:
            r = _find(records, s, p, S)
            cells.append(f"{r['median_step_seconds']:.3f} ({r['peak_memory_bytes'] / MiB:.0f})" if r else "-")
        lines.append(f"| {S} | " + " | ".join(cells) + " |")
    return lines


def plots(records: Sequence[dict], out_dir: str) -> list[str]:
    """PNG plots of step time, peak memory and attention bytes against S, one line per (system, P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    records = [r for r in records if r.get("mode") != "paired"]
    paths = []
    series = sorted({(r["system"], r["sp_size"]) for r in records}, key=lambda c: (c[0], c[1]))
    for field, label, scale, name in [
        ("median_step_seconds", "median step time (s)", 1.0, "step_time.png"),
        ("peak_memory_bytes", "peak memory per rank (MiB)", 1 / MiB, "peak_memory.png"),
        ("bytes_sent_per_rank", "attention bytes sent per rank per layer (MiB)", 1 / MiB, "bytes_sent.png"),
    ]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for system, P in series:
            rows = sorted((r for r in records if r["system"] == system and r["sp_size"] == P),
                          key=lambda r: r["seq_len"])
            ax.plot([r["seq_len"] for r in rows], [r[field] * scale for r in rows], marker="o", label=f"{system} P={P}")
        ax.set_xlabel("global sequence length S")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
