"""The wire against hostile peers: read deadlines a drip cannot renew, interrupting a stream,
XML without DTDs or deep nesting, error messages that quote values briefly."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import pytest

from masc_gadget.config import quote
from masc_gadget.mrd.header import MAX_XML_DEPTH, parse_header, parse_xml, slice_limit
from masc_gadget.mrd.frames import (ID_CLOSE, ID_TEXT, frame_close, frame_text, ConnectionClosed, Message,
                                    ProtocolError, ReadTimeout)
from masc_gadget.mrd.protocol import MrdStream

from tests.masc_gadget.mrd.messages import HEADER_XML


def _drip(sock: socket.socket, data: bytes, every: float) -> threading.Thread:
    def run():
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(every)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_dripped_message_cannot_renew_its_deadline(raw_pair):
    sender, stream = raw_pair
    _drip(sender, frame_text("x" * 100), every=0.02)  # each byte well within the 5 s socket timeout
    start = time.monotonic()
    with pytest.raises(ReadTimeout, match="not received before the deadline") as info:
        stream.read_message(message_timeout=0.3)
    assert 0.25 < time.monotonic() - start < 1.0
    assert info.value.started and isinstance(info.value, socket.timeout)
    with pytest.raises(ProtocolError, match="out of step"):  # part of a frame was consumed
        stream.read_message()


def test_a_deadline_before_the_first_byte_leaves_the_stream_usable(raw_pair):
    sender, stream = raw_pair
    with pytest.raises(ReadTimeout) as info:
        stream.read_message(deadline=time.monotonic() + 0.1)
    assert not info.value.started
    assert stream.sock.gettimeout() == 5.0  # restored
    sender.sendall(frame_text("hello"))
    assert stream.read_message(deadline=time.monotonic() + 1, message_timeout=1) == Message(ID_TEXT, "hello")
    assert stream.sock.gettimeout() == 5.0


def test_the_idle_timeout_still_applies_under_a_message_timeout(raw_pair):
    _, stream = raw_pair
    stream.sock.settimeout(0.1)
    with pytest.raises(socket.timeout) as info:
        stream.read_message(message_timeout=10)
    assert not isinstance(info.value, ReadTimeout)


def test_interrupt_sends_the_close_message_and_wakes_a_blocked_reader():
    a, b = socket.socketpair()
    ours, theirs = MrdStream(a), MrdStream(b)
    errors = []

    def reader():
        try:
            ours.read_message()
        except ConnectionClosed as err:
            errors.append(err)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    assert ours.interrupt(frame_close())
    thread.join(2)
    assert not thread.is_alive() and errors and errors[0].clean
    assert theirs.read_message().id == ID_CLOSE
    with pytest.raises(OSError, match="interrupted"):
        ours.send_close()
    ours.close()
    theirs.close()


def test_interrupt_never_waits_for_a_send_in_progress():
    a, b = socket.socketpair()
    ours = MrdStream(a)
    a.settimeout(5)
    big = frame_text("x" * (4 << 20))
    thread = threading.Thread(target=lambda: _send_quietly(ours, big), daemon=True)
    thread.start()  # blocks: nobody reads b
    time.sleep(0.2)
    start = time.monotonic()
    assert not ours.interrupt(frame_close(), lock_timeout=0.1)
    assert time.monotonic() - start < 1
    thread.join(2)
    assert not thread.is_alive()
    ours.close()
    b.close()


def _send_quietly(stream, frame):
    try:
        stream.send_frame(frame)
    except OSError:
        pass


BILLION_LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
                  + "".join(f'<!ENTITY lol{i} "' + f"&lol{i - 1 if i > 1 else ''};" * 10 + '">'
                            for i in range(1, 10))
                  + "]><ismrmrdHeader>&lol9;</ismrmrdHeader>")


def test_xml_from_a_peer_has_no_doctype_and_bounded_nesting():
    assert parse_xml("<a><b/></a>", "x").tag == "a"
    with pytest.raises(ValueError, match=r"x: XML document type declarations \(<!DOCTYPE>\) are not allowed"):
        parse_xml(BILLION_LAUGHS, "x")
    deep = "<a>" * (MAX_XML_DEPTH + 1) + "</a>" * (MAX_XML_DEPTH + 1)
    with pytest.raises(ValueError, match="x: XML nested deeper than 32 elements"):
        parse_xml(deep, "x")
    parse_xml("<a>" * MAX_XML_DEPTH + "</a>" * MAX_XML_DEPTH, "x")


@pytest.mark.parametrize("xml, message", [
    (BILLION_LAUGHS, "document type declarations"),
    (HEADER_XML.replace("<encodingLimits/>", "<a>" * 100_000 + "</a>" * 100_000), "nested deeper than 32"),
])
def test_hostile_headers_are_refused_quickly(xml, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"ISMRMRD header does not parse: .*{message}"):
        parse_header(xml)
    assert time.monotonic() - start < 2


def test_header_errors_quote_a_value_briefly():
    huge = "7" * 3000 + "abc"
    with pytest.raises(ValueError) as info:
        parse_header(HEADER_XML.replace("63500000", huge))
    assert len(str(info.value)) < 600 and huge not in str(info.value)


def test_slice_limit():
    assert slice_limit(parse_header(HEADER_XML)) is None
    limited = HEADER_XML.replace("<encodingLimits/>", "<encodingLimits><slice><minimum>0</minimum>"
                                 "<maximum>3</maximum><center>0</center></slice></encodingLimits>")
    assert slice_limit(parse_header(limited)) == 4


def test_quote_is_bounded_for_any_value():
    shared = ["x"] * 9
    for _ in range(12):  # what a YAML alias bomb builds: 9 ** 12 items, shared
        shared = [shared] * 9
    tracemalloc.start()
    text = quote(shared)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(text) <= 80 and peak < 1 << 20
    assert "..." in quote("a" * 10_000) and len(quote("a" * 10_000)) <= 80
    assert quote("short") == "'short'"
