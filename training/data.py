"""Loading simulated datasets (the folder layout of DESIGN.md "Data") into batched tensors.

The files are read through :mod:`sim_scanner.dataset.layout`, the owner of the format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from sim_scanner.dataset.layout import read_subject, split_files

log = logging.getLogger(__name__)

REGIONS = ("image", "implant")
"""Where a line choice is rewarded or scored: the whole image, or the periprosthetic region
(:meth:`SliceSet.periprosthetic_roi`)."""

_ARRAYS = ("kspace_metal", "kspace_clean", "images_clean", "images_metal", "implant_mask")
"""The fast arrays a SliceSet holds (layout.SubjectFile fields)."""


@dataclass
class SliceSet:
    """Every slice of one split, stacked (N slices).

    ``kspace_metal`` / ``kspace_clean``: (N, PE, RO) complex64, what a scanner records with and
    without the implant's field; ``target``: (N, H, W) float32 clean fully sampled image (the
    ground truth, H = PE, W = RO); ``metal_image``: (N, H, W) fully sampled metal image;
    ``implant_mask``: (N, H, W) uint8; ``subjects`` / ``slices``: where each slice comes from.
    """

    kspace_metal: torch.Tensor
    kspace_clean: torch.Tensor
    target: torch.Tensor
    metal_image: torch.Tensor
    implant_mask: torch.Tensor
    subjects: list[str]
    slices: np.ndarray

    def __len__(self) -> int:
        return int(self.target.shape[0])

    @property
    def n_pe(self) -> int:
        return int(self.kspace_metal.shape[1])

    def subset(self, index: np.ndarray | list[int] | slice) -> "SliceSet":
        idx = np.arange(len(self))[index]
        t = torch.as_tensor(idx, dtype=torch.long)
        return SliceSet(
            self.kspace_metal[t], self.kspace_clean[t], self.target[t], self.metal_image[t],
            self.implant_mask[t], [self.subjects[i] for i in idx], self.slices[idx],
        )

    def label(self, i: int) -> str:
        return f"{self.subjects[i]}/{int(self.slices[i])}"

    def periprosthetic_roi(self, margin: int) -> torch.Tensor:
        """(N, H, W) bool: each slice's implant mask dilated by ``margin`` pixels, the region a
        radiologist reads around an implant. A slice the implant does not cross takes its
        subject's implant footprint (the union over its slices); a subject with no implant at
        all, the whole image."""
        if margin < 0:
            raise ValueError(f"margin must be >= 0 pixels, got {margin}")
        mask = self.implant_mask.bool()
        footprint = {}
        for s in dict.fromkeys(self.subjects):
            rows = torch.as_tensor([i for i, x in enumerate(self.subjects) if x == s])
            footprint[s] = mask[rows].any(dim=0)
        roi = mask.clone()
        for i, s in enumerate(self.subjects):
            if not bool(roi[i].any()):
                roi[i] = footprint[s] if bool(footprint[s].any()) else True
        if margin > 0:
            roi = F.max_pool2d(roi[:, None].float(), 2 * margin + 1, stride=1, padding=margin)[:, 0] > 0
        return roi


def spread_subset(data: SliceSet, count: int) -> SliceSet:
    """``count`` slices evenly spread over ``data`` (all when count is 0 or >= len(data)), so a
    subsample covers every subject and slice position rather than the first subjects."""
    if count <= 0 or count >= len(data):
        return data
    return data.subset(np.unique(np.linspace(0, len(data) - 1, count).round().astype(np.int64)))


def data_dirs(data: str | Path | list[str | Path]) -> list[Path]:
    """The dataset folders named by ``data``: a path, a comma-separated list of paths, or a list."""
    if isinstance(data, (list, tuple)):
        return [Path(d) for d in data]
    return [Path(d) for d in str(data).split(",") if d]


def load_split(data_dir: str | Path | list[str | Path], split: str, max_slices: int = 0) -> SliceSet:
    """Read the fast arrays of every subject of ``split`` (first ``max_slices`` slices if > 0).

    Several folders (a list or ``A,B``) are concatenated in order, every subject named
    ``FOLDER/sub-XXXX`` so that subjects of different folders stay apart; a folder with no
    subject in ``split`` is skipped (ValueError when none has one). ``max_slices`` applies to
    each folder."""
    dirs = data_dirs(data_dir)
    if len(dirs) != 1:
        sets = [_load_one(d, split, max_slices, prefix=f"{d.name}/") for d in dirs
                if split_files(d, split, allow_empty=True)]
        if not sets:
            raise ValueError(f"no subject of split {split!r} in {', '.join(map(str, dirs))}")
        return SliceSet(*(torch.cat([getattr(s, f) for s in sets]) for f in _TENSORS),
                        [name for s in sets for name in s.subjects], np.concatenate([s.slices for s in sets]))
    return _load_one(dirs[0], split, max_slices)


_TENSORS = ("kspace_metal", "kspace_clean", "target", "metal_image", "implant_mask")


def _load_one(data_dir: Path, split: str, max_slices: int = 0, prefix: str = "") -> SliceSet:
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("km", "kc", "t", "m", "mask")}
    subjects: list[str] = []
    slices: list[np.ndarray] = []
    shape = None
    for path in split_files(data_dir, split):
        sub = read_subject(path, _ARRAYS)
        km, kc, tgt, met, mask = (getattr(sub, name) for name in _ARRAYS)
        if shape is None:
            shape = km.shape[1:]
        elif km.shape[1:] != shape:
            raise ValueError(f"{path} has matrix {km.shape[1:]}, other subjects {shape}")
        parts["km"].append(km)
        parts["kc"].append(kc)
        parts["t"].append(tgt)
        parts["m"].append(met)
        parts["mask"].append(mask)
        subjects += [prefix + path.stem] * km.shape[0]
        slices.append(np.arange(km.shape[0]))
        if max_slices and len(subjects) >= max_slices:
            break
    n = max_slices if max_slices else len(subjects)
    cat = {k: np.concatenate(v)[:n] for k, v in parts.items()}
    log.info("loaded %d slices of split %s from %s", n, split, data_dir)
    return SliceSet(
        torch.from_numpy(cat["km"]),
        torch.from_numpy(cat["kc"]),
        torch.from_numpy(cat["t"].astype(np.float32)),
        torch.from_numpy(cat["m"].astype(np.float32)),
        torch.from_numpy(cat["mask"]),
        subjects[:n],
        np.concatenate(slices)[:n],
    )


def _anatomy_config_sha256(manifest: dict[str, Any]) -> str:
    """SHA-256 of what draws a simulated set's anatomies: its config without the subject count,
    split fractions, name, workers and compression (two sets with equal hashes draw subject i
    alike, from ``SeedSequence([dataset seed, i])``)."""
    import hashlib
    import json

    config = json.loads(json.dumps(manifest.get("config", {})))
    for key in ("subjects", "split_fractions", "name", "workers", "compression"):
        config.get("dataset", {}).pop(key, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def anatomies(folder: str | Path, split: str) -> list[str]:
    """What each subject of a split *is*, comparable across data sets: for a simulated set, its
    generator (:func:`_anatomy_config_sha256`) and subject index; for an imported one
    (``external.json``), the name of the real volume it was made from."""
    import json

    from sim_scanner.dataset.layout import read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    ids = manifest.get("splits", {}).get(split, [])
    external = folder / "external.json"
    if external.is_file():
        names = {e["subject"]: e["name"] for e in json.loads(external.read_text()).get("external", [])}
        return [f"volume:{names.get(sid, sid)}" for sid in ids]
    generator = _anatomy_config_sha256(manifest)[:16]
    return [f"{generator}:{sid}" for sid in ids]


def data_identity(folder: str | Path) -> dict[str, Any]:
    """What identifies a data set a model was trained on: its name, dataset seed, subject
    count, split sizes, the SHA-256 of its manifest and the anatomies of its training split
    (:func:`anatomies`)."""
    import hashlib

    from sim_scanner.dataset.layout import MANIFEST, read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    return {"folder": folder.name, "name": manifest.get("name"), "seed": manifest.get("seed"),
            "subjects": len(manifest.get("subjects", [])),
            "splits": {k: len(v) for k, v in manifest.get("splits", {}).items()},
            "manifest_sha256": hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest(),
            "train_anatomies": anatomies(folder, "train")}


def repeats_training_anatomies(folder: str | Path, split: str, trained_on: list[dict[str, Any]]) -> str | None:
    """Why ``split`` of ``folder`` holds anatomies a model was trained on (``trained_on``: the
    :func:`data_identity` records in its provenance), or None. Subject i of a simulated set is
    drawn from ``SeedSequence([dataset seed, i])`` whatever the subject count, so a set with the
    training set's seed and generator but another subject count repeats training subjects under
    other splits; an imported set repeats a real volume by name."""
    seen = {a for record in trained_on for a in record.get("train_anatomies", [])}
    mine = anatomies(folder, split)
    shared = [a for a in mine if a in seen]
    if not shared:
        return None
    shown = ", ".join(a.split(":", 1)[1] for a in shared[:4]) + (", ..." if len(shared) > 4 else "")
    where = f"{len(shared)} of the {len(mine)} subjects of {Path(folder).name}/{split}"
    if shared[0].startswith("volume:"):
        return (f"{where} are made from real volumes the model was trained on ({shown}); put those volumes in "
                "the training split (masc simulate external --train) to score unseen anatomy")
    return (f"{where} repeat training anatomies ({shown}): the set was simulated with the training set's dataset "
            "seed and generator, which draw subject i alike whatever the subject count; simulate it with "
            "another dataset.seed to score unseen anatomy")
