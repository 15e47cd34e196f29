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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.models.checkpoint import Checkpoint, load_checkpoint, mar_from_checkpoint
from masc_gadget.config import ConfigError, from_dict, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig, masked_logits
from masc_gadget.models.unet import MarNet
from masc_gadget.acquisition.policies import SamplingPolicy

KIND = "masc"


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
            lines = masked_logits(logits, mask).argmax(dim=1)
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


def _policy_from(ck: Checkpoint, path: str | Path, device: str | torch.device) -> LearnedPolicy:
    meta = ck.metadata
    kind = meta.get("kind")
    if kind != KIND:
        raise ValueError(
            f"{path} is not a masc policy checkpoint (metadata kind {kind!r}, expected {KIND!r}); "
            "a MAR-only checkpoint goes to mar_checkpoint, not policy_checkpoint"
        )
    if "policy" not in ck.state_dicts:
        raise ValueError(
            f"{path} holds no policy network (state dicts: {', '.join(sorted(ck.state_dicts)) or 'none'})"
        )
    missing = [k for k in ("policy_net", "n_pe", "height", "width", "observes_mar") if k not in meta]
    if missing:
        raise ValueError(f"{path}: masc checkpoint metadata lacks {', '.join(missing)}")
    if not isinstance(meta["observes_mar"], bool):
        raise ValueError(f"{path}: metadata observes_mar must be true or false, got {meta['observes_mar']!r}")
    try:
        cfg = from_dict(PolicyNetConfig, meta["policy_net"], "policy_net")
        with torch.random.fork_rng(devices=[]):  # the init is overwritten; leave the global RNG alone
            net = PolicyNet(meta["n_pe"], meta["height"], meta["width"], cfg)
    except (ConfigError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    try:
        net.load_state_dict(ck.state_dicts["policy"])
    except RuntimeError as err:
        raise ValueError(f"{path}: 'policy' weights do not match policy_net {meta['policy_net']}: {err}") from None
    return LearnedPolicy(net, observes_mar=meta["observes_mar"], device=device, metadata=meta)


def _mar_from(ck: Checkpoint, path: str | Path, device: torch.device) -> MarNet | None:
    return mar_from_checkpoint(ck, path, device) if "mar" in ck.state_dicts else None


def load_masc(
    path: str | Path, device: str | torch.device = "auto"
) -> tuple[LearnedPolicy, MarNet | None, dict[str, Any]]:
    """The policy and, when the checkpoint holds one (fine-tuned end to end), the MAR network of
    a MASC checkpoint, both on ``device`` in eval mode, and the metadata. One file read."""
    device = resolve_device(device)
    ck = load_checkpoint(path, map_location="cpu")
    policy = _policy_from(ck, path, device)
    return policy, _mar_from(ck, path, device), ck.metadata


def make_learned_policy(checkpoint: str = "", device: str = "auto", **_: Any) -> LearnedPolicy:
    """Registry factory (``masc.policies`` entry point ``masc``): ``make_policy("masc",
    checkpoint=path, device=...)``. Other keyword options are ignored."""
    if not checkpoint:
        raise ValueError("the masc policy needs a checkpoint (policy_checkpoint / --checkpoint)")
    return LearnedPolicy.from_checkpoint(checkpoint, device)
