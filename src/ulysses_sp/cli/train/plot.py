"""PNG plot of a ``metrics.jsonl``: loss, task accuracy (with chance) and tokens/s against the step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of a ``metrics.jsonl``, one per line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(records: list[dict], out: Path, title: str, chance: float | None = None) -> Path:
    """Write the curves of ``records`` to the PNG ``out`` and return it.

    Panels: loss; accuracy (only if the records have it, with a dashed ``chance`` line);
    tokens per second.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    panels = [("loss", "loss")] + ([("accuracy", "task accuracy")] if any("accuracy" in r for r in records) else [])
    panels.append(("tokens_per_second", "tokens / s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        ax.plot(steps, [r.get(key, float("nan")) for r in records], marker="o", markersize=3)
        if key == "accuracy":
            ax.set_ylim(-0.02, 1.02)
            if chance is not None:
                ax.axhline(chance, color="grey", linestyle="--", label=f"chance {chance:.3f}")
                ax.legend(loc="lower right")
        if key == "loss":
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
