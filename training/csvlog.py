"""Per-epoch / per-rollout training logs as CSV, appended row by row (a crash keeps every row
written so far; a resumed run appends to the same file)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def append_row(path: Path, row: dict[str, Any], fields: Sequence[str] | None = None) -> None:
    """Append ``row`` to the CSV at ``path``, writing the header first when the file is new.

    ``fields``: the column order (default: the row's keys); missing values are left empty."""
    new = not path.exists()
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields or row), restval="")
        if new:
            writer.writeheader()
        writer.writerow(row)


def read_rows(path: Path) -> list[dict[str, float]]:
    """The rows of a CSV log as floats (an empty cell reads as NaN)."""
    with Path(path).open(newline="") as fh:
        return [{k: float(v) if v not in ("", None) else float("nan") for k, v in row.items()}
                for row in csv.DictReader(fh)]


def plot_training(log_csv: Path, out: Path, imitation_csv: Path | None = None) -> Path:
    """The co-adaptive training curves as one figure: the episodic return of the rollouts, the
    validation SSIM (the model selection criterion, best marked), the policy entropy and the MAR
    fine-tuning loss against rollouts; and, when the run imitated the oracle first, the imitation
    loss and agreement against epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = read_rows(log_csv)
    imitation = read_rows(imitation_csv) if imitation_csv is not None and Path(imitation_csv).exists() else []
    panels = [("charts/episodic_return", "episodic return (training)"), ("val/ssim", "validation SSIM"),
              ("losses/entropy", "policy entropy"), ("losses/mar", "MAR fine-tuning loss")]
    fig, axes = plt.subplots(1, len(panels) + bool(imitation), figsize=(4.2 * (len(panels) + bool(imitation)), 3.4),
                             constrained_layout=True, squeeze=False)
    if imitation and math.isfinite(imitation[-1].get("val/ssim", math.nan)):
        rows = [{"rollout": 0.0, "val/ssim": imitation[-1]["val/ssim"]}, *rows]  # the imitated policy
    x = np.array([r.get("rollout", np.nan) for r in rows])
    for ax, (key, title) in zip(axes[0], panels):
        y = np.array([r.get(key, np.nan) for r in rows])
        keep = np.isfinite(y)
        ax.plot(x[keep], y[keep], "o-" if key.startswith("val/") else "-", ms=3, lw=1.4)
        if key == "val/ssim" and keep.any():
            best = int(np.nanargmax(np.where(keep, y, -np.inf)))
            ax.plot(x[best], y[best], "r*", ms=11, label=f"best: rollout {int(x[best])}")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    if imitation:
        ax = axes[0, -1]
        epochs = [r["epoch"] for r in imitation]
        ax.plot(epochs, [r["imitation/policy_loss"] for r in imitation], label="policy loss (cross-entropy)")
        twin = ax.twinx()
        twin.plot(epochs, [r["imitation/agreement"] for r in imitation], color="C1", label="agreement")
        twin.set_ylim(0, 1)
        ax.set_title("imitation of the oracle", fontsize=10)
        ax.set_xlabel("epoch")
        fig.legend(*[sum(v, []) for v in zip(ax.get_legend_handles_labels(), twin.get_legend_handles_labels())],
                   fontsize=8, loc="lower right")
    fig.suptitle(Path(log_csv).stem, fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def plot_epochs(log_csv: Path, out: Path, panels: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                best: str, higher_is_better: bool) -> Path:
    """A learning curve of a per-epoch CSV log: one panel per ``(title, [(column, label), ...])``
    against epochs, the selected epoch (the best ``best`` column) marked in every panel; columns
    the log lacks are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = read_rows(log_csv)
    panels = [(title, columns) for title, columns in panels
              if any(math.isfinite(r.get(c, math.nan)) for r in rows for c, _ in columns)]
    epochs = np.array([r.get("epoch", np.nan) for r in rows])
    score = np.array([r.get(best, np.nan) for r in rows])
    chosen = None
    if np.isfinite(score).any():
        chosen = int(np.nanargmax(score) if higher_is_better else np.nanargmin(score))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4), constrained_layout=True, squeeze=False)
    for ax, (title, columns) in zip(axes[0], panels):
        for column, label in columns:
            y = np.array([r.get(column, np.nan) for r in rows])
            keep = np.isfinite(y)
            if not keep.any():
                continue
            ax.plot(epochs[keep], y[keep], "o-", ms=3, lw=1.4, label=label)
        if chosen is not None:
            ax.axvline(epochs[chosen], color="0.5", ls=":", lw=1, label=f"selected: epoch {int(epochs[chosen])}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(log_csv).stem}: the epoch with the best {best} is kept", fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)
