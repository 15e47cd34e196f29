"""What one process serving MRD streams holds, built once and handed to every stream.

``masc serve``, Gadgetron's connect mode (``python -m masc_gadget.serving.gadget PORT``) and
execute mode (``masc(connection)``, started by Gadgetron per stream) each build one
:class:`Host` and pass it to the stream code (:func:`masc_gadget.serving.gadget.process`), so a
protection written here applies to every entry point: the limits of :class:`ServerConfig`, the
operator's settings (the only ones whose model paths and ZeroMQ address are trusted), the model
cache, the shared decision batcher, the memory budget over all connections and the ports the
process listens on (a side channel pointed at them is refused).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from masc_gadget.acquisition.batcher import DecisionBatcher
from masc_gadget.acquisition.policies import POLICIES
from masc_gadget.config import Config, ConfigError, load_config, quote
from masc_gadget.mrd.feedback import DEFAULT_ZMQ_ALLOW, tcp_port
from masc_gadget.serving.metrics import Metrics
from masc_gadget.serving.models import ModelCache
from masc_gadget.serving.settings import SETTINGS, GadgetSettings

__all__ = ["ClientError", "Host", "MemoryBudget", "NamedConfigs", "Reservation", "ServerConfig", "size_text", "allowed_networks", "serving_config",
           "clip", "is_loopback", "peer_allowed", "MAX_CONFIG_NAME_CHARS", "MAX_ERROR_CHARS"]

log = logging.getLogger(__name__)

MAX_CONFIG_NAME_CHARS = 64
"""Longest configuration name (message 1) accepted."""
MAX_ERROR_CHARS = 1000
"""Longest error text sent to a client or logged for it."""

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class ClientError(Exception):
    """The client broke the protocol or a rule of the server; the message goes back to it."""


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ServerConfig:
    """Limits of a process serving streams (config section ``server``): ``masc serve`` and
    Gadgetron's connect mode use all of them, execute mode those that concern one stream."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default; any other address logs a warning)."""
    port: int = 9002
    """TCP port (9002 is the MRD / FIRE convention)."""
    metrics_port: int = -1
    """Operator port for ``GET /metrics`` (Prometheus) and ``GET /health``
    (:mod:`masc_gadget.serving.metrics`; needs the ``metrics`` extra); -1: off, 0: a free port."""
    metrics_host: str = "127.0.0.1"
    """Address of the operator port (loopback by default; any other address logs a warning)."""
    max_connections: int = 32
    """Connections served at once (slots, taken after a valid header and token)."""
    max_connections_per_peer: int = 16
    """Slots one client address may hold at once."""
    reclaim_idle_s: float = 10.0
    """When every slot is taken and an authenticated client waits for one, the slot holder
    silent for longest gives its slot up if it has been silent this long (it gets an error
    naming the rule): silent connections cannot hold the server."""
    shutdown_s: float = 5.0
    """What a shutdown (SIGTERM, SIGINT, connect mode's stop) gives the open connections: each
    stops reading and sends its open and queued slices' images, with the network for the first
    40 % of it and zero-filled after (``MASC.mar`` says so), then an error naming the shutdown;
    what is still open at 90 % of it is closed."""
    max_pending: int = 64
    """Connections still in their handshake at once; a new one beyond it closes the oldest
    (with an error), so idle or unauthenticated sockets cannot lock a real client out."""
    max_pending_per_peer: int = 16
    """Connections in their handshake one client address may have; beyond it its oldest is
    closed."""
    max_handshake_bytes: int = 256 * 2**10
    """Largest configuration script, header or parameters text before authentication (bytes)."""
    idle_timeout_s: float = 300.0
    """A connection silent for this long is closed."""
    handshake_timeout_s: float = 10.0
    """Configuration, header (and token) must arrive, and a slot be free, within this time."""
    message_timeout_s: float = 60.0
    """Every message must arrive whole within this time of its first byte."""
    max_matrix: tuple[int, int] = (1024, 1024)
    """Largest encoded matrix a header may announce: (phase-encoding lines, readout samples)."""
    max_slices: int = 256
    """Most slices a header may announce (encodingLimits slice maximum + 1), and the slice
    indices accepted when the header has no slice limit."""
    max_kspace_bytes: int = 4 * 2**30
    """Largest k-space one scan may hold at once (4 GiB): its open slices and the finished ones
    waiting for their images, receive coils x matrix x 8 bytes each, counted as each slice
    opens. A scan whose first line's slice alone would exceed it is refused before anything is
    allocated; one that opens a slice beyond it gets its open slices' images, then the error."""
    memory_budget_bytes: int = 8 * 2**30
    """The k-space of all connections together (8 GiB), counted as for ``max_kspace_bytes``: a
    scan whose new slice would take the total over it gets its open slices' images, then an
    error naming this limit, and the others go on."""
    allow: tuple[str, ...] = ()
    """Client addresses allowed to connect (IPs or CIDR networks); empty: every address."""
    token: str = ""
    """Shared secret a client must send as ``{"token": "..."}`` in its JSON parameters (message
    5, right after the header); "" = no token needed. Gadgetron forwards no text messages, so
    connect mode cannot ask for one: keep it on loopback or behind ``allow``."""
    client_overrides: tuple[str, ...] = ()
    """Settings a client of ``masc serve`` may change (its JSON parameters, a configuration
    script, a policy named as its configuration), beyond ``feedback`` and ``zmq_address``, which
    it always may; ``["*"]``: every setting. Every other value a client sends that differs from
    the operator's is refused (logged at WARNING and told to the client) and the operator's
    stands; a different protocol (``initial``, ``budget``, ``lines_per_decision``) ends the
    connection with an error naming both. Model settings stay names the server offers
    (``models``) whatever this allows. Gadgetron's modes take their stream XML whole: it is the
    Gadgetron host's."""
    threads: int = 1
    """torch CPU threads of the server process (0: torch's default, one per core). Decisions
    of all connections run batched on one worker; on a busy machine more threads per forward
    mostly contend with each other."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        for name in ("max_connections", "max_connections_per_peer", "max_pending", "max_pending_per_peer",
                     "max_handshake_bytes", "max_slices", "max_kspace_bytes", "memory_budget_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "handshake_timeout_s", "message_timeout_s", "reclaim_idle_s", "shutdown_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be -1 (off), 0 (a free port) or a port, got {self.metrics_port}")
        if len(self.max_matrix) != 2 or min(self.max_matrix) < 1:
            raise ValueError(f"max_matrix must be two sizes >= 1 (PE lines, readout samples), got {self.max_matrix}")
        allowed_networks(self.allow)
        unknown = [k for k in self.client_overrides if k != "*" and k not in SETTINGS]
        if unknown:
            raise ValueError(f"client_overrides: unknown setting {quote(unknown[0])}; known settings: "
                             f"{', '.join(sorted(SETTINGS))} (or * for every one)")

    def networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The allow-list, parsed."""
        return allowed_networks(self.allow)


def allowed_networks(allow: tuple[str, ...]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """IP networks of ``allow`` (a plain address is a one-address network); ValueError naming a
    bad entry."""
    networks = []
    for entry in allow:
        try:
            networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
        except ValueError:
            raise ValueError(f"allow: {quote(entry)} is not an IP address or CIDR network") from None
    return networks


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_allowed(address: str, networks: list) -> bool:
    """Whether a client address is inside the allow-list (every address when it is empty)."""
    if not networks:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == net.version and ip in net for net in networks)


def serving_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The configuration a serving entry point runs: ``path`` with ``overrides``; without a
    file, the recommended shipped model (:data:`masc_gadget.models.shipped.RECOMMENDED`) under
    ``overrides``. A configuration that names no trained model (no policy or MAR checkpoint) is
    served as it says, with a warning."""
    from masc_gadget.models.shipped import RECOMMENDED, recommended_overrides

    if path is None:
        config = load_config(None, [*recommended_overrides(), *overrides])
        log.info("no configuration file: serving the recommended shipped model %s", RECOMMENDED)
    else:
        config = load_config(path, overrides)
    settings = GadgetSettings.from_config(config)
    if not settings.policy_checkpoint and not settings.mar_checkpoint:
        log.warning("serving policy %s, %d + %d lines, with no trained model (gadget.policy_checkpoint and "
                    "gadget.mar_checkpoint are empty: MAR off, images zero-filled); the recommended model is "
                    "shipped:%s (start without --config, or --set %s)", settings.policy, settings.initial,
                    settings.budget, RECOMMENDED, " --set ".join(recommended_overrides()))
    return config


class MemoryBudget:
    """Bytes reserved by all connections together, within ``total`` (thread-safe)."""

    def __init__(self, total: int) -> None:
        self.total = int(total)
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit what is left; False (nothing taken) otherwise."""
        with self._lock:
            if self.used + nbytes > self.total:
                return False
            self.used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` took."""
        with self._lock:
            self.used = max(0, self.used - nbytes)


def size_text(nbytes: int) -> str:
    """Bytes for a person: ``4.0 GiB``, ``12.5 MiB``, ``300 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class Reservation:
    """What one scan holds of its host's memory budget: taken as its slices open (:meth:`take`),
    given back as each is freed (:meth:`give`), all of it when the scan ends (``with``, or
    :meth:`close`). A scan holds at most ``limit`` bytes (``server.max_kspace_bytes``) and all
    scans together at most the budget's total (``server.memory_budget_bytes``), so a connection
    holds what it has sent lines for, never what its header announces. Thread-safe (the image
    worker gives back while the reader takes)."""

    def __init__(self, budget: MemoryBudget, limit: int) -> None:
        self.budget = budget
        self.limit = int(limit)
        self.held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, what: str) -> None:
        """Hold ``nbytes`` more for ``what`` (a text naming it, e.g. a slice's k-space); nothing
        is taken, and ConfigError names the limit, when they do not fit."""
        with self._lock:
            if self.held + nbytes > self.limit:
                held = f" beside the {size_text(self.held)} this scan holds" if self.held else ""
                raise ConfigError(f"{what}{held} exceeds this server's limit of {size_text(self.limit)} per scan "
                                  "(server.max_kspace_bytes)")
            if not self.budget.reserve(nbytes):
                raise ConfigError(f"{what} does not fit what is left of this server's memory budget for all "
                                  f"scans ({size_text(self.budget.total)}, server.memory_budget_bytes); try again "
                                  "when other scans have finished")
            self.held += nbytes

    def give(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what :meth:`take` held (at most what is held)."""
        with self._lock:
            nbytes = min(int(nbytes), self.held)
            self.held -= nbytes
        self.budget.release(nbytes)

    def close(self) -> None:
        """Give back everything still held."""
        self.give(self.held)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamedConfigs:
    """Configurations a client may select by name (message id 1): ``default`` (the operator's
    own), a policy name (the default with that policy), or a YAML file in the config folders.

    A name is a plain file stem (letters, digits, ``_ . -``; no path separators, no ``..``) of
    at most :data:`MAX_CONFIG_NAME_CHARS` characters, looked up only inside the folders."""

    def __init__(self, default: GadgetSettings, folders: list[Path], allowed: tuple[str, ...] = ()) -> None:
        self.default = default
        self.folders = [f for f in folders if f.is_dir()]
        self.allowed = allowed
        """``server.client_overrides``: naming a policy changes the policy only where it allows."""

    def names(self) -> list[str]:
        yaml_names = sorted({p.stem for f in self.folders for p in f.glob("*.yaml")
                             if _PLAIN_NAME.fullmatch(p.stem)})
        return ["default", *sorted(POLICIES), *yaml_names]

    def resolve(self, name: str) -> GadgetSettings:
        base = self.default
        if name in ("", "default"):
            return base
        if name in POLICIES:
            if name != base.policy and "*" not in self.allowed and "policy" not in self.allowed:
                raise ClientError(f"configuration {name!r} would change the policy: this server serves "
                                  f"{base.policy!r}, and its operator lets clients change it only with "
                                  "server.client_overrides: [policy]; ask for the configuration 'default'")
            return base.updated({"policy": name}, f"config {name!r}")
        if len(name) > MAX_CONFIG_NAME_CHARS:
            raise ClientError(f"configuration name is {len(name)} characters, more than the limit "
                              f"{MAX_CONFIG_NAME_CHARS}")
        stem = name[:-5] if name.endswith(".yaml") else name
        if not _PLAIN_NAME.fullmatch(stem) or ".." in stem:
            raise ClientError(f"configuration name {quote(name)} is not a plain name (letters, digits, "
                              "'_', '.', '-'; no path separators, no '..')")
        for folder in self.folders:
            path = folder / f"{stem}.yaml"
            if path.is_file():
                return self._load(name, path)
        raise ClientError(f"unknown configuration {name!r}; known configurations: {', '.join(self.names())}")

    @staticmethod
    def _load(name: str, path: Path) -> GadgetSettings:
        try:
            return GadgetSettings.from_config(load_config(path))
        except (ConfigError, OSError) as err:  # the details name a server path: log only
            log.warning("configuration %s (%s) cannot be used: %s", name, path, clip(str(err)))
            raise ClientError(f"configuration {name!r} cannot be used (see the server log)") from None


@dataclass(eq=False)
class Host:
    """Everything a process serving streams holds, shared by all its streams.

    ``Host()`` is an unlimited-by-config host with the defaults (tests, in-process use);
    :meth:`from_config` is what the entry points build."""

    limits: ServerConfig = field(default_factory=ServerConfig)
    """Sizes, timeouts, slots, allow-list and token."""
    named: NamedConfigs = field(default_factory=lambda: NamedConfigs(GadgetSettings(), []))
    """The operator's settings (``named.default``) and the configurations a client may name."""
    cache: ModelCache = field(default_factory=ModelCache)
    """Models loaded once and shared by this host's streams; which checkpoints a client may
    name. Each host owns its own (no process-wide cache)."""
    batcher: DecisionBatcher | None = None
    """One batched forward for every stream waiting at the same moment (None: each alone)."""
    budget: MemoryBudget | None = None
    """K-space of all streams together (default: ``limits.memory_budget_bytes``)."""
    zmq_allow: tuple[str, ...] = DEFAULT_ZMQ_ALLOW
    """Endpoints a stream may point the ZeroMQ side channel at (``feedback.zmq_allow``)."""
    own_ports: set[int] = field(default_factory=set)
    """TCP ports this process listens on: a side channel aimed at one of them is refused."""
    metrics: Metrics = field(init=False)
    """What an operator watches (:mod:`masc_gadget.serving.metrics`): this host's own registry."""
    warmed: set[tuple] = field(default_factory=set)
    """The decision passes (models, matrix, device) its engines have warmed up: a later engine of
    the same ones starts at once (:class:`~masc_gadget.acquisition.engine.AcquisitionEngine`)."""

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = MemoryBudget(self.limits.memory_budget_bytes)
        self.metrics = Metrics(lambda: (self.budget.used, self.budget.total))

    @classmethod
    def from_config(cls, config: Config, folders: list[Path] | None = None,
                    cache: ModelCache | None = None, batch: bool = True) -> Host:
        """The host of a configuration: its ``server`` limits, its ``acquisition`` and ``gadget``
        sections as the operator's settings, named configurations from ``folders`` (and the
        config file's own folder), its ``models`` section applied to ``cache`` (default: a new one), its
        ``feedback.zmq_allow``; ``batch``: a shared decision batcher."""
        from masc_gadget.acquisition.engine import AcquisitionEngine

        folders = list(folders or [])
        if config.source:
            folders.insert(0, Path(config.source).parent)
        folders.append(Path.cwd() / "configs")
        cache = ModelCache() if cache is None else cache
        cache.configure(config["models"])
        return cls(limits=config["server"], named=NamedConfigs(GadgetSettings.from_config(config), folders,
                                                               tuple(config["server"].client_overrides)),
                   cache=cache, batcher=DecisionBatcher(AcquisitionEngine.run_group) if batch else None,
                   zmq_allow=tuple(config["feedback"].zmq_allow))

    @property
    def default(self) -> GadgetSettings:
        """The operator's settings."""
        return self.named.default

    def reservation(self) -> Reservation:
        """A scan's hold on this host's memory budget, within ``limits.max_kspace_bytes``
        (:class:`Reservation`; a context manager that gives everything back)."""
        return Reservation(self.budget, self.limits.max_kspace_bytes)

    def check_side_channel(self, address: str) -> None:
        """ValueError when ``address`` is a TCP endpoint on a port this process listens on
        (decisions sent into the server's own port)."""
        port = tcp_port(address)
        if port is not None and port in self.own_ports:
            raise ValueError(f"zmq_address points at port {port}, where this server itself listens; "
                             "the side channel goes to the scanner")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the decision batcher."""
        if self.batcher is not None:
            self.batcher.close(timeout)
