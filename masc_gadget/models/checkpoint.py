"""Checkpoints: state dicts plus JSON metadata, written atomically, read with weights_only=True.

File layout (a ``torch.save`` of a plain dict, so ``torch.load(..., weights_only=True)`` can
read it and no code is ever unpickled)::

    {"format": "masc-checkpoint", "version": 1,
     "state_dicts": {name: state_dict},          # e.g. "mar", "policy"; tensors on the CPU
     "metadata_json": json.dumps(metadata),      # config sections, code_version, metrics, ...
     "extra": {...}}                             # e.g. optimizer state dicts, RNG states

Metadata is stored as a JSON string so that it survives unchanged (key order, types) and is
readable without torch.

Metadata sizes a network (``mar_model.width``, ``policy_net.hidden``, ...), so it is checked
before any network is built: each size against a documented bound (:data:`MAX_MAR_WIDTH`,
:data:`MAX_MAR_DEPTH` here; the policy network's in
:mod:`masc_gadget.acquisition.learned`), then the network it describes is built on the
``meta`` device (no memory) and must have at most :data:`MAX_PARAMETERS` parameters and
exactly the names and shapes of the stored weights (:func:`check_weights_fit`). Only then is
the real network built, so a checkpoint can never make the loader allocate more than the
weights it carries.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from masc_gadget import __version__
from masc_gadget.config import from_dict
from masc_gadget.core.seeding import isolated_rng
from masc_gadget.device import resolve_device
from masc_gadget.core.ood import OodCalibration
from masc_gadget.models.unet import MarModelConfig, MarNet, build_mar

FORMAT = "masc-checkpoint"
VERSION = 1

MAX_MAR_WIDTH = 1024
"""Largest ``mar_model.width`` a checkpoint may ask for (the paper's network: 64)."""
MAX_MAR_DEPTH = 8
"""Largest ``mar_model.depth`` (the paper's network: 4)."""
MAX_PARAMETERS = 2**28
"""Largest network a checkpoint may describe, in parameters (268 M, 1 GiB in float32; the
paper's MAR network has 31 M)."""


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


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    name: str | None = None) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (``torch.load`` with
    ``weights_only=True``: nothing but tensors and plain data is unpickled).

    Raises FileNotFoundError when ``path`` does not exist and ValueError naming it when it
    is not a MASC checkpoint, is corrupt or truncated, or was written by a newer format version.
    ``shipped:NAME`` names a checkpoint shipped inside the package (:mod:`masc_gadget.models.shipped`).
    Messages name the checkpoint as ``name`` when given (e.g. the name a client chose), else
    as ``path`` was written (``shipped:NAME``, not the install path).
    """
    from masc_gadget.models.shipped import resolve

    label = name or str(path)
    path = resolve(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {label} does not exist")
    if not path.is_file():
        raise ValueError(f"checkpoint {label} is not a file")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as err:  # torch.load raises many types for corrupt or unsafe files
        reason = _load_error_reason(err)
        raise ValueError(
            f"{label} is not a readable MASC checkpoint (corrupt, truncated or containing "
            f"objects other than tensors and plain data): {reason}"
        ) from None
    return _unpack(payload, label)


def _unpack(payload: Any, label: str) -> Checkpoint:
    """The :class:`Checkpoint` of a ``torch.load``-ed payload; ValueError naming ``label``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{label} is not a MASC checkpoint (no format: {FORMAT!r} entry)")
    version = payload.get("version")
    if not isinstance(version, int) or not 1 <= version <= VERSION:
        raise ValueError(
            f"{label}: checkpoint format version {version!r} is not supported "
            f"(this is MASC {__version__}, reading versions 1 to {VERSION})"
        )
    state_dicts = payload.get("state_dicts")
    metadata_json = payload.get("metadata_json")
    extra = payload.get("extra", {})
    if not isinstance(state_dicts, dict) or not isinstance(metadata_json, str) or not isinstance(extra, dict):
        raise ValueError(f"{label} is a damaged MASC checkpoint (state_dicts, metadata_json or extra missing)")
    try:
        metadata = json.loads(metadata_json)
    except json.JSONDecodeError as err:
        raise ValueError(f"{label} is a damaged MASC checkpoint: metadata is not JSON ({err})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{label} is a damaged MASC checkpoint: metadata is not a JSON object")
    return Checkpoint(state_dicts, metadata, extra)


def check_size(label: str, name: str, value: Any, maximum: int) -> None:
    """ValueError unless metadata size ``name`` is an integer in [1, ``maximum``]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{label}: metadata {name} must be an integer in [1, {maximum}], got {shown}")


def check_weights_fit(build: Callable[[], nn.Module], weights: Any, what: str, label: str) -> None:
    """ValueError unless the network ``build()`` makes has at most :data:`MAX_PARAMETERS`
    parameters and exactly the names and shapes of ``weights`` (a stored state dict).

    ``build`` runs on the ``meta`` device (no memory, no values) with the global RNG left
    alone; bound every size it reads (:func:`check_size`) before calling this."""
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ValueError(f"{label}: {what!r} weights are not a state dict of tensors")
    with isolated_rng(), torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    n_params = sum(math.prod(shape) for shape in expected.values())
    if n_params > MAX_PARAMETERS:
        raise ValueError(f"{label}: metadata describes a {what!r} network of {n_params} parameters; "
                         f"at most {MAX_PARAMETERS} are allowed")
    stored = {k: tuple(v.shape) for k, v in weights.items()}
    if stored != expected:
        bad = sorted(set(stored) ^ set(expected)) or sorted(k for k in stored if stored[k] != expected[k])
        raise ValueError(f"{label}: {what!r} weights do not match the network its metadata describes "
                         f"({len(bad)} tensor(s) differ, first {bad[0][:80]!r})")


def mar_from_checkpoint(ck: Checkpoint, path: str | Path, device: torch.device) -> MarNet:
    """Rebuild the ``"mar"`` network of a loaded checkpoint from ``metadata["mar_model"]``
    (the :class:`MarModelConfig` fields), on ``device`` in eval mode. ``path`` only names the
    checkpoint in messages. Sizes are checked first (module docstring)."""
    if "mar" not in ck.state_dicts:
        raise ValueError(
            f"{path} holds no MAR network (state dicts: {', '.join(sorted(map(str, ck.state_dicts)))[:200] or 'none'})"
        )
    section = ck.metadata.get("mar_model")
    if not isinstance(section, dict):
        raise ValueError(f"{path}: metadata has no 'mar_model' section to rebuild the MAR network from")
    check_size(str(path), "mar_model.width", section.get("width", MarModelConfig.width), MAX_MAR_WIDTH)
    check_size(str(path), "mar_model.depth", section.get("depth", MarModelConfig.depth), MAX_MAR_DEPTH)
    try:
        cfg = from_dict(MarModelConfig, section, "mar_model")
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    check_weights_fit(lambda: build_mar(cfg), ck.state_dicts["mar"], "mar", str(path))
    with isolated_rng():  # the init is overwritten; leave the global RNGs alone
        model = build_mar(cfg)
    try:
        model.load_state_dict(ck.state_dicts["mar"])
    except RuntimeError as err:
        raise ValueError(f"{path}: 'mar' weights do not match mar_model {cfg}: {err}") from None
    model.ood = OodCalibration.from_metadata(ck.metadata.get("ood"), str(path))
    model.ood_early = OodCalibration.early_from_metadata(ck.metadata.get("ood"), str(path))
    return model.to(device).eval()


def load_mar(path: str | Path, device: str | torch.device = "cpu",
             name: str | None = None) -> tuple[MarNet, dict[str, Any]]:
    """The MAR network of a checkpoint, on ``device`` (``cpu``, ``cuda``, ``auto``), in eval mode.

    Rebuilt from ``metadata["mar_model"]`` and the ``"mar"`` state dict. Returns (model, metadata).
    ``name``: how messages name the checkpoint (default: ``path`` as written).
    """
    device = resolve_device(device)
    ck = load_checkpoint(path, map_location="cpu", name=name)
    return mar_from_checkpoint(ck, name or path, device), ck.metadata
