"""Figures of the evaluation: metric-vs-lines curves and example reconstructions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from training.evaluation.tables import DISPLAY_NAMES


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(row: dict[str, Any]) -> str:
    return f"{DISPLAY_NAMES.get(row['method'], row['method'])}{' + MAR' if row['mar'] else ''}"


def plot_curves(results: dict[str, Any], out: str | Path, metrics: tuple[str, ...] = ("ssim", "mse")) -> None:
    """SSIM and MSE against acquired lines, mean with a +-std band (the paper's Figure 3, bottom);
    one row per acceleration, MAR solid, no MAR dashed, one colour per method."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    blocks = results["accelerations"]
    fig, axes = plt.subplots(len(blocks), len(metrics), figsize=(5.5 * len(metrics), 3.8 * len(blocks)),
                             squeeze=False, constrained_layout=True)
    methods = list(dict.fromkeys(row["method"] for b in blocks.values() for row in b["rows"]))
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for r, (acc, block) in enumerate(blocks.items()):
        for c, metric in enumerate(metrics):
            ax = axes[r, c]
            for row in block["rows"]:
                x = np.asarray(row["curves"]["n_lines"])
                mean = np.asarray(row["curves"][metric]["mean"])
                std = np.asarray(row["curves"][metric]["std"])
                style = "-" if row["mar"] else "--"
                ax.plot(x, mean, style, color=colours[row["method"]], label=_label(row), lw=1.6)
                ax.fill_between(x, mean - std, mean + std, color=colours[row["method"]], alpha=0.12 if row["mar"] else 0.06)
            ax.set_xlabel("acquired lines")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(metric.upper())
            ax.set_title(f"{acc} ({block['initial']} + {block['budget']} of {block['n_pe']} lines)")
            ax.grid(alpha=0.3)
            if r == 0 and c == len(metrics) - 1:
                # outside the axes: with a dozen methods, a legend inside covers the curves
                ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle(f"{results['split']} split, {results['n_slices']} slices: mean ± std", fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_examples(results: dict[str, Any], figures: dict[str, Any], out: str | Path) -> None:
    """For a few slices (the most implant): ground truth, the fully sampled metal image, and per
    method its line mask, final reconstruction (MAR when available) and error map
    (the paper's Figure 3, top). Uses the first acceleration."""
    plt = _plt()
    examples = figures["examples"]
    acc = next(iter(results["accelerations"]))
    rows = [(key, val) for (a, key), val in figures["rows"].items() if a == acc]
    with_mar = [(k, v) for k, v in rows if not k.endswith("+nomar")]
    rows = with_mar or rows
    if not examples or not rows:
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.text(0.5, 0.5, "no examples", ha="center", va="center")
        ax.axis("off")
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return
    target = figures["target"].numpy()
    metal = figures["metal"].numpy()
    n_cols = 1 + len(rows)
    fig, axes = plt.subplots(3 * len(examples), n_cols, figsize=(2.4 * n_cols, 2.4 * 3 * len(examples)),
                             squeeze=False, constrained_layout=True)
    block = results["accelerations"][acc]
    by_key = {row["key"]: row for row in block["rows"]}
    for e, label in enumerate(figures["labels"]):
        scale = float(target[e].max()) or 1.0
        gt = target[e] / scale
        r0 = 3 * e
        axes[r0, 0].imshow(gt, cmap="gray", vmin=0, vmax=1)
        axes[r0, 0].set_title(f"ground truth\n{label}", fontsize=8)
        axes[r0 + 1, 0].imshow(metal[e] / scale, cmap="gray", vmin=0, vmax=1)
        axes[r0 + 1, 0].set_title("metal, all lines", fontsize=8)
        axes[r0 + 2, 0].axis("off")
        for c, (key, (images, masks)) in enumerate(rows, start=1):
            img = images[e].numpy() / scale
            mask = np.repeat(masks[e][:, None], img.shape[1], axis=1)
            row = by_key[key]
            idx = examples[e]
            ssim = row["per_slice"]["ssim"][idx]
            axes[r0, c].imshow(mask, cmap="gray", vmin=0, vmax=1, aspect="auto")
            axes[r0, c].set_title(f"{_label(row)}\n{int(masks[e].sum())} lines", fontsize=8)
            axes[r0 + 1, c].imshow(img, cmap="gray", vmin=0, vmax=1)
            axes[r0 + 1, c].set_title(f"SSIM {ssim:.3f}", fontsize=8)
            axes[r0 + 2, c].imshow(np.abs(img - gt), cmap="magma", vmin=0, vmax=0.5)
            axes[r0 + 2, c].set_title("|error|", fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{acc}: masks (PE lines as rows), reconstructions and errors", fontsize=10)
    fig.savefig(out, dpi=90)
    plt.close(fig)
