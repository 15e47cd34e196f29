"""One host for every entry point: the defects a hostile client found in ``masc serve`` and in
connect mode (denial of service, trust), each with the test that failed before the
fix (real sockets, loopback only)."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from masc_gadget.config import ConfigError
from masc_gadget.mrd.header import parse_header
from masc_gadget.mrd.frames import ID_CLOSE, ID_ERROR, ID_IMAGE
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.host import Host
from masc_gadget.serving.settings import GadgetSettings, parameters_json, settings_from_xml

from tests.masc_gadget.serving.hostile import (CACHE, LINES, N_PE, N_RO, assert_serves, connect, connect_mode, drain,
                                               errors_of, gadgetron_stream, good_scan, header_xml, line, open_scan,
                                               running_server, settle, threads_named)


# ------------------------------------------------------------------------------ denial of service

def test_a_quoted_parameters_text_costs_milliseconds_not_seconds():
    """Regression: ``"\\"\\"\\"...`` (64 KiB) froze the server for 20-70 s in a quadratic regex."""
    text = '"' + '\\"' * (32 * 1024 - 1)
    start = time.process_time()
    with pytest.raises(ConfigError, match="not valid JSON"):
        parameters_json(text)
    assert time.process_time() - start < 1.0  # linear: milliseconds; it was tens of seconds


def test_nested_flow_collections_in_a_property_cost_milliseconds():
    """Regression: configuration properties went through yaml.parse, quadratic on nested flow
    collections (12 KB cost ~20 s)."""
    value = "[" * 1000 + "]" * 1000 + "{a: [" * 400  # 4000 characters, under the value limit
    script = "<configuration>" + "".join(f'<property name="{key}" value="{value}"/>'
                                         for key in ("budget", "initial", "seed")) + "</configuration>"
    start = time.process_time()
    with pytest.raises(ConfigError, match="configuration.(budget|initial|seed): must be an integer"):
        settings_from_xml(script, GadgetSettings())
    assert time.process_time() - start < 0.5


def test_idle_sockets_do_not_lock_out_a_client_with_the_token():
    with running_server("server.max_pending=4", "server.token=s3cret") as (_, port):
        idle = [connect(port) for _ in range(12)]
        time.sleep(0.3)
        images, texts = good_scan(port, params={"token": "s3cret"})
        assert sorted(images) == [0, 1] and not texts
        for stream in idle:
            stream.close()


def test_a_silent_slot_holder_gives_its_slot_to_a_waiting_client():
    """Regression: 32 silent connections after a handshake held every slot for up to 300 s."""
    with running_server("server.max_connections=1", "server.reclaim_idle_s=0.3") as (_, port):
        holder = open_scan(port)
        time.sleep(0.6)
        images, texts = good_scan(port)
        assert sorted(images) == [0, 1] and not texts
        _, texts, ids = drain(holder)
        assert "silent for" in texts[0] and "(server.reclaim_idle_s = 0.3 s)" in texts[0] and ids[-1] == ID_CLOSE
        holder.close()


def _stuck_holder(port, n=256, slices=32):
    """A client that opens ``slices`` slices of an n x n matrix and never reads: the images
    owed to it (2 series x slices x n x n x 4 bytes, 16 MiB) fill both socket buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    holder = MrdStream(sock)
    holder.send_config_file("default")
    holder.send_header(header_xml(n, n, slices=slices))
    for slice_index in range(slices):
        holder.send_acquisition(line(slice_index, n // 2, n_ro=n))
    return holder


def test_a_reclaimed_holder_that_never_reads_frees_its_slot_at_once():
    """Regression (serving round 4, item 3): the reclaim closed a holder that never reads, but
    its slot stayed taken while its images waited in a full socket (up to 300 s)."""
    with running_server("server.max_connections=1", "server.reclaim_idle_s=0.3",
                        "server.handshake_timeout_s=4") as (_, port):
        holder = _stuck_holder(port)
        time.sleep(0.6)
        start = time.monotonic()
        images, texts = good_scan(port)
        assert sorted(images) == [0, 1] and not texts and time.monotonic() - start < 3.0
        holder.close()


def test_a_waiting_client_takes_only_the_longest_silent_holders_slot():
    """Regression (serving round 4, item 3): one waiting client ended every silent holder's scan
    (the first one's slot stayed taken while it did not read, so the next was closed too)."""
    with running_server("server.max_connections=2", "server.reclaim_idle_s=0.3",
                        "server.handshake_timeout_s=4") as (server, port):
        older = _stuck_holder(port)
        # the older holder's last line read (its 32 slices of 256 x 256 open) before the younger's
        assert settle(lambda: server.host.budget.used == 32 * 256 * 256 * 8, seconds=10)
        younger = open_scan(port, (0, 8))
        assert settle(lambda: server.host.budget.used == 32 * 256 * 256 * 8 + N_PE * N_RO * 8, seconds=10)
        time.sleep(0.6)
        images, texts = good_scan(port)
        assert sorted(images) == [0, 1] and not texts
        younger.send_close()
        images, texts, ids = drain(younger)
        assert sorted(images) == [0] and not texts and ids[-1] == ID_CLOSE  # untouched
        older.close()
        younger.close()


def test_clients_waiting_for_a_slot_are_bounded():
    """Regression (serving round 4, item 3): slot waiters were unbounded (771 threads)."""
    with running_server("server.max_connections=1", "server.max_pending=2", "server.reclaim_idle_s=60") as (server, port):
        holder = open_scan(port, (0, 8))
        assert settle(lambda: len(server._slots) == 1)  # the holder has the slot
        waiters = []
        for n in (1, 2):  # one after the other: three sockets at once would also test pre-handshake eviction
            waiters.append(open_scan(port))
            assert settle(lambda: len(server._waiting) == n)  # through its handshake, waiting
        _, texts, _ = errors_of(port, lambda st: (st.send_config_file("default"), st.send_header(header_xml())))
        assert texts and "server busy: 2 clients already wait for a connection slot (server.max_pending)" in texts[0]
        for stream in (holder, *waiters):
            stream.close()


def test_idle_sockets_from_a_few_addresses_do_not_push_out_a_slow_handshake():
    """Regression (serving round 4, item 3): idle sockets from 8 loopback addresses evicted a
    client whose handshake arrived in pieces (served 1 of 72 times)."""
    with running_server("server.max_pending=4", "server.max_pending_per_peer=4",
                        "server.handshake_timeout_s=5") as (_, port):
        slow = connect(port)
        frame = b"\x01\x00" + b"default".ljust(1024, b"\x00")
        slow._sock.sendall(frame[:100])  # the handshake's first bytes
        time.sleep(0.2)
        idle = []
        for i in range(24):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((f"127.0.0.{2 + i % 8}", 0))
            sock.connect(("127.0.0.1", port))
            idle.append(sock)
        time.sleep(0.3)
        slow._sock.sendall(frame[100:])
        slow.send_header(header_xml())
        for pe in LINES:
            slow.send_acquisition(line(0, pe))
        slow.send_close()
        images, texts, _ = drain(slow)
        slow.close()
        for sock in idle:
            sock.close()
        assert sorted(images) == [0] and not texts


def test_one_address_holds_at_most_its_share_of_the_slots():
    with running_server("server.max_connections_per_peer=1", "server.handshake_timeout_s=1") as (server, port):
        holder = open_scan(port, (0, 8))
        assert settle(lambda: len(server._slots) == 1)  # the holder has its slot
        _, texts, _ = errors_of(port, lambda s: (s.send_config_file("default"), s.send_header(header_xml())))
        assert texts and "(server.max_connections_per_peer)" in texts[0]
        holder.send_close()
        drain(holder)
        holder.close()


def test_connect_mode_a_stream_cut_mid_frame_leaves_no_thread_behind():
    """Regression: a connection closed mid-frame (a TCP health check) left a thread spinning."""
    with connect_mode() as (port, _):
        before = threads_named("masc-127.0.0.1")
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(struct.pack("<HI", 2, 100) + b"<configur")  # then gone
            sock.close()
        assert settle(lambda: threads_named("masc-127.0.0.1") == before)
        images, texts, ids = gadgetron_stream(port)
        assert not texts and sorted(images) == [0, 1] and ids.count(ID_IMAGE) == 4  # MAR + zero-filled series


def test_connect_mode_has_a_handshake_deadline_and_a_connection_limit():
    with connect_mode("server.handshake_timeout_s=0.5", "server.max_connections=1") as (port, _):
        idle = connect(port)
        _, texts, ids = drain(idle, timeout=5)
        assert ids == [ID_ERROR, ID_CLOSE] and "handshake (configuration, header) not completed within 0.5 s" in texts[0]
        idle.close()
        holder = open_scan(port, (0, 8), script="<configuration/>")
        time.sleep(0.2)
        _, texts, ids = gadgetron_stream(port)
        assert ids[-2:] == [ID_ERROR, ID_CLOSE] and "(server.max_connections)" in texts[0]
        holder.send_close()
        drain(holder)
        holder.close()


def test_connect_mode_answers_a_header_that_does_not_parse():
    with connect_mode() as (port, _):
        _, texts, ids = gadgetron_stream(port, header="<ismrmrdHeader><encoding>", lines=())
        assert ids == [ID_ERROR, ID_CLOSE] and "header" in texts[0].lower()


def test_the_side_channel_cannot_point_at_the_server_itself():
    with running_server() as (_, port):
        images, texts = good_scan(port, params={"zmq_address": f"tcp://127.0.0.1:{port}"})
        assert not images and texts and f"points at port {port}, where this server itself listens" in texts[0]
        assert_serves(port)


# ------------------------------------------------------------------------------ trust

def test_connect_mode_does_not_load_a_model_path_the_stream_names(tmp_path):
    path = tmp_path / "mine.pt"
    path.write_bytes(b"not a checkpoint")
    config = f'<configuration><property name="mar_checkpoint" value="{path}"/></configuration>'
    with connect_mode() as (port, _):
        _, texts, ids = gadgetron_stream(port, config=config)
        assert ids[-2:] == [ID_ERROR, ID_CLOSE] and "mar_checkpoint" in texts[0]
        assert str(tmp_path) not in texts[0]


def test_connect_mode_keeps_the_side_channel_inside_the_allow_list():
    config = '<configuration><property name="zmq_address" value="tcp://192.0.2.1:9003"/></configuration>'
    with connect_mode() as (port, _):
        _, texts, ids = gadgetron_stream(port, config=config)
        assert ids[-2:] == [ID_ERROR, ID_CLOSE] and "is not allowed" in texts[0]


def test_connect_mode_refuses_a_header_over_the_caps():
    with connect_mode() as (port, _):
        _, texts, ids = gadgetron_stream(port, header=header_xml(n_pe=8192, n_ro=8192), lines=())
        assert ids == [ID_ERROR, ID_CLOSE] and "(server.max_matrix)" in texts[0]


def test_execute_mode_applies_the_host_too():
    from masc_gadget.serving.gadget import masc
    from masc_gadget.serving.host import ClientError

    class Stream:  # what gadgetron.external.Connection offers
        config = '<configuration><property name="mar_checkpoint" value="/etc/passwd"/></configuration>'
        header = parse_header(header_xml())

        def __iter__(self):
            return iter([line(0, pe) for pe in LINES])

        def send(self, item):
            pass

    with pytest.raises(ConfigError, match="mar_checkpoint"):
        masc(Stream(), host=Host(cache=CACHE))
    Stream.config = "<configuration/>"
    Stream.header = parse_header(header_xml(n_pe=4096, n_ro=64))
    with pytest.raises(ClientError, match="server.max_matrix"):
        masc(Stream(), host=Host(cache=CACHE))
