"""What the acquisition engine takes and gives: :class:`EngineSettings` (what it needs to know
about a scan, from the ISMRMRD header and the configuration) and :class:`SliceResult` (a
finished slice, as served). Plain records with their checks; the engine is
:mod:`masc_gadget.acquisition.engine`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from masc_gadget.acquisition.episode import check_episode
from masc_gadget.core.coils import COMBINES

__all__ = ["EngineSettings", "SliceResult", "is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class EngineSettings:
    """What the engine needs to know about a scan, built by the gadget from the ISMRMRD header
    and its settings. The scan's geometry, protocol, seed and device have no defaults (they come
    from the header and the configuration's ``acquisition`` and ``gadget`` sections); the four
    that do (coils, lines per decision, coil combine, MAR fallback) are those a single-coil scan
    under the configuration's own defaults needs no setting for."""

    n_pe: int
    """Phase-encoding lines per slice (encoded matrix y)."""
    n_readout: int
    """Samples per readout line (encoded matrix x)."""
    initial: int
    """Lines a slice needs before the first decision (the centre lines of the episode)."""
    budget: int
    """Lines the policy chooses per slice after the initial ones; decisions stop once a slice
    has ``initial + budget`` lines."""
    seed: int
    """Seed of the per-slice random streams ``slice_rng(seed, slice)`` of random policies."""
    device: str
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``."""
    n_coils: int = 1
    """Receive coils (channels) per line; a single-coil scan needs no setting."""
    lines_per_decision: int = 1
    """Lines per decision (an echo train, ``acquisition.lines_per_decision``): the slice gets a
    new decision once every line of its train has arrived (or a line nobody asked for)."""
    coil_combine: str = "rss"
    """How the coils' images become one: ``rss`` or ``sensitivity`` (gadget section)."""
    mar_fallback: str = "auto"
    """When a slice is served zero-filled instead of MAR-corrected (``gadget.mar_fallback``:
    ``auto``, ``off`` or a threshold; :func:`masc_gadget.core.ood.fallback_rule`)."""
    decide_ahead: bool = True
    """A policy that reads no image decides a slice's whole episode at its first decision, sent
    at once (each decision with its step): no round trip per line (``gadget.decide_ahead``)."""
    rows: tuple[int, int] | None = None
    """(first, last) grid rows the scanner can acquire (its header's encoding limits); the policy
    chooses among these only. None: every row."""

    def __post_init__(self) -> None:
        for name in ("n_pe", "n_readout", "initial", "budget", "seed", "n_coils", "lines_per_decision"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.n_readout < 1:
            raise ValueError(f"n_readout must be >= 1, got {self.n_readout}")
        if self.n_coils < 1:
            raise ValueError(f"n_coils must be >= 1, got {self.n_coils}")
        if self.coil_combine not in COMBINES:
            raise ValueError(f"coil_combine must be one of {', '.join(COMBINES)}, got {self.coil_combine!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        check_episode(self.n_pe, self.initial, self.budget)
        if not 1 <= self.lines_per_decision <= self.budget:
            raise ValueError(f"lines_per_decision must be in [1, budget = {self.budget}], got {self.lines_per_decision}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @property
    def total(self) -> int:
        """Lines per slice once its budget is spent, ``initial + budget``."""
        return self.initial + self.budget


@dataclass
class SliceResult:
    """A finished slice."""

    slice: int
    image: np.ndarray
    """(n_pe, n_readout) float32: MAR-corrected magnitude of the acquired lines (the zero-filled
    image when MAR is off), as served (:func:`masc_gadget.core.served.served_images`: >= 0)."""
    zero_filled: np.ndarray
    """(n_pe, n_readout) float32: zero-filled magnitude of the acquired lines (coils combined),
    as served."""
    lines: list[int]
    """Acquired lines in arrival order (a repeated line listed once, where it first came)."""
    decided: list[int]
    """The lines of ``lines`` that the engine had asked for before they arrived, arrival order."""
    policy: str
    """Name of the policy that made the decisions."""
    mar: str
    """"none", or the MAR checkpoint's file name (and epoch); for a slice served zero-filled
    although a network is loaded, why (:data:`NON_FINITE_MAR`, or its OOD score)."""
    ood_score: float = float("nan")
    """The MAR image's OOD score (:mod:`masc_gadget.core.ood`; NaN without an OOD rule)."""
