"""Fixtures of the MRD wire tests: stream pairs over a socket pair and over loopback TCP."""

import socket

import pytest

from masc_gadget.mrd.protocol import MrdStream


@pytest.fixture
def raw_pair():
    """(raw socket, MrdStream with a 5 s socket timeout): hand-made bytes to a reader."""
    a, b = socket.socketpair()
    b.settimeout(5.0)
    stream = MrdStream(b)
    yield a, stream
    a.close()
    stream.close()


@pytest.fixture
def tcp_pair():
    """(client, server) MrdStreams over 127.0.0.1 TCP."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    a, b = MrdStream(client), MrdStream(server)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def pair():
    """(sender, receiver) MrdStreams over an AF_UNIX socketpair."""
    a, b = socket.socketpair()
    sender, receiver = MrdStream(a), MrdStream(b)
    yield sender, receiver
    sender.close()
    receiver.close()
