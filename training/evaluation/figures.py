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


def plot_curves(results: dict[str, Any], out: str | Path, metrics: tuple[str, ...] = ("ssim", "psnr"),
                zoomed: int = 5) -> None:
    """SSIM and PSNR against acquired lines, mean with a +-std band (the paper's Figure 3,
    bottom), MAR solid, no MAR dashed, one colour per method; and a zoom on the second half of
    the scan where the ``zoomed`` best served images (by final SSIM, MAR where evaluated) are
    drawn alone with markers and their final values, so that close methods can be told apart.
    One row per acceleration."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    blocks = results["accelerations"]
    n_cols = len(metrics) + 1
    fig, axes = plt.subplots(len(blocks), n_cols, figsize=(5.2 * n_cols, 3.9 * len(blocks)),
                             squeeze=False, constrained_layout=True)
    methods = list(dict.fromkeys(row["method"] for b in blocks.values() for row in b["rows"]))
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    markers = "osD^vP*X<>"
    for r, (acc, block) in enumerate(blocks.items()):
        title = f"{acc} ({block['initial']} + {block['budget']} of {block['n_pe']} lines)"
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
            ax.set_ylabel(metric.upper() + (" (dB)" if metric == "psnr" else ""))
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            if r == 0 and c == 0:
                ax.legend(fontsize=7, loc="lower right")
        ax = axes[r, -1]
        with_mar = any(row["mar"] for row in block["rows"])
        rows = [row for row in block["rows"] if row["mar"] == with_mar]
        rows.sort(key=lambda row: -row["curves"]["ssim"]["mean"][-1])
        for k, row in enumerate(rows[:zoomed]):
            x = np.asarray(row["curves"]["n_lines"])
            mean = np.asarray(row["curves"]["ssim"]["mean"])
            half = len(x) // 2
            ax.plot(x[half:], mean[half:], "-", marker=markers[k % len(markers)], ms=4, lw=1.4,
                    color=colours[row["method"]], label=f"{_label(row)}: {mean[-1]:.4f}")
        ax.set_xlabel("acquired lines")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("SSIM (mean)")
        ax.set_title(f"the {min(zoomed, len(rows))} best, second half of the scan", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", title="final SSIM", title_fontsize=7)
    fig.suptitle(f"{results['split']} split, {results['n_slices']} slices: mean ± std over slices", fontsize=11)
    fig.savefig(out, dpi=100)
    plt.close(fig)


ERROR_RANGE = 0.3
"""The error maps' shared colour scale: |image - truth| from 0 to this, in units of the clean
image's maximum."""


def plot_examples(results: dict[str, Any], figures: dict[str, Any], out: str | Path) -> None:
    """For a few slices (the most implant) and the first acceleration: the clean ground truth and
    the fully sampled metal image, then one row per method: its lines, the zero-filled image of
    them, the image with MAR (when evaluated with a MAR network), and the MAR image's error
    against the truth, every error map on one shared colour scale with its colourbar."""
    plt = _plt()
    examples = figures["examples"]
    acc = next(iter(results["accelerations"]))
    rows = {key: val for (a, key), val in figures["rows"].items() if a == acc}
    block = results["accelerations"][acc]
    by_key = {row["key"]: row for row in block["rows"]}
    methods = list(dict.fromkeys(row["method"] for row in block["rows"]))
    if not examples or not rows:
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.text(0.5, 0.5, "no examples", ha="center", va="center")
        ax.axis("off")
        fig.savefig(out, dpi=80)
        plt.close(fig)
        return
    target = figures["target"].numpy()
    metal = figures["metal"].numpy()
    columns = ["acquired lines", "zero-filled", "with MAR", "|MAR - truth|"]
    per_example = 1 + len(methods)
    fig, axes = plt.subplots(per_example * len(examples), len(columns),
                             figsize=(2.3 * len(columns) + 1.6, 2.3 * per_example * len(examples)),
                             squeeze=False, constrained_layout=True)
    error_image = None
    for e, label in enumerate(figures["labels"]):
        scale = float(target[e].max()) or 1.0
        gt = target[e] / scale
        top = per_example * e
        axes[top, 0].imshow(gt, cmap="gray", vmin=0, vmax=1)
        axes[top, 0].set_title(f"ground truth ({label})", fontsize=8)
        axes[top, 1].imshow(metal[e] / scale, cmap="gray", vmin=0, vmax=1)
        axes[top, 1].set_title("with metal, every line", fontsize=8)
        for ax in axes[top, 2:]:
            ax.axis("off")
        for m, method in enumerate(methods, start=1):
            r = top + m
            name = DISPLAY_NAMES.get(method, method).split(" (")[0]
            axes[r, 0].set_ylabel(name, fontsize=8)
            images = {mar: rows.get(method + ("" if mar else "+nomar")) for mar in (False, True)}
            lines = next(v for v in images.values() if v is not None)[1][e]
            mask = np.repeat(lines[:, None], gt.shape[1], axis=1)
            axes[r, 0].imshow(mask, cmap="gray", vmin=0, vmax=1, aspect="auto")
            axes[r, 0].set_title(f"{int(lines.sum())} of {lines.size} lines", fontsize=8)
            for c, mar in ((1, False), (2, True)):
                if images[mar] is None:
                    axes[r, c].axis("off")
                    continue
                img = images[mar][0][e].numpy() / scale
                ssim = by_key[method + ("" if mar else "+nomar")]["per_slice"]["ssim"][examples[e]]
                axes[r, c].imshow(img, cmap="gray", vmin=0, vmax=1)
                axes[r, c].set_title(f"SSIM {ssim:.3f}", fontsize=8)
            shown = images[True] if images[True] is not None else images[False]
            error_image = axes[r, 3].imshow(np.abs(shown[0][e].numpy() / scale - gt), cmap="magma", vmin=0,
                                            vmax=ERROR_RANGE)
            axes[r, 3].set_title("error" if images[True] is not None else "error (zero-filled)", fontsize=8)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    for c, title in enumerate(columns):
        axes[0, c].annotate(title, (0.5, 1.25), xycoords="axes fraction", ha="center", fontsize=9, weight="bold")
    if error_image is not None:
        bar = fig.colorbar(error_image, ax=axes[:, 3].tolist(), shrink=0.6, location="right")
        bar.set_label("|error| / max of the clean image", fontsize=8)
    fig.suptitle(f"{acc}: {block['initial']} + {block['budget']} of {block['n_pe']} lines; images scaled by the "
                 f"clean image's maximum", fontsize=10)
    fig.savefig(out, dpi=90)
    plt.close(fig)
