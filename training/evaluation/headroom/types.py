"""A headroom report as data: one :class:`HeadroomRun` per MAR network inside a
:class:`HeadroomReport`, each written to and read from ``headroom.json`` by ``to_json`` /
``from_json`` (the file's keys are the fields' names; a field not measured is left out).

A test over subjects (``lead``, ``policy_vs_best``, ...) is the dict
:func:`training.evaluation.stats.subject_tests` returns (``diff``, ``p_ttest``, ``p_wilcoxon``,
...); per-slice scores are ``slices[method][metric]`` lists, their means ``means[method][metric]``.
The summary (means over the networks, the pooled test, the gate's verdict) is derived from the
runs by :func:`training.evaluation.headroom.summary.summarise` and stored beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["HeadroomReport", "HeadroomRun"]

Tests = dict[str, Any]
"""One paired test over subjects (:func:`training.evaluation.stats.subject_tests`)."""


def _known(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    """``data`` restricted to ``cls``'s fields; ValueError naming a missing required one."""
    names = {f.name for f in dataclasses.fields(cls)}
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{what} has no {missing[0]!r}: not a headroom report (masc check headroom writes one)")
    return {k: v for k, v in data.items() if k in names}


def _plain(value: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}


@dataclass
class HeadroomRun:
    """The measurement under one MAR network (or none, for SENSE)."""

    mar: str
    """The network's path, or ``none (N-coil SENSE)``."""
    orders: list[list[int]]
    """The fixed order of each fold (one, when fitted on another split)."""
    folds: list[int]
    """Each measured slice's fold."""
    oracle_lines: list[list[int]]
    slices: dict[str, dict[str, list[float]]]
    """Per method (oracle, fixed, center-out; gated, policy when measured), per metric, per slice."""
    means: dict[str, dict[str, float]]
    lead: Tests
    """The oracle against the fitted order, over subjects, in the report's metric."""
    lead_psnr: Tests
    fixed_vs_center_out: Tests
    best_fixed: str = "fixed"
    """The better of the fitted order and centre-out (:func:`~training.evaluation.headroom.summary.better_fixed`)."""
    lead_best: Tests | None = None
    """The oracle against :attr:`best_fixed` (None in a report written before that rule)."""
    mar_metadata: dict[str, Any] = field(default_factory=dict)
    gated_counts: list[list[int]] | None = None
    """With corruption: the gated order's acquisitions per slice and line."""
    corruption: dict[str, float] | None = None
    gated_vs_fixed: Tests | None = None
    lead_gated: Tests | None = None
    policy: str | None = None
    """A learned policy scored on the measured slices (its checkpoint)."""
    policy_lines: list[list[int]] | None = None
    policy_vs_fixed: Tests | None = None
    policy_vs_best: Tests | None = None
    policy_vs_gated: Tests | None = None
    captured: float | None = None
    """The share of the oracle's lead over :attr:`best_fixed` the policy captures (NaN: no lead)."""

    def scores(self) -> dict[str, dict[str, np.ndarray]]:
        """:attr:`slices` as arrays."""
        return {m: {k: np.asarray(v) for k, v in by.items()} for m, by in self.slices.items()}

    def to_json(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeadroomRun:
        return cls(**_known(cls, data, "a headroom run"))


@dataclass
class HeadroomReport:
    """``headroom.json``: what was measured, on which slices, and every network's run."""

    data: str
    split: str
    n_slices: int
    n_subjects: int
    labels: list[str]
    """The measured slices (``subject/slice``), in the order of every per-slice list."""
    acquisition: dict[str, int]
    """``initial``, ``budget``, ``n_pe``."""
    config: dict[str, Any]
    """``{"headroom": the measurement's settings}``."""
    metric: str
    """``ssim`` (whole image) or ``roi_ssim`` (the periprosthetic region)."""
    runs: list[HeadroomRun]
    summary: dict[str, Any] = field(default_factory=dict)
    """:func:`~training.evaluation.headroom.summary.summarise` of the runs."""

    @property
    def settings(self) -> dict[str, Any]:
        """The measurement's ``headroom`` settings, as written."""
        return self.config["headroom"]

    @property
    def subjects(self) -> list[str]:
        """Each measured slice's subject."""
        return [label.rsplit("/", 1)[0] for label in self.labels]

    def to_json(self) -> dict[str, Any]:
        out = _plain(self)
        out["runs"] = [run.to_json() for run in self.runs]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeadroomReport:
        if not isinstance(data, dict):
            raise ValueError("a headroom report is a JSON object (masc check headroom writes one)")
        fields = _known(cls, data, "the report")
        fields["runs"] = [HeadroomRun.from_json(run) for run in data["runs"]]
        return cls(**fields)
