"""The dataset format of DESIGN.md ("Data"): the one module that reads and writes it.

A dataset is a folder with ``manifest.json`` and ``{train,val,test}/<subject>.h5``. Each
subject file holds the ISMRMRD groups ``metal`` and ``clean`` (header + one acquisition per PE
line per slice, written and read by :mod:`sim_scanner.dataset.mrd_hdf5`), the fast arrays
``kspace/{metal,clean}`` (complex64 [slice, pe, ro]), ``images/{metal,clean}`` (float32
[slice, y, x]), ``implant_mask`` (uint8 [slice, y, x]), ``field_map_hz`` (float32
[slice, y, x], off-resonance with the implant at each slice centre), and every simulation
parameter as attributes: the dataset's config, the subject's drawn anatomy and implant, and how
the subject was scanned (``scanner_json``: pose, field strength, bandwidth, noise level...,
drawn per subject by the ``variation`` section; absent in files written before it existed).

Everything else (the simulator, the scanner, training, previews) goes through the writers and
readers here; none of them names a file, group, dataset or attribute of the format itself.
This module imports no physics: the scanner client depends on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h5py
import numpy as np

from masc_gadget import __version__
from masc_gadget.config import Config, from_dict, to_dict
from sim_scanner.dataset import mrd_hdf5 as mrd
from sim_scanner.physics.sequence import SequenceConfig

_READ_LOCK = threading.RLock()


def _serialized(read: Callable) -> Callable:
    """Subject files are read one at a time per process: HDF5 reads of the same files from
    several threads at once (concurrent simulated scanners) crash the HDF5 library."""

    @functools.wraps(read)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _READ_LOCK:
            return read(*args, **kwargs)

    return locked

# ---------------------------------------------------------------------------------- the folder

SPLITS = ("train", "val", "test")
"""Split names, also the names of the split folders."""
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SUBJECT_SUFFIX = ".h5"
TMP_SUFFIX = ".tmp"
"""Suffix of a file being written (renamed into place when complete)."""
SIM_SECTIONS = ("dataset", "phantom", "implant", "sequence", "physics", "variation")
"""Config sections that describe the simulation (manifest ``config``, attribute ``config_json``)."""
ADDED_SECTIONS = ("variation",)
"""Simulation sections added after datasets were first written, whose defaults simulate exactly
what those datasets hold: a manifest without one counts as holding its defaults."""
SUBJECT_SECTIONS = ("sequence", "physics")
"""Sections whose fields a subject's ``scanner`` record may override for that subject."""

# ------------------------------------------------------------------------- inside a subject file

MRD_METAL = "metal"
MRD_CLEAN = "clean"
MRD_GROUPS = (MRD_METAL, MRD_CLEAN)
"""ISMRMRD groups: the partner with the implant's field, and the clean one."""

KSPACE_METAL = "kspace/metal"
KSPACE_CLEAN = "kspace/clean"
IMAGES_METAL = "images/metal"
IMAGES_CLEAN = "images/clean"
IMPLANT_MASK = "implant_mask"
FIELD_MAP_HZ = "field_map_hz"
ARRAYS = {
    # SubjectData / SubjectFile field -> HDF5 dataset
    "kspace_metal": KSPACE_METAL,
    "kspace_clean": KSPACE_CLEAN,
    "images_metal": IMAGES_METAL,
    "images_clean": IMAGES_CLEAN,
    "implant_mask": IMPLANT_MASK,
    "field_map_hz": FIELD_MAP_HZ,
}
"""The fast arrays of a subject file, in writing order."""

ATTR_SUBJECT_ID = "subject_id"
ATTR_SPLIT = "split"
ATTR_FORMAT_VERSION = "format_version"
ATTR_MASC_VERSION = "masc_version"
ATTR_SEED = "seed"
ATTR_SLICE_CENTRES = "slice_centres_mm"
ATTR_FOV_CENTRE = "fov_centre_mm"
ATTR_CONFIG_JSON = "config_json"
ATTR_ANATOMY_JSON = "anatomy_json"
ATTR_IMPLANT_JSON = "implant_json"
ATTR_SCANNER_JSON = "scanner_json"
ATTR_IMPLANT_SIDE = "implant.side"
IMPLANT_PARTS = ("stem", "head", "liner", "cup")


def sequence_attr(key: str) -> str:
    """Attribute holding field ``key`` of the sequence config, e.g. ``sequence.b0_t``."""
    return f"sequence.{key}"


def physics_attr(key: str) -> str:
    """Attribute holding field ``key`` of the physics config."""
    return f"physics.{key}"


def implant_material_attr(part: str) -> str:
    """Attribute holding the material of implant ``part`` (one of IMPLANT_PARTS)."""
    return f"implant.{part}_material"


# ------------------------------------------------------------------------------------ subjects


def subject_id(index: int) -> str:
    return f"sub-{index:04d}"


def subject_index(subject: str) -> int:
    """The index a subject id was made from (inverse of :func:`subject_id`)."""
    return int(subject.split("-")[1])


def subject_file(folder: str | Path, split: str, subject: str) -> Path:
    """Where ``subject`` of ``split`` lives in dataset ``folder`` (whether or not it exists)."""
    return Path(folder) / split / f"{subject}{SUBJECT_SUFFIX}"


def is_dataset(folder: str | Path) -> bool:
    """Whether ``folder`` holds a dataset (has a manifest)."""
    return (Path(folder) / MANIFEST).is_file()


def prepare_folder(out: str | Path, clean: bool = True) -> None:
    """Create ``out`` and its split folders; with ``clean``, remove files left half-written by a
    killed run (not while other processes may be writing into the folder)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        (out / split).mkdir(exist_ok=True)
        if clean:
            for stale in (out / split).glob(f"*{SUBJECT_SUFFIX}{TMP_SUFFIX}"):
                stale.unlink()


def split_files(data_dir: str | Path, split: str, allow_empty: bool = False) -> list[Path]:
    """Subject files of ``split`` (sorted), with errors that say what is wrong (an empty split
    is one, unless ``allow_empty``)."""
    data_dir = Path(data_dir)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not is_dataset(data_dir):
        raise FileNotFoundError(
            f"{data_dir} is not a MASC dataset (no {MANIFEST}); create one with masc simulate dataset"
        )
    files = sorted((data_dir / split).glob(f"*{SUBJECT_SUFFIX}"))
    if not files and not allow_empty:
        raise ValueError(f"{data_dir} has no subjects in split {split!r}")
    return files


# ------------------------------------------------------------------------------------ manifest


def sim_config_dict(config: Config) -> dict[str, Any]:
    """The simulation sections of ``config`` as plain data (what the manifest records)."""
    return {k: to_dict(config[k]) for k in SIM_SECTIONS}


def write_manifest(out: Path, config: Config, splits: dict[str, list[str]]) -> dict[str, Any]:
    """Write ``out/manifest.json`` atomically; returns the manifest."""
    import torch  # for its version only; the scanner never writes a manifest

    manifest = {
        "format_version": FORMAT_VERSION,
        "name": config["dataset"].name,
        "seed": config["dataset"].seed,
        "splits": splits,
        "subjects": sorted(s for ids in splits.values() for s in ids),
        "config": sim_config_dict(config),
        "versions": {
            "masc": __version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "h5py": h5py.__version__,
        },
        "layout": {
            "kspace": "complex64 [slice, pe, ro]; image = |centred orthonormal 2D IFFT|",
            "images": "float32 magnitude [slice, y, x]",
            IMPLANT_MASK: "uint8 [slice, y, x], 1 where the pixel contains implant",
            FIELD_MAP_HZ: "float32 [slice, y, x], off-resonance with the implant, slice centre",
            "mrd_groups": list(MRD_GROUPS),
        },
    }
    tmp = out / (MANIFEST + TMP_SUFFIX)
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def _comparable(sim: dict[str, Any]) -> dict[str, Any]:
    """The parts of a config that change the simulated data (not workers / device / count)."""
    sim = json.loads(json.dumps(sim))
    for key in ("workers", "subjects", "name"):
        sim["dataset"].pop(key, None)
    sim["physics"].pop("device", None)
    return sim


def same_simulation(manifest: dict[str, Any], config: Config, splits: dict[str, list[str]]) -> bool:
    """Whether ``manifest`` records a dataset simulated with ``config``'s data-changing
    parameters and the same ``splits`` (so a rerun may resume into it). A section of
    ADDED_SECTIONS missing from the manifest counts as its defaults, which simulate what such
    a dataset holds; any other value of it is another simulation."""
    old = dict(manifest.get("config", {}))
    for name in ADDED_SECTIONS:
        old.setdefault(name, to_dict(type(config[name])()))
    return _comparable(old) == _comparable(sim_config_dict(config)) and manifest.get("splits") == splits


def split_counts(manifest: dict[str, Any]) -> dict[str, int]:
    """Subjects per split, e.g. {"train": 22, "val": 4, "test": 4}."""
    return {split: len(ids) for split, ids in manifest.get("splits", {}).items()}


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a MASC dataset: {MANIFEST} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def subject_path(folder: str | Path, subject: str, manifest: dict[str, Any] | None = None) -> Path:
    """Path of ``subject``'s file in dataset ``folder`` (ValueError naming the known subjects)."""
    manifest = manifest or read_manifest(folder)
    for split, ids in manifest["splits"].items():
        if subject in ids:
            return subject_file(folder, split, subject)
    known = manifest.get("subjects", [])
    raise ValueError(
        f"subject {subject!r} is not in {folder}; known subjects: "
        + ", ".join(known[:10]) + (" ..." if len(known) > 10 else "")
    )


def split_subjects(folder: str | Path, split: str, manifest: dict[str, Any] | None = None) -> list[str]:
    """Subject ids of ``split`` as the manifest lists them (ValueError naming the splits)."""
    manifest = manifest or read_manifest(folder)
    splits = manifest.get("splits", {})
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {folder}; splits: {', '.join(sorted(splits))}")
    return list(splits[split])


def default_subject(manifest: dict[str, Any]) -> str | None:
    """The subject shown when none is named: the first test subject (else val, else train)."""
    for split in ("test", "val", "train"):
        if manifest["splits"].get(split):
            return manifest["splits"][split][0]
    return None


# ------------------------------------------------------------------------------ writing subjects


@dataclass
class SubjectData:
    """One simulated subject, everything that goes into its file."""

    subject_id: str
    kspace_metal: np.ndarray
    kspace_clean: np.ndarray
    images_metal: np.ndarray
    images_clean: np.ndarray
    implant_mask: np.ndarray
    field_map_hz: np.ndarray
    slice_centres_mm: list[float]
    fov_centre_mm: tuple[float, float]
    anatomy: dict[str, Any] = field(default_factory=dict)
    implant: dict[str, Any] = field(default_factory=dict)
    scanner: dict[str, Any] = field(default_factory=dict)
    """How the subject was scanned (JSON-able: pose, field strength...); under the keys of
    SUBJECT_SECTIONS, the fields of those config sections as this subject's scan set them."""
    kspace_metal_coils: np.ndarray | None = None
    """(slice, coil, pe, ro) complex64: the metal scan as a multi-coil array sends it
    (``physics.coils`` > 1), written as the ``metal`` ISMRMRD group; None: single-coil."""


def subject_section(config: Config, scanner: Mapping[str, Any], name: str) -> Any:
    """Config section ``name`` as one subject was simulated with it: ``config``'s, with the
    fields that the subject's ``scanner`` record overrides under ``name``."""
    if name not in SUBJECT_SECTIONS:
        raise ValueError(
            f"subjects override only the sections {', '.join(SUBJECT_SECTIONS)}, not {name!r}"
        )
    overrides = scanner.get(name) or {}
    return dataclasses.replace(config[name], **overrides) if overrides else config[name]


def write_subject(data: SubjectData, path: Path, config: Config, split: str) -> None:
    """Write one subject file atomically (temporary name, then rename)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.unlink(missing_ok=True)
    try:
        _write_mrd_groups(tmp, data, config)
        comp = None if config["dataset"].compression == "none" else config["dataset"].compression
        with h5py.File(tmp, "a") as f:
            opts = {"compression": comp} if comp else {}
            for name, dataset in ARRAYS.items():
                f.create_dataset(dataset, data=getattr(data, name), **opts)
            _write_attrs(f.attrs, data, config, split)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_mrd_groups(path: Path, data: SubjectData, config: Config) -> None:
    """The ISMRMRD groups ``metal`` and ``clean``: header + every line of every slice, with the
    subject's own sequence (field strength, bandwidths)."""
    seq = subject_section(config, data.scanner, "sequence")
    metal = data.kspace_metal if data.kspace_metal_coils is None else data.kspace_metal_coils
    for group, kspace in ((MRD_METAL, metal), (MRD_CLEAN, data.kspace_clean)):
        header = mrd.build_header(
            seq,
            subject_id=data.subject_id,
            slice_centres_mm=data.slice_centres_mm,
            fov_centre_mm=data.fov_centre_mm,
            measurement_id=f"{config['dataset'].name}/{data.subject_id}/{group}",
            extra_user_parameters={"masc_partner": group},
            receiver_channels=kspace.shape[1] if kspace.ndim == 4 else 1,
        )
        acqs = mrd.acquisitions_from_kspace(kspace, seq, data.slice_centres_mm, data.fov_centre_mm)
        mrd.write_mrd_group(path, group, header, acqs)


def _write_attrs(attrs: h5py.AttributeManager, data: SubjectData, config: Config, split: str) -> None:
    attrs[ATTR_SUBJECT_ID] = data.subject_id
    attrs[ATTR_SPLIT] = split
    attrs[ATTR_FORMAT_VERSION] = FORMAT_VERSION
    attrs[ATTR_MASC_VERSION] = __version__
    attrs[ATTR_SEED] = config["dataset"].seed
    attrs[ATTR_SLICE_CENTRES] = np.asarray(data.slice_centres_mm)
    attrs[ATTR_FOV_CENTRE] = np.asarray(data.fov_centre_mm)
    for key, value in to_dict(subject_section(config, data.scanner, "sequence")).items():
        attrs[sequence_attr(key)] = value
    for key, value in to_dict(subject_section(config, data.scanner, "physics")).items():
        attrs[physics_attr(key)] = value
    attrs[ATTR_IMPLANT_SIDE] = data.implant.get("side", "")
    for part in IMPLANT_PARTS:
        mat = data.implant.get("materials", {}).get(part)
        if mat is not None:
            attrs[implant_material_attr(part)] = mat
    attrs[ATTR_CONFIG_JSON] = json.dumps(sim_config_dict(config))
    attrs[ATTR_ANATOMY_JSON] = json.dumps(data.anatomy)
    attrs[ATTR_IMPLANT_JSON] = json.dumps(data.implant)
    attrs[ATTR_SCANNER_JSON] = json.dumps(data.scanner)


# ------------------------------------------------------------------------------ reading subjects


@dataclass
class SubjectFile:
    """A subject file read back: the fast arrays asked for (None: not read) and every attribute."""

    path: Path
    kspace_metal: np.ndarray | None = None
    kspace_clean: np.ndarray | None = None
    images_metal: np.ndarray | None = None
    images_clean: np.ndarray | None = None
    implant_mask: np.ndarray | None = None
    field_map_hz: np.ndarray | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def require(self, *names: str) -> None:
        """ValueError unless every attribute in ``names`` is present."""
        missing = [k for k in names if k not in self.attrs]
        if missing:
            raise ValueError(f"{self.path}: missing attributes {missing} (not a MASC subject file?)")

    @property
    def slice_centres_mm(self) -> list[float]:
        self.require(ATTR_SLICE_CENTRES)
        return [float(z) for z in np.atleast_1d(self.attrs[ATTR_SLICE_CENTRES])]

    @property
    def fov_centre_mm(self) -> tuple[float, ...]:
        """(y, x) in mm, as everywhere in the simulator (two values in a valid file)."""
        self.require(ATTR_FOV_CENTRE)
        return tuple(float(v) for v in np.atleast_1d(self.attrs[ATTR_FOV_CENTRE]))

    @property
    def sim_config(self) -> dict[str, Any]:
        """The simulation sections the subject was simulated with (attribute ``config_json``)."""
        self.require(ATTR_CONFIG_JSON)
        return json.loads(self.attrs[ATTR_CONFIG_JSON])

    @property
    def anatomy(self) -> dict[str, Any]:
        """The subject's drawn anatomy parameters ({} when the file has none)."""
        return json.loads(self.attrs.get(ATTR_ANATOMY_JSON, "{}"))

    @property
    def implant(self) -> dict[str, Any]:
        """The subject's drawn implant, anatomical coordinates ({} when the file has none)."""
        return json.loads(self.attrs.get(ATTR_IMPLANT_JSON, "{}"))

    @property
    def scanner(self) -> dict[str, Any]:
        """How the subject was scanned (:attr:`SubjectData.scanner`); {} in files written
        before per-subject variation, which were scanned exactly as their config says."""
        return json.loads(self.attrs.get(ATTR_SCANNER_JSON, "{}"))

    @property
    def sequence(self) -> SequenceConfig:
        """The sequence this subject was scanned with: the config's, with the subject's
        overrides (field strength, bandwidths, slab offset)."""
        data = {**(self.sim_config.get("sequence") or {}), **(self.scanner.get("sequence") or {})}
        return from_dict(SequenceConfig, data, "sequence")


@_serialized
def read_subject(path: str | os.PathLike, arrays: Iterable[str] = tuple(ARRAYS)) -> SubjectFile:
    """Read the fast ``arrays`` (SubjectFile field names, default all) and the attributes of a
    subject file; ValueError when it is not a readable MASC subject file."""
    out = SubjectFile(Path(path))
    try:
        with h5py.File(path, "r") as f:
            for name in arrays:
                dataset = ARRAYS[name]
                if dataset not in f:
                    raise ValueError(f"{path} is not a readable MASC subject file: no {dataset} dataset")
                setattr(out, name, f[dataset][()])
            out.attrs = dict(f.attrs)
    except (OSError, KeyError) as err:
        raise ValueError(f"{path} is not a readable MASC subject file: {err}") from None
    return out


@_serialized
def subject_slices(path: str | os.PathLike) -> int:
    """Slices in a subject file (0 when it has no metal k-space), without reading the data."""
    with h5py.File(path, "r") as f:
        return int(f[KSPACE_METAL].shape[0]) if KSPACE_METAL in f else 0


class ScanInput(NamedTuple):
    """What the scanner replays for one subject."""

    header_xml: str
    """ISMRMRD header of the ``metal`` group."""
    kspace: np.ndarray
    """(n_slices, n_coils, n_pe, n_readout) complex64, the fully sampled metal k-space as the
    scanner's receive channels record it (one coil for a single-coil dataset)."""
    clean: np.ndarray
    """(n_slices, y, x) float32, the clean fully sampled images (ground truth)."""
    seq: SequenceConfig
    slice_centres_mm: list[float]
    fov_centre_mm: tuple[float, float]
    """(y, x), as everywhere in the simulator."""
    templates: dict | None = None
    """A recorded scan's acquisition headers by (slice, grid row), sent as recorded (their flags,
    counter and time stamp set by the replay); None: built from ``seq`` (a simulated subject)."""


@_serialized
def read_scan_input(path: str | os.PathLike) -> ScanInput:
    """Read a subject file for the scanner: metal header + k-space (from the ISMRMRD group),
    clean images, sequence and geometry, checked against each other."""
    group = mrd.read_mrd_group(path, MRD_METAL)
    sub = read_subject(path, ("images_clean",))
    sub.require(ATTR_CONFIG_JSON, ATTR_SLICE_CENTRES, ATTR_FOV_CENTRE)
    clean = np.asarray(sub.images_clean, dtype=np.float32)
    centres, fov = sub.slice_centres_mm, sub.fov_centre_mm
    seq = sub.sequence
    kspace = group.kspace if group.kspace.ndim == 4 else group.kspace[:, None]
    n_slices, _, n_pe, n_ro = kspace.shape
    if (seq.n_slices, seq.n_pe, seq.n_readout) != (n_slices, n_pe, n_ro):
        raise ValueError(
            f"{path}: metal k-space {group.kspace.shape} does not match the sequence "
            f"({seq.n_slices}, {seq.n_pe}, {seq.n_readout})"
        )
    if clean.shape != (n_slices, n_pe, n_ro):
        raise ValueError(
            f"{path}: {IMAGES_CLEAN} {clean.shape} does not match the k-space {group.kspace.shape}"
        )
    if len(centres) != n_slices or len(fov) != 2:
        raise ValueError(f"{path}: slice_centres_mm / fov_centre_mm do not match {n_slices} slices")
    return ScanInput(group.header_xml, kspace, clean, seq, centres, (fov[0], fov[1]))
