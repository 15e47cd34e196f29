"""Checkpoints: state dicts plus JSON metadata, written atomically, read with weights_only=True.

File layout (a ``torch.save`` of a plain dict, so ``torch.load(..., weights_only=True)`` can
read it and no code is ever unpickled)::

    {"format": "masc-checkpoint", "version": 1,
     "state_dicts": {name: state_dict},          # e.g. "mar", "policy"; tensors on the CPU
     "metadata_json": json.dumps(metadata),      # config sections, code_version, metrics, ...
     "extra": {...}}                             # e.g. optimizer state dicts, RNG states

Metadata is stored as a JSON string so that it survives unchanged (key order, types) and is
readable without torch.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from masc_gadget import __version__
from masc_gadget.config import from_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.unet import MarModelConfig, MarNet, build_mar

FORMAT = "masc-checkpoint"
VERSION = 1


class Checkpoint(NamedTuple):
    """A loaded checkpoint."""

    state_dicts: dict[str, dict[str, Any]]
    """Module name -> state dict (tensors on ``map_location``)."""
    metadata: dict[str, Any]
    """The JSON metadata given to :func:`save_checkpoint` (plus ``code_version``)."""
    extra: dict[str, Any]
    """Extra state (optimizer state dicts, RNG states, ...); empty if none was saved."""


def _to_cpu(value: Any) -> Any:
    """Tensors (in nested dicts / lists / tuples) detached and moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def save_checkpoint(
    path: str | Path,
    modules: dict[str, nn.Module | dict[str, Any]],
    metadata: dict[str, Any],
    extra_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically (temporary file in the same folder, then ``os.replace``).

    modules: name -> ``nn.Module`` (its ``state_dict()`` is stored) or a state dict.
    metadata: JSON-able plain data (use ``masc_gadget.config.to_dict`` for config sections);
        ``code_version`` (``masc_gadget.__version__``) is added when absent.
    extra_state: tensors and plain data only (e.g. ``optimizer.state_dict()``), so that it
        loads with ``weights_only=True``.
    Returns the path written. A crash mid-write leaves any previous file at ``path`` intact.
    """
    path = Path(path)
    if not isinstance(modules, dict) or not modules:
        raise ValueError("modules must be a non-empty dict of name -> nn.Module or state dict, got "
                         f"{modules!r}")
    state_dicts = {}
    for name, module in modules.items():
        if isinstance(module, nn.Module):
            state_dicts[name] = _to_cpu(dict(module.state_dict()))
        elif isinstance(module, dict):
            state_dicts[name] = _to_cpu(dict(module))
        else:
            raise TypeError(
                f"modules[{name!r}] must be an nn.Module or a state dict, got {type(module).__name__}"
            )
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    metadata = {**metadata}
    metadata.setdefault("code_version", __version__)
    try:
        metadata_json = json.dumps(metadata)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint metadata must be JSON-serialisable plain data: {err}") from None
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "state_dicts": state_dicts,
        "metadata_json": metadata_json,
        "extra": _to_cpu(dict(extra_state or {})),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def _load_error_reason(err: Exception) -> str:
    """One short line from torch.load's (often multi-paragraph) error message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    marker = "WeightsUnpickler error:"
    if marker in text:  # weights_only refused the content: keep only the reason
        text = "weights-only unpickler: " + text.split(marker, 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = lines[0] if lines else ""
    if len(reason) > 160:
        reason = reason[:157] + "..."
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (``torch.load`` with
    ``weights_only=True``: nothing but tensors and plain data is unpickled).

    Raises FileNotFoundError when ``path`` does not exist and ValueError naming ``path`` when it
    is not a MASC checkpoint, is corrupt or truncated, or was written by a newer format version.
    ``shipped:NAME`` names a checkpoint shipped inside the package (:mod:`masc_gadget.models.shipped`).
    """
    from masc_gadget.models.shipped import resolve

    path = resolve(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is not a file")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as err:  # torch.load raises many types for corrupt or unsafe files
        reason = _load_error_reason(err)
        raise ValueError(
            f"{path} is not a readable MASC checkpoint (corrupt, truncated or containing "
            f"objects other than tensors and plain data): {reason}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a MASC checkpoint (no format: {FORMAT!r} entry)")
    version = payload.get("version")
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ValueError(
            f"{path}: checkpoint format version {version!r} is not supported "
            f"(this is MASC {__version__}, reading versions 1 to {VERSION})"
        )
    state_dicts = payload.get("state_dicts")
    metadata_json = payload.get("metadata_json")
    extra = payload.get("extra", {})
    if not isinstance(state_dicts, dict) or not isinstance(metadata_json, str) or not isinstance(extra, dict):
        raise ValueError(f"{path} is a damaged MASC checkpoint (state_dicts, metadata_json or extra missing)")
    try:
        metadata = json.loads(metadata_json)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is a damaged MASC checkpoint: metadata is not JSON ({err})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path} is a damaged MASC checkpoint: metadata is not a JSON object")
    return Checkpoint(state_dicts, metadata, extra)


def mar_from_checkpoint(ck: Checkpoint, path: str | Path, device: torch.device) -> MarNet:
    """Rebuild the ``"mar"`` network of a loaded checkpoint from ``metadata["mar_model"]``
    (the :class:`MarModelConfig` fields), on ``device`` in eval mode."""
    if "mar" not in ck.state_dicts:
        raise ValueError(
            f"{path} holds no MAR network (state dicts: {', '.join(sorted(ck.state_dicts)) or 'none'})"
        )
    if not isinstance(ck.metadata.get("mar_model"), dict):
        raise ValueError(f"{path}: metadata has no 'mar_model' section to rebuild the MAR network from")
    try:
        cfg = from_dict(MarModelConfig, ck.metadata["mar_model"], "mar_model")
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the global RNG alone
        model = build_mar(cfg)
    try:
        model.load_state_dict(ck.state_dicts["mar"])
    except RuntimeError as err:
        raise ValueError(f"{path}: 'mar' weights do not match mar_model {ck.metadata['mar_model']}: {err}") from None
    return model.to(device).eval()


def load_mar(path: str | Path, device: str | torch.device = "cpu") -> tuple[MarNet, dict[str, Any]]:
    """The MAR network of a checkpoint, on ``device`` (``cpu``, ``cuda``, ``auto``), in eval mode.

    Rebuilt from ``metadata["mar_model"]`` and the ``"mar"`` state dict. Returns (model, metadata).
    """
    device = resolve_device(device)
    ck = load_checkpoint(path, map_location="cpu")
    return mar_from_checkpoint(ck, path, device), ck.metadata
