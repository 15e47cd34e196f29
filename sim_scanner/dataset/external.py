"""Paired datasets from real images: ``masc simulate external`` (the paper's cross-dataset set).

Readers turn a file into magnitude slices (:class:`Volume`):

* **fastMRI single-coil HDF5** (``kspace`` [slice, kx, ky] complex, ``reconstruction_esc``
  [slice, 320, 320], ``ismrmrd_header``): the ``reconstruction_esc`` images, else the magnitude
  of the inverse FFT of ``kspace``;
* **ISMRMRD HDF5** (a ``dataset`` group of acquisitions): each slice's lines placed at their
  ``kspace_encode_step_1``, inverse FFT, root-sum-of-squares over the coils;
* **DICOM**: one file (2D or multi-frame) or a folder searched recursively, one volume per series
  (grouped by SeriesInstanceUID, sorted along the slice normal, then by InstanceNumber); only MR
  is imported (another modality is refused by name), and a compression without a decoder is
  refused with the plug-in to install (:data:`DECODERS`);
* **NIfTI** (``.nii``, ``.nii.gz``, through nibabel): the slices along the third axis;
* ``builtin``: real MR images that ship inside installed packages, never downloaded: pydicom's
  ``MR_small.dcm`` (a 64 x 64 MR slice) and, when it is already on disk, scikit-image's
  ``brain()`` (10 MR slices; scikit-image 0.26 no longer bundles it, so it is used only from a
  local copy).

Each slice is centre-cropped to a square, resampled to ``sequence.matrix`` and scaled to a
99th-percentile of 1; :func:`~sim_scanner.physics.artifact2d.add_implant` then draws an implant
and gives the paired clean / metal images, and their centred orthonormal 2D FFTs are the two
k-spaces. Every volume becomes one subject of the *test* split (a held-out set: the methods are
trained on the hip simulation), written through :mod:`sim_scanner.dataset.layout`, so
``masc eval`` and ``masc scan`` read it like any dataset.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from masc_gadget.config import Config, to_dict
from masc_gadget.core.kspace import fft2c, magnitude
from masc_gadget.mrd.header import encoding_geometry
from sim_scanner.dataset.layout import (SubjectData, prepare_folder, subject_file, subject_id, write_manifest,
                                        write_subject)
from sim_scanner.dataset.mrd_hdf5 import read_mrd_group
from sim_scanner.physics.artifact2d import Artifact2DConfig, add_implant

log = logging.getLogger(__name__)

__all__ = ["BUILTIN", "DECODERS", "ImportRefused", "ImportSummary", "Volume", "assign_splits", "augment", "builtin_volumes",
           "read_volumes", "simulate_external"]


@dataclass
class Volume:
    """Magnitude slices of one source (a file, a DICOM series, a builtin image set)."""

    name: str
    images: np.ndarray  # (S, H, W) float
    source: str  # "fastmri", "ismrmrd", "dicom", "nifti" or "builtin:..."
    positions_mm: np.ndarray | None = None
    """(S,) each slice's position along the slice normal, from the first one (DICOM geometry);
    None where the source carries none."""


@dataclass
class ImportSummary:
    """What a folder import did: the volumes imported, the files and series skipped with the
    reason, and the warnings about what was imported (duplicate or missing slice positions)."""

    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        self.skipped.append(reason)
        log.warning("not imported: %s", reason)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning("%s", message)

    def render(self) -> str:
        """A few lines for the terminal: counts, then every skip and warning (one line each)."""
        lines = [f"imported {len(self.imported)} volume(s): {', '.join(self.imported) or '-'}"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} file(s) or series:")
            lines += [f"  - {reason}" for reason in self.skipped]
        if self.warnings:
            lines.append(f"{len(self.warnings)} warning(s):")
            lines += [f"  - {message}" for message in self.warnings]
        return "\n".join(lines)


def _fastmri(path: Path, f: h5py.File) -> Volume:
    if "reconstruction_esc" in f:
        images = np.asarray(f["reconstruction_esc"], dtype=np.float64)
    else:
        k = np.asarray(f["kspace"])
        if k.ndim != 3 or not np.iscomplexobj(k):
            raise ValueError(f"{path}: fastMRI 'kspace' must be complex [slice, kx, ky], got {k.dtype} {k.shape}")
        images = magnitude(torch.from_numpy(k)).numpy().astype(np.float64)
    if images.ndim != 3:
        raise ValueError(f"{path}: fastMRI images must be [slice, y, x], got shape {images.shape}")
    return Volume(path.stem, images, "fastmri")


def _ismrmrd(path: Path) -> Volume:
    """The root-sum-of-squares images of an ISMRMRD file's ``dataset`` group, read by the one MRD
    reader (:func:`~sim_scanner.dataset.mrd_hdf5.read_mrd_group`: imaging lines only), cropped
    to the recon field of view when the readout is oversampled."""
    group = read_mrd_group(path, "dataset")
    if not group.acquired.any():
        raise ValueError(f"{path}: the ISMRMRD dataset holds no imaging acquisitions")
    kspace = group.kspace if group.kspace.ndim == 4 else group.kspace[:, None]
    images = np.sqrt((magnitude(torch.from_numpy(kspace)).numpy().astype(np.float64) ** 2).sum(axis=1))
    geometry = encoding_geometry(group.header_xml)
    if geometry.removes_oversampling:  # keep the recon field of view
        width = int(round(geometry.n_readout / geometry.readout_ratio))
        start = (images.shape[-1] - width) // 2
        images = images[..., start:start + width]
    return Volume(path.stem, images, "ismrmrd")


DECODERS = {
    "1.2.840.10008.1.2.4.50": "pylibjpeg pylibjpeg-libjpeg",  # JPEG baseline
    "1.2.840.10008.1.2.4.51": "pylibjpeg pylibjpeg-libjpeg",  # JPEG extended
    "1.2.840.10008.1.2.4.57": "pylibjpeg pylibjpeg-libjpeg",  # JPEG lossless
    "1.2.840.10008.1.2.4.70": "pylibjpeg pylibjpeg-libjpeg",  # JPEG lossless, first-order prediction
    "1.2.840.10008.1.2.4.80": "pylibjpeg pylibjpeg-libjpeg",  # JPEG-LS lossless
    "1.2.840.10008.1.2.4.81": "pylibjpeg pylibjpeg-libjpeg",  # JPEG-LS near-lossless
    "1.2.840.10008.1.2.4.90": "pylibjpeg pylibjpeg-openjpeg",  # JPEG 2000 lossless
    "1.2.840.10008.1.2.4.91": "pylibjpeg pylibjpeg-openjpeg",  # JPEG 2000
}
"""Transfer syntax UID -> the pydicom pixel-data plug-ins that decode it (pip package names)."""


class ImportRefused(ValueError):
    """A file or series that is not imported, with the one-line reason (the rest of a folder
    still imports)."""


def _pixels(d, name: str) -> np.ndarray:
    """A DICOM dataset's rescaled pixels; ImportRefused naming the plug-in to install when its
    compression has no decoder here."""
    try:
        pixels = np.asarray(d.pixel_array, dtype=np.float64)
    except (RuntimeError, NotImplementedError) as err:
        ts = d.file_meta.get("TransferSyntaxUID") if hasattr(d, "file_meta") else None
        if ts is not None and ts.is_compressed:
            plugin = DECODERS.get(str(ts), "pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg (or python-gdcm)")
            raise ImportRefused(f"{name}: compressed as {ts.name} and no decoder for it is installed: "
                                f"pip install {plugin}") from None
        raise ImportRefused(f"{name}: the pixel data cannot be read ({str(err).splitlines()[0]})") from None
    return pixels * float(getattr(d, "RescaleSlope", 1) or 1) + float(getattr(d, "RescaleIntercept", 0) or 0)


def _check_mr(d, name: str) -> None:
    modality = str(getattr(d, "Modality", "") or "")
    if modality and modality.upper() != "MR":
        description = str(getattr(d, "SeriesDescription", "") or "")
        raise ImportRefused(f"{name}: modality {modality}{f' ({description})' if description else ''}, not MR: "
                            "only MR images are imported")


def _slice_key(d) -> tuple[float, int]:
    """Where a DICOM image lies in its series: along the slice normal when the geometry is
    there, then by InstanceNumber."""
    position = getattr(d, "ImagePositionPatient", None)
    orientation = getattr(d, "ImageOrientationPatient", None)
    along = 0.0
    if position is not None and orientation is not None and len(orientation) == 6:
        normal = np.cross(np.asarray(orientation[:3], float), np.asarray(orientation[3:], float))
        along = float(np.dot(normal, np.asarray(position, float)))
    return along, int(getattr(d, "InstanceNumber", 0) or 0)


def _read_image(path: Path) -> tuple[Any, np.ndarray]:
    """One DICOM file's dataset and rescaled pixels; ImportRefused naming the file and the reason
    (unreadable or truncated, not MR, a compression without decoder)."""
    import pydicom

    try:
        d = pydicom.dcmread(str(path))
    except Exception as err:  # noqa: BLE001 - pydicom raises many kinds for a damaged file; each is this file's refusal
        raise ImportRefused(f"{path}: not a readable DICOM file ({type(err).__name__}: "
                            f"{(str(err).splitlines() or [''])[0][:160]})") from None
    _check_mr(d, str(path))
    try:
        return d, _pixels(d, str(path))
    except ImportRefused:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated pixel element, a bad length: this file only
        raise ImportRefused(f"{path}: the pixel data cannot be read ({type(err).__name__}: "
                            f"{(str(err).splitlines() or [''])[0][:160]})") from None


def _positions(keyed: list[tuple[tuple[float, int], Any, np.ndarray]], name: str,
               summary: ImportSummary) -> tuple[list[tuple[tuple[float, int], Any, np.ndarray]], np.ndarray | None]:
    """The images of one series in slice order with exact copies at one position dropped, and
    their positions along the slice normal (None without geometry); warnings for copies, for
    distinct images sharing a position and for gaps in the slice spacing."""
    has_geometry = all(getattr(d, "ImagePositionPatient", None) is not None
                       and len(getattr(d, "ImageOrientationPatient", None) or ()) == 6 for _, d, _ in keyed)
    if not has_geometry:
        if len(keyed) > 1:
            summary.warn(f"{name}: no slice geometry (ImagePositionPatient / ImageOrientationPatient): "
                         f"{len(keyed)} images ordered by InstanceNumber, positions unknown")
        return keyed, None
    kept: list[tuple[tuple[float, int], Any, np.ndarray]] = []
    copies = 0
    for item in keyed:
        if kept and abs(kept[-1][0][0] - item[0][0]) < 1e-3 and np.array_equal(kept[-1][2], item[2]):
            copies += 1
            continue
        kept.append(item)
    if copies:
        summary.warn(f"{name}: {copies} exact copies of images at the same slice position dropped")
    along = np.array([k[0][0] for k in kept])
    distinct, counts = np.unique(np.round(along, 3), return_counts=True)
    if (counts > 1).any():
        summary.warn(f"{name}: {int(counts[counts > 1].sum())} images at {int((counts > 1).sum())} slice position(s) "
                     "share them with another (echoes, repeats or a second stack?): imported as separate slices "
                     "in InstanceNumber order")
    if len(distinct) >= 3:
        steps = np.diff(distinct)
        usual = float(np.median(steps))
        gaps = [(float(a), float(b)) for a, b, step in zip(distinct[:-1], distinct[1:], steps) if step > 1.5 * usual]
        if gaps:
            shown = ", ".join(f"{a - distinct[0]:.1f} to {b - distinct[0]:.1f} mm" for a, b in gaps[:3])
            summary.warn(f"{name}: missing slice positions (spacing {usual:.2f} mm, gaps {shown}"
                         f"{', ...' if len(gaps) > 3 else ''})")
    return kept, along - along[0]


def _dicom_files(files: list[Path], name: str, summary: ImportSummary | None = None) -> Volume:
    """One DICOM series (its files, any order) as a volume. Each file is read on its own: an
    unreadable, truncated, non-MR or undecodable file is skipped with its reason (in
    ``summary``) and the series keeps the rest; ImportRefused when no file is left or the images
    have different sizes."""
    summary = summary if summary is not None else ImportSummary()
    keyed = []
    reasons = []
    for path in files:
        try:
            d, pixels = _read_image(path)
        except ImportRefused as err:
            reasons.append(str(err))
            if len(files) > 1:
                summary.skip(str(err))
            continue
        keyed.append((_slice_key(d), d, pixels))
    if not keyed:
        raise ImportRefused(reasons[0] if len(reasons) == 1 else f"{name}: none of its {len(files)} files "
                            f"imports ({reasons[0]}; ...)")
    keyed.sort(key=lambda item: item[0])
    keyed, positions = _positions(keyed, name, summary)
    slices, where = [], []
    for (along, _), _, pixels in keyed:
        frames = pixels if pixels.ndim == 3 else [pixels]
        slices.extend(frames)
        where.extend([along] * len(frames))
    shapes = {s.shape for s in slices}
    if len(shapes) != 1:
        raise ImportRefused(f"{name}: images of different sizes {sorted(shapes)} in one series")
    if positions is not None and len(where) != len(positions):  # multi-frame files: no per-frame geometry here
        positions = None
    return Volume(name, np.stack(slices), "dicom", positions)


def _dicom_series(files: list[Path], root: Path, summary: ImportSummary) -> dict[str, list[Path]]:
    """DICOM files grouped by SeriesInstanceUID (headers only; an unreadable file is skipped with
    its reason), each series named by its SeriesDescription, else its folder; a name two series
    share gets the folder in front, then a number."""
    import pydicom

    series: dict[str, list[Path]] = {}
    labels: dict[str, tuple[str, str]] = {}
    for path in files:
        try:
            d = pydicom.dcmread(str(path), stop_before_pixels=True)
        except Exception as err:  # noqa: BLE001 - a damaged header: this file only
            summary.skip(f"{path}: not a readable DICOM file ({type(err).__name__}: "
                         f"{(str(err).splitlines() or [''])[0][:160]})")
            continue
        uid = str(getattr(d, "SeriesInstanceUID", "") or f"no-uid:{path.parent}")
        series.setdefault(uid, []).append(path)
        if uid not in labels:
            description = str(getattr(d, "SeriesDescription", "") or "").strip()
            folder = path.parent.relative_to(root).as_posix() if path.parent != root else root.name
            labels[uid] = (description, folder)
    first = {uid: (desc or folder) for uid, (desc, folder) in labels.items()}
    clash = {n for n in first.values() if list(first.values()).count(n) > 1}
    out: dict[str, list[Path]] = {}
    for uid, paths in series.items():
        desc, folder = labels[uid]
        name = f"{folder}/{desc}" if desc and first[uid] in clash else first[uid]
        name = name.replace(" ", "_")
        unique, n = name, 1
        while unique in out:
            n += 1
            unique = f"{name}-{n}"
        out[unique] = sorted(paths)
    return out


def _nifti(path: Path) -> Volume:
    """A NIfTI volume (``.nii``, ``.nii.gz``): its slices along the third axis, as (y, x)
    images; a 4D file's first volume."""
    try:
        import nibabel
    except ImportError:
        raise ImportRefused(f"{path}: NIfTI needs nibabel: pip install nibabel") from None
    data = np.asarray(nibabel.load(str(path)).dataobj, dtype=np.float64)
    if data.ndim == 4:
        data = data[..., 0]
    if data.ndim == 2:
        data = data[..., None]
    if data.ndim != 3:
        raise ImportRefused(f"{path}: NIfTI data must be 2D, 3D or 4D, got shape {data.shape}")
    name = path.name[:-7] if path.name.endswith(".nii.gz") else path.stem
    return Volume(name, np.ascontiguousarray(np.moveaxis(data, 2, 0).transpose(0, 2, 1)), "nifti")


_HDF5 = (".h5", ".hdf5", ".mrd")


def _is_nifti(path: Path) -> bool:
    return path.name.endswith((".nii", ".nii.gz"))


def read_volumes(source: str | Path, summary: ImportSummary | None = None) -> list[Volume]:
    """The volumes of a file or folder: fastMRI / ISMRMRD HDF5 (``.h5``), NIfTI (``.nii``,
    ``.nii.gz``), DICOM (``.dcm`` or files with the DICM preamble). A folder is searched
    recursively: one volume per HDF5 or NIfTI file and per DICOM series (grouped by
    SeriesInstanceUID). In a folder, a file or series that cannot be imported (a modality other
    than MR, a compression without decoder, a truncated file, ...) is skipped with a one-line
    warning that names it, says why and what to install, and the rest imports (a series keeps its
    readable files); duplicate or missing DICOM slice positions are warnings; ValueError when
    nothing imports. ``summary`` collects what was imported and skipped
    (:meth:`ImportSummary.render`). A single file that cannot be imported is an
    :class:`ImportRefused` error."""
    path = Path(source)
    summary = summary if summary is not None else ImportSummary()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        volumes: list[Volume] = []
        dicom = []
        for p in files:
            if p.suffix in _HDF5 or _is_nifti(p):
                try:
                    found = read_volumes(p, summary)
                    volumes += found
                    summary.imported += [f"{v.name} ({len(v.images)} slices)" for v in found]
                except (ImportRefused, OSError) as err:
                    summary.skip(str(err) if isinstance(err, ImportRefused) else f"{p}: cannot be read ({err})")
            elif _is_dicom(p):
                dicom.append(p)
        for name, paths in _dicom_series(dicom, path, summary).items():
            try:
                volume = _dicom_files(paths, name, summary)
            except ImportRefused as err:
                summary.skip(str(err))
                continue
            volumes.append(volume)
            summary.imported.append(f"{name} ({len(volume.images)} slices)")
        if not volumes:
            why = f": {'; '.join(summary.skipped[:3])}" if summary.skipped else ""
            raise ValueError(f"{path}: no importable fastMRI / ISMRMRD HDF5, NIfTI or MR DICOM data in this folder{why}")
        return volumes
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.suffix in _HDF5:
        with h5py.File(path, "r") as f:
            if "kspace" in f or "reconstruction_esc" in f:
                return [_fastmri(path, f)]
            is_mrd = "dataset" in f
        if is_mrd:
            return [_ismrmrd(path)]
        raise ImportRefused(f"{path}: an HDF5 file that is neither fastMRI (kspace / reconstruction_esc) nor "
                            "ISMRMRD (a 'dataset' group)")
    if _is_nifti(path):
        return [_nifti(path)]
    if _is_dicom(path):
        return [_dicom_files([path], path.stem, summary)]
    raise ImportRefused(f"{path}: not a fastMRI / ISMRMRD HDF5, NIfTI or DICOM file")


def _is_dicom(path: Path) -> bool:
    if path.suffix.lower() == ".dcm":
        return True
    with path.open("rb") as fh:
        head = fh.read(132)
    return len(head) == 132 and head[128:] == b"DICM"


def _pydicom_volumes() -> list[Volume]:
    import pydicom.data

    path = Path(pydicom.data.get_testdata_file("MR_small.dcm", download=False) or "")
    return [Volume("pydicom-MR_small", _dicom_files([path], "MR_small").images, "builtin:pydicom")] if path.is_file() else []


def _skimage_volumes() -> list[Volume]:
    brain = _local_skimage_brain()
    if brain is None:
        log.info("scikit-image's brain() is not on this machine (scikit-image >= 0.19 fetches it on first use; "
                 "this importer never downloads): not used")
        return []
    return [Volume("skimage-brain", brain, "builtin:scikit-image")]


def _with_signal(images: np.ndarray, min_fraction: float = 0.15) -> np.ndarray:
    """The slices of a volume in which at least ``min_fraction`` of the pixels are above 10 % of
    the volume's 99th percentile (drops the empty slices at a volume's ends)."""
    level = 0.1 * np.percentile(images, 99)
    keep = (images > level).mean(axis=(1, 2)) >= min_fraction
    return images[keep]


def _nilearn_volumes() -> list[Volume]:
    """nilearn's bundled MNI152 2009a T1 template (1 mm), every 3rd axial slice with signal."""
    import nilearn

    path = Path(nilearn.__file__).parent / "datasets" / "data" / "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
    if not path.is_file():
        return []
    images = _with_signal(_nifti(path).images)[::3]
    return [Volume("nilearn-MNI152-T1", images, "builtin:nilearn")]


_DIPY_FILES = {
    "S0_10slices.nii.gz": "dipy-S0_10slices",  # b0 EPI of a brain, 10 slices
    "aniso_vox.nii.gz": "dipy-aniso_vox",  # a brain at 4 x 4 x 5 mm (ascm_out_test is its denoised copy)
    "test_piesno.nii.gz": "dipy-test_piesno",  # diffusion-weighted brain slices
    "t1_coronal_slice.npy": "dipy-t1_coronal_slice",  # one coronal T1 slice
}


def _dipy_volumes() -> list[Volume]:
    """The real MR images among dipy's bundled data files (:data:`_DIPY_FILES`)."""
    import dipy

    root = Path(dipy.__file__).parent / "data" / "files"
    volumes = []
    for file, name in _DIPY_FILES.items():
        path = root / file
        if not path.is_file():
            continue
        images = np.load(path)[None].astype(np.float64) if file.endswith(".npy") else _nifti(path).images
        volumes.append(Volume(name, _with_signal(images), "builtin:dipy"))
    return volumes


def _pydicom_example_volumes() -> list[Volume]:
    """pydicom's ``examples.overlay``: an abdominal MR slice (300 x 484, liver)."""
    import pydicom.data

    path = Path(pydicom.data.get_testdata_file("examples_overlay.dcm", download=False) or "")
    if not path.is_file():
        return []
    return [Volume("pydicom-overlay", _dicom_files([path], "overlay").images, "builtin:pydicom")]


def _matplotlib_volumes() -> list[Volume]:
    """matplotlib's sample ``s1045.ima.gz``: a 256 x 256 MR head slice (16-bit, little-endian)."""
    import gzip

    import matplotlib

    path = Path(matplotlib.get_data_path()) / "sample_data" / "s1045.ima.gz"
    if not path.is_file():
        return []
    with gzip.open(path, "rb") as fh:
        pixels = np.frombuffer(fh.read(), dtype="<u2")
    if pixels.size != 256 * 256:
        return []
    return [Volume("matplotlib-s1045", pixels.reshape(1, 256, 256).astype(np.float64), "builtin:matplotlib")]


def dead_leaves(size: int, rng: np.random.Generator, radii: tuple[float, float] = (2.0, 64.0),
                leaves: int = 3000, body: bool = True) -> np.ndarray:
    """(size, size) float64 in [0, 1]: a dead-leaves image (disks of power-law radii, density
    ``r^-3`` between ``radii``, drawn front to back so the first ones cover the later ones, each
    a grey level with a weak linear shading), optionally inside an elliptical body outline with
    dark background. Natural-image statistics without any anatomy: restoration networks trained
    on such images transfer to real ones (Achddou et al. 2023; Baradad et al. 2021)."""
    image = np.full((size, size), np.nan)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    r0, r1 = radii
    for _ in range(leaves):
        u = rng.random()  # inverse CDF of p(r) ~ r^-3 on [r0, r1]
        r = 1.0 / math.sqrt(1.0 / r0 ** 2 - u * (1.0 / r0 ** 2 - 1.0 / r1 ** 2))
        cy, cx = rng.uniform(-r, size + r, size=2)
        inside = ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r) & np.isnan(image)
        if inside.any():
            grey, gy, gx = rng.uniform(0.05, 1.0), *rng.normal(0, 0.15 / max(r, 1.0), size=2)
            image[inside] = np.clip(grey + gy * (yy[inside] - cy) + gx * (xx[inside] - cx), 0.0, 1.0)
        if not np.isnan(image).any():
            break
    image = np.nan_to_num(image, nan=rng.uniform(0.05, 1.0))
    if body:
        a, b = rng.uniform(0.3, 0.48, size=2) * size
        outline = ((yy - size / 2) / a) ** 2 + ((xx - size / 2) / b) ** 2 <= 1.0
        image = np.where(outline, image, 0.0)
    return image


def _procedural_volumes(count: int = 4, slices: int = 16, size: int = 256, seed: int = 0) -> list[Volume]:
    """``count`` volumes of dead-leaves images (:func:`dead_leaves`), seeded, half of them
    filling the field of view (as the volumes where networks trained on the pelvis harm do)."""
    volumes = []
    for v in range(count):
        rng = np.random.default_rng([seed, v])
        images = np.stack([dead_leaves(size, rng, body=v % 2 == 0) for _ in range(slices)])
        volumes.append(Volume(f"procedural-dead-leaves-{v}", images, "builtin:procedural"))
    return volumes


BUILTIN = {"pydicom": _pydicom_volumes, "scikit-image": _skimage_volumes, "nilearn": _nilearn_volumes,
           "dipy": _dipy_volumes, "pydicom-examples": _pydicom_example_volumes, "matplotlib": _matplotlib_volumes,
           "procedural": _procedural_volumes}
"""Package -> the real MR images it ships (``procedural``: dead-leaves images made here, no
anatomy at all, for training without real volumes) (read from the installed package, never downloaded),
in the order they are imported (a source added later comes last, so that the implant draws of
the earlier ones do not change).
pydicom-data, nibabel's test data and the raw data of twixtools and pypulseq are deliberately
absent: they are kept for independent checks of models trained on these."""


def builtin_volumes(packages: list[str] | None = None) -> list[Volume]:
    """Real MR images shipped inside installed packages (:data:`BUILTIN`; by default all of
    them, and not the procedural images, which are asked for by name); nothing is downloaded. A package that is not installed is skipped with a warning
    naming it; ValueError when no image is available."""
    names = [n for n in BUILTIN if n != "procedural"] if not packages else packages
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise ValueError(f"unknown builtin source(s) {', '.join(unknown)}: choose from {', '.join(BUILTIN)}")
    volumes = []
    for name in names:
        try:
            volumes += BUILTIN[name]()
        except ImportError:
            package = {"pydicom-examples": "pydicom"}.get(name, name)
            log.warning("%s is not installed: its MR images are not used (pip install %s)", package, package)
    if not volumes:
        raise ValueError(f"no builtin real MR image is available from {', '.join(names)}: pip install "
                         "pydicom nilearn dipy, or pass --source FILE|DIR")
    return volumes


def _local_skimage_brain() -> np.ndarray | None:
    """scikit-image's ``brain()`` slices when a copy is on disk (bundled or in its data cache), else None."""
    try:
        import skimage
        import skimage.data
        import skimage.io
    except ImportError:
        return None
    candidates = [Path(skimage.data.data_dir) / "brain.tiff"]
    try:
        import pooch

        candidates.append(Path(pooch.os_cache("scikit-image")) / skimage.__version__ / "data" / "brain.tiff")
    except ImportError:
        pass
    for path in candidates:
        if path.is_file():
            return np.asarray(skimage.io.imread(str(path)), dtype=np.float64)
    return None


def prepare_slice(image: np.ndarray, matrix: tuple[int, int]) -> np.ndarray:
    """Centre-crop to a square, resample (area-averaging bilinear) to ``matrix``, scale so that
    the 99th percentile is 1."""
    image = np.abs(np.asarray(image, dtype=np.float64))
    h, w = image.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    square = torch.from_numpy(image[top:top + side, left:left + side].copy())[None, None]
    resized = torch.nn.functional.interpolate(square, size=tuple(matrix), mode="bilinear", antialias=True,
                                              align_corners=False)[0, 0].clamp_min(0).numpy()
    scale = np.percentile(resized, 99)
    if not scale > 0:
        raise ValueError("an image with no signal (99th percentile 0) cannot be imported")
    return resized / scale


def _fft2c(image: np.ndarray) -> np.ndarray:
    return fft2c(torch.from_numpy(image)).numpy()


def assign_splits(volumes: list[Volume], train: list[str] = (), val: list[str] = ()) -> list[str]:
    """The split of each volume: ``train`` / ``val`` name volumes (exactly, or by a prefix such as
    ``dipy``); every other volume is ``test``. A volume is one subject, so a split never divides
    a volume's slices. ValueError for a name that matches no volume or both lists."""
    splits = ["test"] * len(volumes)
    for split, names in (("train", train), ("val", val)):
        for name in names:
            hits = [i for i, v in enumerate(volumes) if v.name == name or v.name.startswith(name)]
            if not hits:
                raise ValueError(f"--{split} {name!r} matches no volume; the volumes are: "
                                 f"{', '.join(v.name for v in volumes)}")
            for i in hits:
                if splits[i] != "test" and splits[i] != split:
                    raise ValueError(f"volume {volumes[i].name!r} is named for both train and val")
                splits[i] = split
    return splits


def augment(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``image`` in one of its 8 orientations (a random multiple of 90 degrees, mirrored or not):
    the same anatomy as seen in another plane orientation or readout direction."""
    image = np.rot90(image, int(rng.integers(4)))
    return np.ascontiguousarray(image[:, ::-1] if rng.integers(2) else image)


def simulate_external(config: Config, volumes: list[Volume], out: str | Path, draws: int = 1,
                      progress: bool = True, splits: list[str] | None = None, train_draws: int | None = None,
                      train_augment: bool = False) -> dict:
    """Write the paired dataset of ``volumes`` to ``out``: each volume's slices (``draws``
    implant draws per slice) through the 2D artifact model of section ``artifact2d``, at
    ``sequence.matrix``. Each volume is one subject, in the split ``splits[i]`` (default: all
    in test, a held-out set; :func:`assign_splits`). Training volumes get ``train_draws`` draws
    (default ``draws``), each in a random orientation with ``train_augment`` (:func:`augment`).
    Returns the manifest."""
    from tqdm.auto import tqdm

    train_draws = draws if train_draws is None else train_draws
    if draws < 1 or train_draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws} (train {train_draws})")
    splits = ["test"] * len(volumes) if splits is None else list(splits)
    if len(splits) != len(volumes) or not set(splits) <= {"train", "val", "test"}:
        raise ValueError(f"splits must give train, val or test for each of the {len(volumes)} volumes, got {splits}")
    acfg: Artifact2DConfig = config["artifact2d"]
    seq = config["sequence"]
    matrix = tuple(seq.matrix)
    if matrix[0] != matrix[1]:
        raise ValueError(f"sequence.matrix must be square for imported images, got {matrix}")
    out = Path(out)
    prepare_folder(out)
    ids = [subject_id(i) for i in range(len(volumes))]
    manifest = write_manifest(out, config, {name: [sid for sid, s in zip(ids, splits) if s == name]
                                            for name in ("train", "val", "test")})
    manifest_extra = {"external": [{"subject": sid, "name": v.name, "source": v.source, "slices": len(v.images),
                                    "split": split} for sid, v, split in zip(ids, volumes, splits)]}
    rng = np.random.default_rng(config["dataset"].seed)
    for sid, volume, split in tqdm(list(zip(ids, volumes, splits)), desc="external", unit="volume",
                                   disable=not progress):
        clean, metal, implant, field, draws_meta = [], [], [], [], []
        training = split == "train"
        for image in volume.images:
            base = prepare_slice(image, matrix)
            for _ in range(train_draws if training else draws):
                result = add_implant(augment(base, rng) if training and train_augment else base, acfg, rng)
                clean.append(result.clean)
                metal.append(result.metal)
                implant.append(result.implant)
                field.append(result.field_hz)
                draws_meta.append(result.params)
        k_clean, k_metal = _fft2c(np.stack(clean)), _fft2c(np.stack(metal))
        if acfg.snr > 0:
            sd = float(np.mean(np.stack(clean))) / acfg.snr
            for k in (k_clean, k_metal):
                k += sd / math.sqrt(2) * (rng.standard_normal(k.shape) + 1j * rng.standard_normal(k.shape))
        n = len(clean)
        per = n // len(volume.images)  # the draws of one image follow each other
        if volume.positions_mm is not None:  # the series' own geometry
            centres = [float(volume.positions_mm[i // per]) for i in range(n)]
        else:  # no geometry: every slice (each draw too) one slice thickness from the last
            centres = [float(i * seq.slice_thickness_mm) for i in range(n)]
        data = SubjectData(
            subject_id=sid, kspace_metal=k_metal.astype(np.complex64), kspace_clean=k_clean.astype(np.complex64),
            images_metal=magnitude(torch.from_numpy(k_metal)).numpy().astype(np.float32),
            images_clean=magnitude(torch.from_numpy(k_clean)).numpy().astype(np.float32),
            implant_mask=np.stack(implant).astype(np.uint8), field_map_hz=np.stack(field).astype(np.float32),
            slice_centres_mm=centres, fov_centre_mm=(0.0, 0.0),
            anatomy={"external": {"name": volume.name, "source": volume.source,
                                  "positions": volume.positions_mm is not None}},
            implant={"model": "artifact2d", "draws": draws_meta, "config": to_dict(acfg)},
            scanner={"sequence": {"n_slices": n, "b0_t": acfg.b0_t, "readout_bw_hz_per_px": acfg.readout_bw_hz_per_px}},
        )
        write_subject(data, subject_file(out, split, sid), config, split)
    manifest.update(manifest_extra)
    (out / "external.json").write_text(json.dumps(manifest_extra, indent=1) + "\n")
    log.info("external dataset %s: %d volumes, %d slices", out, len(volumes),
             sum(len(v.images) for v in volumes) * draws)
    return manifest
