"""Turn benchmark records into rows printed as they come, a markdown report, a scaling table and PNG plots.

Also the time budget of a run (``Budget``): which configurations still fit.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence

MiB = 1024 * 1024


def _key(r: dict) -> tuple:
    return r["seq_len"], r["sp_size"], r["system"]


def _find(records: Sequence[dict], system: str, P: int, S: int, documents: int = 1) -> dict | None:
    return next((r for r in records if r["system"] == system and r["sp_size"] == P and r["seq_len"] == S
                 and r.get("documents", 1) == documents), None)


# fp32 steps differ only in summation order (~1e-7 relative per op over a few layers): 1e-4 is far
# above that and far below any real bug (wrong mask, missing tokens). bf16 rounds every op to
# 8 mantissa bits (eps 3.9e-3), so different shardings may differ by a few eps: 2e-2.
LOSS_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


def check_records(records: Sequence[dict], bytes_rtol: float = 0.05) -> list[str]:
    """Problems worth a failing exit code: losses that differ from one process, bytes off the formula, wrong counts."""
    problems = []
    for r in records:  # paired runs: each system against the one process of the same rounds
        rtol = LOSS_RTOL.get(r.get("dtype", "float32"), 2e-2)
        if "one_process_loss" in r and abs(r["loss"] - r["one_process_loss"]) > rtol * abs(r["one_process_loss"]):
            problems.append(f"paired {r['system']} P={r['sp_size']} S={r['seq_len']}: loss {r['loss']} != one "
                            f"process {r['one_process_loss']}")
    records = _isolated(records)
    for r in records:
        loss_rtol = LOSS_RTOL.get(r.get("dtype", "float32"), 2e-2)
        docs = r.get("documents", 1)
        name = f"{r['system']} P={r['sp_size']} S={r['seq_len']}" + (f" documents={docs}" if docs > 1 else "")
        ref = _find(records, "single", 1, r["seq_len"], docs) or next(
            (x for x in records if x["seq_len"] == r["seq_len"] and x["system"] == "ulysses"
             and x.get("documents", 1) == docs), None)
        if ref is not None and abs(r["loss"] - ref["loss"]) > loss_rtol * abs(ref["loss"]):
            problems.append(f"{name}: loss {r['loss']} != {ref['system']} {ref['loss']}")
        formula = r["formula_bytes_sent_per_rank"]
        if abs(r["bytes_sent_per_rank"] - formula) > bytes_rtol * max(formula, 1):
            problems.append(f"{name}: {r['bytes_sent_per_rank']} bytes vs formula {formula}")
        if r["sp_size"] > 1 and r["collectives_per_layer"] != r["formula_collectives_per_layer"]:
            problems.append(f"{name}: {r['collectives_per_layer']} collectives "
                            f"per layer vs {r['formula_collectives_per_layer']}")
    return problems


def _isolated(records: Sequence[dict]) -> list[dict]:
    return [r for r in records if r.get("mode") is None]


def _median_ratio(a: dict | None, b: dict | None) -> float | None:
    """Median over paired rounds of a's step / b's step (records of one paired run)."""
    if a is None or b is None:
        return None
    return statistics.median(x / y for x, y in zip(a["step_seconds"], b["step_seconds"]))


def vs_single(r: dict, records: Sequence[dict]) -> float | None:
    """One process's step / this system's step at the same S (> 1: faster than one process on the
    same cores); paired records: the median of the per-round ratios of their own run."""
    if r.get("mode") == "paired":
        return r.get("one_process_vs_system")
    single = _find(_isolated(records), "single", 1, r["seq_len"], r.get("documents", 1))
    return single["median_step_seconds"] / r["median_step_seconds"] if single else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


class LiveTable:
    """Rows printed as configurations finish, and the full report of what has been measured so far."""

    HEADER = ("| mode | S | P | system | median (min) step s | tokens/s | one process / system | step / ulysses step "
              "| peak MiB | attn bytes/layer (meas/formula) | collectives/layer fwd (bwd) | loss |")

    def __init__(self, command: str = "", out=None) -> None:
        self.command, self.out = command, out or sys.stdout

    def header(self) -> None:
        print(self.HEADER + "\n" + "|---" * self.HEADER.count("|", 1) + "|", file=self.out, flush=True)

    def rows(self, new: Sequence[dict], records: Sequence[dict]) -> None:
        for r in new:
            paired = r.get("mode") == "paired"
            if paired:
                group = [x for x in records if x.get("mode") == "paired" and _pair_key(x) == _pair_key(r)]
                ours = _median_ratio(r, next((x for x in group if x["system"] == "ulysses"), None))
            else:
                u = _find(_isolated(records), "ulysses", r["sp_size"], r["seq_len"])
                ours = r["median_step_seconds"] / u["median_step_seconds"] if u else None
            extra = "| - | - | - |" if paired else (
                f"| {r['peak_memory_bytes'] / MiB:.0f} | {r['bytes_sent_per_rank']:,} "
                f"({r['bytes_sent_per_rank'] / max(r['formula_bytes_sent_per_rank'], 1):.3f}) "
                f"| {r['collectives_per_layer']:g} ({r['collectives_per_layer_backward']:g}) |")
            print(f"| {'paired' if paired else 'isolated'} | {r['seq_len']} | {r['sp_size']} | {_system(r)} "
                  f"| {r['median_step_seconds']:.3f} ({r['min_step_seconds']:.3f}) | {r['tokens_per_second']:,.0f} "
                  f"| {_fmt(vs_single(r, records))} | {_fmt(ours)} {extra} {r['loss']:.6f} |",
                  file=self.out, flush=True)

    def report(self, records: Sequence[dict], skipped: Sequence[str] = ()) -> str:
        text = markdown(records, self.command) if _isolated(records) else ""
        paired = [r for r in records if r.get("mode") == "paired"]
        if paired:
            text += "\n" + "\n".join(paired_table(paired)) + "\n"
        memory = [r for r in records if r.get("mode") == "attention_memory"]
        if memory:
            text += "\n" + "\n".join(attention_memory_table(memory)) + "\n"
        if skipped:
            text += "\nSkipped: " + "; ".join(skipped) + "\n"
        return text or "no records\n"


def _system(r: dict) -> str:
    docs = f" [{r['documents']} docs]" if r.get("documents", 1) > 1 else ""
    if r["system"] == "ulysses_ring":
        return f"ulysses_ring (R={r.get('ring_size', '?')}){docs}"
    return (f"{r['system']} (C={r['head_chunks']})" if r["system"] == "ulysses_chunked" else r["system"]) + docs


class Budget:
    """Wall-clock budget of one run: refuse a configuration predicted to end after ``seconds``.

    Prediction: the fixed cost of a launch (the largest seen, 10 s before any) plus its steps times
    the step time measured at the same S (the slowest system), or scaled from a shorter S by
    ``(S / S0) ** 1.5``; an S with nothing measured below it is always run.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.launch_s, self.step_s = 10.0, {}

    def measured(self, seq_len: int, step_s: float, steps: int, wall_s: float) -> None:
        self.step_s[seq_len] = max(self.step_s.get(seq_len, 0.0), step_s)
        self.launch_s = max(self.launch_s, wall_s - steps * step_s)

    def refuses(self, jobs: Sequence, steps: int) -> str | None:
        """Why the run of ``jobs`` (``steps`` steps each) would not fit, or None."""
        if not self.seconds:
            return None
        S = jobs[0].seq_len
        shorter = [s for s in self.step_s if s <= S]
        if not shorter:
            return None
        s0 = max(shorter)
        predicted = self.launch_s + steps * len(jobs) * self.step_s[s0] * (S / s0) ** 1.5
        elapsed = time.monotonic() - self.start
        if elapsed + predicted > self.seconds:
            return f"predicted to end at {elapsed + predicted:.0f} s, past --budget-s {self.seconds:g}"
        return None


def attention_memory_table(records: Sequence[dict]) -> list[str]:
    """Markdown of the attention-memory records (``cli/bench/attention_memory.py``)."""
    title = "Peak memory of one attention layer, forward + backward, per rank (max over ranks), on top of its inputs:"
    lines = [title, "", "| S | P | head chunks | peak MiB | vs unchunked |", "|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["seq_len"], r["sp_size"], r["head_chunks"])):
        lines.append(f"| {r['seq_len']} | {r['sp_size']} | {r['head_chunks']} | "
                     f"{r['peak_attention_bytes'] / MiB:.1f} | {_fmt(r['vs_first'])} |")
    return lines


def _pair_key(r: dict) -> tuple:
    return r["seq_len"], r["sp_size"]


def paired_table(records: Sequence[dict]) -> list[str]:
    """Markdown: per (S, P), each system's median step, tokens/s, and medians of per-round ratios."""
    title = ("Paired timing (same processes, alternating steps; ratios are medians over rounds of per-round "
             "ratios; one process runs on rank 0 with all cores; `one process / system` > 1: faster than one "
             "process on the same cores):")
    lines = [title, "",
             "| S | P | system | median (min) step s | tokens/s | step / ulysses step | one process / system |",
             "|---|---|---|---|---|---|---|"]
    for key in sorted({_pair_key(r) for r in records}):
        group = sorted((r for r in records if _pair_key(r) == key), key=lambda r: r["system"])
        ours = next((r for r in group if r["system"] == "ulysses"), None)
        if "one_process_step_seconds" in group[0]:
            ts = group[0]["one_process_step_seconds"]
            median = statistics.median(ts)
            mine = _median_ratio({"step_seconds": ts}, ours) if ours else None
            lines.append(f"| {key[0]} | {key[1]} | single | {median:.3f} ({min(ts):.3f}) "
                         f"| {group[0]['batch_size'] * key[0] / median:,.0f} | {_fmt(mine)} | 1.00 |")
        for r in group:
            lines.append(f"| {key[0]} | {key[1]} | {_system(r)} | {r['median_step_seconds']:.3f} "
                         f"({r['min_step_seconds']:.3f}) | {r['tokens_per_second']:,.0f} "
                         f"| {_fmt(_median_ratio(r, ours))} | {_fmt(vs_single(r, records))} |")
    return lines


def markdown(records: Sequence[dict], command: str = "") -> str:
    """The report of the isolated runs: machine, model, per-configuration table, scaling table, checks."""
    records = _isolated(records)
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
        "| S | P | system | median (min) step s | tokens/s | one process / system | step / ulysses step | peak MiB "
        "| attn bytes/layer | formula | meas/formula | collectives/layer fwd (bwd) | loss | formula |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=_key):
        ours = _find(records, "ulysses", r["sp_size"], r["seq_len"])
        speed = f"{r['median_step_seconds'] / ours['median_step_seconds']:.2f}" if ours else "-"
        f = r["formula_bytes_sent_per_rank"]
        tokens = r.get("tokens_per_second", r["batch_size"] * r["seq_len"] / r["median_step_seconds"])
        lines.append(
            f"| {r['seq_len']} | {r['sp_size']} | {_system(r)} | {r['median_step_seconds']:.3f} "
            f"({r.get('min_step_seconds', r['median_step_seconds']):.3f}) | {tokens:,.0f} "
            f"| {_fmt(vs_single(r, records))} | {speed} "
            f"| {r['peak_memory_bytes'] / MiB:.0f} | {r['bytes_sent_per_rank']:,} | {f:,} "
            f"| {(r['bytes_sent_per_rank'] / f if f else 1.0):.3f} "
            f"| {r['collectives_per_layer']:g} ({r['collectives_per_layer_backward']:g}) | {r['loss']:.6f} "
            f"| {r['formula']} |"
        )
    lines += ["", *scaling_table(records), *documents_table(records)]
    problems = check_records(records)
    lines += ["", "Checks (loss vs one process, bytes within 5% of the formula, collectives per layer): "
              + ("all pass." if not problems else "; ".join(problems))]
    return "\n".join(lines) + "\n"


def documents_table(records: Sequence[dict]) -> list[str]:
    """Markdown (empty without packed rows): each system's attention time per token on rows of N
    documents, against the same system on one document per row (same S and P)."""
    packed = [r for r in records if r.get("documents", 1) > 1 and r.get("attention_seconds") is not None]
    if not packed:
        return []
    lines = ["", "Packed rows: wall time inside the attention calls (forward + backward, slowest rank) per token, "
             "against the same system with one document per row:", "",
             "| S | P | system | documents | attention ms / step | attention us / token | attention vs 1 document "
             "| step vs 1 document |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (*_key(r), r.get("documents", 1))):
        if r.get("attention_seconds") is None or not any(_key(p) == _key(r) for p in packed):
            continue
        one = _find(records, r["system"], r["sp_size"], r["seq_len"])
        attn = r["attention_seconds"] / one["attention_seconds"] if one and one.get("attention_seconds") else None
        step = r["median_step_seconds"] / one["median_step_seconds"] if one else None
        lines.append(f"| {r['seq_len']} | {r['sp_size']} | {_system(r)} | {r.get('documents', 1)} "
                     f"| {r['attention_seconds'] * 1e3:.1f} | {r['attention_us_per_token']:.2f} | {_fmt(attn)} "
                     f"| {_fmt(step)} |")
    return lines


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
    records = _isolated(records)
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
