"""Turn a trained checkpoint into a shipped one: half-precision weights, no optimizer state,
and a provenance record beside it (command, seed, code version, validation metrics)."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from masc_gadget import __version__
from masc_gadget.core.ood import OodCalibration
from masc_gadget.models.checkpoint import load_checkpoint, save_checkpoint


def export_checkpoint(checkpoint: str | Path, out: str | Path, command: str = "",
                      notes: dict[str, Any] | None = None, ood: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``out`` (.pt, float16 weights) and ``out`` with .json (provenance); returns the
    provenance. Float16 halves the size; loading casts back to float32. ``ood``: the OOD
    calibration of its MAR network (``masc mar-check --calibrate``: score, threshold, ...),
    stored in the checkpoint's metadata, where the gadget reads it."""
    ck = load_checkpoint(checkpoint)
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
                                **extra})
    cfg = ck.metadata.get("config", {})
    record = {
        "name": out.stem,
        "kind": ck.metadata.get("kind"),
        "command": command,
        "seed": cfg.get("masc_train", {}).get("seed"),
        "code_version": ck.metadata.get("code_version", __version__),
        "trained_rollouts": ck.metadata.get("rollout"),
        "validation": ck.metadata.get("val"),
        "mar_pretrained_epoch": ck.metadata.get("mar_pretrained_epoch"),
        "config": cfg,
        "exported_with": {"masc": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "size_bytes": out.stat().st_size,
        "git_commit": _git_commit(),
        **({"ood": ood} if ood is not None else {}),
        **(notes or {}),
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _git_commit() -> str | None:
    """The commit of the code that exports (None outside a git work tree); a work tree with
    uncommitted changes is marked ``+dirty``."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")
