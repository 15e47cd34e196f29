"""Device selection: ``auto`` means CUDA when present, else CPU; the same code runs on both."""

from __future__ import annotations

import torch


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when present, else CPU; ``"cuda"`` without CUDA is an error.

    A CUDA device always comes back with its index (``cuda`` -> ``cuda:0``, the current device),
    because tensors report theirs and ``torch.device("cuda") != torch.device("cuda:0")``."""
    if not isinstance(name, torch.device):
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            name = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None
    device = name
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use cpu or auto")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
