"""The one place the gadget turns its settings into models and an engine.

The policy is ``masc`` (a trained checkpoint, loaded once per (checkpoint, device) through the
:class:`ModelCache`) or a registry policy (``make_policy(name)``); the MAR network comes from
``mar_checkpoint`` when one is set, else from the MASC checkpoint when it carries its own, else
MAR is off. Both :func:`masc_gadget.serving.gadget.process` (one engine per connection) and
:meth:`masc_gadget.serving.server.MascServer.warm_up` build their engines here.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy
from masc_gadget.config import ConfigError
from masc_gadget.device import resolve_device
from masc_gadget.serving.settings import GadgetSettings

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CACHE", "ModelCache", "Models", "build_engine", "load_models"]


class ModelCache:
    """Engines' models loaded once per (checkpoint, device) and shared between connections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mar: dict[tuple[str, str], Any] = {}
        self._masc: dict[tuple[str, str], Any] = {}

    def masc(self, checkpoint: str, device: str):
        """(LearnedPolicy, its MAR network or None) of a MASC checkpoint."""
        if not checkpoint:
            raise ConfigError("the masc policy needs a trained checkpoint: set policy_checkpoint")
        from masc_gadget.acquisition.learned import load_masc

        key = (checkpoint, device)
        with self._lock:
            if key not in self._masc:
                policy, mar, _ = load_masc(checkpoint, device)
                self._masc[key] = (policy, mar)
                log.info("loaded MASC policy %s on %s", checkpoint, device)
            return self._masc[key]

    def mar(self, checkpoint: str, device: str):
        """The MAR network of a MAR checkpoint; None for "" (MAR off)."""
        if not checkpoint:
            return None
        from masc_gadget.models.checkpoint import load_mar

        key = (checkpoint, device)
        with self._lock:
            if key not in self._mar:
                self._mar[key] = load_mar(checkpoint, device)[0]
                log.info("loaded MAR network %s on %s", checkpoint, device)
            return self._mar[key]


DEFAULT_CACHE = ModelCache()


class Models(NamedTuple):
    """The trained models of a connection's settings (:func:`load_models`)."""

    policy: SamplingPolicy | None
    """The learned policy for ``policy: masc``; None for a registry policy, which
    :func:`build_engine` makes (it has nothing to load)."""
    mar: torch.nn.Module | None
    """The MAR network, or None (MAR off)."""
    mar_name: str
    """How images name it (meta ``MASC.mar``): the checkpoint's file name, the network's class
    name when it came with the MASC checkpoint, "none" without one."""


def load_models(settings: GadgetSettings, cache: ModelCache = DEFAULT_CACHE) -> Models:
    """The learned policy (``masc``) and the MAR network of ``settings``, through ``cache``."""
    policy = None
    mar = cache.mar(settings.mar_checkpoint, settings.device)
    if settings.policy == "masc":
        policy, masc_mar = cache.masc(settings.policy_checkpoint, settings.device)
        if mar is None:
            mar = masc_mar
    if settings.mar_checkpoint:
        mar_name = Path(settings.mar_checkpoint).name
    else:
        mar_name = "none" if mar is None else type(mar).__name__
    return Models(policy, mar, mar_name)


def build_engine(settings: GadgetSettings, n_pe: int, n_readout: int, cache: ModelCache = DEFAULT_CACHE,
                 *, initial: int | None = None, budget: int | None = None) -> AcquisitionEngine:
    """The engine of one scan (``n_pe`` x ``n_readout`` encoded matrix) with the models of
    ``settings``; ``initial`` / ``budget`` replace the settings' ones (the server's warm-up).

    Raises ConfigError / ValueError for settings the scan cannot run with (episode larger than
    the matrix, unknown policy or device, missing checkpoint).
    """
    models = load_models(settings, cache)
    scan = EngineSettings(
        n_pe=n_pe, n_readout=n_readout, initial=settings.initial if initial is None else initial,
        budget=settings.budget if budget is None else budget, seed=settings.seed, device=settings.device,
    )
    policy = models.policy
    if policy is None:
        device = resolve_device(scan.device)
        # building a policy never moves the global RNGs
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            policy = make_policy(settings.policy)
    return AcquisitionEngine(scan, policy, mar=models.mar, mar_name=models.mar_name)
