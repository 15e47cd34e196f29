"""One client stream: the handshake under the host's limits, then the gadget loop.

Two dialects share this code. ``mrd`` is ``masc serve``'s (``gadgetron_ismrmrd_client``,
python-ismrmrd-server's ``client.py``): configuration by name or script, header, the token in
JSON parameters when the server has one; errors go back as text (message 5, ``MASC error:
...``). ``gadgetron`` is Gadgetron's connect mode, where Gadgetron is the client: its stream
configuration (message 2) and header, no text messages; a fatal error goes back as Gadgetron's
error message (8), the only one it reports, and per-line problems are logged.

The handshake must end within ``server.handshake_timeout_s``, each of its texts within
``server.max_handshake_bytes``; only then does the connection take one of the server's slots.
Every message must arrive whole within ``server.message_timeout_s`` of its first byte, so a
peer that drips bytes cannot hold the connection. Messages a client never sends (images,
feedback, errors) are refused at their id. The header is checked against the server's caps
before anything is allocated for it. Errors state the rule, and never quote more than a few
dozen characters of what the client sent, nor any server path or file content.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator

from masc_gadget.config import ConfigError
from masc_gadget.mrd.frames import Limits, frame_error
from masc_gadget.mrd.header import encoding_geometry, parse_header, receiver_channels, slice_limit
from masc_gadget.mrd.frames import (ID_ACQUISITION, ID_CLOSE, ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_HEADER, ID_TEXT,
                                    ID_WAVEFORM, frame_close, ConnectionClosed, Feedback, ProtocolError, ReadTimeout)
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.stages import process
from masc_gadget.serving.host import ClientError, Host, ServerConfig, clip
from masc_gadget.serving.settings import GadgetSettings, parameters_json, settings_from_xml

__all__ = ["CLIENT_MESSAGES", "Connection", "DIALECTS", "check_header"]

log = logging.getLogger(__name__)

DIALECTS = ("mrd", "gadgetron")
"""``mrd``: ``masc serve``'s clients; ``gadgetron``: Gadgetron in connect mode."""

CLIENT_MESSAGES = frozenset({ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_HEADER, ID_CLOSE, ID_TEXT, ID_ACQUISITION,
                             ID_WAVEFORM})
"""Message ids a client may send; any other is refused at its id, before its body is read."""

LINGER_S = 0.5
"""How long a refused connection waits for the client to stop sending before it closes."""

LINGER_BYTES = 1 << 24
"""How much a refused connection reads (and discards) at most while it lingers."""


def check_header(header: Any, limits: ServerConfig) -> int:
    """The header's matrix and slices within the caps (``max_matrix``, ``max_slices``);
    ClientError naming the cap otherwise. Returns the slices a scan may use."""
    geometry = encoding_geometry(header)
    receiver_channels(header)  # ValueError for fewer than one receive channel, before any line comes
    max_pe, max_readout = limits.max_matrix
    readout = max(geometry.n_readout, geometry.grid_readout)
    if geometry.n_pe > max_pe or readout > max_readout:
        raise ClientError(
            f"header: encoded matrix of {geometry.n_pe} phase-encoding lines x {readout} "
            f"readout samples (encoded or recon space) exceeds this server's limit of {max_pe} x {max_readout} "
            f"(server.max_matrix)")
    limit = slice_limit(header)
    if limit is not None and limit > limits.max_slices:
        raise ClientError(
            f"header: encodingLimits slice maximum {limit - 1} ({limit} slices) exceeds this server's "
            f"limit of {limits.max_slices} slices (server.max_slices)")
    return limits.max_slices if limit is None else limit


INTERRUPTED_SEND_S = 5.0
"""How long one send may block once a connection is interrupted (a shutdown, a reclaimed
slot): a client that stopped reading is given up, and what its connection holds is freed."""


class Connection:
    """One client: the handshake, a slot, then an item iterator for :func:`process`.

    ``take_slot(connection, deadline)`` blocks until the server gives this connection a slot
    (True) or not by ``deadline`` (False); the server releases it after :meth:`run`."""

    def __init__(self, sock: socket.socket, peer: str, host: Host, dialect: str = "mrd",
                 take_slot: Callable[[Connection, float], bool] | None = None) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        self.limits = host.limits
        sock.settimeout(self.limits.idle_timeout_s)
        self.stream = MrdStream(sock, limits=Limits(max_text_bytes=self.limits.max_handshake_bytes),
                                quick_ack=dialect == "gadgetron", accept=CLIENT_MESSAGES)
        self.peer = peer
        self.address = peer.rsplit(":", 1)[0]
        self.host = host
        self.dialect = dialect
        self.take_slot = take_slot
        self.trusted: GadgetSettings | None = None
        self.closed_by_client = False
        self.stream_started = False
        self.interrupted = threading.Event()
        self.hurry = threading.Event()  # no time left for the network: finish slices zero-filled
        self.interrupt_reason = ""
        self.read_error: str | None = None
        self.first_items: list[Any] = []
        self.refused: list[str] = []  # the client's settings not applied, told after the handshake
        self.n_slices = self.limits.max_slices
        self.opened = time.monotonic()
        self.last_activity = self.opened  # monotonic time of the last message from the client
        self.slot = False  # set by the server while this connection holds one of its slots

    # ---------------------------------------------------------------------------- errors

    def report(self, message: str) -> None:
        """A problem that does not end the stream (a rejected line): to an MRD client as text;
        Gadgetron takes its error message as the end of the stream, so there it is logged."""
        if self.dialect == "mrd":
            self._send_error(message)

    def warn(self, message: str) -> None:
        """Something the stream did not do as the client asked (a setting the operator did not
        allow): to an MRD client as text starting ``MASC warning:``; logged for Gadgetron."""
        if self.dialect == "mrd":
            try:
                self.stream.send_text(f"MASC warning: {clip(message)}")
            except OSError:
                pass

    def _send_error(self, message: str) -> None:
        try:
            if self.dialect == "mrd":
                self.stream.send_text(f"MASC error: {clip(message)}")
            else:
                self.stream.send_frame(frame_error(f"MASC error: {clip(message)}"))
        except OSError:
            pass

    def interrupt(self, reason: str = "the server is shutting down") -> None:
        """End the connection from another thread (shutdown, a reclaimed slot): stop reading,
        so that the stream finishes its open slices, sends their images and then an error
        naming ``reason``; a connection still in its handshake just closes."""
        self.interrupt_reason = reason
        self.interrupted.set()
        try:
            self.stream.sock.shutdown(socket.SHUT_RD)  # wakes the reader; sending still works
            # a client that does not read cannot hold the thread (and what it holds) for long
            self.stream.sock.settimeout(min(self.limits.idle_timeout_s, INTERRUPTED_SEND_S))
        except OSError:
            pass

    def force_close(self) -> None:
        """Close at once (what :meth:`interrupt` started did not end in time)."""
        self.stream.interrupt(frame_close())

    # ---------------------------------------------------------------------------- handshake

    def _read(self, deadline: float) -> Any:
        try:
            msg = self.stream.read_message(deadline=deadline, message_timeout=self.limits.message_timeout_s)
        except ReadTimeout:
            if time.monotonic() < deadline - 0.01:
                raise ClientError(f"message not completed within {self.limits.message_timeout_s:g} s "
                                  "of its first byte") from None
            raise ClientError(self._handshake_rule("not completed within "
                                                   f"{self.limits.handshake_timeout_s:g} s")) from None
        except socket.timeout:
            raise ClientError(f"connection idle for more than {self.limits.idle_timeout_s:g} s") from None
        self.last_activity = time.monotonic()
        return msg

    def _handshake_rule(self, what: str) -> str:
        token = ", JSON parameters with the token" if self._needs_token else ""
        return f"handshake (configuration, header{token}) {what}"

    @property
    def _needs_token(self) -> bool:
        return bool(self.limits.token) and self.dialect == "mrd"

    def handshake(self, deadline: float) -> tuple[Any, GadgetSettings]:
        msg = self._read(deadline)
        self.stream_started = True
        named = self.host.named
        if msg.id == ID_CONFIG_FILE:
            settings = named.resolve(msg.payload.strip())
            self.trusted = settings  # the operator's configuration, chosen by name
        elif msg.id == ID_CONFIG_TEXT:
            self.trusted = named.default  # a client's script: its models must be names
            # masc serve's client sent it: as far as the operator allows; Gadgetron's connect mode
            # sends the stream XML of the Gadgetron host: applied whole
            allowed = self.host.limits.client_overrides if self.dialect == "mrd" else None
            settings = settings_from_xml(msg.payload, self.trusted, allowed, self.refused)
        else:
            raise ClientError(f"expected a configuration (message 1 or 2) first, got message {msg.id}")
        if self.dialect == "gadgetron" and settings.feedback == "fire":
            raise ClientError("feedback fire (message 1028) is for masc serve; through Gadgetron use "
                              "feedback inband or a zmq_address")
        msg = self._read(deadline)
        if msg.id != ID_HEADER:
            raise ClientError(f"expected the ISMRMRD header (message 3) after the configuration, got message {msg.id}")
        try:
            header = parse_header(msg.payload)
            self.n_slices = check_header(header, self.limits)
        except ValueError as err:
            raise ClientError(str(err)) from None
        if self._needs_token:
            self._authenticate(self._read(deadline))
        self.stream.limits = Limits()  # authenticated: the protocol's own limits
        return header, settings

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
        # surrogatepass: a lone surrogate ("\ud800" in the JSON) is a wrong token, not a codec error
        if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self.limits.token.encode("utf-8")):
            raise ClientError("authentication failed: wrong token")
        self.first_items.append(msg.payload)

    # ---------------------------------------------------------------------------- items

    def items(self) -> Iterator[Any]:
        """The client's items after the handshake, until its close message. A framing error,
        a timeout, a lost connection or an interruption ends the items cleanly (so the gadget
        finishes the slices it holds) and is kept in ``read_error`` for the client."""
        yield from self.first_items
        while True:
            msg = self._next_message()
            if msg is None:
                return
            self.last_activity = time.monotonic()
            if msg.id == ID_CLOSE:
                self.closed_by_client = True
                return
            if msg.id == ID_ACQUISITION:
                slice_index = int(msg.payload.idx.slice)
                if slice_index >= self.n_slices:
                    self.report(f"slice {slice_index}: beyond the header's slice limit (slices 0 to "
                                f"{self.n_slices - 1}); acquisition skipped")
                    continue
                yield msg.payload
            elif msg.id == ID_TEXT and self.dialect == "mrd":
                yield msg.payload
            else:
                log.debug("%s: ignoring message %d", self.peer, msg.id)

    def _next_message(self) -> Any:
        """The next message, or None (``read_error`` set when it was not a clean end)."""
        try:
            return self.stream.read_message(message_timeout=self.limits.message_timeout_s)
        except ConnectionClosed as err:
            if self.interrupted.is_set():
                self.read_error = self.interrupt_reason
            elif err.clean:
                log.warning("%s closed the connection without a close message", self.peer)
            else:
                self.read_error = str(err)
        except ReadTimeout:
            self.read_error = f"message not completed within {self.limits.message_timeout_s:g} s of its first byte"
        except socket.timeout:
            self.read_error = f"connection idle for more than {self.limits.idle_timeout_s:g} s"
        except (ProtocolError, OSError) as err:
            self.read_error = self.interrupt_reason if self.interrupted.is_set() else str(err)
        return None

    # ---------------------------------------------------------------------------- run

    def run(self) -> None:
        try:
            self._run()
        except (ClientError, ProtocolError, ConfigError, ValueError) as err:
            self._fail(str(err))
        except ConnectionClosed as err:
            if self.interrupted.is_set():  # in the handshake: nothing acquired yet
                log.info("%s: closed (%s)", self.peer, self.interrupt_reason)
                self._send_error(self.interrupt_reason)
                try:
                    self.stream.send_close()
                except OSError:
                    pass
            elif err.clean and not self.stream_started:
                log.info("%s closed the connection without sending anything", self.peer)
            else:
                log.warning("%s: connection lost (%s)", self.peer, err)
                if not err.clean:  # a truncated frame: the client may still be listening
                    self._send_error(str(err))
        except socket.timeout:
            log.warning("%s: timed out, closing", self.peer)
            self._send_error("connection timed out")
        except OSError as err:
            log.log(logging.INFO if self.interrupted.is_set() else logging.WARNING,
                    "%s: socket error: %s", self.peer, err)
        except Exception:  # noqa: BLE001 - one client's crash must never take the server down
            log.exception("%s: internal error", self.peer)
            self._send_error("internal error in the MASC gadget (see the server log)")
        finally:
            self.stream.close()

    def _run(self) -> None:
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        header, settings = self.handshake(deadline)
        if self.take_slot is not None and not self.take_slot(self, deadline):
            if self.interrupt_reason:
                raise ClientError(self.interrupt_reason)
            raise ClientError(f"server busy: all {self.limits.max_connections} connection slots are in use "
                              "(server.max_connections); try again later")
        for note in self.refused:
            self.warn(note)
        stats = process(self.items(), header, settings, self._send, on_error=self.report, host=self.host,
                        trusted=self.trusted, eager=self.dialect == "gadgetron", background_images=True,
                        on_warning=self.warn, hurry=self.hurry)
        log.info("%s done: %s", self.peer, stats)
        if self.read_error is not None:
            self._fail(self.read_error)
        else:
            self.stream.send_close()

    def _fail(self, message: str) -> None:
        """Tell the client (and the log) what rule it broke, then close without losing the
        message (:meth:`_linger`)."""
        log.warning("%s: %s", self.peer, clip(message))
        self._send_error(message)
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
