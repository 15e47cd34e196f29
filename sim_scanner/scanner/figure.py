"""``masc scan``'s figure (``scan.png``): for each slice of the first subject, the lines
acquired and where each came from, the image served, the ground truth and the error."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim_scanner.scanner.report import SubjectReport

SOURCE_COLOURS = {"initial": (0.6, 0.6, 0.6), "gadget": (0.2, 0.7, 0.3), "fallback": (0.85, 0.2, 0.2)}
"""The colour of a line in the mask panel, by where the line came from."""

ERROR_RANGE = 0.3
"""The error maps' shared colour scale, in units of the clean image's maximum."""


def plot_scan_subject(report: SubjectReport, served: np.ndarray, targets: np.ndarray, out: str | Path,
                      max_slices: int = 8) -> Path:
    """Write the figure of one scanned subject to ``out``: one row per slice (at most
    ``max_slices``): its acquired lines coloured by source, the served image, the clean ground
    truth and ``|served - truth|`` on one colour scale with a colourbar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    slices = sorted(report.slices, key=lambda r: r.slice)[:max_slices]
    fig, axes = plt.subplots(len(slices), 4, figsize=(10.5, 2.4 * len(slices) + 0.8), squeeze=False,
                             constrained_layout=True)
    error = None
    for row, rep in zip(axes, slices):
        s = rep.slice
        scale = float(targets[s].max()) or 1.0
        mask = np.ones((report.n_pe, 3))
        for line, source in zip(rep.lines, rep.sources):
            if 0 <= line < report.n_pe:
                mask[line] = SOURCE_COLOURS.get(source, (0.0, 0.0, 0.0))
        row[0].imshow(np.repeat(mask[:, None, :], 24, axis=1), aspect="auto", interpolation="nearest")
        row[0].set_ylabel(f"slice {s}", fontsize=9)
        row[0].set_title(f"{len(rep.lines)} lines: {rep.from_gadget} from the gadget, {rep.fallbacks} fallback",
                         fontsize=8)
        ticks = sorted(set(rep.lines))  # the ky of every acquired line
        row[0].set_yticks(ticks[:: max(1, len(ticks) // 6)])
        row[0].tick_params(axis="y", labelsize=5, length=1, pad=1)
        row[1].imshow(served[s] / scale, cmap="gray", vmin=0, vmax=1)
        ssim = rep.metrics.get("ssim", float("nan"))
        fell_back = rep.served.startswith("none")
        what = ("MAR FALLBACK: zero-filled" if fell_back and "OOD" in rep.served
                else rep.served or rep.image_source or "none")
        row[1].set_title(f"served: {what[:40]}, SSIM {ssim:.3f}", fontsize=7, color="red" if fell_back else "black")
        if fell_back:
            for spine in row[1].spines.values():
                spine.set_edgecolor("red")
                spine.set_linewidth(2)
        if report.fov_mm:  # a scale bar of a round length
            cols = served[s].shape[1]
            pixel = report.fov_mm / cols
            length = next((v for v in (100, 50, 20, 10, 5) if v / pixel <= cols / 3), 5)
            y0 = served[s].shape[0] * 0.93
            row[1].plot([cols * 0.05, cols * 0.05 + length / pixel], [y0, y0], color="yellow", lw=1.5)
            row[1].text(cols * 0.05, y0 - served[s].shape[0] * 0.04, f"{length} mm", color="yellow", fontsize=6)
        row[2].imshow(targets[s] / scale, cmap="gray", vmin=0, vmax=1)
        row[2].set_title(f"reference ({report.reference})", fontsize=8)
        error = row[3].imshow(np.abs(served[s] - targets[s]) / scale, cmap="magma", vmin=0, vmax=ERROR_RANGE)
        row[3].set_title("|served - truth|", fontsize=8)
        for ax in row[1:]:
            ax.set_xticks([])
            ax.set_yticks([])
        row[0].set_xticks([])
    if error is not None:
        bar = fig.colorbar(error, ax=axes[:, 3].tolist(), shrink=0.6)
        bar.set_label("|error| / max of the clean image", fontsize=8)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in SOURCE_COLOURS.items()], loc="outside lower center",
               ncol=3, fontsize=8, title="lines (phase encoding, top to bottom)", title_fontsize=8)
    policies = sorted({r.policy for r in slices if r.policy})
    fig.suptitle(f"masc scan: subject {report.subject}, policy {', '.join(policies) or 'unknown (no image came back)'}",
                 fontsize=11)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return Path(out)
