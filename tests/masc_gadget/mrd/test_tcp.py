"""TCP options for closed-loop latency: set on TCP sockets, ignored elsewhere."""

import socket

import pytest

from masc_gadget.mrd import tcp


@pytest.fixture
def tcp_sockets():
    """(client, server) raw sockets over 127.0.0.1 TCP."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    yield client, server
    for s in (client, server, listener):
        s.close()


def test_no_delay_sets_tcp_nodelay(tcp_sockets):
    client, _ = tcp_sockets
    assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    tcp.no_delay(client)
    assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux only")
def test_quick_ack_sets_tcp_quickack(tcp_sockets):
    _, server = tcp_sockets
    tcp.quick_ack(server)
    assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) != 0


def test_other_sockets_and_objects_are_left_alone():
    a, b = socket.socketpair()
    try:
        tcp.no_delay(a)
        tcp.quick_ack(b)
        tcp.no_delay(object())
    finally:
        a.close()
        b.close()
