"""PNG plot of a ``metrics.jsonl`` (``MetricsCallback``'s records): one panel per quantity against the step.

    +----------------------+----------------------+----------------------+
    | loss   train -o-     | learning rate        | grad norm            |
    |        eval  --s--   |                      |                      |
    +----------------------+----------------------+----------------------+
    | tokens / s           | peak memory (GiB,    | copy-task accuracy   |
    |                      |   max over ranks)    |   -- chance          |
    +----------------------+----------------------+----------------------+
    | passkey exact match  | passkey exact match  |   (--eval-passkey-lengths: the per-length accuracy
    |   by length (step)   |  length x depth map  |    against the step, the last record's heat map)
    +----------------------+----------------------+
                      title (model, data, S, P) above all panels

A record's ``split`` (``record_split``) says what it is: ``"train"`` (a Trainer step log) or an
evaluation (``"eval"``, ``"eval_<name>"`` for a dict of eval datasets) whose loss is ``<split>_loss``.
Missing keys, NaN / inf and a single record are fine; a panel with no values says "not logged".
Y axes always show >= 3 labelled ticks: linear with plain numbers (no offset), so a loss moving
between 7.55 and 7.62 reads as 7.56, 7.58, ...; log only for the loss and the grad norm when their
values span a decade or more. X: integer steps.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GIB = 2**30
HEATMAP = "passkey exact match, length x depth"  # the title of the length x depth panel (then the step)


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of a ``metrics.jsonl``, one per line.

    A last line cut short (a run killed while writing it) is skipped; a broken line before it is a
    ``ValueError`` naming the line.
    """
    lines = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n} is not a JSON object ({err.msg}); fix or delete that line") from err
    return records


def record_split(record: Mapping[str, Any]) -> str:
    """``"train"`` or the evaluation split of a record (records written before ``split`` existed: train)."""
    split = record.get("split")
    if split:
        return str(split)
    losses = [k[: -len("_loss")] for k in record if k.endswith("_loss") and k != "train_loss"]
    return "train" if "loss" in record or not losses else losses[0]


def plot_metrics(records: list[dict], out: Path, title: str, chance: float | None = None) -> Path:
    """Write the panels of ``records`` to the PNG ``out`` and return it (see the module docstring)."""
    import matplotlib.pyplot as plt

    fig = metrics_figure(records, title, chance)
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def metrics_figure(records: list[dict], title: str, chance: float | None = None):
    """The matplotlib ``Figure`` that :func:`plot_metrics` saves (panel titles: ``loss``, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(records, chance is not None)
    ncols = 3 if len(panels) > 4 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.2 * nrows + 0.5), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    for ax, (name, lines) in zip(flat, panels):
        _draw(ax, name, lines, chance)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(textwrap.fill(title, 120))
    return fig


def _panels(records: list[dict], with_accuracy: bool) -> list[tuple[str, list[tuple[str, list, list]]]]:
    """``[(panel title, [(line label, steps, values), ...]), ...]``."""
    train = [r for r in records if record_split(r) == "train"]
    evals: dict[str, list[dict]] = {}
    for r in records:
        if record_split(r) not in ("train", "passkey"):
            evals.setdefault(record_split(r), []).append(r)
    loss = [("train", *_series(train, "loss"))] + [(s, *_series(rs, f"{s}_loss")) for s, rs in evals.items()]
    panels = [
        ("loss", loss),
        ("learning rate", [("", *_series(train, "learning_rate"))]),
        ("grad norm", [("", *_series(train, "grad_norm"))]),
        ("tokens / s", [("", *_series(train, "tokens_per_second"))]),
        ("peak memory (GiB, max over ranks)", [("", *_series(train, "peak_memory_bytes", 1 / GIB))]),
    ]
    if with_accuracy or any("accuracy" in r for r in train):
        name = "copy-task accuracy" if with_accuracy else "task accuracy (answer tokens, held-out rows)"
        panels.append((name, [("", *_series(train, "accuracy"))]))
    passkey = [r for r in records if record_split(r) == "passkey" and r.get("passkey_cells")]
    if len(passkey) > 1:
        keys = sorted({k for r in passkey for k in r if k.startswith("passkey_exact_match_")},
                      key=lambda k: int(k.rsplit("_", 1)[1]))
        panels.append(("passkey exact match by length",
                       [(f"S={k.rsplit('_', 1)[1]}", *_series(passkey, k)) for k in keys]))
    if passkey:
        panels.append((f"{HEATMAP} (step {passkey[-1]['step']})", [("", [], passkey[-1]["passkey_cells"])]))
    return panels


def _series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    """Steps and finite values of ``key`` (records without it, or with NaN / inf / non-numbers, skipped)."""
    points = [(r["step"], r[key] * scale) for r in records
              if isinstance(r.get("step"), (int, float)) and _finite(r.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _draw_heatmap(ax, name: str, cells: list[dict]) -> None:
    """Exact-match accuracy of the passkey cells: rows = lengths, columns = depths, values written in."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = [[float("nan")] * len(depths) for _ in lengths]
    for c in cells:
        grid[lengths.index(c["length"])][depths.index(c["depth"])] = c["exact_match"]
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("depth of the key")
    ax.set_ylabel("length (tokens)")
    ax.set_title(name)
    ax.figure.colorbar(image, ax=ax, fraction=0.05)


def _draw(ax, name: str, lines: list[tuple[str, list, list]], chance: float | None) -> None:
    from matplotlib.ticker import MaxNLocator

    if name.startswith(HEATMAP):
        _draw_heatmap(ax, name, lines[0][2])
        return
    ax.set_title(name)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    values = [v for _, _, ys in lines for v in ys]
    if not values:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for i, (label, steps, ys) in enumerate(lines):
        if ys:
            ax.plot(steps, ys, marker="o" if i == 0 else "s", markersize=3 if i == 0 else 5,
                    linestyle="-" if i == 0 else "--", label=label or None)
    if name in ("copy-task accuracy", "task accuracy (answer tokens, held-out rows)", "passkey exact match by length"):
        ax.set_ylim(-0.02, 1.02)
        if chance is not None:
            ax.axhline(chance, color="grey", linestyle="--", label=f"chance {chance:.3f}")
    _y_axis(ax, values, log_ok=name in ("loss", "grad norm"))
    if len(ax.get_legend_handles_labels()[0]) > 1 or (chance is not None and name == "copy-task accuracy"):
        ax.legend(loc="best", fontsize="small")


def _y_axis(ax, values: list[float], log_ok: bool) -> None:
    """Log for positive values spanning >= 10x (ticks at 1, 2, 5 x 10^k; at 10^k only from 3 decades
    on, >= 3 either way), else linear with >= 3 plain ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    if log_ok and min(values) > 0 and max(values) >= 10 * min(values):
        ax.set_yscale("log")
        subs = (1.0, 2.0, 5.0) if max(values) < 1000 * min(values) else (1.0,)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        return
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, min_n_ticks=3))
    formatter = ScalarFormatter(useOffset=False, useMathText=True)
    formatter.set_powerlimits((-3, 5))  # 2e-4 as 2 x 10^-4 on the axis; 7.55 .. 62000 as plain numbers
    ax.yaxis.set_major_formatter(formatter)
