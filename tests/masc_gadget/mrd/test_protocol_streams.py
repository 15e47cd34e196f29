"""MRD stream protocol under stress: short reads, EOF, hostile lengths and ids, limits, timeouts,
close, threads.

Loopback only (socketpair and 127.0.0.1 TCP); every test runs in well under a second.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import ismrmrd
import numpy as np
import pytest

from masc_gadget.mrd import protocol
from masc_gadget.mrd.frames import (ID_ACQUISITION, ID_CLOSE, ID_CONFIG_FILE, ID_CONFIG_TEXT, ID_ERROR, ID_HEADER,
                                    ID_IMAGE, ID_TEXT, ID_WAVEFORM, frame_acquisition, frame_close, frame_image,
                                    frame_text, frame_waveform, ConnectionClosed, Limits,
                                    Message, ProtocolError)
from masc_gadget.mrd.protocol import MrdStream
from tests.masc_gadget.mrd.messages import (assert_acquisitions_equal, make_acquisition, make_image, make_waveform,
                                            recv_exactly)


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
