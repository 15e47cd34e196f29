"""Device selection: ``auto`` means CUDA when present, else CPU; the same code runs on both."""

from __future__ import annotations

import re

import torch

_MAX_INDEX = 127
"""Largest device index torch represents (an int8); a larger one wraps around."""


def resolve_device(name: str | torch.device) -> torch.device:
    """``"auto"`` -> CUDA when present, else CPU; ``"cuda"`` without CUDA, or ``cuda:N`` beyond
    the devices present, is an error that names the device as written.

    A CUDA device always comes back with its index (``cuda`` -> ``cuda:0``, the current device),
    because tensors report theirs and ``torch.device("cuda") != torch.device("cuda:0")``."""
    if isinstance(name, torch.device):
        device, written = name, str(name)
    else:
        written = str(name)
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        index = re.fullmatch(r"cuda:([0-9]+)", name)
        if index is not None and int(index.group(1)) > _MAX_INDEX:  # torch would wrap it (int8)
            raise ValueError(f"device {written!r}: no CUDA device has index {int(index.group(1))}; "
                             "use cpu, auto, cuda or cuda:N for one of this machine's GPUs")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {written!r}; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {written!r} requested but CUDA is not available; use cpu or auto")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device {written!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device
