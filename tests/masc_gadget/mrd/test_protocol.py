"""MRD stream protocol: round trips, byte-identity with the gadgetron client, text.

Loopback only (socketpair and 127.0.0.1 TCP); every test runs in well under a second.
"""

from __future__ import annotations

import socket
import struct
import threading

import ismrmrd
import numpy as np
import pytest
from gadgetron.external import constants as gconstants
from gadgetron.external import readers as greaders
from gadgetron.external import writers as gwriters
from gadgetron.external.connection import Connection

from masc_gadget.mrd.frames import (ID_ACQUISITION, ID_CLOSE, ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_ERROR, ID_FEEDBACK,
                                    ID_HEADER, ID_IMAGE, ID_TEXT, ID_WAVEFORM, MESSAGE_NAMES, decode_text,
                                    frame_acquisition, frame_close, frame_config_file, frame_config_text,
                                    frame_error, frame_header, frame_image, frame_text, frame_waveform,
                                    ConnectionClosed, Message, ProtocolError)
from masc_gadget.mrd.protocol import MrdStream
from tests.masc_gadget.mrd.messages import (CONFIG_XML, HEADER_XML, IMAGE_DTYPES, Sink, Source, assert_acquisitions_equal,
                                            assert_images_equal, gadgetron_frame, header_bytes, make_acquisition,
                                            make_image, make_waveform)


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
