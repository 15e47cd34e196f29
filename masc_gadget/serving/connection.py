"""One ``masc serve`` client: the handshake under its limits, then the gadget loop.

The handshake (configuration by name or script, the ISMRMRD header, the token when the server
has one) must end within ``server.handshake_timeout_s``; only then does the connection take one
of the server's slots. Every message must arrive whole within ``server.message_timeout_s`` of its
first byte, so a peer that drips bytes cannot hold the connection. The header is checked against
the server's caps (``max_matrix``, ``max_slices``) before anything is allocated for it. Errors go
back to the client as ``MASC error: ...`` text, state the rule, and never quote more than a few
dozen characters of what the client sent, nor any server path or file content.
"""

from __future__ import annotations

import hmac
import logging
import re
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from masc_gadget.acquisition.policies import POLICIES
from masc_gadget.acquisition.batcher import DecisionBatcher
from masc_gadget.config import Config, ConfigError, load_config, quote
from masc_gadget.mrd.header import encoding_geometry, parse_header, slice_limit
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
    ReadTimeout,
    Feedback,
    frame_close,
)
from masc_gadget.serving.gadget import process
from masc_gadget.serving.models import ModelCache
from masc_gadget.serving.settings import GadgetSettings, parameters_json, settings_from_xml

if TYPE_CHECKING:
    from masc_gadget.serving.server import ServerConfig

__all__ = ["ClientError", "Connection", "MAX_CONFIG_NAME_CHARS", "MAX_ERROR_CHARS", "NamedConfigs"]

log = logging.getLogger(__name__)

MAX_CONFIG_NAME_CHARS = 64
"""Longest configuration name (message 1) accepted."""
MAX_ERROR_CHARS = 1000
"""Longest error text sent to a client or logged for it."""

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class ClientError(Exception):
    """The client broke the protocol or a rule of the server; the message goes back to it."""


LINGER_S = 0.5
"""How long a refused connection waits for the client to stop sending before it closes."""

LINGER_BYTES = 1 << 24
"""How much a refused connection reads (and discards) at most while it lingers."""


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NamedConfigs:
    """Configurations a client may select by name (message id 1): ``default`` (the server's own),
    a policy name (the default with that policy), or a YAML file in the config folders.

    A name is a plain file stem (letters, digits, ``_ . -``; no path separators, no ``..``) of
    at most :data:`MAX_CONFIG_NAME_CHARS` characters, looked up only inside the folders."""

    def __init__(self, config: Config, folders: list[Path]) -> None:
        self.config = config
        self.folders = [f for f in folders if f.is_dir()]

    def names(self) -> list[str]:
        yaml_names = sorted({p.stem for f in self.folders for p in f.glob("*.yaml")
                             if _PLAIN_NAME.fullmatch(p.stem)})
        return ["default", *sorted(POLICIES), *yaml_names]

    def resolve(self, name: str) -> GadgetSettings:
        base = GadgetSettings.from_config(self.config)
        if name in ("", "default"):
            return base
        if name in POLICIES:
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


class Connection:
    """One client: the handshake, a slot, then an item iterator for :func:`process`.

    ``take_slot(connection, deadline)`` blocks until the server gives this connection a slot
    (True) or not by ``deadline`` (False); the server releases it after :meth:`run`."""

    def __init__(self, sock: socket.socket, peer: str, named: NamedConfigs, cache: ModelCache,
                 scfg: ServerConfig, take_slot: Callable[[Connection, float], bool] | None = None,
                 batcher: DecisionBatcher | None = None) -> None:
        sock.settimeout(scfg.idle_timeout_s)
        self.stream = MrdStream(sock)
        self.peer = peer
        self.named = named
        self.cache = cache
        self.scfg = scfg
        self.take_slot = take_slot
        self.batcher = batcher
        self.trusted: GadgetSettings | None = None
        self.closed_by_client = False
        self.stream_started = False
        self.interrupted = threading.Event()
        self.read_error: str | None = None
        self.first_items: list[Any] = []
        self.n_slices = scfg.max_slices
        self.slot = False  # set by the server while this connection holds one of its slots

    def send_error(self, message: str) -> None:
        try:
            self.stream.send_text(f"MASC error: {clip(message)}")
        except OSError:
            pass

    def interrupt(self) -> None:
        """The server is shutting down: send the close message if the stream is free, and shut
        the socket down, which ends the connection's thread."""
        self.interrupted.set()
        self.stream.interrupt(frame_close())

    # ---------------------------------------------------------------------------- handshake

    def _read(self, deadline: float) -> Any:
        try:
            return self.stream.read_message(deadline=deadline, message_timeout=self.scfg.message_timeout_s)
        except ReadTimeout:
            if time.monotonic() < deadline - 0.01:
                raise ClientError(f"message not completed within {self.scfg.message_timeout_s:g} s "
                                  "of its first byte") from None
            raise ClientError(self._handshake_rule("not completed within "
                                                   f"{self.scfg.handshake_timeout_s:g} s")) from None
        except socket.timeout:
            raise ClientError(f"connection idle for more than {self.scfg.idle_timeout_s:g} s") from None

    def _handshake_rule(self, what: str) -> str:
        token = ", JSON parameters with the token" if self.scfg.token else ""
        return f"handshake (configuration, header{token}) {what}"

    def handshake(self, deadline: float) -> tuple[Any, GadgetSettings]:
        msg = self._read(deadline)
        self.stream_started = True
        if msg.id == ID_CONFIG_FILE:
            settings = self.named.resolve(msg.payload.strip())
            self.trusted = settings  # the operator's configuration, chosen by name
        elif msg.id == ID_CONFIG_TEXT:
            self.trusted = self.named.resolve("default")  # a client's script: its models must be names
            settings = settings_from_xml(msg.payload, self.trusted)
        else:
            raise ClientError(f"expected a configuration (message 1 or 2) first, got message {msg.id}")
        msg = self._read(deadline)
        if msg.id != ID_HEADER:
            raise ClientError(f"expected the ISMRMRD header (message 3) after the configuration, got message {msg.id}")
        try:
            header = parse_header(msg.payload)
            self._check_header(header)
        except ValueError as err:
            raise ClientError(str(err)) from None
        if self.scfg.token:
            self._authenticate(self._read(deadline))
        return header, settings

    def _check_header(self, header: Any) -> None:
        """The header's matrix and slices within the server's caps (``max_matrix``, ``max_slices``)."""
        geometry = encoding_geometry(header)
        max_pe, max_readout = self.scfg.max_matrix
        readout = max(geometry.n_readout, geometry.grid_readout)
        if geometry.n_pe > max_pe or readout > max_readout:
            raise ClientError(
                f"header: encoded matrix of {geometry.n_pe} phase-encoding lines x {readout} "
                f"readout samples (encoded or recon space) exceeds this server's limit of {max_pe} x {max_readout} "
                f"(server.max_matrix)")
        limit = slice_limit(header)
        if limit is not None and limit > self.scfg.max_slices:
            raise ClientError(
                f"header: encodingLimits slice maximum {limit - 1} ({limit} slices) exceeds this server's "
                f"limit of {self.scfg.max_slices} slices (server.max_slices)")
        self.n_slices = self.scfg.max_slices if limit is None else limit

    def _authenticate(self, msg: Any) -> None:
        """The JSON parameters right after the header must carry the server's token."""
        rule = ('this server needs its token in the JSON parameters (message 5, {"token": "..."}) '
                "right after the header")
        if msg.id != ID_TEXT:
            raise ClientError(f"authentication required: {rule}; got message {msg.id}")
        try:
            given = parameters_json(msg.payload).get("token")
        except ConfigError as err:
            raise ClientError(f"authentication required: {rule}; {err}") from None
        if not isinstance(given, str):
            raise ClientError(f"authentication required: {rule}")
        if not hmac.compare_digest(given.encode("utf-8"), self.scfg.token.encode("utf-8")):
            raise ClientError("authentication failed: wrong token")
        self.first_items.append(msg.payload)

    # ---------------------------------------------------------------------------- items

    def items(self) -> Iterator[Any]:
        """The client's items after the handshake, until its close message. A framing error,
        a timeout or a lost connection ends the items cleanly (so the gadget finishes the
        slices it holds) and is kept in ``read_error`` for the client."""
        yield from self.first_items
        while True:
            msg = self._next_message()
            if msg is None:
                return
            if msg.id == ID_CLOSE:
                self.closed_by_client = True
                return
            if msg.id == ID_ACQUISITION:
                slice_index = int(msg.payload.idx.slice)
                if slice_index >= self.n_slices:
                    self.send_error(f"slice {slice_index}: beyond the header's slice limit (slices 0 to "
                                    f"{self.n_slices - 1}); acquisition skipped")
                    continue
                yield msg.payload
            elif msg.id == ID_TEXT:
                yield msg.payload
            else:
                log.debug("%s: ignoring message %d", self.peer, msg.id)

    def _next_message(self) -> Any:
        """The next message, or None (``read_error`` set when it was not a clean end)."""
        try:
            return self.stream.read_message(message_timeout=self.scfg.message_timeout_s)
        except ConnectionClosed as err:
            if err.clean:
                if not self.interrupted.is_set():
                    log.warning("%s closed the connection without a close message", self.peer)
            else:
                self.read_error = str(err)
        except ReadTimeout:
            self.read_error = f"message not completed within {self.scfg.message_timeout_s:g} s of its first byte"
        except socket.timeout:
            self.read_error = f"connection idle for more than {self.scfg.idle_timeout_s:g} s"
        except ProtocolError as err:
            self.read_error = str(err)
        return None

    # ---------------------------------------------------------------------------- run

    def run(self) -> None:
        try:
            self._run()
        except (ClientError, ProtocolError, ConfigError, ValueError) as err:
            self._fail(str(err))
        except ConnectionClosed as err:
            if err.clean and not self.stream_started:
                log.info("%s closed the connection without sending anything", self.peer)
            elif self.interrupted.is_set():
                log.info("%s: closed by the server's shutdown", self.peer)
            else:
                log.warning("%s: connection lost (%s)", self.peer, err)
                if not err.clean:  # a truncated frame: the client may still be listening
                    self.send_error(str(err))
        except socket.timeout:
            log.warning("%s: timed out, closing", self.peer)
            self.send_error("connection timed out")
        except OSError as err:
            log.log(logging.INFO if self.interrupted.is_set() else logging.WARNING,
                    "%s: socket error: %s", self.peer, err)
        except Exception:  # noqa: BLE001 - one client's crash must never take the server down
            log.exception("%s: internal error", self.peer)
            self.send_error("internal error in the MASC gadget (see the server log)")
        finally:
            self.stream.close()

    def _run(self) -> None:
        deadline = time.monotonic() + self.scfg.handshake_timeout_s
        header, settings = self.handshake(deadline)
        if self.take_slot is not None and not self.take_slot(self, deadline):
            if self.interrupted.is_set():
                raise ClientError("the server is shutting down")
            raise ClientError(f"server busy: all {self.scfg.max_connections} connection slots are in use "
                              "(server.max_connections); try again later")
        stats = process(self.items(), header, settings, self._send, on_error=self.send_error, cache=self.cache,
                        trusted=self.trusted, batcher=self.batcher,
                        max_kspace_bytes=(self.scfg.max_kspace_bytes, self.n_slices))
        log.info("%s done: %s", self.peer, stats)
        if self.read_error is not None:
            self._fail(self.read_error)
        else:
            self.stream.send_close()

    def _fail(self, message: str) -> None:
        """Tell the client (and the log) what rule it broke, then close without losing the
        message (:meth:`_linger`)."""
        log.warning("%s: %s", self.peer, clip(message))
        self.send_error(message)
        try:
            self.stream.send_close()
        except OSError:
            pass
        self._linger()

    def _linger(self, seconds: float = LINGER_S, limit: int = LINGER_BYTES) -> None:
        """Half-close and discard what the client still sends, until it closes too or
        ``seconds`` / ``limit`` bytes are spent: closing a socket with unread data resets the
        connection, and a reset can drop the error just sent before the client reads it."""
        sock = self.stream.sock
        try:
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + seconds
            got = 0
            while got < limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:  # timed out, reset, already closed: nothing more to save
            pass

    def _send(self, item: Any) -> None:
        import ismrmrd

        if isinstance(item, ismrmrd.Image):
            self.stream.send_image(item)
        elif isinstance(item, ismrmrd.Acquisition):
            self.stream.send_acquisition(item)
        elif isinstance(item, Feedback):
            self.stream.send_feedback(item)
        else:
            raise TypeError(f"cannot send {type(item).__name__}")
