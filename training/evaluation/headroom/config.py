"""The settings of a headroom measurement (section ``headroom``) and the slices it measures."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from masc_gadget.config import from_dict, to_dict
from training.data import REGIONS, SliceSet
from training.rl.corruption import CorruptionModel
from training.rl.env import EnvConfig


RECONS = ("zero-filled", "sense")
"""How the acquired lines become an image: the product's zero-filled image (then MAR), or
multi-coil CG-SENSE (no MAR)."""


METHODS = ("oracle", "fixed", "center-out")
"""The rows of a headroom measurement."""


@dataclass(frozen=True)
class HeadroomConfig:
    """``masc check headroom`` and ``masc check headroom`` (config section ``headroom``)."""

    folds: int = 2
    """Subject folds of the cross-fitted fixed order (>= 2)."""
    fit_split: str = ""
    """Empty: the fixed order is cross-fitted over ``folds`` subject folds of the measured split.
    A split name (``train``): one fixed order is fitted on that split of the same data folder
    (its subjects' ``slices_per_subject`` slices) and played on every measured slice: the order a
    deployment would ship, fitted on many more slices than a fold holds."""
    slices_per_subject: int = 2
    """Slices measured per subject, those with the most implant (0 = every slice). The oracle
    scores every free line at every step, so this sets the run time."""
    region: str = "image"
    """Where ``Q`` is maximised and SSIM decides: ``image`` or ``implant`` (periprosthetic)."""
    margin: int = 8
    """Pixels the implant is dilated by to give the periprosthetic region."""
    beam: int = 1
    """Beams of the oracle's search (1: the greedy oracle)."""
    gate: float = 0.03
    """The SSIM lead at which adaptivity is worth training for."""
    corruption: CorruptionModel = field(default_factory=CorruptionModel)
    """The k-space corruption of each acquisition and the scanner's flags (a bare number: its
    probability; 0: none; :class:`training.rl.corruption.CorruptionModel`): the oracle may then
    acquire a line again (it knows every draw; the gated order and a learned policy see the
    flags), up to ``attempts`` times; ``seed`` seeds the draws."""
    recon: str = "zero-filled"
    """``zero-filled`` (the product's image, then each MAR network) or ``sense`` (``coils``
    receive coils, CG-SENSE, no MAR network)."""
    coils: int = 8
    """With ``recon: sense``: elements of the body array."""
    sense_iterations: int = 10
    """With ``recon: sense``: conjugate-gradient iterations."""
    batch_size: int = 32
    device: str = "auto"

    FLAT_KEYS: ClassVar[dict[str, str]] = {
        "corruption_kind": "corruption.kind", "attempts": "corruption.attempts", "detection": "corruption.detection",
        "false_alarm": "corruption.false_alarm", "seed": "corruption.seed"}
    """The corruption keys written flat before 0.3, read under ``corruption`` (and so are the
    settings of reports written then, :func:`corruption_of`)."""

    def __post_init__(self) -> None:
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2 (the order is fitted on the others), got {self.folds}")
        if self.region not in REGIONS:
            raise ValueError(f"region must be one of {', '.join(REGIONS)}, got {self.region!r}")
        for name in ("slices_per_subject", "margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.beam < 1 or self.batch_size < 1:
            raise ValueError(f"beam and batch_size must be >= 1, got {self.beam} and {self.batch_size}")
        if not self.gate > 0:
            raise ValueError(f"gate must be > 0, got {self.gate}")
        if not isinstance(self.corruption, CorruptionModel):
            raise TypeError(f"corruption must be a CorruptionModel, got {self.corruption!r}")
        if self.recon not in RECONS:
            raise ValueError(f"recon must be one of {', '.join(RECONS)}, got {self.recon!r}")
        if self.coils < 1 or self.sense_iterations < 1:
            raise ValueError(f"coils and sense_iterations must be >= 1, got {self.coils} and {self.sense_iterations}")
        if self.corruption.enabled and self.recon != "zero-filled":
            raise ValueError("corruption is measured on the zero-filled image: set recon zero-filled")
        if self.corruption.enabled and self.beam > 1:
            raise ValueError("with corruption the oracle is greedy over new lines and repeats: set beam 1")


    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> HeadroomConfig:
        """The settings a report was measured with (its ``headroom`` section, as written), the
        flat corruption keys of earlier reports included (:func:`corruption_of`)."""
        known = {f.name for f in fields(cls)}
        plain = {k: v for k, v in settings.items() if k in known and k != "corruption"}
        return from_dict(cls, {**plain, "corruption": to_dict(corruption_of(settings))}, "headroom")

    def env_config(self, observe_mar: bool = True) -> EnvConfig:
        """The acquisition environment that replays this measurement's draws (the same attempts
        and flags of every line of every slice) for the gated order and learned policies."""
        return EnvConfig(n_envs=1, region=self.region, margin=self.margin, corruption=self.corruption,
                         observe_mar=observe_mar)


def corruption_of(settings: dict[str, Any]) -> CorruptionModel:
    """The corruption of a report's ``headroom`` settings: the nested section, or the flat keys
    (``corruption`` a probability, ``corruption_kind``, ``attempts``, ``detection``,
    ``false_alarm``, ``seed``) of reports written before it was nested."""
    value = settings.get("corruption", 0.0)
    if isinstance(value, dict):
        return CorruptionModel(**value)
    flat = {"kind": "corruption_kind", "attempts": "attempts", "detection": "detection",
            "false_alarm": "false_alarm", "seed": "seed"}
    return CorruptionModel(float(value or 0.0), **{k: settings[old] for k, old in flat.items() if old in settings})


def measured_slices(data: SliceSet, per_subject: int) -> np.ndarray:
    """Indices of the ``per_subject`` slices of each subject with the most implant pixels (all
    when 0), in data order."""
    if per_subject <= 0:
        return np.arange(len(data))
    area = data.implant_mask.reshape(len(data), -1).sum(dim=1).numpy()
    keep: list[int] = []
    for s in dict.fromkeys(data.subjects):
        rows = np.array([i for i, x in enumerate(data.subjects) if x == s])
        keep.extend(rows[np.argsort(-area[rows], kind="stable")[:per_subject]].tolist())
    return np.sort(np.asarray(keep, dtype=np.int64))
