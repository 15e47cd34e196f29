"""The acquisition engine behind the gadget: lines in, next-line decisions and images out.

No sockets and no ismrmrd here (STYLE.md 4, "I/O apart from maths"): the gadget and the
standalone server turn acquisitions into ``add_line(slice, line, samples)`` calls and send the
:class:`Decision` s and :class:`SliceResult` s this engine returns.

One engine serves one connection (one scan, one matrix size). Per slice it keeps the k-space
lines that actually arrived (the scanner is the authority: a line the engine did not ask for
is stored all the same, a repeated line overwrites), and once a slice has its ``initial``
lines it asks the policy for the next line after every new line until ``initial + budget``
lines are in. All slices that want a decision at the same moment are decided in one batched
pass: zero-filled reconstruction -> one MAR forward -> :meth:`SamplingPolicy.select_batch`.

Shapes: a slice's k-space is ``(n_pe, n_readout)`` complex64 (row k = PE line k of centred
k-space, as :mod:`masc_gadget.core.kspace`), its mask ``(n_pe,)`` bool, its image ``(n_pe, n_readout)``
float32 magnitude; a batch of B slices stacks them to ``(B, n_pe, n_readout)`` / ``(B, n_pe)``.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionState, initial_lines
from masc_gadget.models.checkpoint import load_mar
from masc_gadget.acquisition.decision import Decision
from masc_gadget.device import resolve_device
from masc_gadget.core.kspace import zero_filled
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy, slice_rng

__all__ = ["AcquisitionEngine", "Decision", "EngineSettings", "SliceResult"]

log = logging.getLogger(__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class EngineSettings:
    """What the engine needs to know about a scan (built by the gadget from the ISMRMRD header
    and its configuration)."""

    n_pe: int
    """Phase-encoding lines per slice (encoded matrix y)."""
    n_readout: int
    """Samples per readout line (encoded matrix x)."""
    initial: int
    """Lines a slice needs before the first decision (the centre lines of the episode)."""
    budget: int
    """Lines the policy chooses per slice after the initial ones; decisions stop once a slice
    has ``initial + budget`` lines."""
    policy: str = "center-out"
    """Sampling policy name (``masc_gadget.acquisition.policies.make_policy``)."""
    mar_checkpoint: str = ""
    """MAR network checkpoint (``masc_gadget.models.checkpoint.load_mar``); "" = MAR off, the output
    image is the zero-filled one."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``."""
    seed: int = 0
    """Seed of the per-slice random streams ``slice_rng(seed, slice)`` of random policies."""
    return_zero_filled: bool = False
    """Whether the gadget also returns the zero-filled image of each slice (the engine always
    puts it in :attr:`SliceResult.zero_filled`)."""

    def __post_init__(self) -> None:
        for name in ("n_pe", "n_readout", "initial", "budget", "seed"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name, low in (("n_pe", 1), ("n_readout", 1), ("initial", 1), ("budget", 0), ("seed", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.initial + self.budget > self.n_pe:
            raise ValueError(
                f"initial + budget must be <= number of PE lines ({self.n_pe}), "
                f"got {self.initial} + {self.budget}"
            )
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"policy must be a non-empty policy name, got {self.policy!r}")
        if not isinstance(self.mar_checkpoint, (str, Path)):
            raise ValueError(
                f"mar_checkpoint must be a path or '' (MAR off), got {self.mar_checkpoint!r}"
            )
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.return_zero_filled, bool):
            raise ValueError(
                f"return_zero_filled must be true or false, got {self.return_zero_filled!r}"
            )

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
    image when MAR is off)."""
    zero_filled: np.ndarray
    """(n_pe, n_readout) float32: zero-filled magnitude of the acquired lines."""
    lines: list[int]
    """Acquired lines in arrival order (a repeated line listed once, where it first came)."""
    decided: list[int]
    """The lines of ``lines`` that the engine had asked for before they arrived, arrival order."""
    policy: str
    """Name of the policy that made the decisions."""
    mar: str
    """"none", or the MAR checkpoint's file name (and epoch)."""


@dataclass(eq=False)
class _Slice:
    """One slice's buffers (released by :meth:`AcquisitionEngine.finish_slice`)."""

    kspace: np.ndarray  # (n_pe, n_readout) complex64, zero where not acquired
    mask: np.ndarray  # (n_pe,) bool
    rng: np.random.Generator  # slice_rng(seed, slice), kept across steps
    lines: list[int] = field(default_factory=list)
    decided: list[int] = field(default_factory=list)
    issued: set[int] = field(default_factory=set)  # every line the engine asked for
    awaiting: bool = False  # a decision was issued since the last new line

    @property
    def n_acquired(self) -> int:
        return len(self.lines)


class AcquisitionEngine:
    """Per-slice line buffers, batched next-line decisions and final images (module docstring).

    Args:
        settings: the scan and what to run on it.
        policy: a ready policy; None builds ``make_policy(settings.policy)``.
        mar: a ready MAR network ``(B, H, W) -> (B, H, W)``; None loads
            ``settings.mar_checkpoint`` (when set). A given module is moved to the engine's
            device and put in eval mode (in place).
        mar_metadata: the checkpoint metadata of a given ``mar`` (``load_mar``'s second value),
            for :attr:`SliceResult.mar` ("mar.pt (epoch 12)"); optional.

    Both are built once, here, under a forked torch RNG; then one dummy pass (zero-filled
    recon + MAR + policy) warms them up before the first line, so the first real decision does
    not pay for lazy initialisation (CUDA context, cuDNN autotuning, allocator).
    """

    def __init__(
        self,
        settings: EngineSettings,
        policy: SamplingPolicy | None = None,
        mar: torch.nn.Module | None = None,
        mar_metadata: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(settings, EngineSettings):
            raise TypeError(f"settings must be an EngineSettings, got {type(settings).__name__}")
        self.settings = settings
        self.device = resolve_device(settings.device)
        fork_devices = [] if self.device.type != "cuda" else [self.device.index or 0]
        self.mar_metadata: dict[str, Any] = dict(mar_metadata or {})
        with torch.random.fork_rng(devices=fork_devices):  # model init never moves global RNG
            if policy is None:
                policy = make_policy(settings.policy)
            if mar is None and settings.mar_checkpoint:
                mar, self.mar_metadata = load_mar(settings.mar_checkpoint, self.device)
        if not isinstance(policy, SamplingPolicy):
            raise TypeError(f"policy must be a SamplingPolicy, got {type(policy).__name__}")
        self.policy = policy
        self.policy_name = policy.name or type(policy).__name__
        self.mar = None if mar is None else mar.to(self.device).eval()
        self.mar_name = self._describe_mar()
        self._slices: dict[int, _Slice] = {}
        self.warmup_us = self._warm_up()
        self.warmed_up = True
        log.info(
            "acquisition engine: policy %s, MAR %s, device %s, %d PE x %d readout, "
            "%d initial + %d budget lines, warm-up %.1f ms",
            self.policy_name, self.mar_name, self.device, settings.n_pe, settings.n_readout,
            settings.initial, settings.budget, self.warmup_us / 1e3,
        )

    # --- set-up ---------------------------------------------------------------------------------

    def _describe_mar(self) -> str:
        if self.mar is None:
            return "none"
        if not self.settings.mar_checkpoint:
            return type(self.mar).__name__
        name = Path(self.settings.mar_checkpoint).name
        epoch = self.mar_metadata.get("epoch")
        return f"{name} (epoch {epoch})" if epoch is not None else name

    @property
    def sees_mar(self) -> bool:
        """Whether the policy is shown the MAR image (else the zero-filled one): MAR on, the
        policy reads images, and it does not opt out with ``observes_mar = False``."""
        return (
            self.mar is not None
            and self.policy.needs_image
            and getattr(self.policy, "observes_mar", True)
        )

    def _warm_up(self) -> int:
        """One dummy pass through every stage; returns its wall time in microseconds."""
        s = self.settings
        start = time.perf_counter_ns()
        kspace = np.zeros((1, s.n_pe, s.n_readout), dtype=np.complex64)
        kspace[0, s.n_pe // 2, s.n_readout // 2] = 1.0
        mask = np.zeros((1, s.n_pe), dtype=bool)
        mask[0, initial_lines(s.n_pe, s.initial)] = True
        zf, mar = self._reconstruct(kspace, mask, with_mar=self.mar is not None)
        if s.budget > 0:
            image = (mar if self.sees_mar else zf)[0] if self.policy.needs_image else None
            state = AcquisitionState(
                mask=mask[0], steps_left=s.budget, step=0, image=image, n_initial=s.initial
            )
            # a private stream: the slices' own streams are not advanced by the warm-up
            self.policy.select_batch([state], [np.random.default_rng(0)])
        return (time.perf_counter_ns() - start) // 1000

    # --- reconstruction ---------------------------------------------------------------------------

    def _reconstruct(
        self, kspace: np.ndarray, mask: np.ndarray, with_mar: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Zero-filled (and MAR) images of a batch, one MAR forward for all.

        kspace: (B, n_pe, n_readout) complex64; mask: (B, n_pe) bool.
        Returns (zero_filled, mar): (B, n_pe, n_readout) float32 numpy arrays on the CPU; mar is
        None unless ``with_mar``.
        """
        with torch.no_grad():
            k = torch.from_numpy(kspace).to(self.device)
            m = torch.from_numpy(mask).to(self.device)
            zf = zero_filled(k, m)  # (B, n_pe, n_readout) float32
            corrected = self.mar(zf) if with_mar else None  # (B, n_pe, n_readout)
            zf_np = zf.cpu().numpy()
            mar_np = None if corrected is None else corrected.float().cpu().numpy()
        return zf_np, mar_np

    # --- lines ------------------------------------------------------------------------------------

    def _check_slice(self, slice: int) -> int:
        if not _is_int(slice) or slice < 0:
            raise ValueError(f"slice must be a non-negative integer, got {slice!r}")
        return int(slice)

    def add_line(self, slice: int, line: int, data: np.ndarray) -> None:
        """Store PE line ``line`` of slice ``slice``: ``data`` (n_readout,) or (1, n_readout)
        samples of one channel (complex or real numbers).

        Stored whether or not the engine asked for it (the scanner is the authority); a line
        that arrives again overwrites the first one and is not a new line. A new line clears
        the slice's outstanding decision, so it wants a fresh one (:meth:`wanting`) while it has
        at least ``initial`` and fewer than ``initial + budget`` lines.

        Raises ValueError, storing nothing, for a negative slice, a line outside [0, n_pe),
        samples of the wrong shape, or NaN / inf samples.
        """
        s = self.settings
        slice = self._check_slice(slice)
        if not _is_int(line) or not 0 <= line < s.n_pe:
            raise ValueError(
                f"slice {slice}: line must be an integer in [0, {s.n_pe}) (n_pe = {s.n_pe}), "
                f"got {line!r}"
            )
        line = operator.index(line)
        samples = np.asarray(data)
        if samples.dtype.kind not in "iufc":
            raise ValueError(
                f"slice {slice} line {line}: samples must be numbers, got dtype {samples.dtype}"
            )
        if samples.shape not in ((s.n_readout,), (1, s.n_readout)):
            raise ValueError(
                f"slice {slice} line {line}: expected one channel of {s.n_readout} readout "
                f"samples, shape ({s.n_readout},) or (1, {s.n_readout}), got shape "
                f"{samples.shape}"
            )
        with np.errstate(over="ignore", invalid="ignore"):
            row = samples.reshape(s.n_readout).astype(np.complex64)
        if not (np.isfinite(samples).all() and np.isfinite(row).all()):
            raise ValueError(f"slice {slice} line {line} contains NaN/inf samples")
        buf = self._slices.get(slice)
        if buf is None:
            buf = _Slice(
                kspace=np.zeros((s.n_pe, s.n_readout), dtype=np.complex64),
                mask=np.zeros(s.n_pe, dtype=bool),
                rng=slice_rng(s.seed, slice),
            )
            self._slices[slice] = buf
        buf.kspace[line] = row
        if buf.mask[line]:
            return  # a repeat: new samples, same line
        buf.mask[line] = True
        buf.lines.append(line)
        if line in buf.issued:
            buf.decided.append(line)
        buf.awaiting = False

    def _decidable(self, buf: _Slice) -> bool:
        return self.settings.initial <= buf.n_acquired < self.settings.total

    def wanting(self) -> list[int]:
        """Slices that need a decision now, ascending: at least ``initial`` lines, fewer than
        ``initial + budget``, and no decision issued since their last new line."""
        return [
            k for k, buf in sorted(self._slices.items())
            if not buf.awaiting and self._decidable(buf)
        ]

    def decide(self, slices: Iterable[int] | None = None) -> list[Decision]:
        """Decide the next line of every wanting slice (or of ``slices``) in one batched pass.

        Zero-filled recon of the B slices -> one MAR forward on the (B, n_pe, n_readout) batch
        (only when the policy reads images and observes MAR) -> ``policy.select_batch`` on their
        :class:`AcquisitionState` s (mask, steps left, step = lines beyond ``initial``, image,
        ``n_initial = initial``) with each slice's own ``slice_rng(seed, slice)``. Policies with
        ``needs_image = False`` get no image, so the pass skips the reconstruction.

        ``slices`` may name slices that already have an outstanding decision (it is re-issued:
        the same line for a deterministic policy); those of them with fewer than ``initial`` or
        with ``initial + budget`` lines are skipped. An unknown slice is a ValueError.

        Returns one :class:`Decision` per decided slice, in order (wanting: ascending), all
        with the wall time of the whole pass as ``latency_us``; the slices are marked decided.
        """
        if slices is None:
            chosen = self.wanting()
        else:
            chosen = []
            for k in slices:
                k = self._check_slice(k)
                if k not in self._slices:
                    raise ValueError(f"unknown slice {k}: no line of it has arrived (or it is finished)")
                if k not in chosen and self._decidable(self._slices[k]):
                    chosen.append(k)
        if not chosen:
            return []
        s = self.settings
        start = time.perf_counter_ns()
        bufs = [self._slices[k] for k in chosen]
        images: Sequence[np.ndarray | None] = [None] * len(bufs)
        if self.policy.needs_image:
            kspace = np.stack([b.kspace for b in bufs])  # (B, n_pe, n_readout)
            mask = np.stack([b.mask for b in bufs])  # (B, n_pe)
            zf, mar = self._reconstruct(kspace, mask, with_mar=self.sees_mar)
            images = mar if mar is not None else zf
        states = [
            AcquisitionState(
                mask=b.mask,
                steps_left=s.total - b.n_acquired,
                step=b.n_acquired - s.initial,
                image=image,
                n_initial=s.initial,
            )
            for b, image in zip(bufs, images)
        ]
        lines = np.asarray(self.policy.select_batch(states, [b.rng for b in bufs]))
        latency_us = (time.perf_counter_ns() - start) // 1000
        if lines.shape != (len(bufs),):
            raise RuntimeError(
                f"policy {self.policy_name!r} returned {lines.shape} choices for {len(bufs)} slices"
            )
        decisions = []
        for k, b, state, line in zip(chosen, bufs, states, lines):
            line = int(line)
            if not 0 <= line < s.n_pe or b.mask[line]:
                raise RuntimeError(
                    f"policy {self.policy_name!r} chose line {line} for slice {k}, which is not "
                    f"a free line of {s.n_pe}"
                )
            b.issued.add(line)
            b.awaiting = True
            decisions.append(Decision(slice=k, line=line, step=state.step, latency_us=int(latency_us)))
        log.debug("decided %d slice(s) in %d us: %s", len(decisions), latency_us, decisions)
        return decisions

    def on_line(self, slice: int, line: int, data: np.ndarray) -> list[Decision]:
        """:meth:`add_line`, then :meth:`decide` for that slice if it wants a decision:
        [] or [Decision]."""
        self.add_line(slice, line, data)
        slice = int(slice)
        buf = self._slices[slice]
        if buf.awaiting or not self._decidable(buf):
            return []
        return self.decide([slice])

    # --- slices -----------------------------------------------------------------------------------

    def complete(self, slice: int) -> bool:
        """Whether the slice has ``initial + budget`` lines (False for a slice with no line
        stored, e.g. one already finished)."""
        buf = self._slices.get(self._check_slice(slice))
        return buf is not None and buf.n_acquired >= self.settings.total

    def slices(self) -> list[int]:
        """Slices with lines stored (not finished yet), ascending."""
        return sorted(self._slices)

    def acquired(self, slice: int) -> list[int]:
        """The lines of a slice stored so far, arrival order; [] for an unknown slice."""
        buf = self._slices.get(self._check_slice(slice))
        return [] if buf is None else list(buf.lines)

    def finish_slice(self, slice: int) -> SliceResult:
        """The slice's final image from all its acquired lines; its buffers are released (a
        later line of the same slice starts a new episode). ValueError for an unknown slice."""
        return self.finish_slices([slice])[0]

    def finish_slices(self, slices: Sequence[int]) -> list[SliceResult]:
        """:meth:`finish_slice` for several slices with one batched reconstruction and MAR
        forward: (B, n_pe, n_readout) in, one :class:`SliceResult` per slice, in order."""
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
        if not keys:
            return []
        bufs = [self._slices[k] for k in keys]
        zf, mar = self._reconstruct(
            np.stack([b.kspace for b in bufs]),
            np.stack([b.mask for b in bufs]),
            with_mar=self.mar is not None,
        )
        images = zf if mar is None else mar
        results = [
            SliceResult(
                slice=k,
                image=images[i].copy(),
                zero_filled=zf[i].copy(),
                lines=list(b.lines),
                decided=list(b.decided),
                policy=self.policy_name,
                mar=self.mar_name,
            )
            for i, (k, b) in enumerate(zip(keys, bufs))
        ]
        for k in keys:
            del self._slices[k]
        return results

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self.settings, f.name)!r}"
                           for f in dataclasses.fields(self.settings))
        return f"AcquisitionEngine({fields}, slices={self.slices()})"
