"""The listener of ``masc serve`` and of Gadgetron's connect mode: one accept loop, one
:class:`~masc_gadget.serving.host.Host`, one set of protections.

``masc serve`` speaks the client dialect of ``gadgetron_ismrmrd_client`` and of the
python-ismrmrd-server client: config by name (1) or script (2), header (3), an optional text (5)
with JSON parameters, acquisitions, close (4). Connect mode (``python -m
masc_gadget.serving.gadget PORT``) is the same listener in the ``gadgetron`` dialect
(:mod:`masc_gadget.serving.connection`). Many connections at once, each in its own thread and
isolated: a bad message gets an error back to that client only, and the server keeps serving.

Hostile clients are bounded: connections still in their handshake are at most ``max_pending``
(``max_pending_per_peer`` per address), and a new one beyond that closes the oldest, so idle
sockets cannot lock a real client out; a connection takes one of the ``max_connections`` slots
(``max_connections_per_peer`` per address) only after a valid header and token, and a slot holder
silent for ``reclaim_idle_s`` gives its slot to a client waiting for one; an optional allow-list
and shared token restrict who may connect. The port is listened on only after the warm-up.
SIGTERM and SIGINT shut it down within a few seconds: every open connection gets the images of
its open slices (from the lines acquired so far), then an error naming the shutdown.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from masc_gadget.config import Config, ConfigError
from masc_gadget.mrd.frames import frame_close, frame_error, frame_text
from masc_gadget.serving.connection import Connection
from masc_gadget.serving.host import Host, ServerConfig, is_loopback, peer_allowed
from masc_gadget.serving.metrics import MetricsServer
from masc_gadget.serving.models import ModelCache, warm_up

__all__ = ["MascServer", "ServerConfig", "serve_connect_mode"]

log = logging.getLogger(__name__)


class MascServer:
    """Threaded MRD server; ``start()`` binds, warms up, listens and returns (address, port).

    ``dialect``: ``mrd`` (``masc serve``) or ``gadgetron`` (connect mode, Gadgetron is the
    client). ``address`` is where it listens (config ``server.host``, ``--host``); ``host`` the
    :class:`~masc_gadget.serving.host.Host` record every connection gets."""

    def __init__(self, config: Config, address: str | None = None, port: int | None = None,
                 config_folders: list[Path] | None = None, cache: ModelCache | None = None,
                 dialect: str = "mrd") -> None:
        scfg: ServerConfig = config["server"]
        self.address = address or scfg.host
        self.port = scfg.port if port is None else port
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535] (0: any free port), got {self.port}")
        self.scfg = scfg
        self.dialect = dialect
        self.host = Host.from_config(config, config_folders, cache)
        self._networks = scfg.networks()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._pending: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._slots: dict[Connection, None] = {}
        self._waiting: dict[Connection, None] = {}  # handshake done, waiting for a slot
        self._connections: dict[Connection, threading.Thread] = {}
        self._accept: threading.Thread | None = None
        self.metrics_server: MetricsServer | None = None

    def start(self) -> tuple[str, int]:
        """Bind (so that a taken port fails at once), warm up, then listen: the port accepts
        connections only once the server can answer them."""
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.address, self.port))
        except OSError as err:
            sock.close()
            raise OSError(f"cannot listen on {self.address}:{self.port}: {err.strerror or err}") from None
        self.port = sock.getsockname()[1]
        self.host.own_ports.add(self.port)
        if self.scfg.threads:
            torch.set_num_threads(self.scfg.threads)
        try:
            self.warm_up()
        except BaseException:
            sock.close()
            raise
        if self.scfg.metrics_port >= 0:
            self.metrics_server = MetricsServer(self.host.metrics, self.scfg.metrics_host, self.scfg.metrics_port)
            try:
                self.host.own_ports.add(self.metrics_server.start())
            except BaseException:
                sock.close()
                raise
            if not is_loopback(self.scfg.metrics_host):
                log.warning("metrics served on %s, reachable from other hosts", self.scfg.metrics_host)
        sock.listen(max(64, min(self.scfg.max_pending, 1024)))
        sock.settimeout(0.2)
        self._sock = sock
        self._accept = threading.Thread(target=self._accept_loop, name="masc-accept", daemon=True)
        self._accept.start()
        if not is_loopback(self.address):
            log.warning("listening on %s, reachable from other hosts: %s", self.address,
                        "; ".join(self._access_summary()))
        if self.dialect == "gadgetron" and self.scfg.token:
            log.warning("server.token is not asked of Gadgetron streams (Gadgetron forwards no text "
                        "messages): keep connect mode on loopback or behind server.allow")
        what = "MASC gadget (connect mode)" if self.dialect == "gadgetron" else "MASC server"
        log.info("%s listening on %s:%d", what, self.address, self.port)
        return self.address, self.port

    def _access_summary(self) -> list[str]:
        return [f"allow-list {', '.join(self.scfg.allow)}" if self.scfg.allow
                else "no allow-list (server.allow): every address may connect",
                "token required" if self.scfg.token and self.dialect == "mrd"
                else "no token (server.token): no authentication"]

    def warm_up(self, n_pe: int = 64, n_readout: int = 64) -> float:
        """Load the default models and run one decision and one reconstruction before the first
        client (:func:`masc_gadget.serving.models.warm_up`); returns the seconds it took."""
        return warm_up(self.host.default, self.host.cache, n_pe, n_readout, self.host.warmed)

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
        """Check a new connection against the allow-list; make room among the connections in
        their handshake (the oldest goes); start its thread."""
        peer = f"{addr[0]}:{addr[1]}"
        if not peer_allowed(addr[0], self._networks):
            log.warning("refused %s: not in the allow-list (server.allow)", peer)
            _refuse(conn, "this client address is not allowed to connect (server.allow)", self.dialect)
            return
        connection = Connection(conn, peer, self.host, self.dialect, self._take_slot)
        with self._lock:
            same_peer = [c for c in self._pending if c.address == connection.address]
            if len(same_peer) >= self.scfg.max_pending_per_peer:
                self._evict(self._first_to_go(same_peer), f"{self.scfg.max_pending_per_peer} connections from "
                            "this address were in their handshake (server.max_pending_per_peer)")
            elif len(self._pending) >= self.scfg.max_pending:
                self._evict(self._first_to_go(list(self._pending)), f"{self.scfg.max_pending} connections were "
                            "in their handshake (server.max_pending)")
            self._pending[connection] = None
            thread = threading.Thread(target=self._serve, args=(connection,), name=f"masc-{peer}", daemon=True)
            self._connections[connection] = thread
        log.info("connection from %s", peer)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._pending.pop(connection, None)
                self._connections.pop(connection, None)
            raise

    def _first_to_go(self, candidates: list[Connection]) -> Connection:
        """Which connection in its handshake makes room (lock held): one that has sent nothing
        before one whose handshake is arriving, however slowly; among those, one from the
        address with the most connections in their handshake, then the oldest. Idle sockets from
        a few addresses cannot push out a real client's handshake."""
        crowd: dict[str, int] = {}
        for c in self._pending:
            crowd[c.address] = crowd.get(c.address, 0) + 1
        return min(candidates, key=lambda c: (c.stream.bytes_received > 0, -crowd.get(c.address, 0), c.opened))

    def _evict(self, connection: Connection, why: str) -> None:
        """Close the oldest connection still in its handshake (lock held) to make room."""
        self._pending.pop(connection, None)
        log.warning("closing %s, still in its handshake after %.1f s: %s", connection.peer,
                    time.monotonic() - connection.opened, why)
        connection.interrupt(f"server busy: closed before the end of the handshake to make room for a "
                             f"newer connection; {why}")

    def _take_slot(self, connection: Connection, deadline: float) -> bool:
        """A slot for ``connection`` (its handshake is done), waiting until ``deadline``; while
        every slot is taken, the holder silent for longest past ``reclaim_idle_s`` gives its up."""
        per_peer = self.scfg.max_connections_per_peer
        with self._lock:
            self._pending.pop(connection, None)
            full = len(self._slots) >= self.scfg.max_connections
            waiting = sum(c.address == connection.address for c in self._waiting)
            if full and len(self._waiting) >= self.scfg.max_pending:
                connection.interrupt_reason = (f"server busy: {len(self._waiting)} clients already wait for a "
                                               "connection slot (server.max_pending); try again later")
                return False
            if full and waiting >= self.scfg.max_pending_per_peer:
                connection.interrupt_reason = (f"server busy: {waiting} clients of this address already wait for "
                                               "a connection slot (server.max_pending_per_peer); try again later")
                return False
            self._waiting[connection] = None
            try:
                return self._wait_for_slot(connection, deadline, per_peer)
            finally:
                self._waiting.pop(connection, None)

    def _wait_for_slot(self, connection: Connection, deadline: float, per_peer: int) -> bool:
        """:meth:`_take_slot`'s wait (lock held)."""
        while not (self._stop.is_set() or connection.interrupted.is_set()):
            held = sum(c.address == connection.address for c in self._slots)
            if len(self._slots) < self.scfg.max_connections and held < per_peer:
                self._slots[connection] = None
                connection.slot = True
                return True
            if held >= per_peer:
                connection.interrupt_reason = (
                    f"server busy: this address holds {held} connection slots, the limit per address "
                    "(server.max_connections_per_peer); try again later")
            else:
                self._reclaim()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._lock.wait(min(0.1, left))
        return False

    def _reclaim(self) -> None:
        """The slot holder silent for longest gives up its slot if it has been silent at least
        ``reclaim_idle_s`` (lock held): the slot is free at once (the waiter takes it; no other
        holder is touched), and the holder gets its open slices, an error naming the rule and
        the close, with sends that give up on a client that does not read."""
        now = time.monotonic()
        idle = [c for c in self._slots if not c.interrupted.is_set()
                and now - c.last_activity >= self.scfg.reclaim_idle_s]
        if idle:
            victim = min(idle, key=lambda c: c.last_activity)
            silent = now - victim.last_activity
            log.warning("%s silent for %.0f s while a client waits for a slot: closing it", victim.peer, silent)
            self._slots.pop(victim, None)
            victim.slot = False
            victim.interrupt(f"connection silent for {silent:.0f} s while another client waited for a slot "
                             f"(server.reclaim_idle_s = {self.scfg.reclaim_idle_s:g} s)")

    def _serve(self, connection: Connection) -> None:
        try:
            connection.run()
        finally:
            with self._lock:
                self._pending.pop(connection, None)
                self._slots.pop(connection, None)
                self._connections.pop(connection, None)
                self._lock.notify_all()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting; every open connection stops reading, sends the images of its open
        and queued slices (with the network for the first 40 % of ``timeout``, zero-filled
        after) and an error naming the shutdown, then closes; what is still open at 90 % of
        ``timeout`` s (default ``server.shutdown_s``) is closed."""
        timeout = self.host.limits.shutdown_s if timeout is None else timeout
        start = time.monotonic()
        deadline = start + timeout
        self._stop.set()
        if self._accept is not None:
            self._accept.join(max(0.0, deadline - time.monotonic()))
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            open_connections = dict(self._connections)
            self._lock.notify_all()
        for connection in open_connections:
            connection.interrupt("the server is shutting down: the open slices were sent with the lines "
                                 "acquired so far; scan them again on a running server")
        for thread in open_connections.values():
            thread.join(max(0.0, start + 0.4 * timeout - time.monotonic()))
        for connection, thread in open_connections.items():
            if thread.is_alive():
                connection.hurry.set()  # no time left for the network: the rest zero-filled
        for thread in open_connections.values():
            thread.join(max(0.0, start + 0.9 * timeout - time.monotonic()))
        for connection, thread in open_connections.items():
            if thread.is_alive():
                connection.force_close()
        for thread in open_connections.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        self.host.close(max(0.0, deadline - time.monotonic()))
        if self.metrics_server is not None:
            self.metrics_server.close()
        left = sum(thread.is_alive() for thread in open_connections.values())
        if left:
            log.warning("MASC server stopped with %d connection thread(s) still finishing", left)
        else:
            log.info("MASC server stopped (%d connection(s) closed)", len(open_connections))

    def serve_forever(self, stop: threading.Event | None = None,
                      ready: Callable[[int], None] | None = None) -> None:
        """Run until SIGTERM / SIGINT (signals: main thread only) or until ``stop`` is set;
        ``ready(port)`` once listening."""
        import signal

        signals: queue.Queue = queue.Queue()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: signals.put(signum))
        self.start()
        if ready is not None:
            ready(self.port)
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                signum = signals.get(timeout=0.2)
            except queue.Empty:
                continue
            log.info("signal %d received, shutting down", signum)
            break
        self.shutdown()


def serve_connect_mode(config: Config, port: int, address: str = "127.0.0.1", cache: ModelCache | None = None,
                       stop: threading.Event | None = None, ready: Callable[[int], None] | None = None) -> None:
    """Gadgetron's connect mode (``<external><connect port=.../>``): listen on ``address:port`` and
    serve every stream Gadgetron opens, concurrently, with ``masc serve``'s limits (the config's
    ``server`` section, but its host and port) and its shutdown, until SIGTERM / SIGINT or
    ``stop``. The models of the config are warmed up before the port opens; ``ready(port)`` is
    called once listening (port 0 picks a free one)."""
    MascServer(config, address=address, port=port, cache=cache, dialect="gadgetron").serve_forever(stop, ready)


def _refuse(conn: socket.socket, message: str, dialect: str = "mrd") -> None:
    """Tell a connection that is not served why (never blocking the accept loop), and close it."""
    text = f"MASC error: {message}"
    try:
        conn.settimeout(0.5)
        conn.sendall((frame_text(text) if dialect == "mrd" else frame_error(text)) + frame_close())
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        conn.close()
