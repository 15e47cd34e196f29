"""Trained models shipped inside the package, with their provenance beside them.

Refer to one as ``shipped:NAME`` wherever a checkpoint path is accepted (for example
``gadget.policy_checkpoint: shipped:masc_small``); ``NAME.json`` records how it was made.
``NAME`` is one of :func:`available` and nothing else: no separators, no ``..``, so a name
never reaches a file outside this folder.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

PREFIX = "shipped:"

RECOMMENDED = "fixed_small"
"""The shipped model the serving entry points serve when no configuration is given (``masc
serve`` and Gadgetron's connect mode without ``--config``, execute mode): the one the README's
results recommend on this protocol (docs/results.md)."""


def available() -> list[str]:
    """Names of the shipped checkpoints."""
    folder = resources.files(__name__)
    return sorted(p.name[:-3] for p in folder.iterdir() if p.name.endswith(".pt"))


def is_shipped(path_or_name: str | Path) -> bool:
    """Whether ``path_or_name`` is written ``shipped:NAME`` (known name or not)."""
    return str(path_or_name).startswith(PREFIX)


def resolve(path_or_name: str | Path) -> Path:
    """``shipped:NAME`` -> the packaged file; anything else is returned as a Path.

    FileNotFoundError, listing the shipped names (and never a path), for a NAME that is not
    one of :func:`available`."""
    text = str(path_or_name)
    if not is_shipped(text):
        return Path(text)
    name = text[len(PREFIX):]
    names = available()
    if name not in names:
        known = ", ".join(PREFIX + n for n in names) or "none"
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise FileNotFoundError(f"no shipped checkpoint {shown!r}; shipped checkpoints: {known}")
    return Path(str(resources.files(__name__).joinpath(f"{name}.pt")))


def provenance(name: str) -> dict[str, Any]:
    """The provenance record of a shipped checkpoint (command, seed, code version, metrics)."""
    if name not in available():
        return {}
    path = Path(str(resources.files(__name__).joinpath(f"{name}.json")))
    return json.loads(path.read_text()) if path.is_file() else {}


def recommended_overrides(name: str = RECOMMENDED) -> list[str]:
    """``--set`` overrides that serve shipped model ``name``: its policy (the checkpoint's kind),
    the protocol it was trained on (initial, budget, lines per decision), its policy and MAR
    checkpoints. Read from its provenance record (no weights loaded)."""
    record = provenance(name)
    if not record:
        raise FileNotFoundError(f"no shipped checkpoint {name!r}; shipped checkpoints: "
                                f"{', '.join(PREFIX + n for n in available())}")
    acq = (record.get("config") or {}).get("acquisition") or {}
    out = [f"acquisition.policy={record['kind']}"]
    out += [f"acquisition.{key}={acq[key]}" for key in ("initial", "budget", "lines_per_decision") if key in acq]
    return out + [f"gadget.policy_checkpoint={PREFIX}{name}", f"gadget.mar_checkpoint={PREFIX}{name}"]
