"""One way to seed or shield torch's global random generators.

:func:`isolated_rng` forks the CPU generator and, where CUDA is in use, every visible CUDA
generator, optionally seeds them, and restores all of them on exit. Building a network whose
initial weights are overwritten (a checkpoint is loaded into it) and a seeded initialisation
both run inside it, so neither moves the caller's random streams. ``torch.manual_seed`` seeds
the CUDA generators too (lazily, even before CUDA starts), which a fork of the CPU generator
alone would leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["isolated_rng"]


@contextmanager
def isolated_rng(seed: int | None = None) -> Iterator[None]:
    """Run the block with torch's global generators forked (restored on exit); with ``seed``,
    seeded by ``torch.manual_seed(seed)`` first."""
    cuda = torch.cuda.is_available() and (seed is not None or torch.cuda.is_initialized())
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield
