"""The scanner's connection to the gadget: the MRD link with its reader thread, the ZeroMQ
side channel, and the board where their next-line decisions wait for the scan."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import ismrmrd

from masc_gadget.mrd import tcp
from sim_scanner.scanner.config import ScannerConfig

log = logging.getLogger(__name__)

_READER_JOIN_S = 2.0
"""How long to wait for the reader thread after the socket is shut down."""
_ZMQ_POLL_MS = 10
"""Poll period of the ZeroMQ side-channel thread."""


# ------------------------------------------------------------------------------------ decisions


class DecisionBoard:
    """Decisions received so far, keyed by (slice, step); waits wake on arrival or closure."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[tuple[int, int], tuple[Any, float]] = {}
        self._expired: dict[tuple[int, int], float] = {}
        self._closed = False
        self.late_latencies_ms: list[float] = []

    def put(self, decision: Any, received: float) -> None:
        key = (int(decision.slice), int(decision.step))
        with self._cond:
            if key in self._expired:
                self.late_latencies_ms.append((received - self._expired.pop(key)) * 1e3)
                return
            self._items.setdefault(key, (decision, received))
            self._cond.notify_all()

    def close(self) -> None:
        """No more decisions will come (the source is gone): wake every wait."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, key: tuple[int, int], sent: float, deadline: float) -> tuple[Any, float] | None:
        """The decision for ``key`` with its arrival time, or None at the deadline / closure.

        A decision that arrived after ``deadline`` counts as late (None); so does one arriving
        later still, measured from ``sent``.
        """
        with self._cond:
            while True:
                item = self._items.pop(key, None)
                if item is not None:
                    if item[1] <= deadline:
                        return item
                    self.late_latencies_ms.append((item[1] - sent) * 1e3)
                    return None
                if self._closed:
                    return None
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self._expired[key] = sent
                    return None
                self._cond.wait(remaining)


class ZmqPump:
    """Reads the ZeroMQ side channel on its own thread into a :class:`DecisionBoard`."""

    def __init__(self, address: str, board: DecisionBoard, errors: list[str]) -> None:
        from masc_gadget.mrd.feedback import ZmqFeedbackReceiver

        self.receiver = ZmqFeedbackReceiver(address)
        self.endpoint = str(self.receiver.endpoint)
        self._board = board
        self._errors = errors
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="masc-scan-zmq", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                decision = self.receiver.receive(_ZMQ_POLL_MS)
            except ValueError as err:  # a malformed decision: report it, keep listening
                self._errors.append(f"bad ZeroMQ decision: {err}")
                log.warning("bad ZeroMQ decision from the gadget: %s", err)
                continue
            if decision is not None:
                self._board.put(decision, time.perf_counter())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_READER_JOIN_S + 1.0)
        self.receiver.close()


# ----------------------------------------------------------------------------------- connection


class GadgetLink:
    """One MRD connection to the gadget: sends from the caller, a reader thread for replies."""

    def __init__(
        self, sock: socket.socket, mode: str, board: DecisionBoard, errors: list[str],
        warnings: list[str] | None = None,
    ) -> None:
        from masc_gadget.mrd.protocol import MrdStream

        self.sock = sock
        # acknowledge every chunk at once: the gadget's side (stock Gadgetron) may hold its small
        # replies until an ACK comes back (Nagle's algorithm against a delayed ACK)
        self.stream = MrdStream(sock, quick_ack=True)
        self.mode = mode
        self.board = board
        self.errors = errors
        self.warnings: list[str] = [] if warnings is None else warnings
        """The gadget's ``MASC warning:`` texts (a setting it did not apply)."""
        self.images: list[ismrmrd.Image] = []
        self.image_times: list[float] = []
        """When each image of ``images`` arrived (``time.perf_counter()``)."""
        self.lost_reason = ""
        self.server_closed = False
        self._close_sent = False
        self._shut = False
        self._lock = threading.Lock()
        self._lost = threading.Event()
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="masc-scan-reader", daemon=True)

    @classmethod
    def connect(
        cls, scfg: ScannerConfig, board: DecisionBoard, errors: list[str], warnings: list[str] | None = None,
    ) -> GadgetLink:
        host, port = scfg.host_port
        try:
            sock = socket.create_connection((host, port), timeout=scfg.connect_timeout_s)
        except OSError as err:
            raise ConnectionError(
                f"cannot connect to gadget at {host}:{port}: {err} (is masc serve running?)"
            ) from None
        tcp.no_delay(sock)
        sock.settimeout(None)  # the reader blocks; it is woken by shutdown() at the end
        try:  # a gadget that stops reading must not block a send forever
            seconds = float(scfg.close_timeout_s)
            timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except (OSError, struct.error):
            log.debug("could not set SO_SNDTIMEO on the gadget socket")
        link = cls(sock, scfg.feedback, board, errors, warnings)
        link._reader.start()
        return link

    @property
    def alive(self) -> bool:
        return not self._lost.is_set()

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self._lost.is_set():
                return
            self.lost_reason = reason
            self._lost.set()
        log.warning("gadget connection lost: %s", reason)
        self.board.close()

    def _feedback(self, message: Any) -> None:
        """A 1028 "feedback" message: MASC's next-line decision when the scan asked for them."""
        from masc_gadget.mrd.feedback import decision_from_fire

        if self.mode != "fire":
            log.debug("ignoring a 1028 feedback message (feedback=%s)", self.mode)
            return
        try:
            decision = decision_from_fire(message)
        except ValueError as err:
            self.errors.append(f"bad 1028 decision: {err}")
            return
        self.board.put(decision, time.perf_counter())

    def _read_loop(self) -> None:
        from masc_gadget.mrd import protocol
        from masc_gadget.mrd.feedback import decision_from_acquisition, is_feedback

        try:
            while True:
                try:
                    message = self.stream.read_message()
                except (EOFError, OSError, ValueError) as err:
                    # ConnectionClosed is an EOFError, ProtocolError a ValueError.
                    if not self._close_sent:
                        self._mark_lost(
                            f"the gadget closed the connection before the scan ended ({err})"
                            if isinstance(err, EOFError)
                            else f"error reading from the gadget: {err}"
                        )
                    elif not isinstance(err, EOFError):
                        self.errors.append(f"error reading from the gadget after close: {err}")
                    return
                mid, payload = message.id, message.payload
                if mid == protocol.ID_CLOSE:
                    self.server_closed = True
                    if not self._close_sent:
                        self._mark_lost("the gadget sent close (4) before the scan ended")
                    return
                if mid == protocol.ID_ACQUISITION:
                    if is_feedback(payload):
                        if self.mode == "inband":
                            try:
                                decision = decision_from_acquisition(payload)
                            except ValueError as err:
                                self.errors.append(f"bad in-band decision: {err}")
                                continue
                            self.board.put(decision, time.perf_counter())
                        else:
                            log.debug("ignoring an in-band decision (feedback=%s)", self.mode)
                    else:
                        log.debug("ignoring an acquisition returned by the gadget")
                elif mid == protocol.ID_FEEDBACK:
                    self._feedback(payload)
                elif mid == protocol.ID_IMAGE:
                    self.image_times.append(time.perf_counter())
                    self.images.append(payload)
                elif mid in (protocol.ID_TEXT, protocol.ID_ERROR):
                    text = str(payload).strip("\x00").strip()
                    if mid == protocol.ID_TEXT and text.startswith("MASC warning:"):
                        self.warnings.append(text)  # a setting not applied: the scan goes on
                        log.warning("gadget: %s", text)
                    else:
                        self.errors.append(text)
                        log.warning("gadget error: %s", text)
                else:
                    log.debug("ignoring message id %s from the gadget", mid)
        finally:
            self.board.close()
            self._done.set()

    def _send(self, what: str, send: Callable[[], None]) -> bool:
        if not self.alive:
            return False
        try:
            send()
        except (OSError, ValueError) as err:
            self._mark_lost(f"sending {what} failed: {err}")
            return False
        return True

    def handshake(self, config_name: str, header_xml: str, params: dict[str, Any],
                  config_xml: str = "") -> bool:
        """Configuration (the script ``config_xml`` when given, else by name), header, JSON
        parameters; False when the connection was lost on the way."""
        if config_xml:
            configure = ("config script", lambda: self.stream.send_config_text(config_xml))
        else:
            configure = ("config name", lambda: self.stream.send_config_file(config_name))
        return (
            self._send(*configure)
            and self._send("header", lambda: self.stream.send_header(header_xml))
            and self._send("parameters", lambda: self.stream.send_text(json.dumps(params)))
        )

    def send_acquisition(self, acq: ismrmrd.Acquisition) -> bool:
        return self._send("an acquisition", lambda: self.stream.send_acquisition(acq))

    def finish(self, timeout_s: float) -> None:
        """Send close, wait (bounded) for the remaining images and the gadget's close."""
        if self.alive:
            self._close_sent = True  # before sending: the reply may beat the assignment
            if self._send("close", self.stream.send_close) and not self._done.wait(timeout_s):
                self.errors.append(
                    f"the gadget did not close the connection within {timeout_s:g} s of the "
                    "scanner's close"
                )
                log.warning("the gadget did not close within %.1f s; giving up", timeout_s)
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the reader and close the socket (idempotent)."""
        self._close_sent = True
        if self._shut:
            return
        self._shut = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the peer
        self._reader.join(timeout=_READER_JOIN_S)
        try:
            self.stream.close()
        except OSError:
            pass
