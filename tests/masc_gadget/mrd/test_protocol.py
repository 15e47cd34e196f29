"""MRD stream protocol: round trips, byte-identity with the gadgetron client, short reads, limits.

Loopback only (socketpair and 127.0.0.1 TCP); every test runs in well under a second.
"""

from __future__ import annotations

import io
import socket
import struct
import threading
import time

import ismrmrd
import numpy as np
import pytest
from gadgetron.external import constants as gconstants
from gadgetron.external import readers as greaders
from gadgetron.external import writers as gwriters
from gadgetron.external.connection import Connection

from masc_gadget.mrd import protocol
from masc_gadget.mrd.frames import (ID_ACQUISITION, ID_CLOSE, ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_ERROR, ID_FEEDBACK,
                                    ID_HEADER, ID_IMAGE, ID_TEXT, ID_WAVEFORM, MESSAGE_NAMES, decode_text,
                                    frame_acquisition, frame_close, frame_config_file, frame_config_text,
                                    frame_error, frame_header, frame_image, frame_text, frame_waveform,
                                    ConnectionClosed, Limits, Message, ProtocolError)
from masc_gadget.mrd.protocol import MrdStream

HEADER_XML = (
    '<?xml version="1.0"?><ismrmrdHeader xmlns="http://www.ismrm.org/ISMRMRD">'
    "<experimentalConditions><H1resonanceFrequency_Hz>63500000</H1resonanceFrequency_Hz>"
    "</experimentalConditions><encoding><encodedSpace><matrixSize><x>64</x><y>64</y><z>1</z>"
    "</matrixSize><fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm></encodedSpace>"
    "<reconSpace><matrixSize><x>64</x><y>64</y><z>1</z></matrixSize><fieldOfView_mm><x>200</x>"
    "<y>200</y><z>5</z></fieldOfView_mm></reconSpace><encodingLimits/>"
    "<trajectory>cartesian</trajectory></encoding></ismrmrdHeader>"
)
CONFIG_XML = '<?xml version="1.0"?><configuration><property name="budget" value="18"/></configuration>'

IMAGE_DTYPES = [np.uint16, np.int16, np.uint32, np.float32, np.float64, np.complex64, np.complex128]

# ------------------------------------------------------------------------------------ helpers


def make_acquisition(seed: int = 0, samples: int = 16, channels: int = 2, dims: int = 2):
    rng = np.random.default_rng(seed)
    data = (rng.standard_normal((channels, samples)) + 1j * rng.standard_normal((channels, samples)))
    trajectory = rng.standard_normal((samples, dims)).astype(np.float32)
    acq = ismrmrd.Acquisition.from_array(data.astype(np.complex64), trajectory)
    acq.set_flag(ismrmrd.ACQ_USER1)
    acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
    acq.idx.kspace_encode_step_1 = 100 + seed
    acq.idx.slice = 3
    acq.user_int[0] = seed
    acq.user_int[1] = -12345
    acq.user_float[7] = 0.5
    acq.scan_counter = 7 + seed
    acq.measurement_uid = 99
    acq.sample_time_us = 2.5
    acq.center_sample = samples // 2
    acq.position[:] = (1.0, -2.0, 3.5)
    acq.read_dir[:] = (1.0, 0.0, 0.0)
    acq.channel_mask[0] = 0b11
    return acq


def make_image(dtype=np.float32, meta: bool = True, shape=(2, 1, 5, 6)):
    rng = np.random.default_rng(1)
    values = rng.standard_normal(shape) * 100
    if np.issubdtype(dtype, np.complexfloating):
        values = values + 1j * rng.standard_normal(shape)
    if np.issubdtype(dtype, np.unsignedinteger):
        values = np.abs(values)
    image = ismrmrd.Image.from_array(values.astype(dtype))
    image.image_index = 4
    image.image_series_index = 2
    image.slice = 3
    image.field_of_view[:] = (200.0, 200.0, 5.0)
    image.image_type = ismrmrd.IMTYPE_MAGNITUDE
    image.user_int[2] = 77
    if meta:
        image.meta = ismrmrd.Meta(
            {"acquired_lines": ["31", "32", "7"], "policy": "masc-ppo v1", "unicode": "Ø µ"}
        )
    return image


def make_waveform(samples: int = 10, channels: int = 3):
    data = np.arange(channels * samples, dtype=np.uint32).reshape(channels, samples) * 3 + 1
    waveform = ismrmrd.Waveform.from_array(data)
    waveform.waveform_id = 1
    waveform.time_stamp = 123456
    waveform.sample_time_us = 2.5
    return waveform


def header_bytes(obj) -> bytes:
    return bytes(obj.getHead())


class Sink:
    """A fake gadgetron destination: ``.write`` collects bytes."""

    def __init__(self):
        self.buffer = io.BytesIO()

    def write(self, data):
        self.buffer.write(data)

    def getvalue(self) -> bytes:
        return self.buffer.getvalue()


class Source:
    """A fake gadgetron source: ``.read`` over a BytesIO."""

    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)

    def read(self, n: int) -> bytes:
        return self.buffer.read(n)


def gadgetron_frame(write, item) -> bytes:
    sink = Sink()
    write(sink, item)
    return sink.getvalue()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def pair():
    """(sender, receiver) MrdStreams over an AF_UNIX socketpair."""
    a, b = socket.socketpair()
    sender, receiver = MrdStream(a), MrdStream(b)
    yield sender, receiver
    sender.close()
    receiver.close()


def assert_acquisitions_equal(got, want):
    assert isinstance(got, ismrmrd.Acquisition)
    assert header_bytes(got) == header_bytes(want)
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.traj, want.traj)
    assert got.data.dtype == np.complex64 and got.traj.dtype == np.float32
    assert got == want


def assert_images_equal(got, want):
    assert isinstance(got, ismrmrd.Image)
    assert header_bytes(got) == header_bytes(want)
    assert got.data.dtype == want.data.dtype
    np.testing.assert_array_equal(got.data, want.data)
    assert dict(got.meta) == dict(want.meta)
    assert got == want


# ------------------------------------------------------------------------------------ ids


def test_message_ids_and_names():
    ids = [ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_HEADER, ID_CLOSE, ID_TEXT, ID_ERROR,
           ID_ACQUISITION, ID_IMAGE, ID_WAVEFORM, ID_FEEDBACK]
    assert ids == [1, 2, 3, 4, 5, 8, 1008, 1022, 1026, 1028]
    assert set(MESSAGE_NAMES) == set(ids)
    # The same numbers as the gadgetron client's constants.
    assert ID_ACQUISITION == gconstants.GADGET_MESSAGE_ISMRMRD_ACQUISITION
    assert ID_IMAGE == gconstants.GADGET_MESSAGE_ISMRMRD_IMAGE
    assert ID_WAVEFORM == gconstants.GADGET_MESSAGE_ISMRMRD_WAVEFORM
    assert ID_ERROR == gconstants.GADGET_MESSAGE_ERROR
    assert Message(ID_HEADER, "x").name == "header"


# ------------------------------------------------------------------------------------ round trips


def test_round_trip_every_message_type(pair):
    sender, receiver = pair
    acq, image, waveform = make_acquisition(), make_image(), make_waveform()
    sender.send_config_file("default.xml")
    sender.send_config_text(CONFIG_XML)
    sender.send_header(HEADER_XML)
    sender.send_text('{"feedback": "in-band"}')
    sender.send_acquisition(acq)
    sender.send_image(image)
    sender.send_waveform(waveform)
    sender.send_error("Gadget failed: öops")
    sender.send_close()

    assert receiver.read_message() == Message(ID_CONFIG_FILE, "default.xml")
    assert receiver.read_message() == Message(ID_CONFIG_TEXT, CONFIG_XML)
    assert receiver.read_message() == Message(ID_HEADER, HEADER_XML)
    assert receiver.read_message() == Message(ID_TEXT, '{"feedback": "in-band"}')
    message = receiver.read_message()
    assert message.id == ID_ACQUISITION
    assert_acquisitions_equal(message.payload, acq)
    assert message.payload.is_flag_set(ismrmrd.ACQ_USER1)
    assert message.payload.idx.kspace_encode_step_1 == 100
    assert list(message.payload.traj.shape) == [16, 2] and list(message.payload.data.shape) == [2, 16]
    message = receiver.read_message()
    assert message.id == ID_IMAGE
    assert_images_equal(message.payload, image)
    assert message.payload.meta["acquired_lines"] == ["31", "32", "7"]
    assert message.payload.meta["unicode"] == "Ø µ"
    message = receiver.read_message()
    assert message.id == ID_WAVEFORM
    assert header_bytes(message.payload) == header_bytes(waveform)
    np.testing.assert_array_equal(message.payload.data, waveform.data)
    assert message.payload == waveform
    assert receiver.read_message() == Message(ID_ERROR, "Gadget failed: öops")
    assert receiver.read_message() == Message(ID_CLOSE, None)


@pytest.mark.parametrize("dtype", IMAGE_DTYPES)
def test_image_round_trip_every_data_type(pair, dtype):
    sender, receiver = pair
    image = make_image(dtype, meta=False, shape=(3, 2, 4, 5))
    sender.send_image(image)
    got = receiver.read_message().payload
    assert_images_equal(got, image)
    assert got.matrix_size == (5, 4, 2) and got.channels == 3


def test_int_images_travel_as_int32(pair):
    """ISMRMRD_INT is int32 on the wire (the C/C++ library); the Python package would send int64."""
    sender, receiver = pair
    values = np.array([[-(2**31), -1, 0], [1, 7, 2**31 - 1]], dtype=np.int64)
    image = ismrmrd.Image.from_array(values)
    assert image.data_type == ismrmrd.DATATYPE_INT
    frame = frame_image(image)
    assert len(frame) == 2 + 198 + 8 + 0 + values.size * 4
    assert frame[-values.size * 4:] == values.astype("<i4").tobytes()
    sender.send_image(image)
    got = receiver.read_message().payload
    assert got.data_type == ismrmrd.DATATYPE_INT
    np.testing.assert_array_equal(got.data[0, 0], values)

    too_big = ismrmrd.Image.from_array(np.array([[2**31]], dtype=np.int64))
    with pytest.raises(ProtocolError, match="int32"):
        frame_image(too_big)


def test_acquisition_without_trajectory_and_with_nan_data(pair):
    """NaN samples are the engine's business, not a framing error."""
    sender, receiver = pair
    data = np.full((1, 8), np.nan + 1j, dtype=np.complex64)
    acq = ismrmrd.Acquisition.from_array(data)
    sender.send_acquisition(acq)
    got = receiver.read_message().payload
    assert got.trajectory_dimensions == 0 and got.traj.shape == (8, 0)
    assert np.isnan(got.data.real).all() and (got.data.imag == 1).all()


def test_round_trip_over_tcp_sets_nodelay(tcp_pair):
    client, server = tcp_pair
    for stream in tcp_pair:
        assert stream.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    acq = make_acquisition(5)
    client.send_header(HEADER_XML)
    client.send_acquisition(acq)
    assert server.read_message() == Message(ID_HEADER, HEADER_XML)
    assert_acquisitions_equal(server.read_message().payload, acq)
    server.send_close()
    assert client.read_message() == Message(ID_CLOSE, None)


def test_socketpair_is_accepted_without_nodelay():
    a, b = socket.socketpair()
    with MrdStream(a), MrdStream(b):
        pass


# ------------------------------------------------------------------------------------ gadgetron


def test_frames_are_byte_identical_to_gadgetron_writers():
    acq = make_acquisition(3)
    assert frame_acquisition(acq) == gadgetron_frame(gwriters.write_acquisition, acq)
    waveform = make_waveform()
    assert frame_waveform(waveform) == gadgetron_frame(gwriters.write_waveform, waveform)
    for dtype in IMAGE_DTYPES:
        for meta in (False, True):
            ours = frame_image(make_image(dtype, meta))
            theirs = gadgetron_frame(gwriters.write_image, make_image(dtype, meta))
            assert ours == theirs, (dtype, meta)
    for frame, message_id, length in [
        (frame_config_text(CONFIG_XML), ID_CONFIG_TEXT, gconstants.uint32),
        (frame_header(HEADER_XML), ID_HEADER, gconstants.uint32),
        (frame_text("{}"), ID_TEXT, gconstants.uint32),
        (frame_error("boom"), ID_ERROR, gconstants.uint64),
    ]:
        sink = Sink()
        sink.write(gconstants.GadgetMessageIdentifier.pack(message_id))
        payload = {ID_CONFIG_TEXT: CONFIG_XML, ID_HEADER: HEADER_XML, ID_TEXT: "{}",
                   ID_ERROR: "boom"}[message_id]
        gwriters.write_byte_string(sink, payload.encode(), length)
        assert frame == sink.getvalue()


def test_frame_image_records_attribute_length_like_serialize_into():
    image = make_image()
    frame_image(image)
    attributes = image.attribute_string.encode("utf-8")
    assert image.getHead().attribute_string_len == len(attributes)  # bytes, not characters
    assert len(attributes) > len(image.attribute_string)


def test_gadgetron_readers_read_our_frames():
    acq, image, waveform = make_acquisition(2), make_image(np.complex64), make_waveform()
    stream = b"".join([
        frame_header(HEADER_XML),
        frame_acquisition(acq),
        frame_image(image),
        frame_waveform(waveform),
        frame_error("bad"),
        frame_close(),
    ])
    source = Source(stream)

    def next_id():
        return greaders.read(source, gconstants.GadgetMessageIdentifier)

    assert next_id() == ID_HEADER
    assert greaders.read_byte_string(source).decode() == HEADER_XML
    assert next_id() == ID_ACQUISITION
    assert greaders.read_acquisition(source) == acq
    assert next_id() == ID_IMAGE
    got = greaders.read_image(source)
    assert got == image and dict(got.meta) == dict(image.meta)
    assert next_id() == ID_WAVEFORM
    assert greaders.read_waveform(source) == waveform
    assert next_id() == ID_ERROR
    assert greaders.read_byte_string(source, gconstants.uint64) == b"bad"
    assert next_id() == ID_CLOSE
    assert source.read(1) == b""


def test_we_read_gadgetron_frames():
    acq, image, waveform = make_acquisition(4), make_image(np.float64), make_waveform(5, 2)
    data = b"".join([
        gadgetron_frame(gwriters.write_acquisition, acq),
        gadgetron_frame(gwriters.write_image, image),
        gadgetron_frame(gwriters.write_waveform, waveform),
    ])
    a, b = socket.socketpair()
    with MrdStream(b) as stream:
        a.sendall(data)
        a.close()
        assert_acquisitions_equal(stream.read_message().payload, acq)
        assert_images_equal(stream.read_message().payload, image)
        assert stream.read_message().payload == waveform
        with pytest.raises(ConnectionClosed) as info:
            stream.read_message()
        assert info.value.clean


def test_gadgetron_connection_echoes_through_our_stream(pair):
    """The external-gadget side (gadgetron.external.Connection) and our stream understand each other."""
    scanner, gadget_end = pair
    received = {}

    def gadget():
        connection = Connection(gadget_end.sock)
        received["config"] = connection.raw_bytes.config
        received["matrix"] = connection.header.encoding[0].encodedSpace.matrixSize.x
        with connection:
            for item in connection:
                connection.send(item)

    thread = threading.Thread(target=gadget, daemon=True)
    thread.start()
    acquisitions = [make_acquisition(i) for i in range(3)]
    image, waveform = make_image(), make_waveform()
    scanner.send_config_text(CONFIG_XML)
    scanner.send_header(HEADER_XML)
    for acq in acquisitions:
        scanner.send_acquisition(acq)
    scanner.send_image(image)
    scanner.send_waveform(waveform)
    scanner.send_close()
    for acq in acquisitions:
        assert_acquisitions_equal(scanner.read_message().payload, acq)
    assert_images_equal(scanner.read_message().payload, image)
    assert scanner.read_message().payload == waveform
    assert scanner.read_message() == Message(ID_CLOSE, None)
    thread.join(5)
    assert not thread.is_alive()
    assert received == {"config": CONFIG_XML.encode(), "matrix": 64}


# ------------------------------------------------------------------------------------ strings


def test_trailing_nuls_are_stripped(pair):
    sender, receiver = pair
    sender.send_config_text(CONFIG_XML, nul_terminate=True)
    sender.send_header(HEADER_XML, nul_terminate=True)
    sender.send_text("{}", nul_terminate=True)
    sender.sock.sendall(struct.pack("<HI", ID_TEXT, 5) + b"ab\0\0\0")
    assert receiver.read_message() == Message(ID_CONFIG_TEXT, CONFIG_XML)
    assert receiver.read_message() == Message(ID_HEADER, HEADER_XML)
    assert receiver.read_message() == Message(ID_TEXT, "{}")
    assert receiver.read_message() == Message(ID_TEXT, "ab")


def test_nul_terminate_adds_one_nul_and_is_off_by_default():
    assert frame_header("<x/>") == struct.pack("<HI", ID_HEADER, 4) + b"<x/>"
    assert frame_header("<x/>", nul_terminate=True) == struct.pack("<HI", ID_HEADER, 5) + b"<x/>\0"
    assert frame_error("e") == struct.pack("<HQ", ID_ERROR, 1) + b"e"
    assert frame_close() == struct.pack("<H", ID_CLOSE)
    assert frame_text(b"raw bytes") == struct.pack("<HI", ID_TEXT, 9) + b"raw bytes"


def test_config_file_name_is_padded_to_1024_bytes(pair):
    frame = frame_config_file("default.xml")
    assert len(frame) == 2 + 1024
    assert frame == struct.pack("<H", ID_CONFIG_FILE) + b"default.xml" + b"\0" * (1024 - 11)
    assert len(frame_config_file("x" * 1023)) == 1026
    with pytest.raises(ProtocolError, match="1024 bytes, exceeds the limit 1023"):
        frame_config_file("x" * 1024)
    with pytest.raises(ProtocolError, match="NUL"):
        frame_config_file("a\0b")
    sender, receiver = pair
    # A C client's buffer may hold garbage after the terminating NUL: the name ends at the NUL.
    sender.sock.sendall(struct.pack("<H", ID_CONFIG_FILE) + b"masc.xml\0junk".ljust(1024, b"\0"))
    sender.send_config_file("x" * 1023)
    assert receiver.read_message() == Message(ID_CONFIG_FILE, "masc.xml")
    assert receiver.read_message() == Message(ID_CONFIG_FILE, "x" * 1023)


def test_decode_text():
    assert decode_text(b"abc\0\0", "header") == "abc"
    assert decode_text(b"", "header") == ""
    assert decode_text("é".encode() + b"\0", "text") == "é"
    with pytest.raises(ProtocolError, match="^header: invalid UTF-8"):
        decode_text(b"ab\xff", "header")


def test_invalid_utf8_is_a_protocol_error_and_the_stream_stays_usable(raw_pair):
    sock, stream = raw_pair
    sock.sendall(struct.pack("<HI", ID_TEXT, 3) + b"a\xc3(")
    sock.sendall(struct.pack("<HQ", ID_ERROR, 2) + b"\xff\xfe")
    sock.sendall(frame_close())
    with pytest.raises(ProtocolError, match="^text: invalid UTF-8"):
        stream.read_message()
    with pytest.raises(ProtocolError, match="^error: invalid UTF-8"):
        stream.read_message()
    assert stream.read_message() == Message(ID_CLOSE, None)  # the frames were read whole


def test_malformed_image_attributes_are_a_protocol_error(raw_pair):
    sock, stream = raw_pair
    image = make_image(meta=False)
    header = image.getHead()
    attributes = b"<ismrmrdMeta><meta>"  # not well-formed
    header.attribute_string_len = len(attributes)
    sock.sendall(b"".join([struct.pack("<H", ID_IMAGE), bytes(header),
                           struct.pack("<Q", len(attributes)), attributes,
                           image.data.tobytes(), frame_close()]))
    with pytest.raises(ProtocolError, match="image: attribute string"):
        stream.read_message()
    assert stream.read_message() == Message(ID_CLOSE, None)


# ------------------------------------------------------------------------------------ short reads


def test_frames_dribbled_one_byte_at_a_time_are_read(raw_pair):
    sock, stream = raw_pair
    acq = make_acquisition(9, samples=4)
    data = frame_text("hi") + frame_acquisition(acq) + frame_close()

    def dribble():
        for i in range(len(data)):
            sock.send(data[i:i + 1])
            time.sleep(0.0002)

    thread = threading.Thread(target=dribble)
    thread.start()
    try:
        assert stream.read_message() == Message(ID_TEXT, "hi")
        assert_acquisitions_equal(stream.read_message().payload, acq)
        assert stream.read_message() == Message(ID_CLOSE, None)
    finally:
        thread.join()


def test_reads_nothing_beyond_the_frame(raw_pair):
    sock, stream = raw_pair
    first, second = frame_acquisition(make_acquisition(1)), frame_image(make_image())
    sock.sendall(first + second)
    assert stream.read_message().id == ID_ACQUISITION
    assert recv_exactly(stream.sock, len(second)) == second


# ------------------------------------------------------------------------------------ EOF


def test_clean_eof_at_a_message_boundary(raw_pair):
    sock, stream = raw_pair
    sock.sendall(frame_text("last"))
    sock.close()
    assert stream.read_message() == Message(ID_TEXT, "last")
    with pytest.raises(ConnectionClosed) as info:
        stream.read_message()
    assert info.value.clean is True
    assert isinstance(info.value, EOFError)


def test_truncated_frame_names_what_was_expected(raw_pair):
    sock, stream = raw_pair
    sock.sendall(struct.pack("<H", ID_ACQUISITION) + bytes(12))
    sock.close()
    with pytest.raises(ConnectionClosed) as info:
        stream.read_message()
    assert info.value.clean is False
    assert str(info.value) == "truncated frame: expected 340 bytes of acquisition header, got 12"
    with pytest.raises(ProtocolError, match="out of step"):
        stream.read_message()


@pytest.mark.parametrize(
    "data, what",
    [
        (b"\x08", "expected 2 bytes of message id, got 1"),
        (struct.pack("<HI", ID_HEADER, 10) + b"<ismr", "expected 10 bytes of header, got 5"),
        (struct.pack("<H", ID_TEXT) + b"\x01\x00", "expected 4 bytes of text length, got 2"),
        (frame_acquisition(make_acquisition())[:-3], "of acquisition data, got"),
        (frame_image(make_image())[:-1], "of image data, got"),
        (frame_waveform(make_waveform())[:40], "expected 40 bytes of waveform header, got 38"),
    ],
    ids=["id", "header", "text-length", "acquisition", "image", "waveform"],
)
def test_truncation_anywhere_is_unclean(raw_pair, data, what):
    sock, stream = raw_pair
    sock.sendall(data)
    sock.close()
    with pytest.raises(ConnectionClosed, match=what) as info:
        stream.read_message()
    assert not info.value.clean


# ------------------------------------------------------------------------------------ hostile input


def test_unknown_message_id(raw_pair):
    sock, stream = raw_pair
    sock.sendall(struct.pack("<H", 1234) + frame_close())
    with pytest.raises(ProtocolError, match="^unknown message id 1234$"):
        stream.read_message()
    with pytest.raises(ProtocolError, match="out of step"):  # its length is unknown
        stream.read_message()


def _acquisition_header(**fields) -> bytes:
    header = ismrmrd.AcquisitionHeader()
    for name, value in fields.items():
        setattr(header, name, value)
    return bytes(header)


def _image_header(**fields) -> bytes:
    header = ismrmrd.ImageHeader()
    header.data_type = ismrmrd.DATATYPE_FLOAT
    header.channels = 1
    header.matrix_size[:] = (4, 4, 1)
    for name, value in fields.items():
        setattr(header, name, value)
    return bytes(header)


def _waveform_header(**fields) -> bytes:
    header = ismrmrd.WaveformHeader()
    for name, value in fields.items():
        setattr(header, name, value)
    return bytes(header)


# The headers' counters are uint16, so 65535 is the most a peer can claim per field.
HOSTILE = [
    (struct.pack("<HI", ID_HEADER, 2**31), "^header: length 2147483648 exceeds the limit 8388608$"),
    (struct.pack("<HI", ID_CONFIG_TEXT, 2**32 - 1), "^config text: length 4294967295 exceeds"),
    (struct.pack("<HI", ID_TEXT, 8 * 2**20 + 1), "^text: length 8388609 exceeds the limit 8388608$"),
    (struct.pack("<HQ", ID_ERROR, 2**63), "^error: length 9223372036854775808 exceeds"),
    (struct.pack("<H", ID_ACQUISITION) + _acquisition_header(number_of_samples=65535, active_channels=1),
     "^acquisition: number_of_samples 65535 exceeds the limit 16384$"),
    (struct.pack("<H", ID_ACQUISITION) + _acquisition_header(number_of_samples=16, active_channels=10**4),
     "^acquisition: active_channels 10000 exceeds the limit 128$"),
    (struct.pack("<H", ID_ACQUISITION) + _acquisition_header(number_of_samples=16, active_channels=1,
                                                             trajectory_dimensions=4),
     "^acquisition: trajectory_dimensions 4 exceeds the limit 3$"),
    (struct.pack("<H", ID_IMAGE) + _image_header(matrix_size=(65535, 65535, 1)),
     r"^image: data size 65535x65535x1 x 1 channels x 4 bytes = 17179344900 bytes exceeds the limit 268435456$"),
    (struct.pack("<H", ID_IMAGE) + _image_header(data_type=ismrmrd.DATATYPE_CXDOUBLE, channels=65535,
                                                 matrix_size=(65535, 65535, 65535)),
     "^image: data size .* exceeds the limit 268435456$"),
    (struct.pack("<H", ID_IMAGE) + _image_header(data_type=9), "^image: data_type 9 is not an ISMRMRD data type"),
    (struct.pack("<H", ID_IMAGE) + _image_header() + struct.pack("<Q", 2**40),
     "^image: attribute length 1099511627776 exceeds the limit 8388608$"),
    (struct.pack("<H", ID_WAVEFORM) + _waveform_header(number_of_samples=65535, channels=65535),
     r"^waveform: number_of_samples 65535 x channels 65535 = 4294836225 exceeds the limit 1048576$"),
]


@pytest.mark.parametrize("data, message", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_absurd_lengths_fail_before_reading_the_body(raw_pair, data, message):
    """Only the header is sent: the reader must fail at once rather than wait for (or allocate)
    a body. Bytes sent after the header must still be in the socket, unread."""
    sock, stream = raw_pair
    sock.sendall(data + b"BODY")
    start = time.monotonic()
    with pytest.raises(ProtocolError, match=message):
        stream.read_message()
    assert time.monotonic() - start < 2.0
    assert recv_exactly(stream.sock, 4) == b"BODY"
    with pytest.raises(ProtocolError, match="out of step"):
        stream.read_message()


def test_limits_are_configurable():
    a, b = socket.socketpair()
    with MrdStream(a) as sender, MrdStream(b, Limits(max_samples=8, max_text_bytes=3)) as receiver:
        sender.send_text("abc")
        sender.send_text("abcd")
        assert receiver.read_message() == Message(ID_TEXT, "abc")
        with pytest.raises(ProtocolError, match="^text: length 4 exceeds the limit 3$"):
            receiver.read_message()
    a, b = socket.socketpair()
    with MrdStream(a) as sender, MrdStream(b, Limits(max_samples=8)) as receiver:
        sender.send_acquisition(make_acquisition(samples=16))
        with pytest.raises(ProtocolError, match="^acquisition: number_of_samples 16 exceeds the limit 8$"):
            receiver.read_message()
    with pytest.raises(Exception):
        Limits().max_samples = 1  # frozen


def test_inconsistent_objects_are_refused_before_sending():
    header = ismrmrd.AcquisitionHeader()
    header.number_of_samples, header.active_channels = 4, 1
    wrong = ismrmrd.Acquisition(header, data=np.zeros((1, 4), np.complex128))
    with pytest.raises(ProtocolError, match="complex64"):
        frame_acquisition(wrong)


# ------------------------------------------------------------------------------------ timeouts, close


def test_timeout_between_messages_is_retryable_but_not_mid_frame(raw_pair):
    sock, stream = raw_pair
    stream.sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        stream.read_message()
    sock.sendall(frame_text("late"))
    assert stream.read_message() == Message(ID_TEXT, "late")
    frame = frame_acquisition(make_acquisition())
    sock.sendall(frame[:100])
    with pytest.raises(TimeoutError):
        stream.read_message()
    sock.sendall(frame[100:])
    with pytest.raises(ProtocolError, match="out of step.*TimeoutError"):
        stream.read_message()


def test_close_is_idempotent_and_unblocks_a_reader(pair):
    sender, receiver = pair
    outcome = []

    def read():
        try:
            receiver.read_message()
        except (ConnectionClosed, OSError) as error:
            outcome.append(error)

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(0.1)
    receiver.close()
    receiver.close()
    assert receiver.closed
    thread.join(5)
    assert not thread.is_alive() and len(outcome) == 1
    sender.close()
    sender.close()


# ------------------------------------------------------------------------------------ threads


def test_concurrent_sends_never_interleave(pair):
    """4 threads send large acquisitions (bigger than the socket buffer, so sendall writes them
    in pieces) while the reader checks every message is whole and each thread's are in order."""
    sender, receiver = pair
    threads, per_thread, samples, channels = 4, 12, 4096, 8

    def acquisition(thread: int, seq: int):
        value = np.complex64(thread * 1000 + seq + 0.5j)
        acq = ismrmrd.Acquisition.from_array(np.full((channels, samples), value, np.complex64))
        acq.user_int[0], acq.user_int[1] = thread, seq
        return acq

    def send(thread: int):
        for seq in range(per_thread):
            sender.send_acquisition(acquisition(thread, seq))

    workers = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    last = [-1] * threads
    for _ in range(threads * per_thread):
        message = receiver.read_message()
        assert message.id == ID_ACQUISITION
        acq = message.payload
        thread, seq = acq.user_int[0], acq.user_int[1]
        assert seq == last[thread] + 1
        last[thread] = seq
        np.testing.assert_array_equal(acq.data, acquisition(thread, seq).data)
    for worker in workers:
        worker.join()
    assert last == [per_thread - 1] * threads


def test_one_stream_shared_by_a_reader_thread_and_writer_threads(pair):
    """Our end: 4 writer threads and a reader thread on one MrdStream; the peer echoes."""
    ours, peer = pair
    count = 4 * 25

    def echo():
        for _ in range(count):
            peer.send_message(peer.read_message())

    echoer = threading.Thread(target=echo)
    echoer.start()
    got = []
    reader = threading.Thread(target=lambda: got.extend(ours.read_message() for _ in range(count)))
    reader.start()

    def send(thread: int):
        for seq in range(25):
            ours.send_acquisition(make_acquisition(thread * 100 + seq, samples=64))

    writers = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    for thread in writers:
        thread.start()
    for thread in writers + [reader, echoer]:
        thread.join(10)
    assert sorted(m.payload.user_int[0] for m in got) == sorted(
        t * 100 + s for t in range(4) for s in range(25))
    for message in got:
        assert_acquisitions_equal(message.payload, make_acquisition(message.payload.user_int[0], samples=64))


def test_send_message_forwards_what_read_message_returned(pair):
    sender, receiver = pair
    messages = [Message(ID_CONFIG_FILE, "a.xml"), Message(ID_TEXT, "t"), Message(ID_ERROR, "e"),
                Message(ID_CLOSE, None)]
    for message in messages:
        sender.send_message(message)
    assert [receiver.read_message() for _ in messages] == messages
    with pytest.raises(ProtocolError, match="unknown message id 6"):
        protocol.frame_message(Message(6, None))


def test_an_announced_length_costs_memory_only_as_its_bytes_arrive(pair):
    """A peer that announces an 8 MiB text and sends 100 bytes makes the reader hold at most the
    eager buffer (64 KiB), not the 8 MiB it announced."""
    import tracemalloc

    from masc_gadget.mrd.protocol import EAGER_BYTES

    sender, receiver = pair
    sender.sock.sendall(struct.pack("<HI", ID_TEXT, 8 << 20) + b"x" * 100)
    sender.sock.shutdown(socket.SHUT_WR)
    tracemalloc.start()
    try:
        with pytest.raises(ConnectionClosed, match="truncated frame"):
            receiver.read_message()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert EAGER_BYTES == 64 << 10 and peak < 4 * EAGER_BYTES
