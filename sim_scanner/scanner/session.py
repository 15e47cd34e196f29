"""The simulated scanner: replays a paired dataset over the MRD wire protocol and obeys the
gadget's next-line decisions under a deadline (DESIGN.md, "Simulated scanner").

For each subject file the scanner connects to a gadget (``masc serve`` or Gadgetron), sends
config by name (id 1), the ``metal`` group's ISMRMRD header (3) and a JSON text (5) with its
parameters (feedback mode, ZeroMQ address, initial, budget, policy), then acquires:

* the ``initial`` centre lines of a slice (:func:`masc_gadget.acquisition.episode.initial_lines`), then
  ``budget`` lines one at a time. Sequential: slice after slice. Interleaved (``interleave``):
  the initial lines of every slice first, then round-robin over slices, one line each, as a
  multi-slice TSE;
* before each chosen line it waits for the decision for (slice, step) until ``deadline_ms``
  after it sent the previous line of that slice. ``step`` is the number of lines of the slice
  acquired after its initial ones. A decision is taken when its line is in range and not yet
  acquired; otherwise (a miss, an invalid line, a silent or dead gadget) the scanner takes the
  line the deterministic ``fallback`` policy chooses on its current mask, which never repeats a
  line. Every slice therefore always gets exactly ``initial + budget`` lines;
* ``feedback = "none"`` is open loop (a plain MRD client): the initial lines and the fallback
  order are streamed without waiting.

The scanner is the authority on what was acquired: it keeps its own k-space of every line it
acquired, so when the gadget dies mid-scan it finishes on the fallback order (sending nothing)
and scores its own zero-filled reconstruction for slices that got no image back.

Results: :class:`ScanReport` (``OUTDIR/report.json``) and the returned images
(``OUTDIR/images.h5``, one ISMRMRD group per subject: ``<subject>/images`` as returned by the
gadget, ``<subject>/scanner_zero_filled`` for slices without a returned image).

Time stamps: ``acquisition_time_stamp`` (2.5 ms ticks) starts at the time of day when the
subject's scan starts and advances by the sequence's nominal line period
(:func:`sim_scanner.dataset.mrd_hdf5.line_period_ms`), strictly increasing; the scanner does not pace its
lines in real time, only the decision deadlines are real time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, NamedTuple

import h5py
import ismrmrd
import numpy as np
import torch

from masc_gadget import __version__
from masc_gadget.acquisition.episode import AcquisitionConfig, AcquisitionState, initial_lines
from masc_gadget.config import Config, from_dict, to_dict
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import METRICS, slice_metrics
from masc_gadget.mrd.header import flag_mask
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy
from sim_scanner.dataset import mrd_hdf5 as mrd
from sim_scanner.dataset.simulate import read_manifest, subject_path
from sim_scanner.physics.sequence import SequenceConfig

log = logging.getLogger(__name__)

FEEDBACK_MODES = ("inband", "zmq", "none")
IMAGE_FROM_GADGET = "gadget"
IMAGE_ZERO_FILLED = "scanner zero-filled"
REPORT_FILE = "report.json"
IMAGES_FILE = "images.h5"

SOURCE_INITIAL, SOURCE_GADGET, SOURCE_FALLBACK = "initial", "gadget", "fallback"
"""Where each acquired line came from (``SliceReport.sources``)."""

REASON_MISS = "miss"
"""No decision by the deadline while the gadget was connected."""
REASON_INVALID = "invalid"
"""The decision's line was out of range or already acquired."""
REASON_DISCONNECTED = "disconnected"
"""No gadget connection (lost mid-scan, or unreachable for a later subject)."""
REASON_OPEN_LOOP = "open-loop"
"""``feedback = "none"``: the scanner never waits for decisions."""

_F_FIRST_IN_SLICE = flag_mask(ismrmrd.ACQ_FIRST_IN_SLICE)
_F_LAST_IN_SLICE = flag_mask(ismrmrd.ACQ_LAST_IN_SLICE)
_F_LAST_IN_MEASUREMENT = flag_mask(ismrmrd.ACQ_LAST_IN_MEASUREMENT)
_READER_JOIN_S = 2.0
"""How long to wait for the reader thread after the socket is shut down."""
_ZMQ_POLL_MS = 10
"""Poll period of the ZeroMQ side-channel thread."""


# --------------------------------------------------------------------------------------- config


def parse_server(server: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[v6addr]:PORT"``) -> ``(host, port)``; ValueError stating the rule."""
    if not isinstance(server, str):
        raise ValueError(f"server must be HOST:PORT, got {server!r}")
    host, sep, port_text = server.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"server must be HOST:PORT with a port in 1..65535, got {server!r}")
    return host, int(port_text)


@dataclass(frozen=True)
class ScannerConfig:
    """The simulated scanner client (config section ``scanner``)."""

    server: str = "127.0.0.1:9002"
    """Gadget to connect to, HOST:PORT (``masc serve`` or Gadgetron)."""
    feedback: Literal["inband", "zmq", "none"] = "inband"
    """How next-line decisions come back: in-band feedback acquisitions on the MRD connection,
    the ZeroMQ side channel (the scanner binds ``zmq_address``), or none (open loop: stream the
    initial lines and the fallback order without waiting, like a plain MRD client)."""
    deadline_ms: float = 200.0
    """How long the scanner waits for the decision for a slice's next line, from sending the
    previous line of that slice, ms; later decisions are misses and the fallback line is taken."""
    fallback: str = "center-out"
    """Deterministic policy (``masc_gadget.acquisition.policies``) whose choice on the current mask is
    taken when the gadget's decision is missing, late or invalid, e.g. center-out (low
    frequencies first) or equispaced."""
    interleave: bool = False
    """Interleave slices as a multi-slice TSE: the initial lines of every slice first, then one
    chosen line per slice in turn. False: slice after slice."""
    zmq_address: str = "tcp://127.0.0.1:9003"
    """ZeroMQ PULL endpoint the scanner binds for ``feedback = "zmq"`` (``tcp://HOST:*`` picks
    a free port); sent to the gadget in the JSON parameters."""
    config_name: str = "default"
    """Stream configuration name sent as config-by-name (message id 1), e.g. "default" or a
    policy name."""
    connect_timeout_s: float = 5.0
    """Timeout of the TCP connection to the gadget, s."""
    close_timeout_s: float = 10.0
    """After its close message, how long the scanner waits for the remaining images and the
    gadget's close, s (also the send timeout on a gadget that stops reading)."""
    max_subjects: int = 0
    """Scan at most this many subjects of the split (0 = all)."""
    max_slices: int = 0
    """Scan at most this many slices per subject, the first ones (0 = all)."""

    def __post_init__(self) -> None:
        parse_server(self.server)
        if self.feedback not in FEEDBACK_MODES:
            raise ValueError(
                f"feedback must be one of {', '.join(FEEDBACK_MODES)}, got {self.feedback!r}"
            )
        for name in ("deadline_ms", "connect_timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("max_subjects", "max_slices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0 = all), got {value!r}")
        if not self.zmq_address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                "zmq_address must be a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH), "
                f"got {self.zmq_address!r}"
            )
        name = self.config_name
        if not name or len(name.encode("utf-8")) >= 1024 or "\x00" in name:
            raise ValueError(
                "config_name must be a non-empty name shorter than 1024 bytes without NUL, "
                f"got {name!r}"
            )
        policy = make_policy(self.fallback)
        if not policy.deterministic or policy.needs_image:
            raise ValueError(
                f"fallback must be a deterministic policy that needs no image (e.g. center-out, "
                f"equispaced), got {self.fallback!r}"
            )

    @property
    def host_port(self) -> tuple[str, int]:
        """``server`` as ``(host, port)``."""
        return parse_server(self.server)


# -------------------------------------------------------------------------------------- records


class LatencySummary(NamedTuple):
    """Percentiles of decision latencies, ms (None when there were none)."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: list[float]) -> LatencySummary:
        if not values:
            return cls(0, None, None, None, None)
        v = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
        return cls(int(v.size), p50, p90, p99, float(v.max()))


@dataclass
class SliceReport:
    """One slice of one subject: what was acquired, from where, and how good the image is."""

    slice: int
    lines: list[int] = field(default_factory=list)
    """PE lines in acquisition order (initial + budget)."""
    sources: list[str] = field(default_factory=list)
    """Per line: "initial", "gadget" or "fallback"."""
    fallback_reasons: list[str | None] = field(default_factory=list)
    """Per chosen line (budget steps): None when the gadget's line was taken, else "miss",
    "invalid", "disconnected" or "open-loop"."""
    latencies_ms: list[float | None] = field(default_factory=list)
    """Per budget step: scanner-side round trip from sending the previous line of the slice to
    receiving the decision (None: no decision by the deadline)."""
    gadget_latencies_ms: list[float | None] = field(default_factory=list)
    """Per budget step: the decision latency the gadget reported (``user_int[1]`` / 1000)."""
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    """Deadline misses (no decision in time while the gadget was connected)."""
    invalid: int = 0
    """Decisions whose line was out of range or already acquired."""
    image_source: str = ""
    """"gadget" (the returned image) or "scanner zero-filled" (no image came back)."""
    image_lines: list[int] | None = None
    """The lines the returned image says it was built from (meta ``MASC.lines``), if any; a
    mismatch with ``lines`` is reported as a gadget error."""
    metrics: dict[str, float] = field(default_factory=dict)
    """ssim, psnr, mse, nmse, mae of the scored image vs the clean fully sampled image."""
    zero_filled_metrics: dict[str, float] = field(default_factory=dict)
    """The same metrics of the scanner's zero-filled reconstruction of its acquired lines."""


@dataclass
class SubjectReport:
    """One subject's scan."""

    subject: str
    path: str
    n_slices: int
    """Slices scanned (``max_slices`` may be fewer than the file holds)."""
    n_pe: int
    slices: list[SliceReport] = field(default_factory=list)
    connection: str = "ok"
    """"ok", "lost" (the gadget went away mid-scan: the rest was acquired on the fallback
    order) or "unreachable" (no connection for a later subject: all on the fallback order)."""
    connection_lost_at: int | None = None
    """Scan counter of the first line acquired after the connection was found lost."""
    connection_error: str = ""
    server_closed: bool = False
    """Whether the gadget answered the scanner's close with its own close message (id 4)."""
    gadget_errors: list[str] = field(default_factory=list)
    """Text / error messages from the gadget and problems with what it sent."""
    images_returned: int = 0
    late_decisions: int = 0
    """Decisions that arrived after their deadline (the fallback line was taken)."""
    late_latencies_ms: list[float] = field(default_factory=list)
    lines: int = 0
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    invalid: int = 0
    duration_s: float = 0.0


@dataclass
class ScanTotals:
    """Totals over every subject of a scan."""

    subjects: int = 0
    slices: int = 0
    lines: int = 0
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    invalid: int = 0
    late_decisions: int = 0
    gadget_errors: int = 0
    connections_lost: int = 0
    images_from_gadget: int = 0
    images_zero_filled: int = 0
    latency_ms: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """Scanner-side decision latencies, every decision received (late ones included)."""
    gadget_latency_ms: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """Latencies the gadget reported for the decisions that arrived in time."""
    metrics_mean: dict[str, float] = field(default_factory=dict)
    metrics_std: dict[str, float] = field(default_factory=dict)


@dataclass
class ScanReport:
    """``report.json``: the configuration, every subject and the totals."""

    data_dir: str
    split: str
    scanner: dict[str, Any]
    acquisition: dict[str, Any]
    subjects: list[SubjectReport] = field(default_factory=list)
    totals: ScanTotals = field(default_factory=ScanTotals)
    created: str = ""
    masc_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def summary(self) -> str:
        """A few human-readable lines (what ``masc scan`` prints)."""
        t = self.totals
        lat = t.latency_ms
        lines = [
            (
                f"scanned {t.subjects} subject(s), {t.slices} slices, {t.lines} lines "
                f"(feedback {self.scanner.get('feedback')}, deadline "
                f"{self.scanner.get('deadline_ms')} ms, fallback {self.scanner.get('fallback')})"
            ),
            (
                f"decisions from gadget: {t.from_gadget}, fallbacks: {t.fallbacks} "
                f"(deadline misses {t.misses}, invalid {t.invalid}, late {t.late_decisions}), "
                f"gadget errors: {t.gadget_errors}, connections lost: {t.connections_lost}"
            ),
        ]
        if lat.count:
            lines.append(
                f"decision latency ms: p50 {lat.p50:.2f}, p90 {lat.p90:.2f}, p99 {lat.p99:.2f}, "
                f"max {lat.max:.2f} ({lat.count} decisions)"
            )
        if t.metrics_mean:
            lines.append(
                "images: "
                f"{t.images_from_gadget} from gadget, {t.images_zero_filled} scanner zero-filled; "
                + ", ".join(
                    f"{k} {t.metrics_mean[k]:.4g} +- {t.metrics_std.get(k, 0.0):.2g}"
                    for k in METRICS
                    if k in t.metrics_mean
                )
            )
        return "\n".join(lines)


def _plain(obj: Any) -> Any:
    """JSON-able data: NamedTuples become dicts, non-finite floats None."""
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {k: _plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


# ---------------------------------------------------------------------------------- subject data


class ScanInput(NamedTuple):
    """What the scanner replays for one subject."""

    header_xml: str
    """ISMRMRD header of the ``metal`` group."""
    kspace: np.ndarray
    """(n_slices, n_pe, n_readout) complex64, the fully sampled metal k-space."""
    clean: np.ndarray
    """(n_slices, y, x) float32, the clean fully sampled images (ground truth)."""
    seq: SequenceConfig
    slice_centres_mm: list[float]
    fov_centre_mm: tuple[float, float]
    """(y, x), as everywhere in the simulator."""


def load_scan_input(path: str | os.PathLike) -> ScanInput:
    """Read a subject file: metal header + k-space, clean images, sequence and geometry."""
    group = mrd.read_mrd_group(path, "metal")
    with h5py.File(path, "r") as f:
        if "images/clean" not in f:
            raise ValueError(f"{path}: no images/clean dataset (not a MASC subject file?)")
        clean = np.asarray(f["images/clean"][()], dtype=np.float32)
        attrs = f.attrs
        missing = [k for k in ("config_json", "slice_centres_mm", "fov_centre_mm") if k not in attrs]
        if missing:
            raise ValueError(f"{path}: missing attributes {missing} (not a MASC subject file?)")
        sim = json.loads(attrs["config_json"])
        centres = [float(z) for z in np.atleast_1d(attrs["slice_centres_mm"])]
        fov = tuple(float(v) for v in np.atleast_1d(attrs["fov_centre_mm"]))
    seq = from_dict(SequenceConfig, sim.get("sequence"), "sequence")
    n_slices, n_pe, n_ro = group.kspace.shape
    if (seq.n_slices, seq.n_pe, seq.n_readout) != (n_slices, n_pe, n_ro):
        raise ValueError(
            f"{path}: metal k-space {group.kspace.shape} does not match the sequence "
            f"({seq.n_slices}, {seq.n_pe}, {seq.n_readout})"
        )
    if clean.shape != (n_slices, n_pe, n_ro):
        raise ValueError(
            f"{path}: images/clean {clean.shape} does not match the k-space {group.kspace.shape}"
        )
    if len(centres) != n_slices or len(fov) != 2:
        raise ValueError(f"{path}: slice_centres_mm / fov_centre_mm do not match {n_slices} slices")
    return ScanInput(group.header_xml, group.kspace, clean, seq, centres, (fov[0], fov[1]))


# ------------------------------------------------------------------------------------ decisions


class _DecisionBoard:
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


class _ZmqPump:
    """Reads the ZeroMQ side channel on its own thread into a :class:`_DecisionBoard`."""

    def __init__(self, address: str, board: _DecisionBoard, errors: list[str]) -> None:
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


class _GadgetLink:
    """One MRD connection to the gadget: sends from the caller, a reader thread for replies."""

    def __init__(
        self, sock: socket.socket, mode: str, board: _DecisionBoard, errors: list[str]
    ) -> None:
        from masc_gadget.mrd.protocol import MrdStream

        self.sock = sock
        self.stream = MrdStream(sock)
        self.mode = mode
        self.board = board
        self.errors = errors
        self.images: list[ismrmrd.Image] = []
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
        cls, scfg: ScannerConfig, board: _DecisionBoard, errors: list[str]
    ) -> _GadgetLink:
        host, port = scfg.host_port
        try:
            sock = socket.create_connection((host, port), timeout=scfg.connect_timeout_s)
        except OSError as err:
            raise ConnectionError(
                f"cannot connect to gadget at {host}:{port}: {err} (is masc serve running?)"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # the reader blocks; it is woken by shutdown() at the end
        try:  # a gadget that stops reading must not block a send forever
            seconds = float(scfg.close_timeout_s)
            timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        except (OSError, struct.error):
            log.debug("could not set SO_SNDTIMEO on the gadget socket")
        link = cls(sock, scfg.feedback, board, errors)
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
                elif mid == protocol.ID_IMAGE:
                    self.images.append(payload)
                elif mid in (protocol.ID_TEXT, protocol.ID_ERROR):
                    text = str(payload).strip("\x00").strip()
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

    def handshake(self, config_name: str, header_xml: str, params: dict[str, Any]) -> bool:
        return (
            self._send("config name", lambda: self.stream.send_config_file(config_name))
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


# ------------------------------------------------------------------------------------- scanning


@dataclass
class _SliceState:
    """Scanner-side bookkeeping of one slice during the scan."""

    report: SliceReport
    mask: np.ndarray
    initial: list[int]
    last_sent: float = 0.0

    @property
    def count(self) -> int:
        return len(self.report.lines)


def _ticks_since_midnight() -> int:
    now = datetime.now()
    seconds = now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6
    return int(seconds * 1000 / mrd.TIMESTAMP_TICK_MS)


def _schedule(
    n_slices: int, initial: int, budget: int, interleave: bool
) -> list[tuple[int, bool]]:
    """(slice, is_initial) per acquired line, in acquisition order."""
    if not interleave:
        return [
            (s, k < initial) for s in range(n_slices) for k in range(initial + budget)
        ]
    order = [(s, True) for s in range(n_slices) for _ in range(initial)]
    order += [(s, False) for _ in range(budget) for s in range(n_slices)]
    return order


def _image_array(image: ismrmrd.Image, shape: tuple[int, int]) -> np.ndarray:
    """A returned image as a (y, x) float32 magnitude matching ``shape``."""
    data = np.abs(np.asarray(image.data)).astype(np.float32)
    data = data.reshape([d for d in data.shape if d != 1] or [1])
    if data.shape == shape:
        return data
    if data.ndim == 2 and data.shape[::-1] == shape:
        return np.ascontiguousarray(data.T)
    raise ValueError(f"returned image of shape {data.shape} does not match the slice {shape}")


def _image_lines(image: ismrmrd.Image) -> list[int] | None:
    """The acquired lines a returned image lists in its meta attribute ``MASC.lines``."""
    try:
        value = image.meta.get("MASC.lines")
    except (ValueError, SyntaxError, AttributeError):  # unreadable attributes: not ours to judge
        return None
    if value is None:
        return None
    values = [value] if isinstance(value, str) else list(value)
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


def _scores(preds: np.ndarray, targets: np.ndarray) -> dict[str, list[float]]:
    """Per-slice metrics of (S, y, x) images against (S, y, x) clean targets."""
    values = slice_metrics(torch.from_numpy(preds), torch.from_numpy(targets))
    return {k: [float(x) for x in v] for k, v in values.items()}


def gadget_parameters(
    scfg: ScannerConfig, acq: AcquisitionConfig, pump: _ZmqPump | None = None
) -> dict[str, Any]:
    """The JSON parameters (text message, id 5) sent after the header.

    ``feedback`` is the in-band switch of the gadget: "inband" only in in-band mode. With the
    side channel it is "none" and ``zmq_address`` is the endpoint the scanner bound (otherwise
    "", so that the gadget pushes to no one).
    """
    return {
        "feedback": "inband" if scfg.feedback == "inband" else "none",
        "zmq_address": pump.endpoint if pump is not None else "",
        "initial": acq.initial,
        "budget": acq.budget,
        "policy": acq.policy,
    }


def scan_subject(
    path: str | os.PathLike,
    subject_id: str,
    scfg: ScannerConfig,
    acq: AcquisitionConfig,
    *,
    images_path: str | os.PathLike | None = None,
    require_gadget: bool = True,
    on_slice_done: Callable[[int], None] | None = None,
) -> SubjectReport:
    """Scan one subject file against the gadget of ``scfg`` (see the module docstring).

    images_path: ISMRMRD file to append this subject's images to (group ``subject_id``);
    require_gadget: raise ConnectionError when the gadget cannot be reached (else scan on the
    fallback order and record ``connection = "unreachable"``); on_slice_done(slice) is called
    when a slice has all its lines (progress bars).
    """
    started = time.perf_counter()
    data = load_scan_input(path)
    n_total_slices, n_pe, _ = data.kspace.shape
    acq.check(n_pe)
    n_slices = min(n_total_slices, scfg.max_slices or n_total_slices)
    fallback: SamplingPolicy = make_policy(scfg.fallback)
    report = SubjectReport(str(subject_id), str(path), n_slices, int(n_pe))
    errors = report.gadget_errors
    board = _DecisionBoard()
    init = [int(k) for k in initial_lines(n_pe, acq.initial)]
    states = [
        _SliceState(SliceReport(s), np.zeros(n_pe, dtype=bool), list(init)) for s in range(n_slices)
    ]
    schedule = _schedule(n_slices, acq.initial, acq.budget, scfg.interleave)
    acquired = np.zeros_like(data.kspace[:n_slices])
    period_ticks = (
        mrd.line_period_ms(data.seq, "interleaved" if scfg.interleave else "sequential")
        / mrd.TIMESTAMP_TICK_MS
    )
    deadline_s = scfg.deadline_ms / 1e3

    pump: _ZmqPump | None = None
    link: _GadgetLink | None = None
    try:
        if scfg.feedback == "zmq":
            pump = _ZmqPump(scfg.zmq_address, board, errors)
        try:
            link = _GadgetLink.connect(scfg, board, errors)
        except ConnectionError as err:
            if require_gadget:
                raise
            log.warning("%s: %s; scanning on the fallback order", subject_id, err)
            report.connection = "unreachable"
            report.connection_error = str(err)
            board.close()
        if link is not None:
            link.handshake(scfg.config_name, data.header_xml, gadget_parameters(scfg, acq, pump))

        start_ticks = _ticks_since_midnight()
        timestamp = -1
        for counter, (s, is_initial) in enumerate(schedule):
            st = states[s]
            rep = st.report
            connected = link is not None and link.alive
            if link is not None and not connected and report.connection_lost_at is None:
                report.connection_lost_at = counter
            if is_initial:
                line, source = st.initial[st.count], SOURCE_INITIAL
            else:
                line, source = _next_line(st, s, acq, scfg, fallback, board, connected, deadline_s)
                if link is not None and not link.alive and rep.fallback_reasons[-1] == REASON_MISS:
                    # the wait ended because the connection died, not the deadline
                    rep.fallback_reasons[-1] = REASON_DISCONNECTED
                    rep.misses -= 1
                    if report.connection_lost_at is None:
                        report.connection_lost_at = counter
            flags = 0
            if st.count == 0:
                flags |= _F_FIRST_IN_SLICE
            if st.count == acq.total - 1:
                flags |= _F_LAST_IN_SLICE
            if counter == len(schedule) - 1:
                flags |= _F_LAST_IN_MEASUREMENT
            timestamp = max(start_ticks + round(counter * period_ticks), timestamp + 1)
            acquisition = mrd.make_acquisition(
                data.kspace[s, line],
                line=line,
                slice_index=s,
                seq=data.seq,
                slice_centre_mm=data.slice_centres_mm[s],
                fov_centre_mm=data.fov_centre_mm,
                scan_counter=counter,
                timestamp=timestamp % 2**32,
                flags=flags,
                n_slices=n_total_slices,
            )
            st.last_sent = time.perf_counter()
            if link is not None:
                link.send_acquisition(acquisition)
            acquired[s, line] = data.kspace[s, line]
            st.mask[line] = True
            rep.lines.append(int(line))
            rep.sources.append(source)
            if st.count == acq.total and on_slice_done is not None:
                on_slice_done(s)

        if link is not None:
            link.finish(scfg.close_timeout_s)
            report.server_closed = link.server_closed
            if link.lost_reason:
                report.connection = "lost"
                report.connection_error = link.lost_reason
                if report.connection_lost_at is None:
                    report.connection_lost_at = len(schedule)
    finally:
        if link is not None:
            link.shutdown()
        if pump is not None:
            pump.close()

    images = link.images if link is not None else []
    report.images_returned = len(images)
    report.late_decisions = len(board.late_latencies_ms)
    report.late_latencies_ms = [float(v) for v in board.late_latencies_ms]
    by_slice = _images_by_slice(images, n_slices, errors)
    zf = zero_filled(torch.from_numpy(acquired), torch.from_numpy(np.stack([st.mask for st in states])))
    zf_images = zf.numpy().astype(np.float32)
    shape = tuple(data.clean.shape[1:])
    targets = data.clean[:n_slices]
    preds = zf_images.copy()
    zero_filled_written: dict[int, np.ndarray] = {}
    for st in states:
        s = st.report.slice
        image = by_slice.get(s)
        if image is not None:
            st.report.image_lines = _image_lines(image)
            if st.report.image_lines is not None and sorted(st.report.image_lines) != sorted(
                st.report.lines
            ):
                errors.append(
                    f"slice {s}: the gadget's image lists lines {st.report.image_lines}, the "
                    f"scanner acquired {st.report.lines}"
                )
            try:
                preds[s] = _image_array(image, shape)
                st.report.image_source = IMAGE_FROM_GADGET
                continue
            except ValueError as err:
                errors.append(f"slice {s}: {err}")
        st.report.image_source = IMAGE_ZERO_FILLED
        zero_filled_written[s] = zf_images[s]
    zf_scores = _scores(zf_images, targets)
    scores = _scores(preds, targets)
    for st in states:
        s = st.report.slice
        st.report.zero_filled_metrics = {k: v[s] for k, v in zf_scores.items()}
        st.report.metrics = {k: v[s] for k, v in scores.items()}
        report.slices.append(st.report)
    for rep in report.slices:
        report.lines += len(rep.lines)
        report.from_gadget += rep.from_gadget
        report.fallbacks += rep.fallbacks
        report.misses += rep.misses
        report.invalid += rep.invalid
    report.duration_s = time.perf_counter() - started

    if images_path is not None:
        _write_images(images_path, subject_id, data.header_xml, by_slice, zero_filled_written)
    _log_subject(report, scfg)
    return report


def _next_line(
    st: _SliceState,
    s: int,
    acq: AcquisitionConfig,
    scfg: ScannerConfig,
    fallback: SamplingPolicy,
    board: _DecisionBoard,
    connected: bool,
    deadline_s: float,
) -> tuple[int, str]:
    """The next chosen line of slice ``s``: the gadget's decision if valid and in time, else
    the fallback policy's; records the step in the slice report."""
    rep = st.report
    step = st.count - acq.initial
    latency = gadget_latency = None
    reason: str | None
    if scfg.feedback == "none":
        reason = REASON_OPEN_LOOP
    elif not connected:
        reason = REASON_DISCONNECTED
    else:
        got = board.wait((s, step), st.last_sent, st.last_sent + deadline_s)
        if got is None:
            reason = REASON_MISS
        else:
            decision, received = got
            latency = (received - st.last_sent) * 1e3
            gadget_latency = float(decision.latency_us) / 1e3
            line = int(decision.line)
            if 0 <= line < st.mask.size and not st.mask[line]:
                reason = None
            else:
                reason = REASON_INVALID
                log.debug("slice %d step %d: invalid decision line %d", s, step, line)
    rep.latencies_ms.append(latency)
    rep.gadget_latencies_ms.append(gadget_latency)
    rep.fallback_reasons.append(reason)
    if reason is None:
        rep.from_gadget += 1
        return line, SOURCE_GADGET
    rep.fallbacks += 1
    if reason == REASON_MISS:
        rep.misses += 1
    elif reason == REASON_INVALID:
        rep.invalid += 1
    state = AcquisitionState(
        mask=st.mask, steps_left=acq.budget - step, step=step, n_initial=acq.initial
    )
    return fallback.select(state), SOURCE_FALLBACK


def _images_by_slice(
    images: list[ismrmrd.Image], n_slices: int, errors: list[str]
) -> dict[int, ismrmrd.Image]:
    """The first returned image of each scanned slice."""
    out: dict[int, ismrmrd.Image] = {}
    for image in images:
        s = int(image.slice)
        if not 0 <= s < n_slices:
            errors.append(f"the gadget returned an image for slice {s}, outside 0..{n_slices - 1}")
        elif s in out:
            log.debug("ignoring a further image of slice %d", s)
        else:
            out[s] = image
    return out


def _write_images(
    path: str | os.PathLike,
    subject_id: str,
    header_xml: str,
    returned: dict[int, ismrmrd.Image],
    zero_filled_images: dict[int, np.ndarray],
) -> None:
    dset = ismrmrd.Dataset(str(path), subject_id, create_if_needed=True)
    try:
        dset.write_xml_header(header_xml)
        for s in sorted(returned):
            dset.append_image("images", returned[s])
        for s in sorted(zero_filled_images):
            image = ismrmrd.Image.from_array(zero_filled_images[s])
            image.slice = s
            image.image_index = s
            dset.append_image("scanner_zero_filled", image)
    finally:
        dset.close()


def _log_subject(report: SubjectReport, scfg: ScannerConfig) -> None:
    latencies = [v for r in report.slices for v in r.latencies_ms if v is not None]
    ssim = [r.metrics.get("ssim", float("nan")) for r in report.slices]
    from_gadget_images = sum(r.image_source == IMAGE_FROM_GADGET for r in report.slices)
    log.info(
        "%s: %d slices, %d lines, %d from gadget, %d fallbacks (%d misses, %d invalid), "
        "latency p50 %s ms, connection %s, %d/%d images from gadget, mean SSIM %.4f",
        report.subject,
        report.n_slices,
        report.lines,
        report.from_gadget,
        report.fallbacks,
        report.misses,
        report.invalid,
        f"{np.median(latencies):.2f}" if latencies else "-",
        report.connection,
        from_gadget_images,
        report.n_slices,
        float(np.mean(ssim)) if ssim else float("nan"),
    )


def _totals(subjects: list[SubjectReport]) -> ScanTotals:
    t = ScanTotals(subjects=len(subjects))
    latencies: list[float] = []
    gadget_latencies: list[float] = []
    metrics: dict[str, list[float]] = {k: [] for k in METRICS}
    for sub in subjects:
        t.slices += len(sub.slices)
        t.lines += sub.lines
        t.from_gadget += sub.from_gadget
        t.fallbacks += sub.fallbacks
        t.misses += sub.misses
        t.invalid += sub.invalid
        t.late_decisions += sub.late_decisions
        t.gadget_errors += len(sub.gadget_errors)
        t.connections_lost += sub.connection != "ok"
        latencies += sub.late_latencies_ms
        for rep in sub.slices:
            latencies += [v for v in rep.latencies_ms if v is not None]
            gadget_latencies += [
                g for v, g in zip(rep.latencies_ms, rep.gadget_latencies_ms)
                if v is not None and g is not None
            ]
            t.images_from_gadget += rep.image_source == IMAGE_FROM_GADGET
            t.images_zero_filled += rep.image_source == IMAGE_ZERO_FILLED
            for k in METRICS:
                if k in rep.metrics:
                    metrics[k].append(rep.metrics[k])
    t.latency_ms = LatencySummary.of(latencies)
    t.gadget_latency_ms = LatencySummary.of(gadget_latencies)
    t.metrics_mean = {k: float(np.mean(v)) for k, v in metrics.items() if v}
    t.metrics_std = {k: float(np.std(v)) for k, v in metrics.items() if v}
    return t


def run_scan(
    config: Config,
    data_dir: str | os.PathLike,
    split: str,
    out_dir: str | os.PathLike,
    *,
    scanner: ScannerConfig | None = None,
    progress: bool = True,
) -> ScanReport:
    """Scan every subject of ``split`` in dataset ``data_dir``; write ``out_dir/report.json``
    and ``out_dir/images.h5``.

    config: sections ``scanner`` (or pass ``scanner``) and ``acquisition``. The first subject
    raises ConnectionError when the gadget cannot be reached; later subjects are scanned on the
    fallback order and recorded as unreachable.
    """
    from tqdm.auto import tqdm

    if scanner is None:
        scanner = config.sections["scanner"] if "scanner" in config.sections else ScannerConfig()
    acq: AcquisitionConfig = config["acquisition"]
    manifest = read_manifest(data_dir)
    splits = manifest.get("splits", {})
    if split not in splits:
        raise ValueError(
            f"split {split!r} is not in {data_dir}; splits: {', '.join(sorted(splits))}"
        )
    subjects = list(splits[split])
    if scanner.max_subjects:
        subjects = subjects[: scanner.max_subjects]
    if not subjects:
        raise ValueError(f"split {split!r} of {data_dir} has no subjects")
    paths = [subject_path(data_dir, sid, manifest) for sid in subjects]
    n_slices = 0
    for p in paths:
        with h5py.File(p, "r") as f:
            n = int(f["kspace/metal"].shape[0]) if "kspace/metal" in f else 0
        n_slices += min(n, scanner.max_slices or n)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images_path = out / IMAGES_FILE
    if images_path.exists():
        log.info("replacing %s", images_path)
        images_path.unlink()
    report = ScanReport(
        data_dir=str(data_dir),
        split=split,
        scanner=to_dict(scanner),
        acquisition=to_dict(acq),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    log.info(
        "scanning %d subject(s) of %s/%s against %s (feedback %s, deadline %g ms, fallback %s%s)",
        len(subjects), data_dir, split, scanner.server, scanner.feedback, scanner.deadline_ms,
        scanner.fallback, ", interleaved" if scanner.interleave else "",
    )
    bar = tqdm(total=n_slices, unit="slice", desc="scan", disable=not progress)
    try:
        for i, (sid, p) in enumerate(zip(subjects, paths)):
            bar.set_postfix_str(sid)
            report.subjects.append(
                scan_subject(
                    p, sid, scanner, acq,
                    images_path=images_path,
                    require_gadget=i == 0,
                    on_slice_done=lambda _s: bar.update(),
                )
            )
    finally:
        bar.close()
    report.totals = _totals(report.subjects)
    tmp = out / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    os.replace(tmp, out / REPORT_FILE)
    log.info("report written to %s", out / REPORT_FILE)
    return report
