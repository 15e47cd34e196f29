"""Configuration of the simulated scanner client (config section ``scanner``) and the names
its reports use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from masc_gadget.acquisition.policies import make_policy
from sim_scanner.dataset.streams import ORDERS, StreamStyle

FEEDBACK_MODES = ("inband", "fire", "zmq", "none")
IMAGE_FROM_GADGET = "gadget"
IMAGE_ZERO_FILLED = "scanner zero-filled"
REPORT_FILE = "report.json"
IMAGES_FILE = "images.h5"
FIGURE_FILE = "scan.png"
"""The first subject's lines and images, drawn (:mod:`sim_scanner.scanner.figure`)."""

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
    feedback: Literal["inband", "fire", "zmq", "none"] = "inband"
    """How next-line decisions come back: in-band feedback acquisitions on the MRD connection,
    message 1028 "feedback" on the MRD connection (fire, masc serve), the ZeroMQ side channel (the scanner binds ``zmq_address``), or none (open loop: stream the
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
    pace: bool = False
    """Send each line at its time in the sequence, as a scanner plays it: line k of the scan at
    ``k x line period`` after the first (:func:`sim_scanner.dataset.mrd_hdf5.line_period_ms`: TR
    / echo train length, divided among the slices of a TR when interleaved). False: each line
    as soon as its decision (or the fallback) is there."""
    line_period_ms: float = 0.0
    """With ``pace``: the time between lines, ms; 0: the sequence's, from the subject's data."""
    zmq_address: str = "tcp://127.0.0.1:9003"
    """ZeroMQ PULL endpoint the scanner binds for ``feedback = "zmq"`` (``tcp://HOST:*`` picks
    a free port); sent to the gadget in the JSON parameters."""
    policy: str = ""
    """The sampling policy the scan asks the server for in its JSON parameters; "" (default):
    none, the server serves its operator's. A server applies it only where its operator allows
    (``server.client_overrides``), else it tells the scan (a ``MASC warning:`` text, in the
    report's ``gadget_warnings``) and serves its own."""
    config_name: str = "default"
    """Stream configuration name sent as config-by-name (message id 1), e.g. "default" or a
    policy name (masc serve), or the name of an XML in Gadgetron's config folder."""
    config_xml: str = ""
    """A stream configuration file (e.g. configs/gadgetron/masc_external.xml) sent as the
    configuration script (message id 2) instead of ``config_name``: Gadgetron runs it without
    it being installed in its config folder, and masc serve takes its gadget properties."""
    token: str = ""
    """Shared secret sent as ``{"token": ...}`` in the JSON parameters, for a ``masc serve``
    that requires one (``server.token``); "" = none."""
    connect_timeout_s: float = 5.0
    """Timeout of the TCP connection to the gadget, s."""
    close_timeout_s: float = 10.0
    """After its close message, how long the scanner waits for the remaining images and the
    gadget's close, s (also the send timeout on a gadget that stops reading)."""
    max_subjects: int = 0
    """Scan at most this many subjects of the split (0 = all)."""
    max_slices: int = 0
    """Scan at most this many slices per subject, the first ones (0 = all)."""
    readout_oversampling: int = 1
    """2: send every line sampled over twice the field of view, as scanners do (the header's
    encoded space says so; the gadget removes it). 1: as simulated."""
    coils: int = 0
    """Send the lines through a receive array of this many loops
    (the simulator's body array, :func:`sim_scanner.physics.coils.body_array`); 0: the dataset's own
    channels."""
    noise: float = 0.0
    """Receive-chain noise per sample, as a fraction of the subject's largest k-space magnitude."""
    noise_correlation: float = 0.0
    """Correlation of the noise of neighbouring channels, in [0, 1)."""
    noise_seed: int = 0
    """Seed of the noise (each subject draws from its own stream of it)."""
    asymmetric_echo: float = 0.0
    """Fraction of each readout's samples before the echo that are not sent, in [0, 0.5)."""
    order: str = ""
    """Open loop only (``feedback: none``): send each slice's planned lines (its initial lines and
    the fallback order's) in this order: linear, reverse, centric or interleaved
    (:func:`sim_scanner.dataset.streams.line_order`); "": the initial lines first, then the
    fallback order. In closed loop the gadget decides the order."""
    channel_mask: str = "set"
    """How lines carry their channel mask: set (a bit per channel), none, or first (channel 0's
    bit only, as some converters write)."""

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
        if isinstance(self.line_period_ms, bool) or not isinstance(self.line_period_ms, (int, float)) \
                or not (math.isfinite(self.line_period_ms) and self.line_period_ms >= 0):
            raise ValueError(f"line_period_ms must be a finite number >= 0 (0: the sequence's), "
                             f"got {self.line_period_ms!r}")
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
        if isinstance(self.noise_seed, bool) or not isinstance(self.noise_seed, int) or self.noise_seed < 0:
            raise ValueError(f"noise_seed must be an integer >= 0, got {self.noise_seed!r}")
        self.stream_style()  # ValueError naming a field out of range
        if self.order and self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)} or empty, got {self.order!r}")
        if self.order and self.feedback != "none":
            raise ValueError(f"order {self.order} is for open-loop scans (feedback none); with feedback "
                             f"{self.feedback} the gadget decides the order")
        policy = make_policy(self.fallback)
        if not policy.deterministic or policy.needs_image:
            raise ValueError(
                f"fallback must be a deterministic policy that needs no image (e.g. center-out, "
                f"equispaced), got {self.fallback!r}"
            )

    def stream_style(self, peak: float = 1.0) -> StreamStyle | None:
        """How lines are recorded (:class:`~sim_scanner.dataset.streams.StreamStyle`, the noise
        scaled by ``peak``, the k-space's largest magnitude); None when sent as simulated."""
        style = StreamStyle(readout_oversampling=self.readout_oversampling, coils=self.coils,
                            noise=self.noise * peak, noise_correlation=self.noise_correlation,
                            asymmetric_echo=self.asymmetric_echo, channel_mask=self.channel_mask)
        return None if style == StreamStyle() else style

    @property
    def host_port(self) -> tuple[str, int]:
        """``server`` as ``(host, port)``."""
        return parse_server(self.server)
