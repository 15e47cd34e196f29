"""The one place the gadget turns its settings into models and an engine.

The policy is a learned one (``masc``, ``dqn``, ``ss-ddqn`` or ``loupe``: a trained checkpoint of
that kind in ``policy_checkpoint``, loaded through the :class:`ModelCache`) or a registry policy
(``make_policy(name)``); the MAR network comes from ``mar_checkpoint`` when one is set, else from
the policy's checkpoint when it carries its own (MASC, the learned mask), else MAR is off. Both
:func:`masc_gadget.serving.gadget.process` (one engine per connection) and the servers'
warm-ups build their engines here.

Who may name which checkpoint (:func:`load_models`, ``trusted``):

* the operator's settings (the server's config file, the settings a host hands to
  ``process``) are trusted: their ``mar_checkpoint`` / ``policy_checkpoint`` may be paths or
  ``shipped:NAME``;
* a value that arrives per connection (JSON parameters) and differs from those is a *name*:
  ``shipped:NAME`` (:mod:`masc_gadget.models.shipped`), or ``NAME`` / ``NAME.pt`` of a
  checkpoint in the operator's models folder (config section ``models``,
  :class:`ModelsConfig`; "" = none). A path (a separator, ``..``, absolute), an unknown name
  or a file that does not load is a ConfigError that lists the names offered and never shows
  a server path or file content.

The cache holds at most ``models.max_loaded`` models, least recently used evicted, keyed by what
the file *is* (real path, device, inode, size, modification time), so every spelling of one
checkpoint (``./x.pt``, ``x.pt``, a symlink, ``shipped:NAME``) shares one load and a changed
file loads again. Each key loads under its own lock: one connection waiting for a model never
holds up another's.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from masc_gadget.acquisition.batcher import DecisionBatcher
from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
from masc_gadget.acquisition import learned
from masc_gadget.acquisition.learned import KINDS as LEARNED_KINDS
from masc_gadget.acquisition.policies import POLICIES, SamplingPolicy, make_policy
from masc_gadget.config import ConfigError
from masc_gadget.core.seeding import isolated_rng
from masc_gadget.device import resolve_device
from masc_gadget.models import shipped
from masc_gadget.serving.settings import GadgetSettings

log = logging.getLogger(__name__)

__all__ = ["ModelCache", "Models", "ModelsConfig", "build_engine", "check_playable",
           "load_models", "warm_up"]

CHECKPOINT_KEYS = ("mar_checkpoint", "policy_checkpoint")
"""The settings that name checkpoints."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MAX_LISTED = 20
_MAX_SHOWN = 40


@dataclass(frozen=True)
class ModelsConfig:
    """Which models clients may choose, and how many stay loaded (config section ``models``)."""

    directory: str = ""
    """Folder of checkpoints a connection may choose by name (``"mar_checkpoint": "NAME"``
    loads ``DIRECTORY/NAME.pt``); "" = none: a connection may choose only the ``shipped:NAME``
    models and the checkpoints of the server's own config."""
    max_loaded: int = 4
    """Models held loaded at once, shared by all connections; the least recently used is
    dropped first (engines still using it keep it alive)."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str):
            raise ValueError("directory must be a string (a folder, or \"\" for none)")
        if isinstance(self.max_loaded, bool) or not isinstance(self.max_loaded, int) or self.max_loaded < 1:
            raise ValueError(f"max_loaded must be an integer >= 1, got {self.max_loaded!r}")


def _shown(value: str) -> str:
    """A client's value as errors show it: repr, at most 40 characters."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _is_path_like(value: str) -> bool:
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    return any(sep in value for sep in seps) or ".." in value or os.path.isabs(value) or ":" in value


class ModelCache:
    """Loaded models shared between connections (module docstring): at most ``max_loaded``,
    LRU, keyed by file identity, one lock per key; ``directory``: the models folder
    (:class:`ModelsConfig`)."""

    def __init__(self, max_loaded: int = ModelsConfig.max_loaded, directory: str = ModelsConfig.directory) -> None:
        self._lock = threading.Lock()  # guards the tables below; never held while a model loads
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._loading: dict[tuple, threading.Lock] = {}
        self.loads = 0
        """Models loaded so far (a hit loads nothing)."""
        self.configure(ModelsConfig(directory=directory, max_loaded=max_loaded))

    @classmethod
    def from_config(cls, models: ModelsConfig) -> ModelCache:
        """A cache for the ``models`` section of a config."""
        return cls(max_loaded=models.max_loaded, directory=models.directory)

    def configure(self, models: ModelsConfig) -> None:
        """Apply a ``models`` section (the server's config) to this cache."""
        with self._lock:
            self.directory = models.directory
            self.max_loaded = models.max_loaded
            self._evict()

    def __len__(self) -> int:
        """Models held now."""
        return len(self._entries)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``cache or default`` keeps it)
        return True

    # --- names a connection may choose -------------------------------------------------------

    def _folder_names(self) -> dict[str, str]:
        """NAME -> file name of the ``.pt`` files of the models folder (empty without one)."""
        if not self.directory:
            return {}
        try:
            entries = list(os.scandir(self.directory))
        except OSError as err:
            log.warning("models directory cannot be listed: %s", err)
            return {}
        names = {}
        for entry in entries:
            stem = entry.name[:-3]
            if entry.name.endswith(".pt") and _NAME.fullmatch(stem) and entry.is_file():
                names[stem] = entry.name
        return names

    def offered(self) -> list[str]:
        """The names a connection may choose: ``shipped:NAME`` and the models folder's."""
        return [shipped.PREFIX + n for n in shipped.available()] + sorted(self._folder_names())

    def _unknown(self, key: str, reason: str) -> ConfigError:
        names = self.offered()
        listed = ", ".join(names[:_MAX_LISTED]) + (f" and {len(names) - _MAX_LISTED} more"
                                                   if len(names) > _MAX_LISTED else "")
        return ConfigError(f"{key}: {reason}; a connection chooses a model by name from those the "
                           f"server offers: {listed or 'none'} (or leaves {key} out for the "
                           "server's own)")

    def requested(self, value: str, key: str) -> tuple[str, str]:
        """(what to load, its name in messages) of a model a connection asked for by name;
        ConfigError for a path or a name not offered (module docstring)."""
        if not value:
            return "", ""
        if shipped.is_shipped(value):
            if value[len(shipped.PREFIX):] in shipped.available():
                return value, value
            raise self._unknown(key, f"{_shown(value)} is not a shipped model")
        if _is_path_like(value):
            raise self._unknown(key, "a path is not accepted (no separator, '..', drive or absolute path)")
        if not _NAME.fullmatch(value):
            raise self._unknown(key, f"{_shown(value)} is not a model name (letters, digits, '.', '_' and '-', "
                                     "at most 128)")
        stem = value[:-3] if value.endswith(".pt") else value
        found = self._folder_names().get(stem)
        if found is None:
            raise self._unknown(key, f"{_shown(value)} is not a model this server offers")
        return str(Path(self.directory) / found), value

    # --- loading ---------------------------------------------------------------------------

    def _key(self, kind: str, checkpoint: str, device: str, label: str) -> tuple:
        """What the file is: (kind, device, real path, st_dev, st_ino, size, mtime)."""
        path = shipped.resolve(checkpoint)
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            raise FileNotFoundError(f"checkpoint {label} does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"checkpoint {label} is not a file")
        return (kind, str(resolve_device(device)), real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _get(self, key: tuple, load: Callable[[], Any]) -> Any:
        """The model under ``key``, loaded by ``load()`` once (other keys load meanwhile)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            key_lock = self._loading.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._entries:  # loaded by the thread we waited for
                    self._entries.move_to_end(key)
                    return self._entries[key]
            try:
                value = load()
            except BaseException:
                self._done_loading(key, key_lock)
                raise
            with self._lock:
                self._entries[key] = value
                self.loads += 1
                self._evict()
            self._done_loading(key, key_lock)  # after the entry is in: no second load can start
            return value

    def _done_loading(self, key: tuple, key_lock: threading.Lock) -> None:
        with self._lock:
            if self._loading.get(key) is key_lock:
                del self._loading[key]

    def _evict(self) -> None:
        while len(self._entries) > self.max_loaded:  # caller holds self._lock
            key, _ = self._entries.popitem(last=False)
            log.info("model cache: dropped %s (%s) to stay within %d models", key[0], Path(key[2]).name,
                     self.max_loaded)

    def masc(self, checkpoint: str, device: str, name: str | None = None, kind: str = "masc"):
        """(policy, its MAR network or None) of a learned-policy checkpoint of ``kind`` (masc,
        dqn, ss-ddqn, loupe); ``name``: how messages name it (default: ``checkpoint`` as written)."""
        if not checkpoint:
            raise ConfigError(f"the {kind} policy needs a trained checkpoint: set policy_checkpoint")
        label = name or checkpoint
        key = self._key(kind, checkpoint, device, label)

        def load():
            policy, mar, _ = learned.load_learned(key[2], device, name=label, kind=kind)
            log.info("loaded %s policy %s on %s", kind, label, device)
            return policy, mar

        return self._get(key, load)

    def mar(self, checkpoint: str, device: str, name: str | None = None):
        """The MAR network of a MAR checkpoint; None for "" (MAR off)."""
        if not checkpoint:
            return None
        from masc_gadget.models.checkpoint import load_mar

        label = name or checkpoint
        key = self._key("mar", checkpoint, device, label)

        def load():
            model = load_mar(key[2], device, name=label)[0]
            log.info("loaded MAR network %s on %s", label, device)
            return model

        return self._get(key, load)


class Models(NamedTuple):
    """The trained models of a connection's settings (:func:`load_models`)."""

    policy: SamplingPolicy | None
    """The learned policy (``policy: masc``, ``dqn``, ``ss-ddqn``, ``loupe``); None for a registry policy, which
    :func:`build_engine` makes (it has nothing to load)."""
    mar: torch.nn.Module | None
    """The MAR network, or None (MAR off)."""
    mar_name: str
    """How images name it (meta ``MASC.mar``): the checkpoint's file name, the network's class
    name when it came with the MASC checkpoint, "none" without one."""


def _trusted_values(trusted: GadgetSettings) -> set[str]:
    return {v for v in (getattr(trusted, k) for k in CHECKPOINT_KEYS) if v}


def _choice(settings: GadgetSettings, key: str, cache: ModelCache,
            trusted: GadgetSettings | None) -> tuple[str, str, bool]:
    """(what to load, its name, whether the operator chose it) for checkpoint setting ``key``."""
    value = getattr(settings, key)
    if trusted is None or not value or value in _trusted_values(trusted):
        return value, value, True
    spec, label = cache.requested(value, key)
    return spec, label, False


def _load(kind: Callable[..., Any], spec: str, label: str, operator: bool, key: str, device: str) -> Any:
    """``kind(spec, device, name=label)``; a failure of a model the connection chose is a
    ConfigError naming only that name (the details go to the log)."""
    if operator:
        return kind(spec, device, name=label or None)
    try:
        return kind(spec, device, name=label)
    except (OSError, ValueError) as err:
        log.warning("%s %s cannot be loaded: %s", key, label, err)
        raise ConfigError(f"{key} {_shown(label)}: the model cannot be loaded (see the server log)") from None


def load_models(settings: GadgetSettings, cache: ModelCache,
                trusted: GadgetSettings | None = None) -> Models:
    """The learned policy (``masc``, ``dqn``, ``ss-ddqn``, ``loupe``) and the MAR network of
    ``settings``, through ``cache``.

    ``trusted``: the operator's settings. None trusts every value of ``settings`` (the
    operator's own calls: warm-up, command line); otherwise a checkpoint value that differs
    from ``trusted``'s must be a name the server offers (module docstring)."""
    mar_spec, mar_label, mar_op = _choice(settings, "mar_checkpoint", cache, trusted)
    mar = _load(cache.mar, mar_spec, mar_label, mar_op, "mar_checkpoint", settings.device)
    policy = None
    if settings.policy in LEARNED_KINDS:
        spec, label, op = _choice(settings, "policy_checkpoint", cache, trusted)
        load = functools.partial(cache.masc, kind=settings.policy)
        policy, masc_mar = _load(load, spec, label, op, "policy_checkpoint", settings.device)
        if mar is None:
            mar = masc_mar
    if mar_spec:
        mar_name = Path(mar_label).name
    else:
        mar_name = "none" if mar is None else type(mar).__name__
    return Models(policy, mar, mar_name)


def check_playable(settings: GadgetSettings, policy: SamplingPolicy | None, n_pe: int, n_readout: int) -> None:
    """ConfigError when the learned ``policy`` of ``settings`` cannot play an ``n_pe`` x
    ``n_readout`` scan (its network was trained for another image size); the message names the
    remedies: a policy that plays any matrix, by config or JSON parameter, or a checkpoint
    trained for this one."""
    net = getattr(policy, "net", None)
    if net is None:
        return
    trained = (int(net.n_pe), int(net.height), int(net.width))
    if trained[0] == n_pe and trained[1:] == (n_pe, n_readout):
        return
    raise ConfigError(
        f"the served policy {settings.policy} was trained for {trained[1]} x {trained[2]} images (phase encoding x readout), but this scan reconstructs "
        f"{n_pe} x {n_readout}: serve it with a policy that plays any matrix (config: --set acquisition.policy="
        f"center-out; per connection: JSON parameters {{\"policy\": \"center-out\"}}, or any of "
        f"{', '.join(sorted(POLICIES))}), or with a {settings.policy} checkpoint trained for this matrix "
        f"(masc train {settings.policy} on data of this size)")


def build_engine(settings: GadgetSettings, n_pe: int, n_readout: int, cache: ModelCache | None = None,
                 *, initial: int | None = None, budget: int | None = None,
                 trusted: GadgetSettings | None = None,
                 batcher: DecisionBatcher | None = None, n_coils: int = 1,
                 rows: tuple[int, int] | None = None, warmed: set[tuple] | None = None) -> AcquisitionEngine:
    """The engine of one scan (``n_pe`` x ``n_readout`` encoded matrix) with the models of
    ``settings``; ``initial`` / ``budget`` replace the settings' ones (the server's warm-up);
    ``trusted`` as in :func:`load_models`; ``batcher``: the server's shared decision batcher
    (None: the engine runs its own decision passes); ``n_coils``: receive coils per line (combined
    by the settings' ``coil_combine``); ``rows``: the grid rows the scanner can acquire (its
    header's encoding limits, :attr:`~masc_gadget.mrd.header.EncodingGeometry.acquirable_rows`);
    ``warmed``: the serving host's set of warmed-up passes (:class:`AcquisitionEngine`).

    Raises ConfigError / ValueError for settings the scan cannot run with (episode larger than
    the matrix, unknown policy or device, missing checkpoint, a model not offered, a learned
    policy trained for another matrix: :func:`check_playable`).
    """
    models = load_models(settings, ModelCache() if cache is None else cache, trusted)
    check_playable(settings, models.policy, n_pe, n_readout)
    scan = EngineSettings(
        n_pe=n_pe, n_readout=n_readout, initial=settings.initial if initial is None else initial,
        budget=settings.budget if budget is None else budget, seed=settings.seed, device=settings.device,
        n_coils=n_coils, coil_combine=settings.coil_combine, lines_per_decision=settings.lines_per_decision,
        mar_fallback=settings.mar_fallback, rows=rows, decide_ahead=settings.decide_ahead,
    )
    policy = models.policy
    if policy is None:
        # building a policy never moves the global RNGs
        with isolated_rng():
            policy = make_policy(settings.policy)
    return AcquisitionEngine(scan, policy, mar=models.mar, mar_name=models.mar_name, batcher=batcher,
                             warmed=warmed)


def warm_up(settings: GadgetSettings, cache: ModelCache, n_pe: int = 64,
            n_readout: int = 64, warmed: set[tuple] | None = None) -> float:
    """Load the models of ``settings`` into ``cache`` and run one decision and one final
    reconstruction on a dummy slice (a learned policy on its own image size), so that the first
    line of a scan does not pay for the process's kernel set-up; returns the seconds it took."""
    import time

    import numpy as np

    start = time.perf_counter()
    policy = load_models(settings, cache).policy
    net = getattr(policy, "net", None)
    if net is not None:
        n_pe, n_readout = net.n_pe, net.width
    initial = min(settings.initial, n_pe - 1)
    engine = build_engine(settings, n_pe, n_readout, cache, initial=initial, budget=1, warmed=warmed)
    zeros = np.zeros(n_readout, np.complex64)
    for line in range(n_pe // 2 - initial // 2, n_pe // 2 - initial // 2 + initial):
        engine.on_line(0, line, zeros)
    engine.finish_slice(0)
    seconds = time.perf_counter() - start
    log.info("warmed up in %.2f s (policy %s, MAR %s, device %s)", seconds, settings.policy,
             settings.mar_checkpoint or "off", engine.device)
    return seconds
