"""The bytes of each MRD (ISMRMRD v1) message: ids, formats, limits, errors, and the pure
functions that turn an object into one whole frame. :mod:`masc_gadget.mrd.protocol` reads and
writes them on a socket (see its docstring for the table of messages)."""

from __future__ import annotations

import ctypes
import io
import struct
from dataclasses import dataclass
from typing import Callable, NamedTuple

import ismrmrd
import numpy as np

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
ID_FEEDBACK = 1028

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
    ID_FEEDBACK: "feedback",
}
"""Human-readable name of every message id this module reads and writes."""

CONFIG_FILE_BYTES = 1024
"""Fixed size of the config file name field (id 1), NUL padded."""

MESSAGE_ID = struct.Struct("<H")
UINT32 = struct.Struct("<I")
UINT64 = struct.Struct("<Q")

TEXT_LENGTH = {  # length prefix of each text message
    ID_CONFIG_TEXT: UINT32,
    ID_HEADER: UINT32,
    ID_TEXT: UINT32,
    ID_ERROR: UINT64,
}

ACQUISITION_HEADER_BYTES = ctypes.sizeof(ismrmrd.AcquisitionHeader)  # 340
IMAGE_HEADER_BYTES = ctypes.sizeof(ismrmrd.ImageHeader)  # 198
WAVEFORM_HEADER_BYTES = ctypes.sizeof(ismrmrd.WaveformHeader)  # 40

TRAJECTORY_DTYPE = np.dtype("<f4")
SAMPLE_DTYPE = np.dtype("<c8")
WAVEFORM_DTYPE = np.dtype("<u4")

IMAGE_WIRE_DTYPES: dict[int, np.dtype] = {  # ISMRMRD_DataTypes, as the C/C++ library defines them
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
    return MESSAGE_ID.pack(ID_CONFIG_FILE) + data.ljust(CONFIG_FILE_BYTES, b"\x00")


def _frame_text(message_id: int, text: str | bytes, nul_terminate: bool) -> bytes:
    data = _encode(text, MESSAGE_NAMES[message_id])
    if nul_terminate:
        data += b"\x00"
    return MESSAGE_ID.pack(message_id) + TEXT_LENGTH[message_id].pack(len(data)) + data


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
    return MESSAGE_ID.pack(ID_CLOSE)


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
        ACQUISITION_HEADER_BYTES
        + samples * dims * TRAJECTORY_DTYPE.itemsize
        + samples * channels * SAMPLE_DTYPE.itemsize
    )
    dtypes_ok = acq.data.dtype == SAMPLE_DTYPE and acq.traj.dtype == TRAJECTORY_DTYPE
    if len(body) != expected or not dtypes_ok:
        raise ProtocolError(
            f"acquisition: serialises to {len(body)} bytes but the header "
            f"({samples} samples, {channels} channels, {dims} trajectory dimensions) implies "
            f"{expected}; data must be complex64 {(channels, samples)} (is {acq.data.dtype} "
            f"{acq.data.shape}), trajectory float32 {(samples, dims)} (is {acq.traj.dtype} "
            f"{acq.traj.shape})"
        )
    return MESSAGE_ID.pack(ID_ACQUISITION) + body


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
    wire_dtype = IMAGE_WIRE_DTYPES.get(header.data_type)
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
            MESSAGE_ID.pack(ID_IMAGE),
            bytes(header),
            UINT64.pack(len(attributes)),
            attributes,
            pixels,
        )
    )


def frame_waveform(waveform: ismrmrd.Waveform) -> bytes:
    """Id 1026: header and uint32 data [channels, samples]; as ``writers.write_waveform``."""
    body = _serialize(waveform)
    samples, channels = waveform.number_of_samples, waveform.channels
    expected = WAVEFORM_HEADER_BYTES + samples * channels * WAVEFORM_DTYPE.itemsize
    if len(body) != expected or waveform.data.dtype != WAVEFORM_DTYPE:
        raise ProtocolError(
            f"waveform: serialises to {len(body)} bytes but the header ({samples} samples, "
            f"{channels} channels) implies {expected}; data must be uint32 {(channels, samples)}"
        )
    return MESSAGE_ID.pack(ID_WAVEFORM) + body


class Feedback(NamedTuple):
    """Id 1028, "feedback" (as a public python-ismrmrd-server fork defines it for real-time
    feedback from reconstruction to sequence): a named blob, ``uint32`` name length + name
    (UTF-8), ``uint32`` data length + data. What the data mean is the name's business
    (MASC's next-line decisions: :mod:`masc_gadget.mrd.feedback`)."""

    name: str
    data: bytes


def frame_feedback(feedback: Feedback) -> bytes:
    """Id 1028: :class:`Feedback` as uint32 + name, uint32 + data."""
    name = _encode(feedback.name, "feedback name")
    data = bytes(feedback.data)
    return (MESSAGE_ID.pack(ID_FEEDBACK) + UINT32.pack(len(name)) + name
            + UINT32.pack(len(data)) + data)


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
    ID_FEEDBACK: frame_feedback,
}


def frame_message(message: Message) -> bytes:
    """Frame any :class:`Message` (e.g. one that :meth:`MrdStream.read_message` returned)."""
    framer = _FRAMERS.get(message.id)
    if framer is None:
        raise ProtocolError(f"unknown message id {message.id}")
    return framer(message.payload)
