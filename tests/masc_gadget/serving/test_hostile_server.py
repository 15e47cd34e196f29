"""``masc serve`` against hostile clients: each test is one defect of the attack report, played
over real sockets on 127.0.0.1 with synthetic headers and lines; every test also checks that the
server still answers a well-behaved client."""

from __future__ import annotations

import logging
import socket
import threading
import time
from xml.sax.saxutils import escape as xml_escape

import numpy as np
import pytest

from masc_gadget.mrd.frames import ID_CLOSE, ID_IMAGE, ID_TEXT
from masc_gadget.serving.server import MascServer

from tests.masc_gadget.serving.hostile import (
    LINES, assert_serves, connect, drain, errors_of, good_scan, header_xml, line, listening_port, open_scan, running_server,
)


def alias_bomb(levels: int = 6, width: int = 9) -> str:
    """A YAML flow sequence whose anchors expand to ``width ** levels`` items, escaped for an
    XML attribute."""
    parts = ["&a0 [" + ", ".join(["x"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return xml_escape("[" + ", ".join(parts) + "]")


@pytest.fixture(scope="module")
def server():
    with running_server() as (srv, port):
        yield srv, port


# ------------------------------------------------------------------ 1, 2: config script values

def test_yaml_alias_bomb_in_the_config_script_gets_a_short_error(server):
    _, port = server
    script = f'<configuration><property name="budget" value="{alias_bomb()}"/></configuration>'
    start = time.monotonic()
    _, texts, ids = errors_of(port, lambda s: (s.send_config_text(script), s.send_header(header_xml())))
    assert time.monotonic() - start < 5
    assert len(texts) == 1 and len(texts[0]) < 300, [t[:200] for t in texts]
    assert "configuration.budget: must be an integer" in texts[0]  # no YAML parser sees it
    assert ids[-1] == ID_CLOSE
    assert_serves(port)


def test_empty_property_value_is_the_empty_string(server):
    _, port = server
    script = '<configuration><property name="mar_checkpoint" value=""/></configuration>'

    def send(stream):
        stream.send_config_text(script)
        stream.send_header(header_xml(slices=1))
        for pe in LINES:
            stream.send_acquisition(line(0, pe))
        stream.send_close()

    images, texts, _ = errors_of(port, send)
    assert not texts and sorted(images) == [0]


# ------------------------------------------------------------------ 3: caps on the header

@pytest.mark.parametrize("n_pe, n_ro, slices, rule", [
    (16384, 4096, 2, "exceeds this server's limit of 1024 x 1024 (server.max_matrix)"),
    (16, 16, 65535, "exceeds this server's limit of 256 slices (server.max_slices)"),
])
def test_header_over_the_caps_is_refused_at_the_header(server, n_pe, n_ro, slices, rule):
    _, port = server
    _, texts, ids = errors_of(port, lambda s: (s.send_config_file("default"),
                                               s.send_header(header_xml(n_pe, n_ro, slices))))
    assert len(texts) == 1 and rule in texts[0], texts
    assert ids[-1] == ID_CLOSE
    assert_serves(port)


def test_caps_are_configurable():
    with running_server("server.max_matrix=[8,32]", "server.max_slices=1") as (_, port):
        _, texts, _ = errors_of(port, lambda s: (s.send_config_file("default"), s.send_header(header_xml())))
        assert "limit of 8 x 32" in texts[0]
        _, texts, _ = errors_of(port, lambda s: (s.send_config_file("default"),
                                                 s.send_header(header_xml(8, 16, slices=2))))
        assert "limit of 1 slices" in texts[0]


@pytest.mark.parametrize("slices", [2, None])
def test_line_beyond_the_slice_limit_is_rejected(slices):
    """Beyond the header's slice limit; without one, beyond server.max_slices."""
    with running_server("server.max_slices=4") as (_, port):
        far = 2 if slices else 4

        def send(stream):
            stream.send_config_file("default")
            stream.send_header(header_xml(slices=slices))
            for pe in LINES:
                stream.send_acquisition(line(0, pe))
            stream.send_acquisition(line(far, 8))
            stream.send_acquisition(line(65_000, 8))
            stream.send_close()

        images, texts, _ = errors_of(port, send)
        last = 1 if slices else 3
        assert sorted(images) == [0]
        assert texts == [f"MASC error: slice {far}: beyond the header's slice limit (slices 0 to {last}); "
                         "acquisition skipped",
                         f"MASC error: slice 65000: beyond the header's slice limit (slices 0 to {last}); "
                         "acquisition skipped"]


# ------------------------------------------------------------------ 4: idle and drip clients

def test_idle_clients_in_the_handshake_take_no_slot():
    with running_server("server.max_connections=2") as (_, port):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        try:
            time.sleep(0.2)
            start = time.monotonic()
            assert_serves(port)
            assert time.monotonic() - start < 2.5  # not after the idle ones' deadline
        finally:
            for sock in idle:
                sock.close()


def test_handshake_must_end_within_its_deadline_even_when_dripped():
    with running_server("server.handshake_timeout_s=1", "server.message_timeout_s=30") as (_, port):
        silent = connect(port)
        dripper = connect(port)
        frame = b"\x01\x00" + b"default".ljust(1024, b"\x00")
        start = time.monotonic()
        for byte in frame[:12]:
            try:
                dripper._sock.sendall(bytes([byte]))
            except OSError:  # the server gave up on it
                break
            time.sleep(0.15)
        for stream in (silent, dripper):
            _, texts, ids = drain(stream)
            stream.close()
            assert texts == ["MASC error: handshake (configuration, header) not completed within 1 s"]
            assert ids[-1] == ID_CLOSE
        assert time.monotonic() - start < 4
        assert_serves(port)


def test_a_message_must_end_within_its_deadline_even_when_dripped():
    with running_server("server.message_timeout_s=1", "server.idle_timeout_s=30") as (_, port):
        stream = connect(port)
        stream.send_config_file("default")
        stream.send_header(header_xml(slices=1))
        for pe in LINES:
            stream.send_acquisition(line(0, pe))
        start = time.monotonic()
        frame = b"\xf0\x03" + bytes(340)  # an acquisition, dripped: every byte renews the idle timeout
        for byte in frame[:15]:
            try:
                stream._sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
        images, texts, ids = drain(stream)
        stream.close()
        assert time.monotonic() - start < 4
        assert sorted(images) == [0]  # the slice held when the drip was cut off
        assert texts == ["MASC error: message not completed within 1 s of its first byte"]
        assert_serves(port)


def test_idle_sockets_cannot_lock_a_client_out_the_oldest_goes():
    """Regression: 64 idle sockets used to lock every client out (token holders included)."""
    with running_server("server.max_pending=2") as (_, port):
        idle = [connect(port) for _ in range(2)]
        time.sleep(0.2)
        assert_serves(port)  # a third connection makes room: the oldest idle one is closed
        _, texts, ids = drain(idle[0])
        assert texts == ["MASC error: server busy: closed before the end of the handshake to make room for a "
                         "newer connection; 2 connections were in their handshake (server.max_pending)"]
        assert ids[-1] == ID_CLOSE
        for stream in idle:
            stream.close()


def test_one_address_has_its_own_handshake_limit():
    with running_server("server.max_pending_per_peer=1") as (_, port):
        idle = connect(port)
        time.sleep(0.2)
        assert_serves(port)
        assert "(server.max_pending_per_peer)" in drain(idle)[1][0]
        idle.close()


def test_a_full_server_says_busy_after_the_handshake():
    with running_server("server.max_connections=1", "server.handshake_timeout_s=1") as (_, port):
        holder = open_scan(port)
        time.sleep(0.2)
        _, texts, _ = errors_of(port, lambda s: (s.send_config_file("default"), s.send_header(header_xml())))
        assert texts == ["MASC error: server busy: all 1 connection slots are in use "
                         "(server.max_connections); try again later"]
        holder.send_close()
        assert drain(holder)[2] == [ID_CLOSE]
        holder.close()
        assert_serves(port)


# ------------------------------------------------------------------ 5, 9: configuration names

def test_configuration_names_cannot_leave_the_config_folders(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    (tmp_path / "secret.yaml").write_text("SECRET-CONTENT: 1\n")
    (folder / "broken.yaml").write_text("acquisition: [SECRET-BROKEN\n")
    with running_server(folders=[folder]) as (_, port):
        for name in ("../secret", "../../etc/x", "..", "a/b", "/etc/passwd", "..\\secret", "broken"):
            _, texts, _ = errors_of(port, lambda s: (s.send_config_file(name), s.send_header(header_xml())))
            assert len(texts) == 1, (name, texts)
            assert "SECRET" not in texts[0] and str(tmp_path) not in texts[0]
            if name == "broken":
                assert texts[0] == "MASC error: configuration 'broken' cannot be used (see the server log)"
            else:
                assert "is not a plain name (letters, digits, '_', '.', '-'; no path separators, no '..')" \
                    in texts[0], texts
        assert_serves(port)


def test_a_long_configuration_name_gets_an_error(server):
    _, port = server
    _, texts, _ = errors_of(port, lambda s: (s.send_config_file("x" * 1023), s.send_header(header_xml())))
    assert texts == ["MASC error: configuration name is 1023 characters, more than the limit 64"]


# ------------------------------------------------------------------ 6: framing error mid-scan

@pytest.mark.parametrize("garbage, error", [
    (np.uint16(4321).tobytes(), "unknown message id 4321"),
    (np.uint16(5).tobytes() + np.uint32(2**31).tobytes(), "text: length 2147483648 exceeds the limit"),
    (np.uint16(1008).tobytes() + bytes(100), "truncated frame"),
])
def test_a_framing_error_mid_scan_returns_the_slices_acquired_so_far(server, garbage, error):
    _, port = server

    def send(stream):
        stream.send_config_file("default")
        stream.send_header(header_xml(slices=2))
        for s in (0, 1):
            for pe in LINES:
                stream.send_acquisition(line(s, pe))
        stream._sock.sendall(garbage)
        stream._sock.shutdown(socket.SHUT_WR)

    images, texts, ids = errors_of(port, send)
    assert sorted(images) == [0, 1]
    assert len(texts) == 1 and error in texts[0], texts
    assert ids == [ID_IMAGE] * 4 + [ID_TEXT, ID_CLOSE]  # two slices, each its MAR and zero-filled series
    assert_serves(port)


# ------------------------------------------------------------------ 7: who may connect

def test_the_allow_list_refuses_other_addresses():
    with running_server("server.allow=[10.0.0.0/8, 'fd00::/8']") as (_, port):
        _, texts, ids = errors_of(port, lambda stream: None)
        assert texts == ["MASC error: this client address is not allowed to connect (server.allow)"]
    with running_server("server.allow=[10.0.0.0/8, 127.0.0.1]") as (_, port):
        assert_serves(port)


def test_a_token_is_required_before_any_acquisition(caplog):
    caplog.set_level(logging.INFO)
    secret = "s3cret-Token"
    with running_server(f"server.token={secret}") as (_, port):
        for params, error in [(None, "authentication required"), ({"policy": "random"}, "authentication required"),
                              ({"token": "wrong"}, "authentication failed: wrong token"),
                              ({"token": 7}, "authentication required"),
                              ({"token": "\ud800"}, "authentication failed: wrong token")]:  # a lone surrogate
            images, texts = good_scan(port, params=params)
            assert not images and len(texts) == 1 and error in texts[0], texts
            assert secret not in texts[0]
        assert_serves(port, params={"token": secret, "policy": "random"})
    assert secret not in caplog.text


def test_a_token_sent_to_a_server_without_one_is_ignored(server):
    assert_serves(server[1], params={"token": "anything"})


def test_listening_beyond_loopback_logs_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="masc_gadget.serving.server")
    with running_server(host="0.0.0.0"):
        pass
    assert "listening on 0.0.0.0, reachable from other hosts: no allow-list (server.allow)" in caplog.text
    caplog.clear()
    with running_server():
        pass
    assert "reachable from other hosts" not in caplog.text


# ------------------------------------------------------------------ 8: shutdown

def test_shutdown_closes_every_connection_within_its_deadline():
    with running_server() as (server, port):
        started = []
        for _ in range(4):  # handshake done, then idle
            stream = connect(port)
            stream.send_config_file("default")
            stream.send_header(header_xml())
            started.append(stream)
        in_handshake = [connect(port) for _ in range(2)]
        time.sleep(0.3)
        start = time.monotonic()
        server.shutdown(timeout=5)
        assert time.monotonic() - start < 2
        for stream in started + in_handshake:  # each is told why, then closed
            _, texts, ids = drain(stream, timeout=2)
            stream.close()
            assert ids == [ID_TEXT, ID_CLOSE] and "the server is shutting down" in texts[0], (ids, texts)
        with pytest.raises(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.recv(1)


# ------------------------------------------------------------------ 9: nesting, device

@pytest.mark.parametrize("params, error", [
    ("[" * 100_000 + "]" * 100_000, "parameters text is 200000 characters, more than the limit 65536"),
    ("[" * 30_000 + "]" * 30_000, "parameters text nests arrays / objects deeper than the limit 8"),
    ('{"budget": ' + "[" * 50 + "]" * 50 + "}", "deeper than the limit 8"),
    ('{"device": "meta"}', "device must be cpu, cuda, cuda:N or auto, got 'meta'"),
    ('{"policy": "' + "p" * 20_000 + '", "budget": "' + "b" * 20_000 + '"}', "parameters.budget: must be an integer"),
])
def test_bad_parameters_get_a_clear_short_error(server, params, error):
    _, port = server

    def send(stream):
        stream.send_config_file("default")
        stream.send_header(header_xml())
        stream.send_text(params)
        stream.send_acquisition(line(0, 8))
        stream.send_close()

    _, texts, _ = errors_of(port, send)
    assert len(texts) == 1 and error in texts[0] and len(texts[0]) < 300, [t[:300] for t in texts]
    assert "internal error" not in texts[0]


@pytest.mark.parametrize("where", ["config", "header"])
def test_deep_xml_gets_a_clear_error(server, where):
    _, port = server
    deep = "<a>" * 10_000 + "</a>" * 10_000  # within server.max_handshake_bytes
    config = f"<configuration>{deep}</configuration>" if where == "config" else "<configuration/>"
    header = header_xml().replace("<trajectory>", deep + "<trajectory>") if where == "header" else header_xml()
    _, texts, _ = errors_of(port, lambda s: (s.send_config_text(config), s.send_header(header)))
    assert len(texts) == 1 and "XML nested deeper than 32 elements" in texts[0], [t[:300] for t in texts]


# ------------------------------------------------------------------ 10: listen after warm-up

def test_the_port_accepts_connections_only_after_the_warm_up(monkeypatch):
    seen = []
    real = MascServer.warm_up

    def warm_up(self, *args, **kwargs):
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            seen.append("accepted")
        except ConnectionRefusedError:
            seen.append("refused")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MascServer, "warm_up", warm_up)
    with running_server() as (_, port):
        assert seen == ["refused"]
        assert_serves(port)


# ------------------------------------------------------------------ 11: a Gadgetron stream XML

def test_a_gadgetron_stream_xml_is_a_config_script(server):
    _, port = server
    script = ('<?xml version="1.0"?><configuration><version>2</version><readers><reader>'
              "<dll>gadgetron_core_readers</dll><classname>AcquisitionReader</classname></reader></readers>"
              '<stream><external><execute name="masc_gadget.serving.gadget" target="masc" type="python"/>'
              '<configuration><property name="feedback" value="inband"/></configuration></external></stream>'
              "</configuration>")

    def send(stream):
        stream.send_config_text(script)
        stream.send_header(header_xml(slices=1))
        for pe in (8, 7):  # its feedback is in-band: closed loop, one decision per line after the first
            stream.send_acquisition(line(0, pe))
        stream.send_close()

    images, texts, ids = errors_of(port, send)
    assert not texts and sorted(images) == [0]
    assert ids.count(1008) >= 1  # in-band decisions: the stream XML's feedback property was applied


# ------------------------------------------------------------------ all at once

def test_hostile_clients_at_the_same_time_do_not_disturb_a_good_one(server):
    _, port = server
    results = {}

    def good():
        results["good"] = good_scan(port)

    hostile = [connect(port) for _ in range(10)]
    thread = threading.Thread(target=good)
    thread.start()
    for stream in hostile[:5]:
        stream.send_config_text(f'<configuration><property name="budget" value="{alias_bomb()}"/></configuration>')
    for stream in hostile[5:]:
        stream._sock.sendall(b"\x01\x00../../etc")
    thread.join(20)
    images, texts = results["good"]
    assert sorted(images) == [0, 1] and not texts
    for stream in hostile:
        stream.close()


def test_sigterm_closes_idle_connections_and_exits_within_seconds():
    import signal
    import subprocess
    import sys

    from tests.conftest import CONFIGS

    proc = subprocess.Popen(
        [sys.executable, "-m", "masc_gadget.cli", "serve", "--config", str(CONFIGS / "tiny.yaml"),
         "--set", "gadget.device=cpu", "--port", "0"],
        stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(proc)
        streams = []
        for _ in range(8):
            stream = connect(port)
            stream.send_config_file("default")
            stream.send_header(header_xml())
            streams.append(stream)
        time.sleep(0.3)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 3
        for stream in streams:
            _, texts, ids = drain(stream, timeout=2)
            assert ids == [ID_TEXT, ID_CLOSE] and "the server is shutting down" in texts[0], (ids, texts)
            stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
