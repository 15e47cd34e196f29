"""``masc view``: the images a server returned (an ISMRMRD file of images, as ``masc send`` writes
it) as PNG, and as DICOM with the geometry the image headers carry.

The PNG has one row per series and one column per slice: each panel is titled with its series,
slice, the policy that acquired it and what was served (``MASC.mar``: the network, or the OOD
fallback that served it zero-filled, marked in red), with a millimetre scale bar from the image's
field of view and the patient directions at its edges (from ``read_dir`` and ``phase_dir``, DICOM
LPS). The DICOM files (MR Image Storage, one per image) carry the position, orientation, pixel
spacing and slice thickness of the image header, the series and instance numbers, and
``ImageComments`` (which says when the MAR series was served zero-filled).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import ismrmrd
import numpy as np

from sim_scanner.dataset.streams import check_group

__all__ = ["ViewedImage", "direction_letters", "read_images", "write_dicom", "write_png"]


@dataclass
class ViewedImage:
    """One returned image: pixels (y, x), its header fields and meta attributes."""

    pixels: np.ndarray
    series: int
    slice: int
    index: int
    fov_mm: tuple[float, float, float]
    position: tuple[float, float, float]
    read_dir: tuple[float, float, float]
    phase_dir: tuple[float, float, float]
    meta: dict[str, str]

    @property
    def fallback(self) -> bool:
        """Whether the MAR series of this slice was served zero-filled (``MASC.mar`` says none)."""
        return self.series == 1 and self.meta.get("MASC.mar", "").startswith("none")

    @property
    def pixel_mm(self) -> tuple[float, float]:
        """(row, column) spacing in mm: the field of view over the matrix (y, x)."""
        rows, cols = self.pixels.shape
        return self.fov_mm[1] / rows, self.fov_mm[0] / cols


def _meta(image: ismrmrd.Image) -> dict[str, str]:
    text = image.attribute_string
    if not text:
        return {}
    meta = ismrmrd.Meta.deserialize(text)
    return {k: " ".join(str(v) for v in (meta[k] if isinstance(meta[k], list) else [meta[k]])) for k in meta.keys()}


def read_images(path: str | os.PathLike, group: str = "out") -> list[ViewedImage]:
    """Every image of ``group`` in ``path`` (its ``image_*`` variables), by series then slice;
    ValueError naming what is missing."""
    path = check_group(path, group)
    with h5py.File(path, "r") as f:
        names = sorted(k for k in f[group].keys() if k.startswith("image_"))
    if not names:
        raise ValueError(f"{path}/{group}: no image variables (image_*)")
    dataset = ismrmrd.Dataset(str(path), group, create_if_needed=False)
    out = []
    try:
        for name in names:
            for i in range(dataset.number_of_images(name)):
                image = dataset.read_image(name, i)
                data = np.asarray(image.data)
                pixels = np.abs(data.reshape(-1, *data.shape[-2:])[0]).astype(np.float64)
                out.append(ViewedImage(pixels, int(image.image_series_index), int(image.slice), int(image.image_index),
                                       tuple(float(v) for v in image.field_of_view),
                                       tuple(float(v) for v in image.position), tuple(float(v) for v in image.read_dir),
                                       tuple(float(v) for v in image.phase_dir), _meta(image)))
    finally:
        dataset.close()
    return sorted(out, key=lambda im: (im.series, im.slice, im.index))


_LETTERS = (("L", "R"), ("P", "A"), ("S", "I"))
"""DICOM LPS: +x patient left, +y posterior, +z head (superior)."""


def direction_letters(vector: tuple[float, float, float]) -> str:
    """The patient directions a unit vector points to, strongest first ("L", "AS", ...); "" for a
    zero vector."""
    v = np.asarray(vector, dtype=float)
    if not np.any(v):
        return ""
    order = np.argsort(-np.abs(v))
    return "".join(_LETTERS[i][0 if v[i] > 0 else 1] for i in order if abs(v[i]) > 0.3 * np.abs(v).max())


def _opposite(letters: str) -> str:
    flip = {a: b for pair in _LETTERS for a, b in (pair, pair[::-1])}
    return "".join(flip[c] for c in letters)


def _label(image: ViewedImage) -> str:
    kind = {1: "MAR series", 2: "zero-filled series"}.get(image.series, f"series {image.series}")
    served = image.meta.get("MASC.mar", "")
    if image.fallback:
        served = "FALLBACK: served zero-filled"
    policy = image.meta.get("MASC.policy", "")
    return "\n".join(x for x in (f"{kind}, slice {image.slice}", f"policy {policy}" if policy else "",
                                 served[:48]) if x)


def write_png(images: list[ViewedImage], out: str | os.PathLike, title: str = "") -> Path:
    """One row per series, one column per slice (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({im.series for im in images})
    slices = sorted({im.slice for im in images})
    grid = {(im.series, im.slice): im for im in images}
    vmax = float(np.percentile(np.concatenate([im.pixels.ravel() for im in images]), 99.5)) or 1.0
    fig, axes = plt.subplots(len(series), len(slices), figsize=(2.8 * len(slices), 3.7 * len(series)), squeeze=False)
    for r, s in enumerate(series):
        for c, k in enumerate(slices):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            image = grid.get((s, k))
            if image is None:
                ax.set_visible(False)
                continue
            ax.imshow(image.pixels, cmap="gray", vmin=0, vmax=vmax)
            ax.set_title(_label(image), fontsize=7, color="red" if image.fallback else "black")
            if image.fallback:
                for spine in ax.spines.values():
                    spine.set_edgecolor("red")
                    spine.set_linewidth(2)
            rows, cols = image.pixels.shape
            row_mm, col_mm = image.pixel_mm
            if col_mm > 0:  # a scale bar of a round length, about a quarter of the width
                length = next((v for v in (100, 50, 20, 10, 5, 2, 1) if v / col_mm <= cols / 3), 1)
                x0, y0 = cols * 0.05, rows * 0.93
                ax.plot([x0, x0 + length / col_mm], [y0, y0], color="yellow", lw=2)
                ax.text(x0, y0 - rows * 0.03, f"{length} mm", color="yellow", fontsize=6)
            right, down = direction_letters(image.read_dir), direction_letters(image.phase_dir)
            for text, xy in ((right, (0.98, 0.5)), (_opposite(right), (0.02, 0.5)),
                             (down, (0.5, 0.02)), (_opposite(down), (0.5, 0.98))):
                if text:
                    ax.text(*xy, text, transform=ax.transAxes, color="cyan", fontsize=7, ha="center", va="center")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_dicom(images: list[ViewedImage], folder: str | os.PathLike, header: dict[str, Any] | None = None) -> list[Path]:
    """One MR Image Storage file per image in ``folder`` (module docstring); pixels scaled to
    unsigned 16 bits with the rescale slope and intercept that give the served values back."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    study = generate_uid()
    series_uid = {s: generate_uid() for s in sorted({im.series for im in images})}
    frame = generate_uid()
    written = []
    for image in images:
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = MRImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        path = folder / f"series{image.series}_slice{image.slice:03d}.dcm"
        ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
        ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
        ds.Modality = "MR"
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series_uid[image.series], frame
        ds.SeriesNumber, ds.InstanceNumber = image.series, image.slice + 1
        ds.SeriesDescription = {1: "MASC MAR", 2: "MASC zero-filled"}.get(image.series, f"series {image.series}")
        ds.ImageComments = image.meta.get("ImageComments", "")[:128]
        ds.ImagePositionPatient = [float(v) for v in image.position]
        ds.ImageOrientationPatient = [float(v) for v in (*image.read_dir, *image.phase_dir)]
        row_mm, col_mm = image.pixel_mm
        ds.PixelSpacing = [float(row_mm), float(col_mm)]
        ds.SliceThickness = float(image.fov_mm[2])
        for key, value in (header or {}).items():
            setattr(ds, key, value)
        peak = float(image.pixels.max())
        slope = peak / 65535.0 if peak > 0 else 1.0
        pixels = np.clip(np.round(image.pixels / slope), 0, 65535).astype(np.uint16)
        ds.RescaleSlope, ds.RescaleIntercept = f"{slope:.6g}", "0"
        ds.Rows, ds.Columns = pixels.shape
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.PixelData = pixels.tobytes()
        ds.save_as(str(path), enforce_file_format=True)
        written.append(path)
    return written
