"""The learned MASC acquisition policy as a :class:`~masc_gadget.acquisition.policies.SamplingPolicy`.

A trained :class:`~masc_gadget.models.policy_net.PolicyNet` is run greedily: the free line with
the largest logit (acquired lines are masked out), one forward pass for a whole batch of
slices. It joins the policy registry as ``masc`` through the ``masc.policies`` entry point
(:func:`make_learned_policy`), so offline evaluation and the streaming gadget use it like the
baselines.

Checkpoint (written with :func:`~masc_gadget.models.checkpoint.save_checkpoint`)::

    state dicts  "policy" (PolicyNet), optionally "mar" (MarNet)
    metadata     {"kind": "masc", "policy_net": to_dict(PolicyNetConfig), "n_pe": ...,
                  "height": ..., "width": ..., "observes_mar": bool,
                  "mar_model": to_dict(MarModelConfig) (with "mar"), ...}

:func:`policy_metadata` builds that metadata from the networks.

Before the network is built, its sizes are checked against these bounds (and the network it
describes against the stored weights, :func:`~masc_gadget.models.checkpoint.check_weights_fit`):
``n_pe``, ``height``, ``width`` <= :data:`MAX_MATRIX`; ``policy_net.channels`` at most
:data:`MAX_STAGES` stages of <= :data:`MAX_CHANNELS`; ``policy_net.hidden`` <=
:data:`MAX_HIDDEN`; ``policy_net.pool_size`` <= :data:`MAX_POOL`. A checkpoint outside them is
a ValueError naming the size and its bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.models.checkpoint import (Checkpoint, check_size, check_weights_fit, load_checkpoint,
                                           mar_from_checkpoint)
from masc_gadget.config import ConfigError, from_dict, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig, masked_logits
from masc_gadget.models.unet import MarNet
from masc_gadget.acquisition.policies import SamplingPolicy

KIND = "masc"

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
    }
    if mar is not None:
        meta["mar_model"] = to_dict(mar.config)
    return {**meta, **extra}


class LearnedPolicy(SamplingPolicy):
    """Greedy (argmax over free lines) acquisition with a trained :class:`PolicyNet`.

    Args:
        net: the trained network (moved to ``device``, put in eval mode).
        observes_mar: whether the network was trained on MAR-corrected images (then the
            engine / evaluation show it the MAR image when a MAR network runs) or on the
            zero-filled ones.
        device: where the forward pass runs (cpu, cuda, auto).
        metadata: the checkpoint's metadata, kept for reports.

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
    ) -> None:
        if not isinstance(net, PolicyNet):
            raise TypeError(f"net must be a PolicyNet, got {type(net).__name__}")
        if not isinstance(observes_mar, bool):
            raise TypeError(f"observes_mar must be a bool, got {observes_mar!r}")
        self.device = resolve_device(device)
        self.net = net.to(self.device).eval()
        self.observes_mar = observes_mar
        self.metadata: dict[str, Any] = dict(metadata or {})

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "auto") -> LearnedPolicy:
        """The policy of a MASC checkpoint (see the module docstring), on ``device``."""
        ck = load_checkpoint(path, map_location="cpu")
        return _policy_from(ck, path, device)

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
        images = np.stack([
            np.abs(s.image) if np.iscomplexobj(s.image) else np.asarray(s.image) for s in states
        ]).astype(np.float32, copy=False)
        masks = np.stack([s.mask for s in states])
        frac = np.array([s.steps_left / s.budget for s in states], dtype=np.float32)
        with torch.inference_mode():
            mask = torch.from_numpy(masks).to(self.device)
            logits, _ = self.net(
                torch.from_numpy(images).to(self.device), mask, torch.from_numpy(frac).to(self.device)
            )
            scores = masked_logits(logits, mask)
            if not bool(torch.isfinite(scores).all()):  # argmax would pick a NaN's line
                raise ValueError(f"policy {self.name!r}: the network's line scores are not finite "
                                 "(NaN or inf) for this image; no line is chosen")
            lines = scores.argmax(dim=1)
        return lines.cpu().numpy().astype(np.int64)

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        self._check(state)
        return int(self._greedy([state])[0])

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
            f"LearnedPolicy(n_pe={self.net.n_pe}, image=({self.net.height}, {self.net.width}), "
            f"observes_mar={self.observes_mar}, device={self.device})"
        )


def _check_sizes(meta: dict[str, Any], label: str) -> None:
    """ValueError unless every size the metadata gives the policy network is within bounds."""
    for key in ("n_pe", "height", "width"):
        check_size(label, key, meta[key], MAX_MATRIX)
    section = meta["policy_net"]
    if not isinstance(section, dict):
        raise ValueError(f"{label}: metadata policy_net must be a mapping of the policy network's sizes")
    channels = section.get("channels", PolicyNetConfig.channels)
    if not isinstance(channels, (list, tuple)) or not 1 <= len(channels) <= MAX_STAGES:
        raise ValueError(f"{label}: metadata policy_net.channels must be a list of 1 to {MAX_STAGES} integers")
    for c in channels:
        check_size(label, "policy_net.channels[]", c, MAX_CHANNELS)
    check_size(label, "policy_net.hidden", section.get("hidden", PolicyNetConfig.hidden), MAX_HIDDEN)
    check_size(label, "policy_net.pool_size", section.get("pool_size", PolicyNetConfig.pool_size), MAX_POOL)
    prior = meta.get("prior_lines", 0)
    if prior != 0:
        check_size(label, "prior_lines", prior, meta["n_pe"])


def _policy_from(ck: Checkpoint, path: str | Path, device: str | torch.device) -> LearnedPolicy:
    """The policy network of a loaded checkpoint; ``path`` only names it in messages."""
    meta = ck.metadata
    kind = meta.get("kind")
    if kind != KIND:
        shown = repr(kind) if len(repr(kind)) <= 40 else repr(kind)[:37] + "..."
        raise ValueError(
            f"{path} is not a masc policy checkpoint (metadata kind {shown}, expected {KIND!r}); "
            "a MAR-only checkpoint goes to mar_checkpoint, not policy_checkpoint"
        )
    if "policy" not in ck.state_dicts:
        raise ValueError(
            f"{path} holds no policy network (state dicts: {', '.join(sorted(map(str, ck.state_dicts)))[:200] or 'none'})"
        )
    missing = [k for k in ("policy_net", "n_pe", "height", "width", "observes_mar") if k not in meta]
    if missing:
        raise ValueError(f"{path}: masc checkpoint metadata lacks {', '.join(missing)}")
    if not isinstance(meta["observes_mar"], bool):
        raise ValueError(f"{path}: metadata observes_mar must be true or false")
    _check_sizes(meta, str(path))
    try:
        cfg = from_dict(PolicyNetConfig, meta["policy_net"], "policy_net")
        prior = meta.get("prior_lines", 0)  # checkpoints before the prior have none
        check_weights_fit(lambda: PolicyNet(meta["n_pe"], meta["height"], meta["width"], cfg,
                                            prior_lines=prior),
                          ck.state_dicts["policy"], "policy", str(path))
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the global RNG alone
            net = PolicyNet(meta["n_pe"], meta["height"], meta["width"], cfg, prior_lines=prior)
    except ConfigError as err:
        raise ValueError(f"{path}: {err}") from None
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith(str(path)) else f"{path}: {err}") from None
    try:
        net.load_state_dict(ck.state_dicts["policy"])
    except RuntimeError as err:
        raise ValueError(f"{path}: 'policy' weights do not match policy_net {cfg}: {err}") from None
    if net.prior_order is not None:
        try:
            net.set_prior(net.prior_order.clone())  # the stored order must be valid lines
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return LearnedPolicy(net, observes_mar=meta["observes_mar"], device=device, metadata=meta)


def _mar_from(ck: Checkpoint, path: str | Path, device: torch.device) -> MarNet | None:
    return mar_from_checkpoint(ck, path, device) if "mar" in ck.state_dicts else None


def load_masc(
    path: str | Path, device: str | torch.device = "auto", name: str | None = None
) -> tuple[LearnedPolicy, MarNet | None, dict[str, Any]]:
    """The policy and, when the checkpoint holds one (fine-tuned end to end), the MAR network of
    a MASC checkpoint, both on ``device`` in eval mode, and the metadata. One file read.
    ``name``: how messages name the checkpoint (default: ``path`` as written)."""
    device = resolve_device(device)
    ck = load_checkpoint(path, map_location="cpu", name=name)
    label = name or path
    policy = _policy_from(ck, label, device)
    return policy, _mar_from(ck, label, device), ck.metadata


def make_learned_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> LearnedPolicy:
    """Registry factory (``masc.policies`` entry point ``masc``): ``make_policy("masc",
    checkpoint=path, device=...)``. Other keyword options are ignored."""
    if not checkpoint:
        raise ValueError("the masc policy needs a checkpoint (policy_checkpoint / --checkpoint)")
    return LearnedPolicy.from_checkpoint(checkpoint, device)
