"""``masc serve``: the standalone MRD server running the MASC gadget.

Speaks the client dialect of ``gadgetron_ismrmrd_client`` and of the python-ismrmrd-server
client: config by name (1) or script (2), header (3), an optional text (5) with JSON parameters,
acquisitions, close (4). Many connections at once, each in its own thread and isolated: a bad
message gets a text (5) error back to that client only, and the server keeps serving. SIGTERM
and SIGINT shut it down cleanly.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from masc_gadget.config import Config, ConfigError, load_config
from masc_gadget.serving.gadget import process
from masc_gadget.serving.models import DEFAULT_CACHE, ModelCache, build_engine, load_models
from masc_gadget.serving.settings import GadgetSettings, settings_from_xml
from masc_gadget.mrd.header import parse_header
from masc_gadget.acquisition.policies import POLICIES
from masc_gadget.mrd.protocol import (
    ID_ACQUISITION,
    ID_CLOSE,
    ID_CONFIG_FILE,
    ID_CONFIG_TEXT,
    ID_HEADER,
    ID_TEXT,
    ConnectionClosed,
    MrdStream,
    ProtocolError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """The standalone server (config section ``server``)."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback by default)."""
    port: int = 9002
    """TCP port (9002 is the MRD / FIRE convention)."""
    max_connections: int = 32
    """Connections served at once; more wait in the listen backlog."""
    idle_timeout_s: float = 300.0
    """A connection silent for this long is closed."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")


class ClientError(Exception):
    """The client broke the protocol; the message goes back to it as text."""


class NamedConfigs:
    """Configurations a client may select by name (message id 1): ``default`` (the server's own),
    a policy name (the default with that policy), or a YAML file in the config folders."""

    def __init__(self, config: Config, folders: list[Path]) -> None:
        self.config = config
        self.folders = [f for f in folders if f.is_dir()]

    def names(self) -> list[str]:
        yaml_names = sorted({p.stem for f in self.folders for p in f.glob("*.yaml")})
        return ["default", *sorted(POLICIES), *yaml_names]

    def resolve(self, name: str) -> GadgetSettings:
        base = GadgetSettings.from_config(self.config)
        if name in ("", "default"):
            return base
        if name in POLICIES:
            return base.updated({"policy": name}, f"config {name!r}")
        stem = name[:-5] if name.endswith(".yaml") else name
        for folder in self.folders:
            path = folder / f"{stem}.yaml"
            if path.is_file():
                return GadgetSettings.from_config(load_config(path))
        raise ClientError(f"unknown configuration {name!r}; known configurations: {', '.join(self.names())}")


class _Connection:
    """One client: the handshake, then an item iterator for :func:`process`."""

    def __init__(self, sock: socket.socket, peer: str, named: NamedConfigs, cache: ModelCache,
                 idle_timeout_s: float) -> None:
        sock.settimeout(idle_timeout_s)
        self.stream = MrdStream(sock)
        self.peer = peer
        self.named = named
        self.cache = cache
        self.closed_by_client = False
        self.stream_started = False

    def send_error(self, message: str) -> None:
        try:
            self.stream.send_text(f"MASC error: {message}")
        except OSError:
            pass

    def handshake(self) -> tuple[Any, GadgetSettings]:
        msg = self.stream.read_message()
        self.stream_started = True
        if msg.id == ID_CONFIG_FILE:
            settings = self.named.resolve(msg.payload.strip())
        elif msg.id == ID_CONFIG_TEXT:
            settings = settings_from_xml(msg.payload, self.named.resolve("default"))
        else:
            raise ClientError(f"expected a configuration (message 1 or 2) first, got message {msg.id}")
        msg = self.stream.read_message()
        if msg.id != ID_HEADER:
            raise ClientError(f"expected the ISMRMRD header (message 3) after the configuration, got message {msg.id}")
        try:
            header = parse_header(msg.payload)
        except ValueError as err:
            raise ClientError(str(err)) from None
        return header, settings

    def items(self) -> Iterator[Any]:
        while True:
            try:
                msg = self.stream.read_message()
            except ConnectionClosed as err:
                if not err.clean:
                    raise
                log.warning("%s closed the connection without a close message", self.peer)
                return
            if msg.id == ID_CLOSE:
                self.closed_by_client = True
                return
            if msg.id in (ID_ACQUISITION, ID_TEXT):
                yield msg.payload
            else:
                log.debug("%s: ignoring message %d", self.peer, msg.id)

    def run(self) -> None:
        try:
            header, settings = self.handshake()
            stats = process(self.items(), header, settings, self._send, on_error=self.send_error, cache=self.cache)
            log.info("%s done: %s", self.peer, stats)
            self.stream.send_close()
        except (ClientError, ProtocolError, ConfigError, ValueError) as err:
            log.warning("%s: %s", self.peer, err)
            self.send_error(str(err))
            try:
                self.stream.send_close()
            except OSError:
                pass
        except ConnectionClosed as err:
            if err.clean and not self.stream_started:
                log.info("%s closed the connection without sending anything", self.peer)
                return
            log.warning("%s: connection lost (%s)", self.peer, err)
            if not err.clean:  # a truncated frame: the client may still be listening
                self.send_error(str(err))
        except socket.timeout:
            log.warning("%s: idle for too long, closing", self.peer)
            self.send_error("connection idle for too long")
        except OSError as err:
            log.warning("%s: socket error: %s", self.peer, err)
        except Exception:  # noqa: BLE001 - one client's crash must never take the server down
            log.exception("%s: internal error", self.peer)
            self.send_error("internal error in the MASC gadget (see the server log)")
        finally:
            self.stream.close()

    def _send(self, item: Any) -> None:
        import ismrmrd

        if isinstance(item, ismrmrd.Image):
            self.stream.send_image(item)
        elif isinstance(item, ismrmrd.Acquisition):
            self.stream.send_acquisition(item)
        else:
            raise TypeError(f"cannot send {type(item).__name__}")


class MascServer:
    """Threaded MRD server; ``start()`` binds and returns the bound (host, port)."""

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
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(scfg.max_connections)
        self._threads: set[threading.Thread] = set()
        self._accept: threading.Thread | None = None
        GadgetSettings.from_config(config)  # fail early on a bad config

    def start(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot listen on {self.host}:{self.port}: {err.strerror or err}") from None
        sock.listen(64)
        sock.settimeout(0.2)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self.warm_up()
        self._accept = threading.Thread(target=self._accept_loop, name="masc-accept", daemon=True)
        self._accept.start()
        log.info("MASC server listening on %s:%d", self.host, self.port)
        return self.host, self.port

    def warm_up(self, n_pe: int = 64, n_readout: int = 64) -> float:
        """Load the default models and run one decision and one reconstruction before the first
        client, so that the first line of a scan does not pay for the process's kernel set-up
        (~0.25 s on a CPU). Returns the seconds it took."""
        import time

        import numpy as np

        start = time.perf_counter()
        s = GadgetSettings.from_config(self.named.config)
        policy = load_models(s, self.cache).policy
        if policy is not None:  # a learned policy knows its matrix
            n_pe, n_readout = policy.net.n_pe, policy.net.width
        initial = min(s.initial, n_pe - 1)
        engine = build_engine(s, n_pe, n_readout, self.cache, initial=initial, budget=1)
        zeros = np.zeros(n_readout, np.complex64)
        for line in range(n_pe // 2 - initial // 2, n_pe // 2 - initial // 2 + initial):
            engine.on_line(0, line, zeros)
        engine.finish_slice(0)
        seconds = time.perf_counter() - start
        log.info("warmed up in %.2f s (policy %s, MAR %s, device %s)", seconds, s.policy,
                 s.mar_checkpoint or "off", engine.device)
        return seconds

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            peer = f"{addr[0]}:{addr[1]}"
            log.info("connection from %s", peer)
            self._slots.acquire()
            thread = threading.Thread(target=self._serve, args=(conn, peer), name=f"masc-{peer}", daemon=True)
            self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            _Connection(conn, peer, self.named, self.cache, self.scfg.idle_timeout_s).run()
        finally:
            self._slots.release()
            self._threads.discard(threading.current_thread())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, wait up to ``timeout`` s for running connections."""
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        if self._accept is not None:
            self._accept.join(timeout)
        for thread in list(self._threads):
            thread.join(timeout)
        log.info("MASC server stopped")

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
