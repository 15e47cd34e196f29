"""Bounded fuzzing of ``masc serve``: random and mutated MRD byte streams against a live server.

Each case is one connection that sends a seeded stream (a valid scan mutated, or random bytes),
ends its side and reads until the server closes. Every case must end with the server closing
the connection, its replies must be bounded ``MASC error:`` texts (never an internal error), and
the server must then still answer a good client. The default run plays 2000 cases; the ``slow``
one 8000 more (``make test-all``).
"""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from masc_gadget.mrd.frames import (ID_CLOSE, frame_acquisition, frame_close, frame_config_file, frame_config_text,
                                    frame_header, frame_text)
from masc_gadget.serving.host import MAX_ERROR_CHARS

from tests.masc_gadget.serving.hostile import LINES, assert_serves, connect, drain, header_xml, line, running_server

INTERESTING = [0, 1, 2, 3, 4, 5, 8, 1008, 1022, 1026, 0x7F, 0xFF, 0xFFFF, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def valid_stream(rng: np.random.Generator) -> bytes:
    """A well-formed scan: configuration, header, maybe parameters, a few lines, close."""
    frames = [frame_config_file(str(rng.choice(["default", "center-out", "random"])))
              if rng.random() < 0.7 else
              frame_config_text('<configuration><property name="budget" value="2"/></configuration>')]
    slices = int(rng.integers(1, 3))
    frames.append(frame_header(header_xml(slices=slices)))
    if rng.random() < 0.5:
        frames.append(frame_text(json.dumps({"feedback": str(rng.choice(["none", "inband"])), "initial": 1})))
    for s in range(slices):
        for pe in LINES[: int(rng.integers(1, 4))]:
            frames.append(frame_acquisition(line(s, pe, seed=int(rng.integers(1000)))))
    frames.append(frame_close())
    return b"".join(frames)


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    """One to three random mutations: bit flips, truncation, insertion, deletion, duplication,
    an interesting integer written over a length or id field, or random bytes."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(7))
        at = int(rng.integers(max(1, len(buf))))
        if kind == 0:  # bit flips
            for pos in rng.integers(len(buf), size=int(rng.integers(1, 9))):
                buf[pos] ^= 1 << int(rng.integers(8))
        elif kind == 1:  # truncation
            del buf[at:]
        elif kind == 2:  # insertion of random bytes
            buf[at:at] = rng.bytes(int(rng.integers(1, 64)))
        elif kind == 3:  # deletion
            del buf[at:at + int(rng.integers(1, 64))]
        elif kind == 4:  # duplication
            buf[at:at] = buf[at:at + int(rng.integers(1, 2048))]
        elif kind == 5:  # an interesting value over 2, 4 or 8 bytes
            width = int(rng.choice([2, 4, 8]))
            value = int(rng.choice(INTERESTING)) % (1 << (8 * width))
            buf[at:at + width] = value.to_bytes(width, "little")
        else:  # random bytes, possibly after a valid prefix
            buf = buf[: at if rng.random() < 0.5 else 0] + bytearray(rng.bytes(int(rng.integers(1, 4096))))
        if not buf:
            buf = bytearray(rng.bytes(2))
    return bytes(buf)


def play(port: int, data: bytes) -> tuple[list[str], list[int]]:
    """Send ``data``, end our side, read until the server closes: (texts, message ids)."""
    stream = connect(port, timeout=15)
    try:
        try:
            stream._sock.sendall(data)
            stream._sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already gave up on this stream
            pass
        _, texts, ids = drain(stream, timeout=15)
        return texts, ids
    finally:
        stream.close()


def answers(port: int) -> bool:
    """A cheap good client: configuration, header, close; the server answers with close."""
    stream = connect(port, timeout=10)
    try:
        stream.send_config_file("default")
        stream.send_header(header_xml())
        stream.send_close()
        _, texts, ids = drain(stream, timeout=10)
        return ids == [ID_CLOSE] and not texts
    finally:
        stream.close()


def fuzz(cases: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with running_server("server.handshake_timeout_s=5", "server.message_timeout_s=5") as (_, port):
        for case in range(cases):
            data = mutate(rng, valid_stream(rng)) if rng.random() < 0.9 else rng.bytes(int(rng.integers(1, 2048)))
            texts, ids = play(port, data)
            where = f"case {case} (seed {seed}): {data[:64]!r}..."
            assert all(t.startswith("MASC error: ") and len(t) <= MAX_ERROR_CHARS + 12 for t in texts), where
            assert not any("internal error" in t for t in texts), (where, texts)
            assert answers(port), where
        assert_serves(port)


def test_fuzz_the_server():
    """2000 cases, ~5 s on a 2-core CPU."""
    fuzz(cases=2000, seed=20240601)


@pytest.mark.slow
def test_fuzz_the_server_longer():
    """8000 more cases, ~20 s on a 2-core CPU."""
    fuzz(cases=8000, seed=7)


def test_fuzz_connect_mode():
    """300 cases against connect mode (Gadgetron as the client): every case ends with the
    module closing the stream, with at most bounded error messages (8), and the module still
    serves a good stream afterwards."""
    from tests.masc_gadget.serving.test_host import connect_mode, gadgetron_stream

    rng = np.random.default_rng(11)
    with connect_mode("server.handshake_timeout_s=5", "server.message_timeout_s=5") as (port, _):
        for case in range(300):
            data = mutate(rng, valid_stream(rng)) if rng.random() < 0.9 else rng.bytes(int(rng.integers(1, 2048)))
            stream = connect(port, timeout=15)
            try:
                try:
                    stream._sock.sendall(data)
                    stream._sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                _, texts, _ = drain(stream, timeout=15)
            finally:
                stream.close()
            where = f"case {case}: {data[:64]!r}..."
            assert all(t.startswith("MASC error: ") and len(t) <= MAX_ERROR_CHARS + 12 for t in texts), where
            assert not any("internal error" in t for t in texts), (where, texts)
        images, texts, _ = gadgetron_stream(port)
        assert sorted(images) == [0, 1] and not texts
