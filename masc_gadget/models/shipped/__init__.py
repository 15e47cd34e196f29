"""Trained models shipped inside the package, with their provenance beside them.

Refer to one as ``shipped:NAME`` wherever a checkpoint path is accepted (for example
``gadget.policy_checkpoint: shipped:masc_small``); ``NAME.json`` records how it was made.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

PREFIX = "shipped:"


def available() -> list[str]:
    """Names of the shipped checkpoints."""
    folder = resources.files(__name__)
    return sorted(p.name[:-3] for p in folder.iterdir() if p.name.endswith(".pt"))


def resolve(path_or_name: str | Path) -> Path:
    """``shipped:NAME`` -> the packaged file; anything else is returned as a Path."""
    text = str(path_or_name)
    if not text.startswith(PREFIX):
        return Path(text)
    name = text[len(PREFIX):]
    candidate = Path(str(resources.files(__name__).joinpath(f"{name}.pt")))
    if not candidate.is_file():
        known = ", ".join(PREFIX + n for n in available()) or "none"
        raise FileNotFoundError(f"no shipped checkpoint {text!r}; shipped checkpoints: {known}")
    return candidate


def provenance(name: str) -> dict[str, Any]:
    """The provenance record of a shipped checkpoint (command, seed, code version, metrics)."""
    path = Path(str(resources.files(__name__).joinpath(f"{name}.json")))
    return json.loads(path.read_text()) if path.is_file() else {}
