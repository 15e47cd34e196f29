"""Preview figure of one simulated subject: clean, metal, difference, implant mask, field map."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim_scanner.dataset.layout import (
    default_subject,
    implant_material_attr,
    read_manifest,
    read_subject,
    sequence_attr,
    subject_path,
)


def pick_slices(implant_mask: np.ndarray, count: int) -> list[int]:
    """``count`` slices spread over the stack, favouring those that contain implant."""
    n = implant_mask.shape[0]
    count = max(1, min(count, n))
    with_metal = np.nonzero(implant_mask.reshape(n, -1).any(axis=1))[0]
    pool = with_metal if len(with_metal) >= count else np.arange(n)
    picks = np.linspace(0, len(pool) - 1, count).round().astype(int)
    return sorted({int(pool[i]) for i in picks})


def scan_summary(scanner: dict) -> str:
    """One line on how a subject was scanned (its ``scanner`` record), "" when it has none."""
    if not scanner:
        return ""
    shift = scanner.get("fov_shift_mm", [0.0, 0.0])
    parts = [
        f"turned {scanner.get('rotation_deg', 0.0):+.1f} deg",
        f"FOV shift x {shift[0]:+.0f} y {shift[1]:+.0f} mm",
        f"slab {scanner.get('slab_offset_mm', 0.0):+.0f} mm from the head",
        f"SNR {scanner['snr']:.0f}" if scanner.get("snr") else "no noise",
        f"coil shading {scanner.get('coil', {}).get('strength', 0.0):g}",
        f"head {scanner.get('head_material', '?')}",
    ]
    return ", ".join(parts)


def write_preview(folder: str | Path, subject: str | None, out: str | Path, n_slices: int = 4) -> Path:
    """Render the preview PNG of ``subject`` (default: the first test subject) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    manifest = read_manifest(folder)
    if subject is None:
        subject = default_subject(manifest)
    path = subject_path(folder, subject, manifest)
    if not path.is_file():
        raise FileNotFoundError(f"{path} has not been simulated yet (run masc simulate dataset)")
    sub = read_subject(path, ("images_clean", "images_metal", "implant_mask", "field_map_hz"))
    clean, metal, mask, fmap = sub.images_clean, sub.images_metal, sub.implant_mask, sub.field_map_hz
    bw = float(sub.attrs.get(sequence_attr("readout_bw_hz_per_px"), 710.0))
    b0 = float(sub.attrs.get(sequence_attr("b0_t"), 3.0))
    centres = np.asarray(sub.slice_centres_mm)
    external = sub.anatomy.get("external")
    has_z = not external or bool(external.get("positions"))  # imported images carry z only from DICOM geometry
    materials = sub.attrs.get(implant_material_attr("stem"), "?")
    slices = pick_slices(mask, n_slices)
    vmax = float(np.percentile(clean, 99.5)) or 1.0
    flim = 5 * bw
    cols = ["clean (ground truth)", "metal", "|metal - clean|", "implant mask", "field map (Hz)"]
    fig, axes = plt.subplots(len(slices), len(cols), figsize=(3.0 * len(cols), 3.0 * len(slices)),
                             squeeze=False, constrained_layout=True)
    for row, k in enumerate(slices):
        panels = [
            (clean[k], dict(cmap="gray", vmin=0, vmax=vmax)),
            (metal[k], dict(cmap="gray", vmin=0, vmax=vmax)),
            (np.abs(metal[k] - clean[k]), dict(cmap="magma", vmin=0, vmax=vmax)),
            (mask[k], dict(cmap="gray", vmin=0, vmax=1)),
            (fmap[k], dict(cmap="RdBu_r", vmin=-flim, vmax=flim)),
        ]
        for col, (img, kw) in enumerate(panels):
            ax = axes[row, col]
            im = ax.imshow(img, origin="upper", interpolation="nearest", **kw)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(cols[col], fontsize=10)
            if col == 0:
                ax.set_ylabel(f"slice {k}  z={centres[k]:+.0f} mm" if has_z else f"slice {k}", fontsize=9)
            if col == 4 and row == len(slices) - 1:
                fig.colorbar(im, ax=axes[:, 4], shrink=0.6, label=f"Hz (±5 px at {bw:.0f} Hz/px)")
    if external:  # an imported image with the 2D artifact model: none of the hip simulation's fields
        implant = sub.implant.get("config", {})
        title = (f"{manifest.get('name', '')} {subject}: {external.get('name', '?')} ({external.get('source', '?')}), "
                 f"2D artifact model, {b0:g} T, {bw:.0f} Hz/px, chi {implant.get('chi_ppm', '?')} ppm"
                 + ("" if has_z else "; slice positions unknown (z not shown)"))
        scan = ""
    else:
        title = (f"{manifest.get('name', '')} {subject}: {b0:g} T, {bw:.0f} Hz/px, {materials} implant, "
                 f"readout L-R (x), phase encoding A-P (y)")
        scan = scan_summary(sub.scanner)
    fig.suptitle(title + (f"\n{scan}" if scan else ""), fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
