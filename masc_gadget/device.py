"""Device selection: ``auto`` means CUDA when present, else CPU; the same code runs on both."""

from __future__ import annotations

import torch


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when present, else CPU; ``"cuda"`` without CUDA is an error."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use cpu or auto")
    return device
