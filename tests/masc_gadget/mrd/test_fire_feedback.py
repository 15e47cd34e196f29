"""Message 1028 "feedback" (FIRE-style): framing round trip, MASC's decision payload, and
hostile lengths refused before anything is allocated."""

import socket
import struct

import pytest

from masc_gadget.acquisition.decision import Decision
from masc_gadget.mrd.feedback import FIRE_NAME, decision_from_fire, fire_feedback
from masc_gadget.mrd.frames import ID_FEEDBACK, frame_feedback, Feedback, Limits, ProtocolError
from masc_gadget.mrd.protocol import MrdStream


def test_feedback_frame_layout_and_round_trip():
    message = Feedback("x.y", b"\x01\x02")
    assert frame_feedback(message) == struct.pack("<HI3sI2s", 1028, 3, b"x.y", 2, b"\x01\x02")
    a, b = socket.socketpair()
    try:
        MrdStream(a).send_feedback(message)
        got = MrdStream(b).read_message()
    finally:
        a.close()
        b.close()
    assert got.id == ID_FEEDBACK and got.name == "feedback" and got.payload == message


def test_masc_decision_round_trip_and_layout():
    decision = Decision(slice=3, line=41, step=2, latency_us=1234)
    message = fire_feedback(decision)
    assert message.name == FIRE_NAME == "masc.next_lines"
    assert message.data == struct.pack("<IIIII", 3, 2, 1234, 1, 41)
    assert decision_from_fire(message) == decision


@pytest.mark.parametrize("message, match", [
    (Feedback("other", struct.pack("<IIIII", 0, 0, 0, 1, 5)), "is not 'masc.next_lines'"),
    (Feedback(FIRE_NAME, b"\x00" * 8), "shorter than its 16-byte head"),
    (Feedback(FIRE_NAME, struct.pack("<IIII", 0, 0, 0, 0)), "at least one"),
    (Feedback(FIRE_NAME, struct.pack("<IIII", 0, 0, 0, 2) + b"\x00" * 4), "do not hold 2 line"),
])
def test_bad_masc_payloads_name_the_problem(message, match):
    with pytest.raises(ValueError, match=match):
        decision_from_fire(message)


def test_hostile_feedback_lengths_are_refused_before_reading():
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack("<HI", 1028, 2**31))  # a 2 GB name
        with pytest.raises(ProtocolError, match="feedback name: length"):
            MrdStream(b, Limits(max_text_bytes=1024)).read_message()
    finally:
        a.close()
        b.close()
