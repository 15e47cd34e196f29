"""``masc serve``: the standalone MRD server running the MASC gadget.

Speaks the client dialect of ``gadgetron_ismrmrd_client`` and of the python-ismrmrd-server
client: config by name (1) or script (2), header (3), an optional text (5) with JSON parameters,
acquisitions, close (4). Many connections at once, each in its own thread and isolated: a bad
message gets a text (5) error back to that client only, and the server keeps serving.

Hostile clients are bounded (:mod:`masc_gadget.serving.connection`): connections still in their
handshake are at most ``max_pending`` and must finish it within ``handshake_timeout_s``; a
connection takes one of the ``max_connections`` slots only after a valid header (and token); an
optional allow-list and shared token restrict who may connect. The port is listened on only
after the warm-up. SIGTERM and SIGINT shut it down within a few seconds: every open connection
gets the close message.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from masc_gadget.acquisition.batcher import DecisionBatcher
from masc_gadget.acquisition.engine import AcquisitionEngine
from masc_gadget.config import Config, quote
from masc_gadget.mrd.protocol import frame_close, frame_text
from masc_gadget.serving.connection import ClientError, Connection, NamedConfigs
from masc_gadget.serving.gadget import configure, warm_up
from masc_gadget.serving.models import DEFAULT_CACHE, ModelCache
from masc_gadget.serving.settings import GadgetSettings

__all__ = ["ClientError", "MascServer", "NamedConfigs", "ServerConfig", "register"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """The standalone server (config section ``server``)."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default; any other address logs a warning)."""
    port: int = 9002
    """TCP port (9002 is the MRD / FIRE convention)."""
    max_connections: int = 32
    """Connections served at once (slots, taken after a valid header and token)."""
    max_pending: int = 64
    """Connections still in their handshake at once; more are refused with an error."""
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
    """Largest k-space a scan may hold, slices x receive coils x matrix x 8 bytes (4 GiB): a
    multi-coil scan's buffers grow with its coils, so one whose header and first line announce
    more is refused before anything is allocated for it."""
    allow: tuple[str, ...] = ()
    """Client addresses allowed to connect (IPs or CIDR networks); empty: every address."""
    token: str = ""
    """Shared secret a client must send as ``{"token": "..."}`` in its JSON parameters (message
    5, right after the header); "" = no token needed."""
    threads: int = 1
    """torch CPU threads of the server process (0: torch's default, one per core). Decisions
    of all connections run batched on one worker; on a busy machine more threads per forward
    mostly contend with each other."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's default), got {self.threads}")
        for name in ("max_connections", "max_pending", "max_slices", "max_kspace_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "handshake_timeout_s", "message_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if len(self.max_matrix) != 2 or min(self.max_matrix) < 1:
            raise ValueError(f"max_matrix must be two sizes >= 1 (PE lines, readout samples), got {self.max_matrix}")
        allowed_networks(self.allow)

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


def _peer_allowed(address: str, networks: list) -> bool:
    if not networks:
        return True
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == net.version and ip in net for net in networks)


class MascServer:
    """Threaded MRD server; ``start()`` binds, warms up, listens and returns (host, port)."""

    def __init__(self, config: Config, host: str | None = None, port: int | None = None,
                 config_folders: list[Path] | None = None, cache: ModelCache = DEFAULT_CACHE) -> None:
        scfg: ServerConfig = config["server"]
        self.host = host or scfg.host
        self.port = scfg.port if port is None else port
        self.scfg = scfg
        folders = list(config_folders or [])
        if config.source:
            folders.insert(0, Path(config.source).parent)
        folders.append(Path.cwd() / "configs")
        self.named = NamedConfigs(config, folders)
        self.cache = cache
        configure(config, cache)  # the models and feedback sections: what clients may choose
        self.batcher = DecisionBatcher(AcquisitionEngine.run_group)
        self._networks = scfg.networks()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(scfg.max_connections)
        self._pending = 0
        self._connections: dict[Connection, threading.Thread] = {}
        self._accept: threading.Thread | None = None
        GadgetSettings.from_config(config)  # fail early on a bad config

    def start(self) -> tuple[str, int]:
        """Bind (so that a taken port fails at once), warm up, then listen: the port accepts
        connections only once the server can answer them."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self.port}: {err.strerror or err}") from None
        self.port = sock.getsockname()[1]
        if self.scfg.threads:
            torch.set_num_threads(self.scfg.threads)
        try:
            self.warm_up()
        except BaseException:
            sock.close()
            raise
        sock.listen(max(64, min(self.scfg.max_pending, 1024)))
        sock.settimeout(0.2)
        self._sock = sock
        self._accept = threading.Thread(target=self._accept_loop, name="masc-accept", daemon=True)
        self._accept.start()
        if not is_loopback(self.host):
            log.warning("listening on %s, reachable from other hosts: %s", self.host,
                        "; ".join(self._access_summary()))
        log.info("MASC server listening on %s:%d", self.host, self.port)
        return self.host, self.port

    def _access_summary(self) -> list[str]:
        return [f"allow-list {', '.join(self.scfg.allow)}" if self.scfg.allow
                else "no allow-list (server.allow): every address may connect",
                "token required" if self.scfg.token else "no token (server.token): no authentication"]

    def warm_up(self, n_pe: int = 64, n_readout: int = 64) -> float:
        """Load the default models and run one decision and one reconstruction before the first
        client (:func:`masc_gadget.serving.gadget.warm_up`); returns the seconds it took."""
        return warm_up(GadgetSettings.from_config(self.named.config), self.cache, n_pe, n_readout)

    # ---------------------------------------------------------------------------- connections

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                self._admit(conn, addr)
            except (OSError, RuntimeError) as err:  # the peer reset at once; no thread to be had
                log.warning("connection from %s failed at once: %s", addr[0], err)
                conn.close()

    def _admit(self, conn: socket.socket, addr: tuple) -> None:
        """Check a new connection against the allow-list and ``max_pending``; start its thread."""
        peer = f"{addr[0]}:{addr[1]}"
        if not _peer_allowed(addr[0], self._networks):
            log.warning("refused %s: not in the allow-list (server.allow)", peer)
            _refuse(conn, "this client address is not allowed to connect (server.allow)")
            return
        with self._lock:
            busy = self._pending >= self.scfg.max_pending
            if not busy:
                self._pending += 1
        if busy:
            log.warning("refused %s: %d connections already in their handshake", peer, self.scfg.max_pending)
            _refuse(conn, f"server busy: {self.scfg.max_pending} connections are already in their "
                    "handshake (server.max_pending); try again later")
            return
        log.info("connection from %s", peer)
        connection = None
        try:
            connection = Connection(conn, peer, self.named, self.cache, self.scfg, self._take_slot,
                                    self.batcher)
            thread = threading.Thread(target=self._serve, args=(connection,), name=f"masc-{peer}", daemon=True)
            with self._lock:
                self._connections[connection] = thread
            thread.start()
        except BaseException:
            with self._lock:
                self._pending -= 1
                self._connections.pop(connection, None)
            raise

    def _take_slot(self, connection: Connection, deadline: float) -> bool:
        """A slot for ``connection`` (its handshake is done), waiting until ``deadline``."""
        while not (self._stop.is_set() or connection.interrupted.is_set()):
            if self._slots.acquire(timeout=max(0.0, min(0.1, deadline - time.monotonic()))):
                with self._lock:
                    self._pending -= 1
                connection.slot = True
                return True
            if time.monotonic() >= deadline:
                return False
        return False

    def _serve(self, connection: Connection) -> None:
        try:
            connection.run()
        finally:
            with self._lock:
                if connection.slot:
                    self._slots.release()
                else:
                    self._pending -= 1
                self._connections.pop(connection, None)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting; send every open connection the close message and shut its socket;
        wait up to ``timeout`` s in all for their threads."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._accept is not None:
            self._accept.join(max(0.0, deadline - time.monotonic()))
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            open_connections = dict(self._connections)
        for connection in open_connections:
            connection.interrupt()
        for thread in open_connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        self.batcher.close(max(0.0, deadline - time.monotonic()))
        left = sum(thread.is_alive() for thread in open_connections.values())
        if left:
            log.warning("MASC server stopped with %d connection thread(s) still finishing", left)
        else:
            log.info("MASC server stopped (%d connection(s) closed)", len(open_connections))

    def serve_forever(self) -> None:
        """Run until SIGTERM / SIGINT (main thread only)."""
        import signal

        stop = queue.Queue()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.put(signum))
        self.start()
        while True:
            try:
                signum = stop.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        log.info("signal %d received, shutting down", signum)
        self.shutdown()


def _refuse(conn: socket.socket, message: str) -> None:
    """Tell a connection that is not served why (never blocking the accept loop), and close it."""
    try:
        conn.settimeout(0.5)
        conn.sendall(frame_text(f"MASC error: {message}") + frame_close())
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        conn.close()


def register(subparsers, common) -> None:
    """``masc serve``."""
    serve = subparsers.add_parser(
        "serve", parents=[common], help="run the MASC gadget as a standalone MRD server",
        description="Standalone MRD server running the MASC gadget (gadgetron_ismrmrd_client and "
        "python-ismrmrd-server client dialects). Stops on SIGTERM / Ctrl-C.",
    )
    serve.add_argument("--host", help="address to listen on (default: server.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: server.port, 9002)")
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args) -> int:
    from masc_gadget.cli import config_from_args

    config = config_from_args(args)
    server = MascServer(config, host=args.host, port=args.port)
    settings = GadgetSettings.from_config(config)
    log.info("default settings: policy %s, %d + %d lines, MAR %s, device %s", settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.device)
    server.serve_forever()
    return 0
