"""The MRD (ISMRMRD v1) stream protocol: message ids, framing, and a thread-safe socket stream.

One module owns the wire format (house style rule 5). Everything is little-endian and every
message starts with a ``uint16`` id:

==========  ================  ======================================================
id          name              payload
==========  ================  ======================================================
1           config file       1024 bytes, the file name NUL padded
2           config text       ``uint32`` length + text (Gadgetron's XML config script)
3           header            ``uint32`` length + ISMRMRD XML header
4           close             nothing
5           text              ``uint32`` length + text (e.g. JSON parameters)
8           error             ``uint64`` length + text (Gadgetron's error message)
1008        acquisition       AcquisitionHeader (340 bytes), trajectory float32
                              [samples, dims], data complex64 [channels, samples]
1022        image             ImageHeader (198 bytes), ``uint64`` attribute length,
                              attribute XML (ismrmrd Meta), data [c, z, y, x]
1026        waveform          WaveformHeader (40 bytes), data uint32 [channels, samples]
==========  ================  ======================================================

Reading is defensive: every length is checked against :class:`Limits` before the body is read
or allocated. Only framing is checked here; what the data mean is for the engine to judge.

One deliberate departure from the reference Python packages, towards the MRD spec and the C++
implementations (Gadgetron, ``gadgetron_ismrmrd_client``): ``DATATYPE_INT`` images travel as
int32 (ISMRMRD's ``ISMRMRD_INT``). The ismrmrd Python package maps that type to numpy's platform
``int`` (int64 on Linux) and would write 8 bytes per pixel. On reading, the pixels are widened to
the int64 array that the ismrmrd Python ``Image`` holds.

:func:`frame_image` (like ``Image.serialize_into``) sets the image's ``attribute_string_len`` to
the UTF-8 length of its attribute string, so that a sent image equals the one read back.
"""

from __future__ import annotations

import ctypes
import io
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import ismrmrd
import numpy as np

from masc_gadget.mrd import tcp

__all__ = [
    "ID_CONFIG_FILE", "ID_CONFIG_TEXT", "ID_HEADER", "ID_CLOSE", "ID_TEXT", "ID_ERROR",
    "ID_ACQUISITION", "ID_IMAGE", "ID_WAVEFORM", "MESSAGE_NAMES", "CONFIG_FILE_BYTES", "Limits",
    "ProtocolError", "ConnectionClosed", "ReadTimeout", "Message", "MrdStream", "frame_config_file",
    "frame_config_text", "frame_header", "frame_text", "frame_error", "frame_close",
    "frame_acquisition", "frame_image", "frame_waveform", "frame_message", "decode_text",
]

# --------------------------------------------------------------------------------------------
# Message ids and formats

ID_CONFIG_FILE = 1
ID_CONFIG_TEXT = 2
ID_HEADER = 3
ID_CLOSE = 4
ID_TEXT = 5
ID_ERROR = 8
ID_ACQUISITION = 1008
ID_IMAGE = 1022
ID_WAVEFORM = 1026

MESSAGE_NAMES: dict[int, str] = {
    ID_CONFIG_FILE: "config file",
    ID_CONFIG_TEXT: "config text",
    ID_HEADER: "header",
    ID_CLOSE: "close",
    ID_TEXT: "text",
    ID_ERROR: "error",
    ID_ACQUISITION: "acquisition",
    ID_IMAGE: "image",
    ID_WAVEFORM: "waveform",
}
"""Human-readable name of every message id this module reads and writes."""

CONFIG_FILE_BYTES = 1024
"""Fixed size of the config file name field (id 1), NUL padded."""

_MESSAGE_ID = struct.Struct("<H")
_UINT32 = struct.Struct("<I")
_UINT64 = struct.Struct("<Q")

_TEXT_LENGTH = {  # length prefix of each text message
    ID_CONFIG_TEXT: _UINT32,
    ID_HEADER: _UINT32,
    ID_TEXT: _UINT32,
    ID_ERROR: _UINT64,
}

_ACQUISITION_HEADER_BYTES = ctypes.sizeof(ismrmrd.AcquisitionHeader)  # 340
_IMAGE_HEADER_BYTES = ctypes.sizeof(ismrmrd.ImageHeader)  # 198
_WAVEFORM_HEADER_BYTES = ctypes.sizeof(ismrmrd.WaveformHeader)  # 40

_TRAJECTORY_DTYPE = np.dtype("<f4")
_SAMPLE_DTYPE = np.dtype("<c8")
_WAVEFORM_DTYPE = np.dtype("<u4")

_IMAGE_WIRE_DTYPES: dict[int, np.dtype] = {  # ISMRMRD_DataTypes, as the C/C++ library defines them
    ismrmrd.DATATYPE_USHORT: np.dtype("<u2"),
    ismrmrd.DATATYPE_SHORT: np.dtype("<i2"),
    ismrmrd.DATATYPE_UINT: np.dtype("<u4"),
    ismrmrd.DATATYPE_INT: np.dtype("<i4"),
    ismrmrd.DATATYPE_FLOAT: np.dtype("<f4"),
    ismrmrd.DATATYPE_DOUBLE: np.dtype("<f8"),
    ismrmrd.DATATYPE_CXFLOAT: np.dtype("<c8"),
    ismrmrd.DATATYPE_CXDOUBLE: np.dtype("<c16"),
}


# --------------------------------------------------------------------------------------------
# Records and errors


@dataclass(frozen=True)
class Limits:
    """Hard limits on what a peer may send, so that a hostile length cannot allocate unboundedly."""

    max_text_bytes: int = 8 * 2**20
    """Config script, header, text, error payloads and image attribute strings, in bytes."""
    max_samples: int = 16384
    """Samples per readout (acquisition ``number_of_samples``)."""
    max_channels: int = 128
    """Receive channels per acquisition (``active_channels``)."""
    max_trajectory_dimensions: int = 3
    """Trajectory dimensions per sample (``trajectory_dimensions``)."""
    max_image_bytes: int = 256 * 2**20
    """Image pixel data, in bytes (channels x matrix size x element size)."""
    max_waveform_samples: int = 2**20
    """Waveform samples over all channels (``number_of_samples`` x ``channels``)."""


class ProtocolError(ValueError):
    """Malformed input on the wire; the message names the message, the field, value and limit."""


class ConnectionClosed(EOFError):
    """The peer closed the connection.

    ``clean`` is True when it closed at a message boundary, False when a frame was cut short.
    """

    def __init__(self, message: str, clean: bool):
        super().__init__(message)
        self.clean = clean


class ReadTimeout(TimeoutError):
    """A deadline of :meth:`MrdStream.read_message` passed (a ``socket.timeout`` too);
    ``started``: part of the message had arrived (the stream is then out of step)."""

    def __init__(self, message: str, started: bool):
        super().__init__(message)
        self.started = started


class Message(NamedTuple):
    """One message read from the stream.

    ``payload`` is a ``str`` for config file / config text / header / text / error, ``None`` for
    close, and an ``ismrmrd.Acquisition``, ``ismrmrd.Image`` or ``ismrmrd.Waveform``.
    """

    id: int
    payload: object

    @property
    def name(self) -> str:
        """The message's name (``MESSAGE_NAMES``)."""
        return MESSAGE_NAMES.get(self.id, f"message {self.id}")


def decode_text(raw: bytes | bytearray | memoryview, what: str) -> str:
    """UTF-8 text from the wire, without the trailing NULs that real clients send.

    Raises ProtocolError naming ``what`` when the bytes are not valid UTF-8.
    """
    data = bytes(raw).rstrip(b"\x00")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ProtocolError(
            f"{what}: invalid UTF-8 at byte {error.start} of {len(data)}"
        ) from None


# --------------------------------------------------------------------------------------------
# Framing (pure functions: object -> the bytes of one whole message)


def _encode(text: str | bytes, what: str) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise TypeError(f"{what} must be str or bytes, got {type(text).__name__}")


def frame_config_file(name: str) -> bytes:
    """Id 1: the config file name in a 1024-byte field, NUL padded (at most 1023 bytes)."""
    data = _encode(name, "config file name")
    if len(data) >= CONFIG_FILE_BYTES:
        raise ProtocolError(
            f"config file: name is {len(data)} bytes, exceeds the limit {CONFIG_FILE_BYTES - 1}"
        )
    if b"\x00" in data:
        raise ProtocolError("config file: name contains a NUL byte")
    return _MESSAGE_ID.pack(ID_CONFIG_FILE) + data.ljust(CONFIG_FILE_BYTES, b"\x00")


def _frame_text(message_id: int, text: str | bytes, nul_terminate: bool) -> bytes:
    data = _encode(text, MESSAGE_NAMES[message_id])
    if nul_terminate:
        data += b"\x00"
    return _MESSAGE_ID.pack(message_id) + _TEXT_LENGTH[message_id].pack(len(data)) + data


def frame_config_text(text: str | bytes, nul_terminate: bool = False) -> bytes:
    """Id 2: a config script (uint32 length + UTF-8), optionally NUL terminated."""
    return _frame_text(ID_CONFIG_TEXT, text, nul_terminate)


def frame_header(xml: str | bytes, nul_terminate: bool = False) -> bytes:
    """Id 3: the ISMRMRD XML header (uint32 length + UTF-8), optionally NUL terminated.

    Leave ``nul_terminate`` off for Gadgetron's Python client: its XML parser rejects the NUL.
    """
    return _frame_text(ID_HEADER, xml, nul_terminate)


def frame_text(text: str | bytes, nul_terminate: bool = False) -> bytes:
    """Id 5: free text, e.g. JSON parameters (uint32 length + UTF-8)."""
    return _frame_text(ID_TEXT, text, nul_terminate)


def frame_error(text: str | bytes) -> bytes:
    """Id 8: an error message (uint64 length + UTF-8), as Gadgetron sends them."""
    return _frame_text(ID_ERROR, text, False)


def frame_close() -> bytes:
    """Id 4: end of stream."""
    return _MESSAGE_ID.pack(ID_CLOSE)


def _serialize(obj) -> bytes:
    buffer = io.BytesIO()
    obj.serialize_into(buffer.write)
    return buffer.getvalue()


def frame_acquisition(acq: ismrmrd.Acquisition) -> bytes:
    """Id 1008: header, trajectory float32 [samples, dims], data complex64 [channels, samples].

    Byte-identical to ``gadgetron.external.writers.write_acquisition``. Raises ProtocolError when
    the arrays do not match the header (e.g. complex128 data), which would desynchronise the peer.
    """
    body = _serialize(acq)
    samples, channels, dims = acq.number_of_samples, acq.active_channels, acq.trajectory_dimensions
    expected = (
        _ACQUISITION_HEADER_BYTES
        + samples * dims * _TRAJECTORY_DTYPE.itemsize
        + samples * channels * _SAMPLE_DTYPE.itemsize
    )
    dtypes_ok = acq.data.dtype == _SAMPLE_DTYPE and acq.traj.dtype == _TRAJECTORY_DTYPE
    if len(body) != expected or not dtypes_ok:
        raise ProtocolError(
            f"acquisition: serialises to {len(body)} bytes but the header "
            f"({samples} samples, {channels} channels, {dims} trajectory dimensions) implies "
            f"{expected}; data must be complex64 {(channels, samples)} (is {acq.data.dtype} "
            f"{acq.data.shape}), trajectory float32 {(samples, dims)} (is {acq.traj.dtype} "
            f"{acq.traj.shape})"
        )
    return _MESSAGE_ID.pack(ID_ACQUISITION) + body


def frame_image(image: ismrmrd.Image) -> bytes:
    """Id 1022: header, uint64 attribute length, attribute XML (ismrmrd Meta), data [c, z, y, x].

    Byte-identical to ``gadgetron.external.writers.write_image`` for every data type except
    ``DATATYPE_INT``, which goes as int32 (the MRD spec) rather than int64. Like
    ``Image.serialize_into``, it sets the image header's ``attribute_string_len``.
    """
    attributes = image.attribute_string.encode("utf-8")
    # As Image.serialize_into does: the header records the attribute length, so that an image
    # compares equal to the copy the peer reads back.
    image._head.attribute_string_len = len(attributes)
    header = image.getHead()
    wire_dtype = _IMAGE_WIRE_DTYPES.get(header.data_type)
    if wire_dtype is None:
        raise ProtocolError(f"image: data_type {header.data_type} is not an ISMRMRD data type")
    data = image.data
    channels = header.channels
    x, y, z = header.matrix_size
    if data.shape != (channels, z, y, x):
        raise ProtocolError(
            f"image: data shape {data.shape} does not match the header "
            f"(channels, z, y, x) = {(channels, z, y, x)}"
        )
    if header.data_type == ismrmrd.DATATYPE_INT:
        info = np.iinfo(np.int32)
        if data.size and (data.min() < info.min or data.max() > info.max):
            raise ProtocolError(
                "image: DATATYPE_INT pixels must fit int32 (the MRD wire type), "
                f"got values in [{data.min()}, {data.max()}]"
            )
    elif data.dtype != wire_dtype:
        raise ProtocolError(
            f"image: data is {data.dtype} but data_type {header.data_type} means {wire_dtype}"
        )
    pixels = np.ascontiguousarray(data, dtype=wire_dtype).tobytes()
    return b"".join(
        (
            _MESSAGE_ID.pack(ID_IMAGE),
            bytes(header),
            _UINT64.pack(len(attributes)),
            attributes,
            pixels,
        )
    )


def frame_waveform(waveform: ismrmrd.Waveform) -> bytes:
    """Id 1026: header and uint32 data [channels, samples]; as ``writers.write_waveform``."""
    body = _serialize(waveform)
    samples, channels = waveform.number_of_samples, waveform.channels
    expected = _WAVEFORM_HEADER_BYTES + samples * channels * _WAVEFORM_DTYPE.itemsize
    if len(body) != expected or waveform.data.dtype != _WAVEFORM_DTYPE:
        raise ProtocolError(
            f"waveform: serialises to {len(body)} bytes but the header ({samples} samples, "
            f"{channels} channels) implies {expected}; data must be uint32 {(channels, samples)}"
        )
    return _MESSAGE_ID.pack(ID_WAVEFORM) + body


_FRAMERS: dict[int, Callable[[object], bytes]] = {
    ID_CONFIG_FILE: frame_config_file,
    ID_CONFIG_TEXT: frame_config_text,
    ID_HEADER: frame_header,
    ID_CLOSE: lambda _payload: frame_close(),
    ID_TEXT: frame_text,
    ID_ERROR: frame_error,
    ID_ACQUISITION: frame_acquisition,
    ID_IMAGE: frame_image,
    ID_WAVEFORM: frame_waveform,
}


def frame_message(message: Message) -> bytes:
    """Frame any :class:`Message` (e.g. one that :meth:`MrdStream.read_message` returned)."""
    framer = _FRAMERS.get(message.id)
    if framer is None:
        raise ProtocolError(f"unknown message id {message.id}")
    return framer(message.payload)


# --------------------------------------------------------------------------------------------
# The stream


class MrdStream:
    """MRD messages over a connected stream socket (TCP or AF_UNIX).

    Thread-safe: one thread may read while others send. Every send is a single ``sendall`` of a
    whole frame under a lock, so frames from different threads never interleave; reads take
    their own lock.

    Socket timeouts: a timeout before the first byte of a message leaves the stream usable (call
    ``read_message`` again); a timeout, error or limit violation in the middle of a frame leaves
    the stream out of step with the peer, and every later ``read_message`` raises ProtocolError
    (likewise a failed ``sendall`` makes later sends raise). A ProtocolError raised after the
    whole frame was read (invalid UTF-8, malformed image attributes) does not: the next message
    can still be read. ``read_message`` also takes deadlines that a peer dripping single bytes
    cannot renew (:class:`ReadTimeout`).
    """

    def __init__(self, sock: socket.socket, limits: Limits = Limits(), quick_ack: bool = False):
        self.sock = sock
        self.limits = limits
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._in_frame = False  # bytes of the current frame were consumed and more are owed
        self._deadline: float | None = None  # time.monotonic() by which the current read must end
        self._message_timeout: float | None = None
        self._idle: float | None = None  # the socket's own timeout, restored after a timed read
        self._read_broken: str | None = None
        self._write_broken: str | None = None
        self.quick_ack = quick_ack  # TCP_QUICKACK before each read: peer without TCP_NODELAY
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # AF_UNIX (socketpair): no Nagle to turn off
            pass
        self._readers: dict[int, Callable[[], object]] = {
            ID_CONFIG_FILE: self._read_config_file,
            ID_CONFIG_TEXT: lambda: self._read_text(ID_CONFIG_TEXT),
            ID_HEADER: lambda: self._read_text(ID_HEADER),
            ID_CLOSE: self._frame_done,
            ID_TEXT: lambda: self._read_text(ID_TEXT),
            ID_ERROR: lambda: self._read_text(ID_ERROR),
            ID_ACQUISITION: self._read_acquisition,
            ID_IMAGE: self._read_image,
            ID_WAVEFORM: self._read_waveform,
        }

    @property
    def _sock(self) -> socket.socket:
        """Alias of :attr:`sock` (some tests write raw bytes through ``stream._sock``)."""
        return self.sock

    def __enter__(self) -> "MrdStream":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---------------------------------------------------------------------------- reading

    def read_message(self, deadline: float | None = None, message_timeout: float | None = None) -> Message:
        """Read exactly one message (blocking), and nothing beyond it.

        ``deadline`` (``time.monotonic()``): the whole message must have arrived by then;
        ``message_timeout``: the rest must follow its first byte within this many seconds. Either
        raises :class:`ReadTimeout`, however slowly bytes trickle in; the socket's own timeout
        still bounds each silence (``socket.timeout``), and is restored afterwards.

        Raises ConnectionClosed (``clean`` True at a message boundary, False mid-frame),
        ProtocolError for an unknown id or a field over :class:`Limits`.
        """
        with self._read_lock:
            if self._read_broken is not None:
                raise ProtocolError(
                    f"stream is out of step after an earlier error: {self._read_broken}"
                )
            timed = deadline is not None or message_timeout is not None
            self._idle = self.sock.gettimeout() if timed else None
            self._deadline, self._message_timeout = deadline, message_timeout
            try:
                return self._read_one()
            finally:
                self._deadline = self._message_timeout = None
                if timed:
                    try:
                        self.sock.settimeout(self._idle)
                    except OSError:  # closed meanwhile
                        pass

    def _read_one(self) -> Message:
        """One message (read lock held); a mid-frame failure leaves the stream out of step."""
        self._in_frame = False
        try:
            raw = self._recv_exact(_MESSAGE_ID.size, "message id", at_boundary=True)
            message_id = _MESSAGE_ID.unpack(raw)[0]
            reader = self._readers.get(message_id)
            if reader is None:  # its length is unknown: the stream cannot be resynchronised
                raise ProtocolError(f"unknown message id {message_id}")
            return Message(message_id, reader())
        except ConnectionClosed as error:
            if not error.clean:
                self._read_broken = str(error)
            raise
        except BaseException as error:
            if self._in_frame:  # part of a frame was consumed: out of step with the peer
                self._read_broken = f"{type(error).__name__}: {error}"
            raise

    def _recv_exact(self, n: int, what: str, at_boundary: bool = False) -> bytearray:
        """Receive exactly n bytes (n already checked against the limits); loop on short reads."""
        buffer = bytearray(n)
        view = memoryview(buffer)
        got = 0
        while got < n:
            count = self._recv_into(view[got:], n - got, what)
            if count == 0:
                if at_boundary and got == 0:
                    raise ConnectionClosed("connection closed by the peer", clean=True)
                raise ConnectionClosed(
                    f"truncated frame: expected {n} bytes of {what}, got {got}", clean=False
                )
            got += count
            self._in_frame = True
        return buffer

    def _recv_into(self, view: memoryview, n: int, what: str) -> int:
        """``sock.recv_into`` under the deadlines of :meth:`read_message`; the message's first
        bytes start its ``message_timeout``."""
        if self.quick_ack:
            tcp.quick_ack(self.sock)
        if self._deadline is None:
            count = self.sock.recv_into(view, n)
        else:
            count = self._recv_before_deadline(view, n, what)
        if count and not self._in_frame and self._message_timeout is not None:
            end = time.monotonic() + self._message_timeout
            self._deadline = end if self._deadline is None else min(self._deadline, end)
        return count

    def _recv_before_deadline(self, view: memoryview, n: int, what: str) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise ReadTimeout(f"{what}: not received before the deadline", self._in_frame)
        self.sock.settimeout(remaining if self._idle is None else min(self._idle, remaining))
        try:
            return self.sock.recv_into(view, n)
        except socket.timeout:
            if time.monotonic() >= self._deadline - 1e-3:
                raise ReadTimeout(f"{what}: not received before the deadline", self._in_frame) from None
            raise

    def _frame_done(self) -> None:
        """Mark the current frame as completely read (later errors leave the stream usable)."""
        self._in_frame = False

    def _check(self, what: str, value: int, limit: int) -> None:
        if value > limit:
            raise ProtocolError(f"{what} {value} exceeds the limit {limit}")

    def _read_config_file(self) -> str:
        raw = self._recv_exact(CONFIG_FILE_BYTES, "config file name")
        self._frame_done()
        return decode_text(raw.split(b"\x00", 1)[0], "config file")

    def _read_text(self, message_id: int) -> str:
        name = MESSAGE_NAMES[message_id]
        length_format = _TEXT_LENGTH[message_id]
        length = length_format.unpack(self._recv_exact(length_format.size, f"{name} length"))[0]
        self._check(f"{name}: length", length, self.limits.max_text_bytes)
        raw = self._recv_exact(length, name)
        self._frame_done()
        return decode_text(raw, name)

    def _read_acquisition(self) -> ismrmrd.Acquisition:
        head = self._recv_exact(_ACQUISITION_HEADER_BYTES, "acquisition header")
        header = ismrmrd.AcquisitionHeader.from_buffer_copy(head)
        limits = self.limits
        samples, channels = header.number_of_samples, header.active_channels
        dims = header.trajectory_dimensions
        self._check("acquisition: number_of_samples", samples, limits.max_samples)
        self._check("acquisition: active_channels", channels, limits.max_channels)
        self._check(
            "acquisition: trajectory_dimensions", dims, limits.max_trajectory_dimensions
        )
        size = samples * (dims * _TRAJECTORY_DTYPE.itemsize + channels * _SAMPLE_DTYPE.itemsize)
        body = self._recv_exact(size, "acquisition data")
        self._frame_done()
        return ismrmrd.Acquisition.deserialize_from(io.BytesIO(head + body).read)

    def _read_image(self) -> ismrmrd.Image:
        head = self._recv_exact(_IMAGE_HEADER_BYTES, "image header")
        header = ismrmrd.ImageHeader.from_buffer_copy(head)
        wire_dtype = _IMAGE_WIRE_DTYPES.get(header.data_type)
        if wire_dtype is None:
            raise ProtocolError(
                f"image: data_type {header.data_type} is not an ISMRMRD data type "
                f"(known: {sorted(_IMAGE_WIRE_DTYPES)})"
            )
        x, y, z = header.matrix_size
        channels = header.channels
        size = channels * x * y * z * wire_dtype.itemsize
        if size > self.limits.max_image_bytes:
            raise ProtocolError(
                f"image: data size {x}x{y}x{z} x {channels} channels x {wire_dtype.itemsize} "
                f"bytes = {size} bytes exceeds the limit {self.limits.max_image_bytes}"
            )
        length = _UINT64.unpack(self._recv_exact(_UINT64.size, "image attribute length"))[0]
        self._check("image: attribute length", length, self.limits.max_text_bytes)
        attributes = self._recv_exact(length, "image attributes")
        pixels = self._recv_exact(size, "image data")
        self._frame_done()
        text = decode_text(attributes, "image attributes")
        try:
            image = ismrmrd.Image(head=head, attribute_string=text)
        except (SyntaxError, AssertionError, AttributeError) as error:  # ET.ParseError: SyntaxError
            raise ProtocolError(
                f"image: attribute string is not ismrmrd Meta XML ({type(error).__name__}: {error})"
            ) from None
        image.data.ravel()[:] = np.frombuffer(pixels, dtype=wire_dtype)
        return image

    def _read_waveform(self) -> ismrmrd.Waveform:
        head = self._recv_exact(_WAVEFORM_HEADER_BYTES, "waveform header")
        header = ismrmrd.WaveformHeader.from_buffer_copy(head)
        samples, channels = header.number_of_samples, header.channels
        if samples * channels > self.limits.max_waveform_samples:
            raise ProtocolError(
                f"waveform: number_of_samples {samples} x channels {channels} = "
                f"{samples * channels} exceeds the limit {self.limits.max_waveform_samples}"
            )
        data = self._recv_exact(samples * channels * _WAVEFORM_DTYPE.itemsize, "waveform data")
        self._frame_done()
        waveform = ismrmrd.Waveform(head)
        waveform.data.ravel()[:] = np.frombuffer(data, dtype=_WAVEFORM_DTYPE)
        return waveform

    # ---------------------------------------------------------------------------- sending

    def send_frame(self, frame: bytes) -> None:
        """Send one already framed message with a single ``sendall`` under the write lock."""
        with self._write_lock:
            if self._write_broken is not None:
                raise OSError(
                    f"stream cannot send after an earlier failed send: {self._write_broken}"
                )
            try:
                self.sock.sendall(frame)
            except BaseException as error:
                self._write_broken = f"{type(error).__name__}: {error}"
                raise

    def send_message(self, message: Message) -> None:
        """Send any :class:`Message` (forwarding what :meth:`read_message` returned)."""
        self.send_frame(frame_message(message))

    def send_config_file(self, name: str) -> None:
        """Id 1: the config by name (1024 bytes, NUL padded)."""
        self.send_frame(frame_config_file(name))

    def send_config_text(self, text: str, nul_terminate: bool = False) -> None:
        """Id 2: the config script."""
        self.send_frame(frame_config_text(text, nul_terminate))

    def send_header(self, xml: str, nul_terminate: bool = False) -> None:
        """Id 3: the ISMRMRD XML header."""
        self.send_frame(frame_header(xml, nul_terminate))

    def send_text(self, text: str, nul_terminate: bool = False) -> None:
        """Id 5: free text (JSON parameters)."""
        self.send_frame(frame_text(text, nul_terminate))

    def send_error(self, text: str) -> None:
        """Id 8: an error message (uint64 length)."""
        self.send_frame(frame_error(text))

    def send_close(self) -> None:
        """Id 4: end of stream."""
        self.send_frame(frame_close())

    def send_acquisition(self, acq: ismrmrd.Acquisition) -> None:
        """Id 1008."""
        self.send_frame(frame_acquisition(acq))

    def send_image(self, image: ismrmrd.Image) -> None:
        """Id 1022."""
        self.send_frame(frame_image(image))

    def send_waveform(self, waveform: ismrmrd.Waveform) -> None:
        """Id 1026."""
        self.send_frame(frame_waveform(waveform))

    # ---------------------------------------------------------------------------- closing

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def interrupt(self, frame: bytes | None = None, lock_timeout: float = 0.2) -> bool:
        """End the stream from another thread (e.g. a server shutting down), never blocking for
        long: send ``frame`` (e.g. :func:`frame_close`) only if no other send holds the stream
        for more than ``lock_timeout`` s and the socket takes it at once, then shut the socket
        down, which wakes a reader blocked on it. Later sends raise OSError; :meth:`close` still
        closes the socket. Returns whether ``frame`` went out whole."""
        sent = False
        locked = frame is not None and self._write_lock.acquire(timeout=lock_timeout)
        try:
            if locked and self._write_broken is None:
                poller = select.poll()  # send only what the socket takes at once
                poller.register(self.sock.fileno(), select.POLLOUT)
                if poller.poll(0):
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT) == len(frame)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        finally:
            self._write_broken = "the stream was interrupted"
            if locked:
                self._write_lock.release()
        return sent

    def close(self) -> None:
        """Shut the socket down and close it (idempotent; unblocks a reader in another thread)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        self.sock.close()
