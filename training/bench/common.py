"""Helpers the ``masc bench`` benchmarks share: device synchronisation, percentiles and a
description of the machine the numbers were measured on."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from typing import Any

import torch

from masc_gadget import __version__
from masc_gadget.device import resolve_device


def percentile_of(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steps_per_s(steps: int, seconds: float) -> float:
    return steps / seconds if seconds > 0 else float("inf")


def environment(device: str | torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    device = resolve_device(device)
    env = {
        "masc_version": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": str(device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env
