"""Out-of-distribution scores of a MAR image: how far the network is from what it was trained for.

A MAR network meets anatomy, contrasts and artifacts it never saw. Each score below is computed
per slice from what the gadget has at the end of a scan (the zero-filled image of the acquired
lines, the network's output, the line mask), is 0 for an untouched image and grows with how
much, or how inconsistently, the network changed it:

``consistency``
    The network's output, sent back through the scan's own sampling (centred 2D FFT, the
    acquired lines only, inverse FFT, magnitude), against the zero-filled image it came from:
    ``||ZF_M(F g) - ZF|| / ||ZF||``. A correction that stays with the acquired data scores low;
    one that invents structure the acquired lines do not contain scores high. No extra network
    pass.
``residual``
    The relative size of the correction, ``||g - ZF|| / ||ZF||``. No extra network pass.
``flip``
    Test-time augmentation: the output for the readout-mirrored input, mirrored back, against the
    output, ``||g - flip(g(flip ZF))|| / ||g||``. Mirroring along the readout leaves the line mask
    unchanged, so a network on familiar ground answers alike; one pass more.
``holdout``
    An early rule's score after lines beyond the initial ones (``after_lines``): the network's
    output for the image of the protocol's initial centre lines alone, sent through the scan's
    sampling, against the acquired lines it did not see (H: the acquired lines beyond the
    initial ones), ``||P_H F g(ZF_0) - P_H F ZF|| / ||P_H F ZF||``. It asks whether the network
    predicts k-space it was not given, which is what it does for every line a scan skips: a
    network that invents wrong structure predicts its held-out lines badly. One pass more; in
    early rules only (an end-of-scan fallback serves the zero-filled image of the slice's own
    lines, which can harm). On validation it finds harm within a domain where the others do not
    (docs/mar-safety.md).
``halves``
    An early rule's score after lines beyond the initial ones, like ``holdout``, with the lines
    split in two: the network is given the initial lines and the inner half (rounded down) of the
    acquired lines beyond them, by distance from the k-space centre (G), and its output ``g(ZF_G)``
    is judged twice: how badly it predicts the outer half it was not given (the ``holdout``
    residual on ``H = M - G``), and how far it leaves the lines it was given (the
    ``consistency`` residual of ``g(ZF_G)`` against ``ZF_G``); the score is their geometric mean.
    A network that invents structure either contradicts its own lines or mispredicts the
    others; one pass more, as ``holdout`` (docs/results.md, "A second look at hip harm").

Which score the gadget uses, and the threshold above which it returns the zero-filled image
instead, are chosen on a validation split by ``masc check mar`` and stored in the MAR
checkpoint (metadata ``ood``); see :func:`masc_gadget.core.served.served_images`.

Two stages of the rule (:class:`OodCalibration` ``stage``):

``end``
    The score of the final image; a flagged slice is served as the zero-filled image of the lines
    it was acquired with. For lines scattered over k-space that image can be far worse than doing
    nothing (centre-out's zero-filled image with as many lines), so this stage can harm.
``early``
    The early switch: the score of the image of the initial centre lines, computed at the
    policy's first decision (from the images a policy that reads them is shown; made for the
    score alone for a policy that reads none). A flagged slice is switched to centre-out for the
    rest of its lines (:func:`masc_gadget.acquisition.policies.select_lines`) and served
    zero-filled: it is then exactly doing nothing, never worse. A policy that reads no image
    still decides each slice's lines at its first decision, all at once (its order, or
    centre-out's when flagged), so the scanner still has them ahead. With ``after_lines``
    (``masc check mar --early-lines N``) the rule scores the image of a slice's first N lines
    instead (:func:`switch_point`): it sees more, and a switched slice keeps those lines, so it
    is served the zero-filled image of them and centre-out's next ones, level with doing
    nothing only while N is small (measured, docs/results.md); a policy that reads no image
    sends its plan up to there at the first decision and the rest after the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from masc_gadget.core.kspace import fft2c, initial_lines, zero_filled

__all__ = ["EARLY_SCORES", "GIVEN_SCORES", "SCORES", "STAGES", "Initial", "OodCalibration", "early_calibration_of", "early_switch", "calibration_of", "consistency_score", "fallback_rule", "flip_score",
           "given_image", "given_lines", "halves_score", "holdout_score", "initial_image", "initial_of", "inner_lines", "ood_score",
           "residual_score", "switch_point"]

SCORES = ("consistency", "residual", "flip")
"""The scores of any rule, computed from the final image alone."""
GIVEN_SCORES = ("holdout", "halves")
"""The scores that run the network on the image of some of a slice's lines (its initial lines;
for ``halves`` also the inner half of the others) and judge its output against the rest: defined
once a slice has lines beyond the initial ones, in early rules only."""
EARLY_SCORES = (*SCORES, *GIVEN_SCORES)
"""The scores of an early rule: :data:`SCORES` and :data:`GIVEN_SCORES`."""
STAGES = ("end", "early")


def _relative(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    num = (a - b).flatten(1).norm(dim=1)
    den = ref.flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return (num / den).float()


def consistency_score(zero_filled_image: torch.Tensor, corrected: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) ``||ZF_M(F g) - ZF|| / ||ZF||`` (module docstring); images (B, H, W) real, mask
    (B, H) bool over the phase-encoding rows."""
    resampled = zero_filled(fft2c(corrected.to(torch.complex64)), mask)
    return _relative(resampled, zero_filled_image, zero_filled_image)


def residual_score(zero_filled_image: torch.Tensor, corrected: torch.Tensor) -> torch.Tensor:
    """(B,) ``||g - ZF|| / ||ZF||``."""
    return _relative(corrected, zero_filled_image, zero_filled_image)


@torch.no_grad()
def flip_score(mar: Callable[[torch.Tensor], torch.Tensor], zero_filled_image: torch.Tensor,
               corrected: torch.Tensor) -> torch.Tensor:
    """(B,) ``||g - flip(g(flip ZF))|| / ||g||`` with ``flip`` along the readout (last) axis."""
    mirrored = mar(zero_filled_image.flip(-1)).flip(-1)
    return _relative(corrected, mirrored, corrected)


Initial = tuple[torch.Tensor, torch.Tensor]
"""The image of the lines a score of :data:`GIVEN_SCORES` gives the network, and their mask:
((B, H, W) real, (B, H) or (H,) bool); the initial centre lines for ``holdout``
(:func:`initial_image`), those and the inner half of the others for ``halves`` (:func:`given_image`)."""


def _held_out(output: torch.Tensor, zero_filled_image: torch.Tensor, given: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """(B,) ``||P_H F output - P_H F ZF|| / ||P_H F ZF||`` with H = ``mask`` - ``given`` ((B, H) bool)."""
    held = mask.bool() & ~given
    if not bool(held.any(dim=1).all()):
        raise ValueError("the holdout and halves scores need lines beyond the initial ones on every slice "
                         "(an early rule with after_lines > initial)")
    seen = fft2c(zero_filled_image.to(torch.complex64))
    predicted = fft2c(output.to(torch.complex64))
    rows = held[:, :, None].to(seen.real.dtype)
    num = ((predicted - seen).abs() ** 2 * rows).flatten(1).sum(dim=1)
    den = (seen.abs() ** 2 * rows).flatten(1).sum(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return (num / den).sqrt().float()


@torch.no_grad()
def holdout_score(mar: Callable[[torch.Tensor], torch.Tensor], initial: Initial, zero_filled_image: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """(B,) ``||P_H F g(ZF_0) - P_H F ZF|| / ||P_H F ZF||`` (module docstring): ``initial`` the
    image of the initial lines and their mask, ``mask`` (B, H) the acquired lines. NaN (not
    scored) for a slice that lacks some initial line (an open-loop stream in file order: its first
    lines are k-space edges); ValueError when a slice has no line beyond the initial ones (nothing
    held out)."""
    image, first = initial
    first = first.bool().expand_as(mask)
    score = _held_out(mar(image.float()), zero_filled_image, first, mask)
    return torch.where(_lacks_initial(first, mask), torch.full_like(score, math.nan), score)


@torch.no_grad()
def halves_score(mar: Callable[[torch.Tensor], torch.Tensor], given: Initial, zero_filled_image: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """(B,) the geometric mean of ``||P_H F g(ZF_G) - P_H F ZF|| / ||P_H F ZF||`` and
    ``||ZF_G(F g(ZF_G)) - ZF_G|| / ||ZF_G||`` (module docstring): ``given`` the image of the
    given lines G (:func:`given_image`) and their mask (B, H), ``mask`` (B, H) the acquired lines,
    H = M - G. NaN for a slice that lacks some initial line; ValueError when a slice has nothing
    held out."""
    image, inner = given
    inner = inner.bool().expand_as(mask)
    output = mar(image.float())
    held = _held_out(output, zero_filled_image, inner, mask)
    kept = consistency_score(image.float(), output, inner)
    score = (held * kept).sqrt()
    return torch.where(_lacks_initial(inner, mask), torch.full_like(score, math.nan), score)


def _lacks_initial(first: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the slices of ``mask`` (B, H) without every line of ``first`` ((H,) or (B, H))."""
    return (first.bool().expand_as(mask) & ~mask.bool()).any(dim=1)


def initial_image(kspace: torch.Tensor, initial: int,
                  recon: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = zero_filled) -> Initial:
    """What the ``holdout`` score predicts from: the images (``recon``, zero-filled by default) of
    B slices' ``initial`` centre lines alone, from their k-space (B, H, W) complex (single coil),
    and those lines' mask (H,)."""
    first = torch.zeros(kspace.shape[-2], dtype=torch.bool, device=kspace.device)
    first[torch.as_tensor(initial_lines(kspace.shape[-2], initial), device=kspace.device)] = True
    return recon(kspace, first.expand(len(kspace), -1)), first


def inner_lines(mask: torch.Tensor, initial: int) -> torch.Tensor:
    """(B, H) bool: the lines the ``halves`` score gives the network, from the acquired ``mask``
    (B, H): the protocol's ``initial`` centre lines and the inner half (rounded down) of the
    acquired lines beyond them, nearest the centre ``H // 2`` first (at equal distance the line
    below the centre first)."""
    mask = mask.bool()
    n_pe = mask.shape[-1]
    first = torch.zeros(n_pe, dtype=torch.bool, device=mask.device)
    first[torch.as_tensor(initial_lines(n_pe, initial), device=mask.device)] = True
    beyond = mask & ~first
    index = torch.arange(n_pe, device=mask.device)
    centre = n_pe // 2
    key = torch.where(index < centre, 2 * (centre - index), 2 * (index - centre) + 1).expand_as(mask)
    key = torch.where(beyond, key, torch.full_like(key, 2 * n_pe + 2))  # the others last
    rank = torch.empty_like(key)
    rank.scatter_(1, key.argsort(dim=1), index.expand_as(mask).contiguous())
    return first | (beyond & (rank < (beyond.sum(dim=1, keepdim=True) // 2)))


def given_lines(score: str, mask: torch.Tensor, initial: int) -> torch.Tensor:
    """(B, H) bool: the lines the score ``score`` (of :data:`GIVEN_SCORES`) gives the network,
    from the acquired ``mask`` (B, H): the protocol's ``initial`` centre lines (``holdout``), or
    those and the inner half of the others (``halves``, :func:`inner_lines`)."""
    if score == "halves":
        return inner_lines(mask, initial)
    if score != "holdout":
        raise ValueError(f"the {score} score gives the network no lines: choose from {', '.join(GIVEN_SCORES)}")
    first = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    first[torch.as_tensor(initial_lines(mask.shape[-1], initial), device=mask.device)] = True
    return first.expand_as(mask).clone()


def given_image(kspace: torch.Tensor, mask: torch.Tensor, initial: int,
                recon: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = zero_filled) -> Initial:
    """What the ``halves`` score gives the network: the images (``recon``, zero-filled by
    default) of B slices' :func:`inner_lines` of the acquired ``mask`` (B, H), from their k-space
    (B, H, W) complex (single coil), and those lines' mask (B, H)."""
    inner = inner_lines(mask, initial)
    return recon(kspace, inner), inner


def initial_of(rule: OodCalibration | None, kspace: torch.Tensor, initial: int,
               mask: torch.Tensor | None = None) -> Initial | None:
    """What ``rule``'s score gives the network, for an early rule scored by one of
    :data:`GIVEN_SCORES` (:func:`initial_image`; :func:`given_image` of the acquired ``mask``
    for ``halves``); None for another rule."""
    if rule is None or rule.score not in GIVEN_SCORES:
        return None
    if rule.score == "holdout":
        return initial_image(kspace, initial)
    if mask is None:
        raise ValueError("the halves score needs the acquired lines (mask) to split them")
    return given_image(kspace, mask, initial)


def ood_score(kind: str, zero_filled_image: torch.Tensor, corrected: torch.Tensor | None, mask: torch.Tensor,
              mar: Callable[[torch.Tensor], torch.Tensor] | None = None, initial: Initial | None = None
              ) -> torch.Tensor:
    """(B,) the score ``kind`` (one of :data:`EARLY_SCORES`) of B slices, float32; non-finite
    outputs score +inf. :data:`GIVEN_SCORES` need the network and ``initial``, the image of the
    lines they give it and their mask (:func:`initial_of`), and not ``corrected`` (the others do);
    they are NaN (not scored, never flagged) for a slice without the initial lines."""
    unscored = torch.zeros(zero_filled_image.shape[0], dtype=torch.bool, device=zero_filled_image.device)
    if kind in GIVEN_SCORES:
        if mar is None or initial is None:
            raise ValueError(f"the {kind} score needs the MAR network and the image of the lines it is given "
                             f"(initial_of)")
        score = (holdout_score if kind == "holdout" else halves_score)(mar, initial, zero_filled_image, mask)
        unscored = _lacks_initial(initial[1], mask)
    elif corrected is None:
        raise ValueError(f"the {kind} score needs the MAR output (corrected)")
    elif kind == "consistency":
        score = consistency_score(zero_filled_image, corrected, mask)
    elif kind == "residual":
        score = residual_score(zero_filled_image, corrected)
    elif kind == "flip":
        if mar is None:
            raise ValueError("the flip score needs the MAR network")
        score = flip_score(mar, zero_filled_image, corrected)
    else:
        raise ValueError(f"unknown OOD score {kind!r}: choose from {', '.join(EARLY_SCORES)}")
    return torch.where(torch.isfinite(score) | unscored, score, torch.full_like(score, float("inf")))


@torch.no_grad()
def early_switch(rule: OodCalibration, zero_filled_image: torch.Tensor, corrected: torch.Tensor | None,
                 mask: torch.Tensor, mar: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 initial: Initial | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The early rule at its switch point: ((B,) bool flagged, (B,) float32 scores) for B slices
    from the images of their lines so far (zero-filled, and the MAR output the policy is shown:
    None for :data:`GIVEN_SCORES`, which read the output for ``initial``, the image of the lines
    they give the network and their mask). A slice whose output is not finite is flagged."""
    if rule.stage != "early":
        raise ValueError(f"early_switch needs an early rule, got stage {rule.stage!r}")
    score = ood_score(rule.score, zero_filled_image.float(), None if corrected is None else corrected.float(), mask,
                      mar, initial)
    return score > rule.threshold, score


@dataclass(frozen=True)
class OodCalibration:
    """Which score a MAR network is judged by, and the threshold above which its slice is served
    zero-filled (``inf``: scored, never replaced); ``stage``: scored on the final image
    (``end``) or on the image of the initial lines, switching a flagged slice to centre-out
    (``early``; module docstring)."""

    score: str
    threshold: float
    stage: str = "end"
    after_lines: int | None = None
    """An early rule only: score (and switch) once a slice has this many lines, its initial ones
    and the first ones its policy chose (None: at the initial lines; :func:`switch_point`)."""

    def __post_init__(self) -> None:
        if self.score not in EARLY_SCORES:
            raise ValueError(f"unknown OOD score {self.score!r}: choose from {', '.join(EARLY_SCORES)}")
        if self.score not in SCORES and (self.stage != "early" or self.after_lines is None):
            raise ValueError(f"the {self.score} score is an early rule's after lines beyond the initial ones "
                             f"(stage early, after_lines), got stage {self.stage!r}, after_lines {self.after_lines!r}")
        if self.stage not in STAGES:
            raise ValueError(f"unknown OOD stage {self.stage!r}: choose from {', '.join(STAGES)}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(f"the OOD threshold must be a number > 0, got {self.threshold!r}")
        if self.after_lines is not None and (self.stage != "early" or isinstance(self.after_lines, bool)
                                             or not isinstance(self.after_lines, int) or self.after_lines < 1):
            raise ValueError(f"after_lines is an early rule's line count >= 1, got {self.after_lines!r} "
                             f"(stage {self.stage!r})")

    @classmethod
    def from_metadata(cls, section: Any, where: str) -> OodCalibration | None:
        """The end-of-scan calibration stored in a checkpoint's metadata (``ood``: {score,
        threshold}, optionally ``early``: {score, threshold}), or None when there is none;
        ValueError naming ``where`` when it (or its ``early`` entry) is malformed."""
        if section is None:
            return None
        try:
            rule = cls(str(section["score"]), float(section["threshold"]))
        except (TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{where}: metadata 'ood' must be {{score, threshold}}: {err}") from None
        cls.early_from_metadata(section, where)
        return rule

    @classmethod
    def early_from_metadata(cls, section: Any, where: str) -> OodCalibration | None:
        """The early-switch calibration of a checkpoint's metadata ``ood`` (its ``early`` entry:
        {score, threshold}), or None; ValueError naming ``where`` when it is malformed."""
        early = section.get("early") if isinstance(section, dict) else None
        if early is None:
            return None
        try:
            return cls(str(early["score"]), float(early["threshold"]), "early", early.get("after_lines"))
        except (TypeError, KeyError, ValueError, AttributeError) as err:
            raise ValueError(f"{where}: metadata 'ood.early' must be {{score, threshold[, after_lines]}}: "
                             f"{err}") from None


def switch_point(rule: OodCalibration | None, initial: int, lines_per_decision: int = 1) -> int | None:
    """How many lines a slice has when the early ``rule`` scores it (None: no early rule): its
    ``after_lines`` (at least the initial lines), rounded up to a decision's train of
    ``lines_per_decision`` lines after the initial ones, since a slice is decided a train at a
    time."""
    if rule is None or rule.stage != "early":
        return None
    chosen = max(0, (rule.after_lines or initial) - initial)
    if rule.score not in SCORES and chosen == 0:
        raise ValueError(f"the {rule.score} score needs lines beyond the {initial} initial ones: this rule scores "
                         f"after {rule.after_lines}: calibrate and export the network's rule for this protocol "
                         f"(masc check mar --early-lines), or serve it with gadget.mar_fallback=off")
    return initial + -(-chosen // lines_per_decision) * lines_per_decision


def calibration_of(mar: Any) -> OodCalibration | None:
    """The calibration a loaded MAR network carries (attribute ``ood``, set by the checkpoint
    loader), or None."""
    found = getattr(mar, "ood", None)
    return found if isinstance(found, OodCalibration) else None


def early_calibration_of(mar: Any) -> OodCalibration | None:
    """The early-switch calibration a loaded MAR network carries (attribute ``ood_early``), or
    None."""
    found = getattr(mar, "ood_early", None)
    return found if isinstance(found, OodCalibration) and found.stage == "early" else None


def fallback_rule(mar: Any, setting: str, switches_early: bool = False) -> OodCalibration | None:
    """The rule a gadget serves ``mar``'s images by, from the ``gadget.mar_fallback`` setting:
    ``auto`` the network's own calibration: its early switch when the network has one and the
    caller ``switches_early`` (can switch a flagged slice to centre-out after its initial lines:
    the gadget's engine, for every policy; False: a caller that cannot, the oracle), else its
    end-of-scan rule (None without one: always its image);
    ``off`` scored by its end-of-scan calibration's score but never replaced; a number, that
    threshold on the end-of-scan calibration's score (``consistency`` for a network without
    one)."""
    if mar is None:
        return None
    calibration = calibration_of(mar)
    if setting == "auto":
        early = early_calibration_of(mar) if switches_early else None
        return early if early is not None else calibration
    kind = calibration.score if calibration is not None else "consistency"
    if setting == "off":
        return OodCalibration(kind, math.inf) if calibration is not None else None
    return OodCalibration(kind, float(setting))


def check_fallback_setting(value: Any) -> str:
    """``value`` as a valid ``gadget.mar_fallback`` (``auto``, ``off`` or a number > 0, as text);
    ValueError otherwise. YAML reads an unquoted ``off`` in a config file or ``--set`` as false
    (and ``on`` as true): false is ``off``, true is ``auto``."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return text
    try:
        number = float(text)
    except (ValueError, OverflowError):  # OverflowError: an integer of hundreds of digits
        number = math.nan
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"mar_fallback must be auto, off or a threshold > 0, got {str(value)[:40]!r}")
    return repr(number)
