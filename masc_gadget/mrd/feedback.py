"""Next-line feedback: how a :class:`Decision` travels from the gadget to the scanner.

Two forms (DESIGN.md, "Next-line feedback"):

* **in-band**: a header-only ``ismrmrd.Acquisition`` (no samples) with flag ``ACQ_USER1``,
  ``idx.kspace_encode_step_1`` = the line to acquire next, ``idx.slice`` = its slice (other idx
  fields copied from an acquisition of that slice), ``user_int[0]`` = step index,
  ``user_int[1]`` = decision latency in microseconds. Channel counts are those of ISMRMRD's
  own empty acquisition (``ismrmrd_init_acquisition_header``: 0 samples, 1 active and
  1 available channel), so it has no payload and every MRD reader takes it.
* **message 1028** ("feedback", FIRE-style; opt-in with ``feedback = "fire"``, masc serve only):
  name ``"masc.next_lines"``, data little-endian ``uint32`` slice, step, latency_us, n_lines,
  then ``n_lines`` x ``uint32`` line (the lines to acquire next, in order; one today).
* **side channel**: ZeroMQ PUSH (gadget, connects) -> PULL (scanner, binds), one JSON object
  per decision: ``{"slice", "line", "step", "latency_us", "t"}`` (``t``: unix time of sending).
  Sending never blocks: a full queue or an absent scanner drops the decision and counts it.
  The gadget connects only to endpoints of the allow-list (:func:`endpoint_allowed`, config
  section ``feedback``, :class:`FeedbackConfig`): by default loopback TCP only
  (``tcp://127.0.0.1:*``, ``tcp://localhost:*``, ``tcp://[::1]:*``), never ``ipc://`` unless
  the operator lists it; anything else is refused before a socket is made.

Protocol code: ismrmrd, zmq and json, never torch.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import numbers
import struct
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ismrmrd
import zmq

from masc_gadget.acquisition.decision import Decision
from masc_gadget.mrd.frames import Feedback

__all__ = [
    "DEFAULT_ZMQ_ALLOW",
    "FEEDBACK_FLAG",
    "Decision",
    "FeedbackConfig",
    "ZmqFeedback",
    "ZmqFeedbackReceiver",
    "decision_from_acquisition",
    "decision_from_json",
    "tcp_port",
    "check_endpoint",
    "decision_json",
    "endpoint_allowed",
    "feedback_acquisition",
    "is_feedback",
]

log = logging.getLogger(__name__)

FEEDBACK_FLAG = ismrmrd.ACQ_USER1
"""ISMRMRD flag number (1-based) that marks a next-line feedback acquisition."""

FIELDS = ("slice", "line", "step", "latency_us")
"""The integer fields of a decision, in JSON and in :class:`Decision`."""

_UINT16_MAX = 2**16 - 1
_INT32_MAX = 2**31 - 1


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"decision {name} must be an integer, got {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"decision {name} must be in [{low}, {high}], got {value}")
    return value


def feedback_acquisition(
    decision: Decision, template: ismrmrd.AcquisitionHeader | ismrmrd.Acquisition | None = None
) -> ismrmrd.Acquisition:
    """The in-band form of ``decision``: a header-only acquisition (module docstring).

    ``template``: an acquisition (or its header) of the same slice, usually the line that
    triggered the decision; its measurement uid, time stamps, geometry (position, read / phase /
    slice directions, table position), encoding space and idx fields (contrast, repetition,
    set, phase, average, segment, ...) are copied. Its flags, sample counts, channel mask and
    user values are not: the result has only ``ACQ_USER1`` set and no samples.

    Raises ValueError when the line or slice does not fit the uint16 idx fields or the step
    is negative; a latency above int32 is clamped.
    """
    line = _check_int("line", decision.line, 0, _UINT16_MAX)
    slice_ = _check_int("slice", decision.slice, 0, _UINT16_MAX)
    step = _check_int("step", decision.step, 0, _INT32_MAX)
    latency = _check_int("latency_us", decision.latency_us, 0, 2**63 - 1)
    if template is None:
        head = ismrmrd.AcquisitionHeader()
        head.version = 1
    else:
        if isinstance(template, ismrmrd.Acquisition):
            template = template.getHead()
        if not isinstance(template, ismrmrd.AcquisitionHeader):
            raise TypeError(
                "template must be an ismrmrd.Acquisition or AcquisitionHeader, got "
                f"{type(template).__name__}"
            )
        head = ismrmrd.AcquisitionHeader.from_buffer_copy(template)
        # what describes samples, and the template's own flags and user values, is not copied
        head.discard_pre = head.discard_post = head.center_sample = 0
        for array in (head.channel_mask, head.user_int, head.user_float):
            for i in range(len(array)):
                array[i] = 0
    head.number_of_samples = 0
    head.trajectory_dimensions = 0
    head.active_channels = 1
    head.available_channels = 1
    head.flags = 0
    head.idx.kspace_encode_step_1 = line
    head.idx.slice = slice_
    head.user_int[0] = step
    head.user_int[1] = min(latency, _INT32_MAX)
    acq = ismrmrd.Acquisition(head)
    acq.set_flag(FEEDBACK_FLAG)
    return acq


def is_feedback(acq: ismrmrd.Acquisition | ismrmrd.AcquisitionHeader) -> bool:
    """Whether ``acq`` is next-line feedback: ``ACQ_USER1`` set and no samples."""
    return bool(acq.is_flag_set(FEEDBACK_FLAG)) and int(acq.number_of_samples) == 0


def decision_from_acquisition(acq: ismrmrd.Acquisition | ismrmrd.AcquisitionHeader) -> Decision:
    """The :class:`Decision` an in-band feedback acquisition carries (inverse of
    :func:`feedback_acquisition`). ValueError if ``acq`` is not feedback."""
    if not is_feedback(acq):
        raise ValueError(
            "not a next-line feedback acquisition (needs flag ACQ_USER1 and 0 samples), got "
            f"flags {int(acq.flags):#x} and {int(acq.number_of_samples)} samples"
        )
    return Decision(
        slice=int(acq.idx.slice),
        line=int(acq.idx.kspace_encode_step_1),
        step=int(acq.user_int[0]),
        latency_us=int(acq.user_int[1]),
    )


FIRE_NAME = "masc.next_lines"
"""The name of MASC's 1028 feedback messages."""
_FIRE_HEAD = struct.Struct("<IIII")  # slice, step, latency_us, n_lines
_LINE = struct.Struct("<I")


def fire_feedback(decision: Decision) -> Feedback:
    """The 1028 message of a decision (module docstring)."""
    return Feedback(FIRE_NAME, _FIRE_HEAD.pack(int(decision.slice), int(decision.step),
                                               int(decision.latency_us), 1) + _LINE.pack(int(decision.line)))


def decision_from_fire(feedback: Feedback) -> Decision:
    """The decision a 1028 message carries (inverse of :func:`fire_feedback`). ValueError for
    another name, a short or inconsistent body, or a message with no line."""
    if feedback.name != FIRE_NAME:
        raise ValueError(f"feedback message {feedback.name[:40]!r} is not {FIRE_NAME!r}")
    data = feedback.data
    if len(data) < _FIRE_HEAD.size:
        raise ValueError(f"{FIRE_NAME}: {len(data)} bytes, shorter than its {_FIRE_HEAD.size}-byte head")
    slice_index, step, latency_us, n_lines = _FIRE_HEAD.unpack_from(data)
    if n_lines < 1 or len(data) != _FIRE_HEAD.size + n_lines * _LINE.size:
        raise ValueError(f"{FIRE_NAME}: {len(data)} bytes do not hold {n_lines} line(s) (at least one)")
    line = _LINE.unpack_from(data, _FIRE_HEAD.size)[0]
    return Decision(slice=slice_index, line=line, step=step, latency_us=latency_us)


def decision_json(decision: Decision) -> str:
    """One JSON object: ``{"slice", "line", "step", "latency_us", "t"}`` (``t``: unix time, s)."""
    payload = {name: int(getattr(decision, name)) for name in FIELDS}
    payload["t"] = time.time()
    return json.dumps(payload, separators=(",", ":"))


def decision_from_json(text: str | bytes) -> Decision:
    """The decision of a :func:`decision_json` object (extra keys such as ``t`` are ignored).

    Raises ValueError for text that is not a JSON object, or that lacks a field or holds a
    non-integer one (naming the field).
    """
    try:
        payload = json.loads(text)
    except (TypeError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"decision is not valid JSON: {err}") from None
    if not isinstance(payload, dict):
        raise ValueError(f"decision must be a JSON object, got {type(payload).__name__}")
    values = {}
    for name in FIELDS:
        if name not in payload:
            raise ValueError(
                f"decision JSON has no {name!r} field (needs {', '.join(FIELDS)}), got keys "
                f"{sorted(payload)}"
            )
        value = payload[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"decision JSON field {name!r} must be an integer, got {value!r}")
        values[name] = value
    return Decision(**values)


DEFAULT_ZMQ_ALLOW: tuple[str, ...] = ("tcp://127.0.0.1:*", "tcp://localhost:*", "tcp://[::1]:*")
"""Endpoints the gadget may connect its feedback socket to unless the operator says otherwise."""

_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5}|\*)")
_MAX_SHOWN = 80


def _parse_tcp(endpoint: str, pattern: bool) -> tuple[str, str] | None:
    """(host lower-cased, port) of ``tcp://HOST:PORT`` (a pattern may have port ``*``), else
    None. Nothing else is accepted: no interface or source-address forms (``tcp://a;b``)."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        return None
    port = match["port"]
    if port == "*":
        return (match["host"].lower(), port) if pattern else None
    return (match["host"].lower(), port) if 1 <= int(port) <= 65535 else None


def tcp_port(address: str) -> int | None:
    """The port of a ``tcp://HOST:PORT`` endpoint, else None."""
    parsed = _parse_tcp(address, pattern=False) if isinstance(address, str) else None
    return None if parsed is None else int(parsed[1])


def _check_pattern(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"a ZeroMQ allow-list entry must be a non-empty string, got {pattern!r}")
    if pattern.startswith("tcp://") and _parse_tcp(pattern, pattern=True) is None:
        raise ValueError(f"ZeroMQ allow-list entry {pattern!r} must look like tcp://HOST:PORT or "
                         "tcp://HOST:* (HOST a name, an IPv4 address or [IPv6])")
    if "://" not in pattern:
        raise ValueError(f"ZeroMQ allow-list entry {pattern!r} must be an endpoint like tcp://HOST:PORT")
    return pattern


@dataclass(frozen=True)
class FeedbackConfig:
    """The ZeroMQ side channel's allow-list (config section ``feedback``)."""

    zmq_allow: tuple[str, ...] = DEFAULT_ZMQ_ALLOW
    """Endpoints a connection may ask the gadget to connect to (``zmq_address``):
    ``tcp://HOST:PORT`` or ``tcp://HOST:*`` (any port of that host, matched literally),
    ``ipc://PATH`` where PATH may end in ``*`` (e.g. ``ipc:///run/masc/*``), or an exact
    endpoint. Default: loopback TCP only. The ``zmq_address`` of the server's own config is
    allowed as well."""

    def __post_init__(self) -> None:
        if not isinstance(self.zmq_allow, (tuple, list)):
            raise ValueError("zmq_allow must be a list of endpoints")
        object.__setattr__(self, "zmq_allow", tuple(_check_pattern(p) for p in self.zmq_allow))


def endpoint_allowed(address: str, patterns: Sequence[str] | None = None) -> bool:
    """Whether ``address`` matches an entry of ``patterns`` (default :data:`DEFAULT_ZMQ_ALLOW`,
    loopback; a server passes its host's ``feedback.zmq_allow``):
    an exact entry; ``tcp://HOST:PORT`` against ``tcp://HOST:PORT|*`` (host literal, no DNS);
    ``ipc://PATH`` (no ``..``) against ``ipc://`` entries ending in ``*``."""
    patterns = DEFAULT_ZMQ_ALLOW if patterns is None else patterns
    if not isinstance(address, str) or "*" in address:
        return False
    if address in patterns:
        return True
    tcp = _parse_tcp(address, pattern=False)
    for pattern in patterns:
        if tcp is not None and pattern.startswith("tcp://"):
            want = _parse_tcp(pattern, pattern=True)
            if want is not None and want[0] == tcp[0] and want[1] in ("*", tcp[1]):
                return True
        elif (address.startswith("ipc://") and pattern.startswith("ipc://") and pattern.endswith("*")
              and ".." not in address and fnmatch.fnmatchcase(address, pattern)):
            return True
    return False


def check_endpoint(address: str, patterns: Sequence[str] | None = None) -> str:
    """``address`` if :func:`endpoint_allowed`, else ValueError stating the rule and the
    allow-list (the address shown at most 80 characters)."""
    if endpoint_allowed(address, patterns):
        return address
    shown = repr(address) if len(repr(address)) <= _MAX_SHOWN else repr(address)[: _MAX_SHOWN - 3] + "..."
    allowed = ", ".join(DEFAULT_ZMQ_ALLOW if patterns is None else patterns) or "none"
    raise ValueError(f"zmq_address {shown} is not allowed: the gadget connects its feedback socket only "
                     f"to endpoints the server allows (feedback.zmq_allow): {allowed}")


class ZmqFeedback:
    """Gadget side of the side channel: a PUSH socket connected to the scanner's PULL socket.

    ``send`` never blocks (``zmq.NOBLOCK``): when the queue (``hwm`` messages) is full, e.g.
    because no scanner is listening, the decision is dropped and counted in ``dropped``.
    ZeroMQ reconnects by itself, so a scanner that binds later gets the decisions sent from
    then on (and those still queued). ``context``: None uses the process-wide
    ``zmq.Context.instance()`` (not terminated by :meth:`close`). ``allowed``: the endpoints
    it may connect to (default :data:`DEFAULT_ZMQ_ALLOW`); any other address is a ValueError
    before a socket is made.
    """

    def __init__(self, address: str, context: zmq.Context | None = None, hwm: int = 1000,
                 allowed: Sequence[str] | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            shown = repr(address)[:_MAX_SHOWN]
            raise ValueError(f"feedback address must be a ZeroMQ endpoint like tcp://host:port, got {shown}")
        check_endpoint(address, allowed)
        if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 1:
            raise ValueError(f"hwm must be an integer >= 1 (messages queued), got {hwm!r}")
        self.address = address
        self.sent = 0
        """Decisions handed to ZeroMQ."""
        self.dropped = 0
        """Decisions dropped (queue full, no peer, or socket closed)."""
        ctx = context if context is not None else zmq.Context.instance()
        self._socket: zmq.Socket | None = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        if address.startswith("tcp://["):
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as err:
            self._socket.close(linger=0)
            self._socket = None
            raise ValueError(f"cannot connect the feedback socket to {address[:_MAX_SHOWN]!r}: {err}") from None

    def send(self, decision: Decision) -> bool:
        """Queue ``decision`` as JSON without blocking; False (and ``dropped`` + 1) if it
        cannot be queued now."""
        if self._socket is None:
            self.dropped += 1
            return False
        try:
            self._socket.send_string(decision_json(decision), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("feedback to %s: %d decision(s) dropped (no receiver or queue full)",
                            self.address, self.dropped)
            return False
        except zmq.ZMQError as err:  # never let the side channel stop the gadget
            self.dropped += 1
            log.warning("feedback to %s: decision dropped: %s", self.address, err)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Close the socket (queued decisions are discarded: linger 0). Idempotent."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def __enter__(self) -> ZmqFeedback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZmqFeedbackReceiver:
    """Scanner side of the side channel: a bound PULL socket.

    ``address`` may use a wildcard port (``tcp://127.0.0.1:*``); :attr:`endpoint` is the
    endpoint actually bound, to hand to the gadget.
    """

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"feedback address must be a ZeroMQ endpoint like tcp://host:port, got {address!r}")
        ctx = context if context is not None else zmq.Context.instance()
        self._socket: zmq.Socket | None = ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as err:
            self._socket.close(linger=0)
            self._socket = None
            raise ValueError(f"cannot bind the feedback socket to {address!r}: {err}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound endpoint, e.g. tcp://127.0.0.1:40123."""

    def receive(self, timeout_ms: int) -> Decision | None:
        """The next decision, waiting at most ``timeout_ms`` (0: only what has arrived);
        None if none came. ValueError for a message that is not a decision."""
        if self._socket is None:
            raise ValueError("feedback receiver is closed")
        if not self._socket.poll(max(int(timeout_ms), 0), zmq.POLLIN):
            return None
        return decision_from_json(self._socket.recv(flags=zmq.NOBLOCK))

    def close(self) -> None:
        """Close the socket. Idempotent."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def __enter__(self) -> ZmqFeedbackReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
