"""Turn a trained checkpoint into a shipped one: half-precision weights, no optimizer state,
and a provenance record beside it (command, seed, code version, validation metrics)."""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path
from typing import Any

import torch

from masc_gadget import __version__
from masc_gadget.core.ood import OodCalibration
from masc_gadget.models.checkpoint import load_checkpoint, save_checkpoint
from training.run import git_commit

log = logging.getLogger(__name__)


SEEDED = ("masc_train", "finetune", "loupe", "dqn", "mar_train")


def _seed_of(section: dict[str, Any]) -> int | None:
    """A trainer section's seed as a checkpoint stored it: ``run.seed``, or ``seed`` before the
    run settings were nested."""
    return (section.get("run") or {}).get("seed", section.get("seed"))
"""The config sections whose ``seed`` is a checkpoint's training seed, in the order looked up."""


def export_checkpoint(checkpoint: str | Path, out: str | Path, command: str = "",
                      notes: dict[str, Any] | None = None, ood: dict[str, Any] | None = None,
                      export_command: str = "") -> dict[str, Any]:
    """Write ``out`` (.pt, float16 weights) and ``out`` with .json (provenance); returns the
    provenance. Float16 halves the size; loading casts back to float32. ``ood``: the OOD
    calibration of its MAR network (``masc check mar --calibrate``: score, threshold, ...),
    stored in the checkpoint's metadata, where the gadget reads it.

    The provenance names the code (git commit, versions), the commands (``command``: those
    that trained it; ``export_command``: this export), the full training config with the MAR
    pre-training's sections (read from the pre-trained checkpoint the training names, when it
    is there) and the data it was trained on (:func:`training.data.data_identity` of each
    folder: manifest hash and the anatomies of its training split, also stored in the
    checkpoint, so that ``masc eval`` can warn about a set that repeats them)."""
    ck = load_checkpoint(checkpoint)
    training_data = _training_data(ck.metadata, checkpoint)
    mar_pretraining = _mar_pretraining(ck.metadata)
    if ood is not None:
        OodCalibration.from_metadata(ood, str(checkpoint))  # refuse a malformed one before writing
        if "mar" not in ck.state_dicts:
            raise ValueError(f"{checkpoint} holds no MAR network to calibrate")
    half = {name: {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
            for name, sd in ck.state_dicts.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = {"ood": ood} if ood is not None else {}
    save_checkpoint(out, half, {**ck.metadata, "shipped_from": Path(checkpoint).name, "weights_dtype": "float16",
                                "training_data": training_data, **extra})
    cfg = dict(ck.metadata.get("config", {}))
    if mar_pretraining is not None:
        cfg["mar_pretraining"] = mar_pretraining
    record = {
        "name": out.stem,
        "kind": ck.metadata.get("kind"),
        "command": command or (ck.metadata.get("provenance") or {}).get("command", ""),
        "provenance": ck.metadata.get("provenance"),
        "seed": next((seed for c in (ck.metadata.get("finetune_config") or {}, cfg) for k in SEEDED
                      if (seed := _seed_of(c.get(k) or {})) is not None), None),
        "code_version": ck.metadata.get("code_version", __version__),
        "trained_rollouts": ck.metadata.get("rollout"),
        "validation": ck.metadata.get("val"),
        "mar_pretrained_epoch": ck.metadata.get("mar_pretrained_epoch"),
        "config": cfg,
        "exported_with": {"masc": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "size_bytes": out.stat().st_size,
        "git_commit": git_commit(),
        "export_command": export_command,
        "training_data": [{k: v for k, v in d.items() if k != "train_anatomies"} for d in training_data],
        **({"ood": ood} if ood is not None else {}),
        **(notes or {}),
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def check_record(results: dict[str, Any], name: str = "", promised: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a shipped model's provenance keeps of a ``masc check mar`` run (its ``results.json``):
    the split, policy and lines checked and, per data folder, the subjects and slices, the
    identity SSIM, the MAR image against its zero-filled input, the harmed share and the
    promises (kept or broken). ``name``: the network's entry (default: the only one).
    ``promised``: the folders whose promises the model is held to (``promises_kept``; default:
    every folder); the others' figures are kept as measured. ValueError when the results hold
    no such entry or several and none is named, or a promised folder is not in them."""
    folders = results.get("folders") or {}
    names = sorted({n for entries in folders.values() for n in entries})
    if not name:
        if len(names) != 1:
            raise ValueError(f"the check holds {', '.join(names) or 'no network'}: name one, FILE:NAME")
        name = names[0]
    if name not in names:
        raise ValueError(f"the check holds no network {name!r}; it holds {', '.join(names) or 'none'}")
    record: dict[str, Any] = {key: results.get(key) for key in ("split", "policy", "lines")}
    record["folders"] = {}
    for folder, entries in folders.items():
        if name not in entries:
            continue
        s = entries[name]["summary"]
        record["folders"][folder] = {
            "subjects": s["n_subjects"], "slices": s["n_slices"], "identity_ssim": s["identity_ssim"]["mean"],
            "mar_ssim": s["mar_ssim"]["mean"], "mar_vs_zf_ssim": s["mar_vs_zf_ssim"]["diff"],
            "harmed_fraction": s["harmed_fraction"], "promises": s.get("promises")}
    missing = [f for f in promised if f not in record["folders"]]
    if missing:
        raise ValueError(f"the check has no folder {', '.join(missing)}; it has {', '.join(record['folders'])}")
    record["promised_on"] = list(promised or record["folders"])
    record["promises_kept"] = all((record["folders"][f]["promises"] or {}).get("all") is True
                                  for f in record["promised_on"])
    return record


def _training_data(metadata: dict[str, Any], checkpoint: str | Path) -> list[dict[str, Any]]:
    """:func:`training.data.data_identity` of each data folder the training names (its
    ``data`` metadata, as given on its command line, read from here); a folder that is not
    there is recorded by name only, with a warning."""
    from training.data import data_dirs, data_identity

    records = []
    for folder in data_dirs(metadata.get("data", "") or []):
        try:
            records.append(data_identity(folder))
        except (FileNotFoundError, ValueError) as err:
            log.warning("%s: training data %s cannot be read (%s); its provenance names it only", checkpoint,
                        folder, err)
            records.append({"folder": Path(folder).name})
    return records


def _mar_pretraining(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The config sections and data of the MAR pre-training the checkpoint names
    (``mar_pretrained``), when that checkpoint is there."""
    path = metadata.get("mar_pretrained")
    if not path or not Path(path).is_file():
        return None
    pre = load_checkpoint(path).metadata
    return {"checkpoint": Path(path).name, "epoch": pre.get("epoch"), "data": pre.get("data"),
            "provenance": pre.get("provenance"),
            **{k: pre[k] for k in ("mar_model", "mar_train", "acquisition") if k in pre}}


def export_lines(checkpoint: str | Path, out: str | Path) -> list[int]:
    """A fixed order's phase-encoding lines (``kspace_encode_step_1``) in acquisition order, the
    protocol's initial centre lines first, written as a text ky list with a commented header (name,
    kind, matrix, counts): what a sequence plays without asking the gadget. ValueError for a
    checkpoint whose lines depend on the image (MASC, DQN)."""
    from masc_gadget.acquisition.episode import initial_lines
    from masc_gadget.models.shipped import resolve

    ck = load_checkpoint(resolve(checkpoint))
    meta = ck.metadata
    kind = meta.get("kind")
    if "order" not in meta:
        raise ValueError(f"{checkpoint} is a {kind or 'MAR'} checkpoint: its lines depend on each slice's image "
                         "(or it has none); only a fixed order (masc train fixed-order, loupe) plays without the gadget")
    n_pe = int(meta["n_pe"])
    initial = int(meta.get("initial") or ((meta.get("config") or {}).get("acquisition") or {}).get("initial", 2))
    first = [int(x) for x in initial_lines(n_pe, initial)]
    lines = first + [int(x) for x in meta["order"] if int(x) not in first]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mask = "".join("1" if i in set(lines) else "0" for i in range(n_pe))
    out.write_text(f"# MASC fixed order {Path(str(checkpoint)).name} ({kind}): {n_pe} phase-encoding lines, "
                   f"{len(first)} initial centre lines + {len(lines) - len(first)} chosen, in acquisition order\n"
                   f"# ky = kspace_encode_step_1 in 0..{n_pe - 1} (centre {n_pe // 2}); mask {mask}\n"
                   + "".join(f"{ky}\n" for ky in lines))
    return lines
