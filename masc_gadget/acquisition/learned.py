"""Trained acquisition policies as :class:`~masc_gadget.acquisition.policies.SamplingPolicy` objects.

Four kinds of checkpoint hold a learned policy; the metadata's ``kind`` says which:

* ``masc``: a :class:`~masc_gadget.models.policy_net.PolicyNet` (PPO actor), run greedily: the
  free line with the largest logit;
* ``dqn`` and ``ss-ddqn``: a :class:`~masc_gadget.models.q_net.QNet`, run greedily: the free line
  with the largest Q-value;
* ``loupe``: a learned fixed order (a :class:`~masc_gadget.acquisition.policies.FixedOrder`),
  with the MAR network it was trained with.

The network policies (:class:`LearnedPolicy`) score a whole batch of slices in one forward pass,
with the acquired lines masked out. Each kind joins the policy registry under its own name
through the ``masc.policies`` entry points, so offline evaluation and the streaming gadget use
them like the baselines; :func:`load_learned` reads any of them.

Checkpoint (written with :func:`~masc_gadget.models.checkpoint.save_checkpoint`)::

    masc     state dicts "policy" (PolicyNet), optionally "mar" (MarNet)
             metadata {"kind": "masc", "policy_net": to_dict(PolicyNetConfig), "n_pe", "height",
                       "width", "observes_mar": bool, "prior_lines", "mar_model" (with "mar"), ...}
    dqn,     state dicts "q" (QNet), optionally "mar"
    ss-ddqn  metadata {"kind", "q_net": to_dict(QNetConfig), "spectral": bool, "n_pe", "height",
                       "width", "observes_mar", "mar_model" (with "mar"), ...}
    loupe    state dicts "mar" (MarNet)
             metadata {"kind": "loupe", "n_pe", "order": [budget distinct lines], "mar_model", ...}

:func:`policy_metadata` and :func:`q_metadata` build that metadata from the networks.

Before a network is built, its sizes are checked against these bounds (and the network it
describes against the stored weights, :func:`~masc_gadget.models.checkpoint.check_weights_fit`):
``n_pe``, ``height``, ``width`` <= :data:`MAX_MATRIX`; ``channels`` at most :data:`MAX_STAGES`
stages of <= :data:`MAX_CHANNELS`; ``hidden`` <= :data:`MAX_HIDDEN`; ``pool_size`` <=
:data:`MAX_POOL`. A checkpoint outside them is a ValueError naming the size and its bound.
"""

from __future__ import annotations

import logging

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.core.seeding import isolated_rng
from masc_gadget.models.checkpoint import (Checkpoint, check_size, check_weights_fit, load_checkpoint,
                                           mar_from_checkpoint)
from masc_gadget.config import ConfigError, from_dict, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.q_net import QNet, QNetConfig
from masc_gadget.models.unet import MarNet
from masc_gadget.acquisition.policies import FixedOrder, SamplingPolicy

KIND = "masc"
Q_KINDS = ("dqn", "ss-ddqn")
"""The value-based baselines: a QNet, greedy in Q."""
LOUPE = "loupe"
"""The learned fixed mask (LOUPE-style): a fixed order and its MAR network."""
FIXED = "fixed-order"
"""The population order of a protocol and the MAR network co-adapted to it (``masc train
fixed-order``): a fixed order and its MAR network, as LOUPE's."""
ORDER_KINDS = (LOUPE, FIXED)
"""Kinds whose policy is a fixed order (metadata ``order``) and whose checkpoint holds a MAR network."""
KINDS = (KIND, *Q_KINDS, *ORDER_KINDS)
"""Every kind of learned-policy checkpoint, each also a policy name."""

MAX_MATRIX = 8192
"""Largest ``n_pe``, ``height`` and ``width`` of a policy network (image rows and columns)."""
MAX_STAGES = 8
"""Most encoder stages (``policy_net.channels`` entries)."""
MAX_CHANNELS = 4096
"""Most channels of one encoder stage."""
MAX_HIDDEN = 65536
"""Largest ``policy_net.hidden``."""
MAX_POOL = 64
"""Largest ``policy_net.pool_size``."""


def policy_metadata(
    net: PolicyNet, observes_mar: bool, mar: MarNet | None = None, **extra: Any
) -> dict[str, Any]:
    """Checkpoint metadata that :func:`load_masc` reads back: ``kind``, ``policy_net``,
    ``n_pe``, ``height``, ``width``, ``observes_mar`` (+ ``mar_model`` when ``mar`` is given),
    plus ``extra`` (epoch, metrics, config, ...)."""
    meta: dict[str, Any] = {
        "kind": KIND,
        "policy_net": to_dict(net.config),
        "n_pe": net.n_pe,
        "height": net.height,
        "width": net.width,
        "observes_mar": bool(observes_mar),
        "prior_lines": net.prior_lines,
        "prior_train": net.prior_train,
    }
    if mar is not None:
        meta["mar_model"] = to_dict(mar.config)
    return {**meta, **extra}


def q_metadata(net: QNet, kind: str, observes_mar: bool, mar: MarNet | None = None,
               **extra: Any) -> dict[str, Any]:
    """Checkpoint metadata of a value-based baseline (``kind`` ``dqn`` or ``ss-ddqn``) that
    :func:`load_learned` reads back."""
    if kind not in Q_KINDS:
        raise ValueError(f"kind must be one of {', '.join(Q_KINDS)}, got {kind!r}")
    meta: dict[str, Any] = {"kind": kind, "q_net": to_dict(net.config), "spectral": net.spectral,
                            "n_pe": net.n_pe, "height": net.height, "width": net.width,
                            "observes_mar": bool(observes_mar)}
    if mar is not None:
        meta["mar_model"] = to_dict(mar.config)
    return {**meta, **extra}


class LearnedPolicy(SamplingPolicy):
    """Greedy (argmax over free lines) acquisition with a trained :class:`PolicyNet` (logits)
    or :class:`QNet` (Q-values).

    Args:
        net: the trained network (moved to ``device``, put in eval mode); its ``scores(image,
            mask, steps_left_frac)`` gives (B, n_pe) scores with the acquired lines masked.
        observes_mar: whether the network was trained on MAR-corrected images (then the
            engine / evaluation show it the MAR image when a MAR network runs) or on the
            zero-filled ones.
        device: where the forward pass runs (cpu, cuda, auto).
        metadata: the checkpoint's metadata, kept for reports.
        name: the policy's name (the checkpoint's kind: ``masc``, ``dqn`` or ``ss-ddqn``).

    The network sees ``steps_left / (step + steps_left)``, the fraction of the episode's budget
    still to choose, as the environment's ``steps_left / budget`` during training.
    """

    name = KIND
    needs_image = True
    deterministic = True

    def __init__(
        self,
        net: PolicyNet,
        observes_mar: bool = True,
        device: str | torch.device = "cpu",
        metadata: dict[str, Any] | None = None,
        name: str = KIND,
    ) -> None:
        if not isinstance(net, (PolicyNet, QNet)):
            raise TypeError(f"net must be a PolicyNet or a QNet, got {type(net).__name__}")
        self.name = str(name)
        if not isinstance(observes_mar, bool):
            raise TypeError(f"observes_mar must be a bool, got {observes_mar!r}")
        self.device = resolve_device(device)
        self.net = net.to(self.device).eval()
        self.observes_mar = observes_mar
        self.metadata: dict[str, Any] = dict(metadata or {})

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "auto") -> LearnedPolicy:
        """The policy of a MASC, DQN or SS-DDQN checkpoint (see the module docstring), on ``device``."""
        ck = load_checkpoint(path, map_location="cpu")
        policy = _policy_from(ck, path, device, expected=None)
        if not isinstance(policy, LearnedPolicy):
            raise ValueError(f"{path} is a {ck.metadata.get('kind')} checkpoint: a fixed order, not a network "
                             "policy; load it with load_learned")
        return policy

    # --- choosing lines -------------------------------------------------------------------------

    def _check(self, state: AcquisitionState) -> None:
        """The checks of :meth:`SamplingPolicy.check`, plus the network's sizes."""
        self.check(state)
        if state.n_pe != self.net.n_pe:
            raise ValueError(
                f"policy {self.name!r} was trained for {self.net.n_pe} PE lines, got a state with "
                f"{state.n_pe}"
            )
        shape = tuple(np.shape(state.image))
        if shape != (self.net.height, self.net.width):
            raise ValueError(
                f"policy {self.name!r} was trained on ({self.net.height}, {self.net.width}) images, "
                f"got {shape}"
            )

    def _greedy(self, states: Sequence[AcquisitionState]) -> np.ndarray:
        """(B,) int64 argmax of the masked logits, one forward pass for all ``states``."""
        return self._scores(states).argmax(axis=1).astype(np.int64)

    def _scores(self, states: Sequence[AcquisitionState]) -> np.ndarray:
        """(B, n_pe) float masked scores (logits or Q), one forward pass for all ``states``."""
        images = np.stack([
            np.abs(s.image) if np.iscomplexobj(s.image) else np.asarray(s.image) for s in states
        ]).astype(np.float32, copy=False)
        masks = np.stack([s.mask for s in states])
        frac = np.array([s.steps_left / s.budget for s in states], dtype=np.float32)
        with torch.inference_mode():
            mask = torch.from_numpy(masks).to(self.device)
            scores = self.net.scores(torch.from_numpy(images).to(self.device), mask,
                                     torch.from_numpy(frac).to(self.device))
            if not bool(torch.isfinite(scores).all()):  # argmax would pick a NaN's line
                raise ValueError(f"policy {self.name!r}: the network's line scores are not finite "
                                 "(NaN or inf) for this image; no line is chosen")
        return scores.float().cpu().numpy()

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        self._check(state)
        return int(self._greedy([state])[0])

    def select_trains(self, states: Sequence[AcquisitionState],
                      rngs: Sequence[np.random.Generator | None] | None, k: int) -> np.ndarray:
        """The top ``k`` free lines of ONE forward pass per state (the greedy echo train, as the
        policy is trained to choose it), -1 beyond a state's ``steps_left``: (B, k) int64."""
        states = list(states)
        if not states:
            return np.zeros((0, k), dtype=np.int64)
        for state in states:
            self._check(state)
        scores = self._scores(states)
        out = np.full((len(states), k), -1, dtype=np.int64)
        for i, state in enumerate(states):
            n = min(k, state.steps_left, int((~state.mask).sum()))
            out[i, :n] = np.argsort(-scores[i], kind="stable")[:n]
        return out

    def select_batch(
        self,
        states: Sequence[AcquisitionState],
        rngs: Sequence[np.random.Generator | None] | None = None,
    ) -> np.ndarray:
        """One choice per state, (B,) int64, from ONE forward pass over the batch (``rngs`` is
        accepted for the common interface and ignored: the policy is deterministic)."""
        states = list(states)
        if rngs is not None and len(rngs) != len(states):
            raise ValueError(f"need one rng per state: got {len(rngs)} rngs for {len(states)} states")
        if not states:
            return np.zeros(0, dtype=np.int64)
        for state in states:
            self._check(state)
        lines = self._greedy(states)
        for state, line in zip(states, lines):
            if state.mask[line]:  # cannot happen while a free line exists; guard the contract
                raise RuntimeError(f"policy {self.name!r} chose line {line}, which is already acquired")
        return lines

    def __repr__(self) -> str:
        return (
            f"LearnedPolicy({self.name!r}, n_pe={self.net.n_pe}, image=({self.net.height}, {self.net.width}), "
            f"observes_mar={self.observes_mar}, device={self.device})"
        )


def _check_sizes(meta: dict[str, Any], label: str, section_name: str = "policy_net",
                 defaults: Any = PolicyNetConfig) -> None:
    """ValueError unless every size the metadata gives the network is within bounds."""
    for key in ("n_pe", "height", "width"):
        check_size(label, key, meta[key], MAX_MATRIX)
    section = meta[section_name]
    if not isinstance(section, dict):
        raise ValueError(f"{label}: metadata {section_name} must be a mapping of the network's sizes")
    channels = section.get("channels", defaults.channels)
    if not isinstance(channels, (list, tuple)) or not 1 <= len(channels) <= MAX_STAGES:
        raise ValueError(f"{label}: metadata {section_name}.channels must be a list of 1 to {MAX_STAGES} integers")
    for c in channels:
        check_size(label, f"{section_name}.channels[]", c, MAX_CHANNELS)
    check_size(label, f"{section_name}.hidden", section.get("hidden", defaults.hidden), MAX_HIDDEN)
    check_size(label, f"{section_name}.pool_size", section.get("pool_size", defaults.pool_size), MAX_POOL)
    prior = meta.get("prior_lines", 0)
    if prior != 0:
        check_size(label, "prior_lines", prior, meta["n_pe"])


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(ck: Checkpoint, path: str | Path, expected: str | None) -> str:
    """The checkpoint's kind, checked against ``expected`` (None: any learned kind)."""
    kind = ck.metadata.get("kind")
    hint = "a MAR-only checkpoint goes to mar_checkpoint, not policy_checkpoint"
    if expected is not None and kind != expected:
        raise ValueError(f"{path} is not a {expected} policy checkpoint (metadata kind {_shown(kind)}, "
                         f"expected {expected!r}); {hint}")
    if kind not in KINDS:
        raise ValueError(f"{path} is not a learned policy checkpoint (metadata kind {_shown(kind)}, expected "
                         f"one of {', '.join(KINDS)}); {hint}")
    return kind


def _require(ck: Checkpoint, path: str | Path, kind: str, state: str, keys: tuple[str, ...]) -> None:
    if state not in ck.state_dicts:
        names = ", ".join(sorted(map(str, ck.state_dicts)))[:200] or "none"
        raise ValueError(f"{path} holds no {state!r} network (state dicts: {names})")
    missing = [k for k in keys if k not in ck.metadata]
    if missing:
        raise ValueError(f"{path}: {kind} checkpoint metadata lacks {', '.join(missing)}")
    for key in ("observes_mar", "spectral"):
        if key in keys and not isinstance(ck.metadata[key], bool):
            raise ValueError(f"{path}: metadata {key} must be true or false")


def _build(path: str | Path, build: Any, weights: Any, what: str, section: str) -> torch.nn.Module:
    """``build()`` checked against the stored weights, then loaded with them."""
    try:
        check_weights_fit(build, weights, what, str(path))
        with isolated_rng():  # the init is overwritten; leave the global RNGs alone
            net = build()
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith(str(path)) else f"{path}: {err}") from None
    try:
        net.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(f"{path}: {what!r} weights do not match {section}: {err}") from None
    return net


def _masc_from(ck: Checkpoint, path: str | Path, device: str | torch.device) -> LearnedPolicy:
    meta = ck.metadata
    _require(ck, path, KIND, "policy", ("policy_net", "n_pe", "height", "width", "observes_mar"))
    _check_sizes(meta, str(path))
    try:
        cfg = from_dict(PolicyNetConfig, meta["policy_net"], "policy_net")
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None
    prior = meta.get("prior_lines", 0)  # checkpoints before the prior have none
    net = _build(path, lambda: PolicyNet(meta["n_pe"], meta["height"], meta["width"], cfg, prior_lines=prior),
                 ck.state_dicts["policy"], "policy", f"policy_net {cfg}")
    if net.prior_order is not None:
        try:
            net.set_prior(net.prior_order.clone())  # the stored order must be valid lines
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    train = meta.get("prior_train", 1)  # checkpoints before echo trains mark one line
    if isinstance(train, bool) or not isinstance(train, int) or not 1 <= train <= meta["n_pe"]:
        raise ValueError(f"{path}: metadata prior_train must be an integer in [1, n_pe], got {train!r}")
    net.prior_train = train
    if cfg.reacquire:
        logging.getLogger(__name__).warning(
            "%s was trained to acquire a line again when the scanner flags it corrupted (policy_net.reacquire); "
            "the gadget receives no such flags and serves it as if none were (no repeats); masc check headroom plays the flags",
            path)
    return LearnedPolicy(net, observes_mar=meta["observes_mar"], device=device, metadata=meta)


def _q_from(ck: Checkpoint, path: str | Path, kind: str, device: str | torch.device) -> LearnedPolicy:
    meta = ck.metadata
    _require(ck, path, kind, "q", ("q_net", "spectral", "n_pe", "height", "width", "observes_mar"))
    _check_sizes(meta, str(path), "q_net", QNetConfig)
    try:
        cfg = from_dict(QNetConfig, meta["q_net"], "q_net")
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None
    net = _build(path, lambda: QNet(meta["n_pe"], meta["height"], meta["width"], cfg, spectral=meta["spectral"]),
                 ck.state_dicts["q"], "q", f"q_net {cfg}")
    return LearnedPolicy(net, observes_mar=meta["observes_mar"], device=device, metadata=meta, name=kind)


def _order_from(ck: Checkpoint, path: str | Path, kind: str) -> FixedOrder:
    meta = ck.metadata
    _require(ck, path, kind, "mar", ("n_pe", "order"))
    check_size(str(path), "n_pe", meta["n_pe"], MAX_MATRIX)
    order = meta["order"]
    n_pe = meta["n_pe"]
    if (not isinstance(order, list) or not order or len(order) > n_pe
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n_pe for x in order)
            or len(set(order)) != len(order)):
        raise ValueError(f"{path}: metadata order must be a list of 1 to {n_pe} distinct lines in [0, {n_pe})")
    return FixedOrder(np.asarray(order, dtype=np.int64), name=kind)


def _policy_from(ck: Checkpoint, path: str | Path, device: str | torch.device,
                 expected: str | None = KIND) -> SamplingPolicy:
    """The policy of a loaded checkpoint (``expected``: the kind it must be, None: any learned
    kind); ``path`` only names it in messages."""
    kind = _kind(ck, path, expected)
    if kind == KIND:
        return _masc_from(ck, path, device)
    if kind in Q_KINDS:
        return _q_from(ck, path, kind, device)
    return _order_from(ck, path, kind)


def _mar_from(ck: Checkpoint, path: str | Path, device: torch.device) -> MarNet | None:
    return mar_from_checkpoint(ck, path, device) if "mar" in ck.state_dicts else None


def load_learned(
    path: str | Path, device: str | torch.device = "auto", name: str | None = None, kind: str | None = None
) -> tuple[SamplingPolicy, MarNet | None, dict[str, Any]]:
    """The policy and, when the checkpoint holds one (trained with the policy), the MAR network
    of a learned-policy checkpoint of any kind (or of ``kind``), on ``device`` in eval mode, and
    the metadata. One file read. ``name``: how messages name the checkpoint (default:
    ``path`` as written)."""
    device = resolve_device(device)
    ck = load_checkpoint(path, map_location="cpu", name=name)
    label = name or path
    policy = _policy_from(ck, label, device, expected=kind)
    return policy, _mar_from(ck, label, device), ck.metadata


def load_masc(
    path: str | Path, device: str | torch.device = "auto", name: str | None = None
) -> tuple[LearnedPolicy, MarNet | None, dict[str, Any]]:
    """:func:`load_learned` of a MASC checkpoint (kind ``masc``)."""
    return load_learned(path, device, name, kind=KIND)


def make_learned_policy(checkpoint: str = "", device: str = "auto", kind: str = KIND, **_: Any) -> SamplingPolicy:
    """Registry factory (``masc.policies`` entry point ``masc``): ``make_policy("masc",
    checkpoint=path, device=...)``. Other keyword options are ignored."""
    if not checkpoint:
        raise ValueError(f"the {kind} policy needs a checkpoint (policy_checkpoint / --checkpoint)")
    return load_learned(checkpoint, device, kind=kind)[0]


def make_dqn_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> SamplingPolicy:
    """Registry factory of ``dqn`` (a ``masc train dqn`` checkpoint)."""
    return make_learned_policy(checkpoint, device, kind="dqn")


def make_ss_ddqn_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> SamplingPolicy:
    """Registry factory of ``ss-ddqn`` (a ``masc train ss-ddqn`` checkpoint)."""
    return make_learned_policy(checkpoint, device, kind="ss-ddqn")


def make_loupe_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> SamplingPolicy:
    """Registry factory of ``loupe`` (a ``masc train loupe`` checkpoint)."""
    return make_learned_policy(checkpoint, device, kind=LOUPE)


def make_fixed_order_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> SamplingPolicy:
    """Registry factory of ``fixed-order`` (a ``masc train fixed-order`` or ``masc train refit`` checkpoint)."""
    return make_learned_policy(checkpoint, device, kind=FIXED)
