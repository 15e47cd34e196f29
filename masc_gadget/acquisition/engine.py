"""The acquisition engine behind the gadget: lines in, next-line decisions and images out.

No sockets and no ismrmrd here (I/O apart from the maths): the gadget and the
standalone server turn acquisitions into ``add_line(slice, line, samples)`` calls and send the
:class:`Decision` s and :class:`SliceResult` s this engine returns.

One engine serves one connection (one scan, one matrix size). Per slice it keeps the k-space
lines that actually arrived (the scanner is the authority: a line the engine did not ask for
is stored all the same, a repeated line overwrites), and once a slice has its ``initial``
lines it asks the policy for the next line after every new line until ``initial + budget``
lines are in (with ``lines_per_decision`` k > 1: for the next echo train of k lines, once every
line of the last train is in, sent as k decisions of consecutive steps). All slices that want a
decision at the same moment are decided in one batched pass: zero-filled reconstruction -> one
MAR forward -> :meth:`SamplingPolicy.select_batch` (``select_trains`` for k > 1).

Shapes: a slice's k-space is ``(n_coils, n_pe, n_readout)`` complex64 (row k = PE line k of
centred k-space, as :mod:`masc_gadget.core.kspace`; one plane per receive coil), its mask ``(n_pe,)``
bool, its image ``(n_pe, n_readout)`` float32 magnitude, the coils combined
(:func:`masc_gadget.core.coils.coil_combine`, ``coil_combine`` of the settings) before MAR; a batch
of B slices stacks them to ``(B, n_coils, n_pe, n_readout)`` / ``(B, n_pe)``. With one coil the
image is the zero-filled magnitude, as it always was.

Non-finite values never reach a decision or an image: :meth:`AcquisitionEngine.add_line`
rejects samples that are NaN or inf or whose real or imaginary part exceeds
:data:`MAX_SAMPLE_MAGNITUDE` (1e30) in magnitude, so the float32 FFT sums of any matrix up to
~10^8 samples stay finite; as a second line of defence every reconstruction a decision is made
on (zero-filled and MAR) is checked, and a line after which it is not finite is rejected by
:meth:`AcquisitionEngine.on_line` with the slice's previous state kept. A final image whose MAR
output is not finite falls back to the zero-filled image (named so in ``SliceResult.mar``).
Final images are the served ones of :func:`masc_gadget.core.served.served_images`, the function
``masc eval`` and the training environment score.

Randomness: each slice draws from its own ``slice_rng(seed, slice)`` stream, kept across its
steps, so a random policy makes the same choices for a slice whatever the interleaving of the
slices; the global numpy and torch RNGs are never used. Not thread-safe: one engine per
connection, called from one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from masc_gadget.acquisition.batcher import DecisionBatcher, DecisionRequest, QueueFull, split_rows
from masc_gadget.acquisition.contract import EngineSettings, SliceResult, is_int
from masc_gadget.acquisition.decision import Decision
from masc_gadget.acquisition.episode import AcquisitionState, EpisodeBatch
from masc_gadget.acquisition.policies import SamplingPolicy, select_next, select_trains, slice_rng
from masc_gadget.core.coils import coil_combine
from masc_gadget.core.ood import GIVEN_SCORES, Initial, early_switch, fallback_rule, given_lines, switch_point
from masc_gadget.core.served import served_images
from masc_gadget.device import resolve_device

__all__ = ["AcquisitionEngine", "Decision", "EngineSettings", "SliceResult"]

log = logging.getLogger(__name__)


MAX_SAMPLE_MAGNITUDE = 1e30
"""Largest magnitude of a sample's real or imaginary part that :meth:`AcquisitionEngine.add_line`
accepts (real scanner data are many orders of magnitude smaller); larger values would overflow
the float32 reconstruction (NaN images)."""


class _Undo(NamedTuple):
    """How to take back one :meth:`AcquisitionEngine._store`."""

    slice: int
    line: int
    row: np.ndarray | None  # the previous samples of the line (None: the slice was new)
    new_line: bool
    awaiting: bool
    n_decided: int
    pending: frozenset


class _Served(NamedTuple):
    """Served images of B finished slices, numpy on the CPU."""

    zero_filled: np.ndarray  # (B, n_pe, n_readout) float32
    image: np.ndarray  # (B, n_pe, n_readout) float32
    mar_used: np.ndarray  # (B,) bool
    ood_score: np.ndarray  # (B,) float32, NaN without an OOD rule


class DecisionPayload(NamedTuple):
    """What one engine's decision request carries to the shared batcher (:meth:`AcquisitionEngine.run_group`)."""

    engine: AcquisitionEngine
    kspace: np.ndarray
    """(B, n_coils, n_pe, n_readout) complex64 of the B slices."""
    mask: np.ndarray
    """(B, n_pe) bool, their acquired rows."""
    states: list[AcquisitionState]
    rngs: list[np.random.Generator | None]
    unscored: np.ndarray
    """(B,) bool: slices the early OOD rule has not scored yet."""
    k: int | None = None
    """Lines per slice (None: ``lines_per_decision``; a whole episode when deciding ahead)."""


@dataclass(eq=False)
class _Slice:
    """One slice's buffers (released by :meth:`AcquisitionEngine.finish_slices`)."""

    kspace: np.ndarray  # (n_coils, n_pe, n_readout) complex64, zero where not acquired
    episode: EpisodeBatch  # a batch of one: its mask, arrival order and slice_rng(seed, slice)
    decided: list[int] = field(default_factory=list)
    issued: set[int] = field(default_factory=set)  # every line the engine asked for
    pending: set[int] = field(default_factory=set)  # lines of the last train not arrived yet
    awaiting: bool = False  # a train was issued and lines of it are still to come
    unscorable: bool = False  # the early rule could not score it at its switch point: never scored again



class AcquisitionEngine:
    """Per-slice line buffers, batched next-line decisions and final images (module docstring).

    The engine does no I/O: it receives ready models.

    Args:
        settings: the scan and what to run on it.
        policy: the sampling policy (``make_policy(name)``, or a learned one).
        mar: a MAR network ``(B, H, W) -> (B, H, W)``, or None (MAR off: the output image is
            the zero-filled one). It is moved to the engine's device and put in eval mode (in
            place).
        mar_name: how reports name the MAR network ("mar.pt (epoch 12)"); default: its class
            name, or "none" without one.
        batcher: a :class:`~masc_gadget.acquisition.batcher.DecisionBatcher` running
            :meth:`run_group` that many engines share (one per server): their decision passes
            that wait at the same moment then run as one batched forward. None: each engine
            runs its own passes.

    A dummy pass (zero-filled recon + MAR + policy) warms them up before the first line, so the
    first real decision does not pay for lazy initialisation (CUDA context, cuDNN autotuning,
    allocator). ``warmed``: the batch keys (models, matrix, device) whose passes already ran, a
    serving host's own set (:attr:`masc_gadget.serving.host.Host.warmed`) shared by its engines, so
    its later connections start their engines at once; None: this engine warms up.
    """

    def __init__(
        self,
        settings: EngineSettings,
        policy: SamplingPolicy,
        mar: torch.nn.Module | None = None,
        mar_name: str = "",
        batcher: DecisionBatcher | None = None,
        warmed: set[tuple] | None = None,
    ) -> None:
        if not isinstance(settings, EngineSettings):
            raise TypeError(f"settings must be an EngineSettings, got {type(settings).__name__}")
        if not isinstance(policy, SamplingPolicy):
            raise TypeError(f"policy must be a SamplingPolicy, got {type(policy).__name__}")
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.policy = policy
        self.policy_name = policy.name or type(policy).__name__
        self.mar = None if mar is None else mar.to(self.device).eval()
        self.mar_name = mar_name or ("none" if mar is None else type(mar).__name__)
        self.sees_mar = policy.sees_mar(self.mar is not None)
        """Whether the policy is shown the MAR image (else the zero-filled one)."""
        self.ood = fallback_rule(self.mar, settings.mar_fallback, switches_early=True)
        """The rule that serves a slice zero-filled when its MAR image's OOD score is too high:
        at the end of the scan, or (stage ``early``, the network's early calibration) at the
        first decision, switching the slice to centre-out (:mod:`masc_gadget.core.ood`); for a
        policy that reads no image the engine makes the initial lines' images for that score
        alone, and a slice decided ahead gets centre-out's plan."""
        self.early = self.ood is not None and self.ood.stage == "early"
        self.switch_at = switch_point(self.ood, settings.initial, settings.lines_per_decision)
        """With an early rule: the lines a slice has when it is scored (its initial lines, or the
        rule's ``after_lines``); a slice decided ahead gets its plan up to there first, the rest
        after the verdict."""
        self.ahead = settings.decide_ahead and not policy.needs_image
        """A slice's whole episode is decided at its first decision (the policy reads no image)."""
        self._slices: dict[int, _Slice] = {}
        self._outside = np.zeros(settings.n_pe, dtype=bool)
        """(n_pe,) rows the scanner cannot acquire: shown to the policy as taken, never chosen."""
        if settings.rows is not None:
            first, last = settings.rows
            self._outside[:first] = True
            self._outside[last + 1:] = True
        self.batcher = batcher
        self._batch_key = (id(policy), id(self.mar), self.sees_mar, str(self.device),
                           settings.n_pe, settings.n_readout, settings.n_coils, settings.coil_combine,
                           settings.lines_per_decision, self.ahead, settings.initial,
                           self.ood if self.early else None)
        """Engines whose requests may share a decision pass (:meth:`run_group`, which runs the
        first one's :meth:`decision_pass`): the same models, matrix, protocol and early rule
        (``mar_fallback`` is a per-connection setting)."""
        # the first engine of a model, matrix and device of a serving host warms them up; the
        # host's next engines start at once (its warm-up already ran the same passes)
        done = warmed is not None and self._batch_key in warmed
        self.warmup_us = 0 if done else self._warm_up()
        if warmed is not None:
            warmed.add(self._batch_key)
        log.info(
            "acquisition engine: policy %s, MAR %s, device %s, %d PE x %d readout x %d coil(s)%s, "
            "%d initial + %d budget lines, warm-up %.1f ms",
            self.policy_name, self.mar_name, self.device, settings.n_pe, settings.n_readout, settings.n_coils,
            f" ({settings.coil_combine})" if settings.n_coils > 1 else "",
            settings.initial, settings.budget, self.warmup_us / 1e3,
        )

    def _episode(self, rng: np.random.Generator, start: bool = False) -> EpisodeBatch:
        s = self.settings
        return EpisodeBatch(s.n_pe, s.initial, s.budget, 1, rngs=[rng], start=start, name="slice")

    def _warm_up(self) -> int:
        """One dummy pass through every stage; returns its wall time in microseconds."""
        s = self.settings
        start = time.perf_counter_ns()
        kspace = np.zeros((1, s.n_coils, s.n_pe, s.n_readout), dtype=np.complex64)
        kspace[0, :, s.n_pe // 2, s.n_readout // 2] = 1.0
        # a private stream: the slices' own streams are not advanced by the warm-up
        episode = self._episode(np.random.default_rng(0), start=True)
        zf, mar = self._reconstruct(kspace, episode.masks, with_mar=self.mar is not None)
        if s.budget > 0:
            images = (mar if self.sees_mar else zf) if self.policy.needs_image else None
            select_next(self.policy, episode, images=images)
        return (time.perf_counter_ns() - start) // 1000

    # --- reconstruction ---------------------------------------------------------------------------

    def _forward(self, kspace: np.ndarray, mask: np.ndarray, with_mar: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zero-filled images of a batch (coils combined) and, ``with_mar``, their MAR images in one
        forward: kspace (B, n_coils, n_pe, n_readout) complex64, mask (B, n_pe) bool -> (B, n_pe,
        n_readout) tensors on the engine's device. Call under ``torch.no_grad()``."""
        k = torch.from_numpy(kspace).to(self.device)
        zf = coil_combine(k, torch.from_numpy(mask).to(self.device), self.settings.coil_combine)
        return zf, (self.mar(zf) if with_mar else None)

    def _reconstruct(
        self, kspace: np.ndarray, mask: np.ndarray, with_mar: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """What a policy observes: :meth:`_forward` as float32 numpy arrays on the CPU (the MAR
        output unclamped); mar is None unless ``with_mar``."""
        with torch.no_grad():
            zf, corrected = self._forward(kspace, mask, with_mar)
            return zf.cpu().numpy(), None if corrected is None else corrected.float().cpu().numpy()

    def _initial(self, kspace: np.ndarray, mask: np.ndarray) -> Initial | None:
        """For the scores that give the network some of a slice's lines (:data:`GIVEN_SCORES`;
        None for the others): the zero-filled images, coils combined, of B slices' initial lines
        alone (``holdout``) or of their :func:`inner_lines` of the acquired ``mask`` (B, n_pe)
        (``halves``), kspace (B, n_coils, n_pe, n_readout), and those lines' mask."""
        if self.ood is None or self.ood.score not in GIVEN_SCORES:
            return None
        given = given_lines(self.ood.score, torch.from_numpy(mask), self.settings.initial).numpy()
        with torch.no_grad():
            zf, _ = self._forward(kspace, given, with_mar=False)
        return zf.float(), torch.from_numpy(given).to(zf.device)

    def _served(self, keys: Sequence[int], kspace: np.ndarray, mask: np.ndarray, switched: np.ndarray,
                early_score: np.ndarray, with_mar: bool = True) -> _Served:
        """The served images of the finished slices ``keys``
        (:func:`masc_gadget.core.served.served_images` of :meth:`_forward`) as numpy arrays: (B,
        n_pe, n_readout) float32 images and (B,) whether each is the MAR one; ``switched``,
        ``early_score`` (B,): the early rule's verdicts (:class:`EpisodeBatch`); ``with_mar``
        False: the zero-filled images only (no MAR pass). Logs what it replaced."""
        with torch.no_grad():
            zf, corrected = self._forward(kspace, mask, with_mar and self.mar is not None)
            zf_finite = torch.isfinite(zf.flatten(1)).all(dim=1).cpu().numpy()
            served = served_images(zf, corrected, ood=self.ood, mask=torch.from_numpy(mask).to(zf.device),
                                   mar=self.mar, switched=torch.from_numpy(switched),
                                   early_score=torch.from_numpy(early_score))
        if not zf_finite.all():
            log.error("slice(s) %s: zero-filled image not finite; non-finite pixels set to 0",
                      [k for k, ok in zip(keys, zf_finite) if not ok])
        used = served.mar_used.cpu().numpy()
        scores = served.ood_score.cpu().numpy()
        if self.mar is not None and not used.all():
            flagged = self.ood is not None and scores > self.ood.threshold
            if np.any(flagged):
                log.warning("slice(s) %s: %sOOD score above %.3g (%s): the zero-filled image is returned as the "
                            "MAR series", [k for k, f in zip(keys, flagged) if f],
                            "early " if self.early else "", self.ood.threshold, self.ood.score)
            if np.any(~used & ~flagged):
                log.error("slice(s) %s: MAR image not finite; the zero-filled image is returned",
                          [k for k, ok, f in zip(keys, used, np.broadcast_to(flagged, used.shape)) if not ok and not f])
        return _Served(served.zero_filled.cpu().numpy(), served.image.cpu().numpy(), used, scores)

    # --- lines ------------------------------------------------------------------------------------

    def _check_slice(self, slice: int) -> int:
        if not is_int(slice) or slice < 0:
            raise ValueError(f"slice must be a non-negative integer, got {slice!r}")
        return int(slice)

    def _samples(self, slice: int, line: int, data: np.ndarray) -> np.ndarray:
        """``data`` as (n_coils, n_readout) complex64 rows; ValueError naming the problem."""
        s = self.settings
        samples = np.asarray(data)
        if samples.dtype.kind not in "iufc":
            raise ValueError(
                f"slice {slice} line {line}: samples must be numbers, got dtype {samples.dtype}"
            )
        shapes = ((s.n_readout,), (1, s.n_readout)) if s.n_coils == 1 else ((s.n_coils, s.n_readout),)
        if samples.shape not in shapes:
            expected = " or ".join(str(shape) for shape in shapes)
            raise ValueError(
                f"slice {slice} line {line}: expected {'one channel' if s.n_coils == 1 else f'{s.n_coils} channels'} of {s.n_readout} readout "
                f"samples, shape {expected}, got shape {samples.shape}"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            row = samples.reshape(s.n_coils, s.n_readout).astype(np.complex64)
        if not (np.isfinite(samples).all() and np.isfinite(row).all()):
            raise ValueError(f"slice {slice} line {line} contains NaN/inf samples")
        if row.size and max(np.abs(row.real).max(), np.abs(row.imag).max()) > MAX_SAMPLE_MAGNITUDE:
            raise ValueError(
                f"slice {slice} line {line}: samples must have real and imaginary parts of "
                f"magnitude <= {MAX_SAMPLE_MAGNITUDE:g} (larger ones overflow the reconstruction)"
            )
        return row

    def add_line(self, slice: int, line: int, data: np.ndarray) -> None:
        """Store PE line ``line`` of slice ``slice``: ``data`` (n_coils, n_readout) samples, one
        row per coil ((n_readout,) is accepted for one coil; complex or real numbers).

        Stored whether or not the engine asked for it (the scanner is the authority); a line
        that arrives again overwrites the first one and is not a new line. A new line clears
        the slice's outstanding decision, so it wants a fresh one (:meth:`wanting`) while it has
        at least ``initial`` and fewer than ``initial + budget`` lines.

        Raises ValueError, storing nothing, for a negative slice, a line outside [0, n_pe),
        samples of the wrong shape, NaN / inf samples, or samples beyond
        :data:`MAX_SAMPLE_MAGNITUDE`.
        """
        self._store(slice, line, data)

    def _store(self, slice: int, line: int, data: np.ndarray) -> _Undo:
        """:meth:`add_line`; returns how to take it back (:meth:`_undo`)."""
        s = self.settings
        slice = self._check_slice(slice)
        if not is_int(line) or not 0 <= line < s.n_pe:
            raise ValueError(
                f"slice {slice}: line must be an integer in [0, {s.n_pe}) (n_pe = {s.n_pe}), "
                f"got {line!r}"
            )
        line = operator.index(line)
        row = self._samples(slice, line, data)
        buf = self._slices.get(slice)
        previous = None
        if buf is None:
            buf = _Slice(
                kspace=np.zeros((s.n_coils, s.n_pe, s.n_readout), dtype=np.complex64),
                episode=self._episode(slice_rng(s.seed, slice)),
            )
            self._slices[slice] = buf
        else:
            previous = buf.kspace[:, line].copy()
        undo = _Undo(slice, line, previous, False, buf.awaiting, len(buf.decided), frozenset(buf.pending))
        buf.kspace[:, line] = row
        if not buf.episode.record(0, line):
            return undo  # a repeat: new samples, same line
        if line in buf.issued:
            buf.decided.append(line)
        if line in buf.pending:  # a line of the train: the slice waits for the rest of it
            buf.pending.discard(line)
            buf.awaiting = bool(buf.pending)
        else:  # a line nobody asked for: decide again from what is there
            buf.pending.clear()
            buf.awaiting = False
        return undo._replace(new_line=True)

    def _undo(self, undo: _Undo) -> None:
        """Take back a :meth:`_store`: the slice is as it was before that line came."""
        if undo.row is None:
            del self._slices[undo.slice]
            return
        buf = self._slices[undo.slice]
        buf.kspace[:, undo.line] = undo.row
        if undo.new_line:
            lines = buf.episode.lines(0)[:-1]  # the line taken back came last
            episode = self._episode(buf.episode.rngs[0])
            for kept in lines:
                episode.record(0, kept)
            if len(lines) >= (self.switch_at or self.settings.initial):  # the verdict stands on the lines kept
                episode.switch(0, buf.episode.switched, buf.episode.switch_score)
            buf.episode = episode
            del buf.decided[undo.n_decided:]
        buf.awaiting = undo.awaiting
        buf.pending = set(undo.pending)

    def _decidable(self, buf: _Slice) -> bool:
        return bool(buf.episode.is_deciding(0))

    def wanting(self) -> list[int]:
        """Slices that need a decision now, ascending: at least ``initial`` lines, fewer than
        ``initial + budget``, and no decision issued since their last new line."""
        return [
            k for k, buf in sorted(self._slices.items())
            if not buf.awaiting and self._decidable(buf)
        ]

    def _chosen(self, slices: Iterable[int] | None) -> list[int]:
        if slices is None:
            return self.wanting()
        chosen = []
        for k in slices:
            k = self._check_slice(k)
            if k not in self._slices:
                raise ValueError(f"unknown slice {k}: no line of it has arrived (or it is finished)")
            if k not in chosen and self._decidable(self._slices[k]):
                chosen.append(k)
        return chosen

    def decide(self, slices: Iterable[int] | None = None) -> list[Decision]:
        """Decide the next line of every wanting slice (or of ``slices``) in one batched pass.

        Zero-filled recon of the B slices -> one MAR forward on the (B, n_pe, n_readout) batch
        (only when the policy reads images and observes MAR) -> ``policy.select_batch`` on their
        :class:`AcquisitionState` s (:meth:`EpisodeBatch.states`) with each slice's own
        ``slice_rng(seed, slice)``. Policies with ``needs_image = False`` get no image, so the
        pass skips the reconstruction.

        ``slices`` may name slices that already have an outstanding decision (it is re-issued:
        the same line for a deterministic policy); those of them with fewer than ``initial`` or
        with ``initial + budget`` lines are skipped. An unknown slice is a ValueError.

        A slice whose image is not finite (NaN / inf) is not decided (logged); it stays wanting.
        Returns one :class:`Decision` per decided slice, in order (wanting: ascending), all
        with the wall time of the whole pass as ``latency_us``; the slices are marked decided.
        """
        decisions, bad = self._decide(self._chosen(slices))
        if bad:
            log.warning("slice(s) %s not decided: their reconstruction is not finite", bad)
        return decisions

    def _decide(self, chosen: list[int]) -> tuple[list[Decision], list[int]]:
        """:meth:`decide` of the ``chosen`` slices: (decisions, slices left undecided because
        their image is not finite)."""
        if not chosen:
            return [], []
        start = time.perf_counter_ns()
        bufs = [self._slices[k] for k in chosen]
        states = [b.episode.states()[0] for b in bufs]
        if self._outside.any():  # rows beyond the scanner's encoding limits are not offered
            states = [dataclasses.replace(s, mask=s.mask | self._outside) for s in states]
            free = [not s.mask.all() for s in states]
            if not all(free):
                log.warning("slice(s) %s: every line the scanner can acquire is in; no decision",
                            [k for k, f in zip(chosen, free) if not f])
                chosen = [k for k, f in zip(chosen, free) if f]
                bufs = [b for b, f in zip(bufs, free) if f]
                states = [s for s, f in zip(states, free) if f]
                if not chosen:
                    return [], []
        rngs = [b.episode.rngs[0] for b in bufs]
        kspace = mask = None
        waiting = np.array([self.early and not b.episode.scored(0)[0] and not b.unscorable for b in bufs], dtype=bool)
        have = np.array([len(b.episode.lines(0)) for b in bufs])
        unscored = waiting & (have >= (self.switch_at or 0))  # due for the early rule now
        if self.policy.needs_image or unscored.any():  # the policy's image, or the early rule's
            kspace = np.stack([b.kspace for b in bufs])  # (B, n_coils, n_pe, n_readout)
            mask = np.concatenate([b.episode.masks for b in bufs])  # (B, n_pe)
        k = max(s.steps_left for s in states) if self.ahead else None
        if self.batcher is not None and kspace is not None:  # a network pass: shared with other scans
            request = DecisionRequest(self._batch_key, DecisionPayload(self, kspace, mask, states, rngs, unscored, k),
                                      len(bufs))
            try:
                lines, finite, early = self.batcher(request)
            except QueueFull as err:  # the server is saturated: no decision now, the lines stay
                log.warning("slice(s) %s: no decision this time, %s; the scanner takes its own line and the "
                            "next line asks again", chosen, err)
                return [], []
        else:
            lines, finite, early = self.decision_pass(kspace, mask, states, rngs, unscored, k=k)
        for b, score, due, ok in zip(bufs, early, unscored, finite):
            if not np.isnan(score):
                b.episode.switch(0, [score > self.ood.threshold], [score])
            elif due and ok:  # scored at its switch point or never (an open-loop stream): no later pass
                b.unscorable = True
        if self.ahead and (waiting & ~unscored).any():  # a plan up to the switch point; the rest after the verdict
            lines = lines.copy()
            for i in np.flatnonzero(waiting & ~unscored):
                lines[i, self.switch_at - have[i]:] = -1
        bad = [k for k, ok in zip(chosen, finite) if not ok]
        keep = np.flatnonzero(finite)
        chosen, bufs = [chosen[i] for i in keep], [bufs[i] for i in keep]
        states, lines = [states[i] for i in keep], lines[keep]
        latency_us = (time.perf_counter_ns() - start) // 1000
        decisions = []
        for k, b, state, row in zip(chosen, bufs, states, lines):
            train = [int(line) for line in row if line >= 0]
            b.issued.update(train)
            b.pending = set(train)
            b.awaiting = True
            decisions += [Decision(slice=k, line=line, step=state.step + j, latency_us=int(latency_us))
                          for j, line in enumerate(train)]
        log.debug("decided %d slice(s) in %d us: %s", len(decisions), latency_us, decisions)
        return decisions, bad

    def decision_pass(self, kspace: np.ndarray | None, mask: np.ndarray | None,
                      states: Sequence[AcquisitionState], rngs: Sequence[np.random.Generator | None],
                      unscored: np.ndarray | None = None,
                      k: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One decision pass over B slices: zero-filled recon of ``kspace`` (B, n_coils, n_pe, n_readout)
        under ``mask`` (B, n_pe) -> MAR (when the policy observes it) -> the early OOD rule on the
        ``unscored`` slices ((B,) bool; an early rule only) -> one ``policy.select_batch``.
        Policies that read no image take ``kspace = mask = None``. ``k``: lines per slice
        (default ``lines_per_decision``; a whole episode when deciding ahead).

        Returns ((B, lines_per_decision) int64 trains, -1 where not decided; (B,) bool whether
        the slice's reconstruction is finite: a slice whose image is NaN / inf is never decided on;
        (B,) float32 early scores, NaN where not scored: a slice scoring above the threshold is
        switched to centre-out from this decision on)."""
        finite = np.ones(len(states), dtype=bool)
        early = np.full(len(states), np.nan, dtype=np.float32)
        scoring = self.early and unscored is not None and bool(np.any(unscored))
        if self.policy.needs_image or scoring:
            # holdout and halves read the network's output for the image of the lines they give it
            wants_output = scoring and self.ood.score not in GIVEN_SCORES
            zf, mar = self._reconstruct(kspace, mask, with_mar=self.sees_mar or wants_output)
            finite = _finite(zf) if mar is None else _finite(zf) & _finite(mar)
            if self.policy.needs_image:
                images = mar if self.sees_mar and mar is not None else zf
                states = [dataclasses.replace(s, image=image) for s, image in zip(states, images)]
            rows = np.flatnonzero(unscored & finite) if scoring else np.zeros(0, int)
            if rows.size:
                on = self.device
                flagged, scores = early_switch(self.ood, torch.from_numpy(zf[rows]).to(on),
                                               None if mar is None else torch.from_numpy(mar[rows]).to(on),
                                               torch.from_numpy(mask[rows]).to(on), self.mar,
                                               self._initial(kspace[rows], mask[rows]))
                early[rows] = scores.cpu().numpy()
                if np.isnan(early[rows]).any():
                    log.warning("%d slice(s) not scored by the early rule (%s): their initial lines were not among "
                                "their first %d lines (an open-loop stream in file order?); never switched",
                                int(np.isnan(early[rows]).sum()), self.ood.score, self.switch_at)
                for i, flag in zip(rows, flagged.tolist()):
                    if flag:
                        states[i] = dataclasses.replace(states[i], switched=True)
        k = self.settings.lines_per_decision if k is None else k
        lines = np.full((len(states), k), -1, dtype=np.int64)
        keep = np.flatnonzero(finite)
        if keep.size:
            lines[keep] = select_trains(self.policy, [states[i] for i in keep], [rngs[i] for i in keep], k)
        return lines, finite, early

    @staticmethod
    def run_group(group: Sequence[DecisionRequest]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The :class:`DecisionBatcher` pass: requests of engines with equal models (their batch
        key), concatenated into one :meth:`decision_pass`, the answers split back."""
        payloads: list[DecisionPayload] = [r.payload for r in group]
        engine = payloads[0].engine
        sizes = [r.size for r in group]
        kspace = np.concatenate([p.kspace for p in payloads])
        mask = np.concatenate([p.mask for p in payloads])
        states = [s for p in payloads for s in p.states]
        rngs = [g for p in payloads for g in p.rngs]
        unscored = np.concatenate([p.unscored for p in payloads])
        ks = [p.k for p in payloads if p.k is not None]  # deciding ahead: each slice's whole episode
        lines, finite, early = engine.decision_pass(kspace, mask, states, rngs, unscored, k=max(ks) if ks else None)
        return list(zip(split_rows(lines, sizes), split_rows(finite, sizes), split_rows(early, sizes)))

    def on_line(self, slice: int, line: int, data: np.ndarray) -> list[Decision]:
        """:meth:`add_line`, then :meth:`decide` for that slice if it wants a decision:
        [] or [Decision].

        When the slice's reconstruction with this line is not finite (NaN / inf), or the
        policy cannot decide on it (ValueError), the line is taken back (the slice keeps its
        previous lines and samples) and ValueError says so; nothing is decided. The check runs
        where the policy looks at an image: at each decision, and for new samples of a line
        while a decision is outstanding. Lines stored without a decision (before the initial
        lines are in, after the budget) are checked by the next decision, or, at the end, the
        final image falls back to the zero-filled one (:meth:`finish_slices`)."""
        undo = self._store(slice, line, data)
        slice = int(slice)
        buf = self._slices[slice]
        if buf.awaiting or not self._decidable(buf):
            # new samples of a line while a decision is outstanding: what the policy will see
            if buf.awaiting and self.policy.needs_image and not self._finite_images(buf):
                self._undo(undo)
                raise ValueError(self._not_finite(slice, line))
            return []
        try:
            decisions, bad = self._decide([slice])
        except ValueError:
            self._undo(undo)
            raise
        if bad:
            self._undo(undo)
            raise ValueError(self._not_finite(slice, line))
        return decisions

    def _finite_images(self, buf: _Slice) -> bool:
        """Whether the image the policy would see of ``buf`` is finite."""
        zf, mar = self._reconstruct(buf.kspace[None], buf.episode.masks, with_mar=self.sees_mar)
        return bool(_finite(zf).all() and (mar is None or _finite(mar).all()))

    @staticmethod
    def _not_finite(slice: int, line: int) -> str:
        return (f"slice {slice} line {int(line)} rejected: with it the slice's reconstruction is not "
                "finite (NaN or inf); the slice keeps its previous lines")

    # --- slices -----------------------------------------------------------------------------------

    def complete(self, slice: int) -> bool:
        """Whether the slice has ``initial + budget`` lines (False for a slice with no line
        stored, e.g. one already finished)."""
        buf = self._slices.get(self._check_slice(slice))
        return buf is not None and buf.episode.is_done(0)

    def holds(self, slice: int) -> bool:
        """Whether the slice has lines stored (open: not finished or detached yet)."""
        return self._check_slice(slice) in self._slices

    def slices(self) -> list[int]:
        """Slices with lines stored (not finished yet), ascending."""
        return sorted(self._slices)

    def acquired(self, slice: int) -> list[int]:
        """The lines of a slice stored so far, arrival order; [] for an unknown slice."""
        buf = self._slices.get(self._check_slice(slice))
        return [] if buf is None else buf.episode.lines(0)

    def finish_slice(self, slice: int) -> SliceResult:
        """The slice's final image from all its acquired lines; its buffers are released (a
        later line of the same slice starts a new episode). ValueError for an unknown slice."""
        return self.finish_slices([slice])[0]

    def finish_slices(self, slices: Sequence[int]) -> list[SliceResult]:
        """:meth:`finish_slice` for several slices with one batched reconstruction and MAR
        forward: (B, n_coils, n_pe, n_readout) in, one :class:`SliceResult` per slice, in order.

        Images are finite: a slice whose MAR image is not gets its zero-filled image instead
        (``mar`` = :data:`NON_FINITE_MAR`), logged as an error."""
        return self.finish_detached(self.detach_slices(slices))

    def detach_slices(self, slices: Sequence[int]) -> list[tuple[int, Any]]:
        """Take the slices' buffers out of the engine (cheap; a later line of one starts a new
        episode), for :meth:`finish_detached` to reconstruct, possibly on another thread, while
        this engine goes on deciding for the other slices. ValueError for an unknown slice."""
        keys = []
        for k in slices:
            k = self._check_slice(k)
            if k not in self._slices:
                raise ValueError(
                    f"unknown slice {k}: no line of it has arrived (or it is already finished); "
                    f"slices held: {self.slices()}"
                )
            if k not in keys:
                keys.append(k)
        return [(k, self._slices.pop(k)) for k in keys]

    def finish_detached(self, detached: Sequence[tuple[int, Any]], hurried: str = "") -> list[SliceResult]:
        """The final images of slices taken out by :meth:`detach_slices` (one batched
        reconstruction and MAR forward; reads the models only, so it may run beside decisions).
        ``hurried``: why there is no time for the network (e.g. a shutdown): the zero-filled
        images are served, ``mar`` naming the reason."""
        if not detached:
            return []
        keys = [k for k, _ in detached]
        bufs = [b for _, b in detached]
        served = self._served(keys, np.stack([b.kspace for b in bufs]), np.concatenate([b.episode.masks for b in bufs]),
                              np.concatenate([b.episode.switched for b in bufs]),
                              np.concatenate([b.episode.switch_score for b in bufs]), with_mar=not hurried)
        return [
            SliceResult(
                slice=k,
                image=served.image[i],
                zero_filled=served.zero_filled[i],
                lines=b.episode.lines(0),
                decided=list(b.decided),
                policy=self.policy_name,
                mar=(f"none ({hurried}: served zero-filled)" if hurried and self.mar is not None
                     else self._mar_label(bool(served.mar_used[i]), float(served.ood_score[i]))),
                ood_score=float(served.ood_score[i]),
            )
            for i, (k, b) in enumerate(zip(keys, bufs))
        ]

    def _mar_label(self, used: bool, score: float) -> str:
        if self.mar is None or used:
            return self.mar_name
        if self.ood is not None and score > self.ood.threshold:
            if self.early:
                return (f"none (early OOD score {score:.3g} > {self.ood.threshold:.3g}, {self.ood.score}: "
                        "switched to centre-out)")
            return f"none (OOD score {score:.3g} > {self.ood.threshold:.3g}, {self.ood.score})"
        return NON_FINITE_MAR

    def followed(self, slice: int) -> bool:
        """Whether every line of the slice after its first ``initial`` ones is a line the
        engine asked for (a closed-loop scan); False for a slice with no line stored."""
        buf = self._slices.get(self._check_slice(slice))
        if buf is None:
            return False
        return len(buf.decided) == max(int(buf.episode.n_acquired[0]) - self.settings.initial, 0)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.settings, f.name)!r}"
                           for f in dataclasses.fields(self.settings))
        return f"AcquisitionEngine({fields}, slices={self.slices()})"


NON_FINITE_MAR = "none (MAR output not finite)"
"""``SliceResult.mar`` of a slice whose MAR image was not finite (its zero-filled image is used)."""


def _finite(images: np.ndarray) -> np.ndarray:
    """(B,) bool: each (n_pe, n_readout) image of ``images`` (B, ...) is finite everywhere."""
    return np.isfinite(images.reshape(len(images), -1)).all(axis=1)
