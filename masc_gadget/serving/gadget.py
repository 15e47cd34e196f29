"""The MASC streaming gadget inside Gadgetron.

Execute mode: ``masc(connection)`` runs as an external Python module that Gadgetron starts per
stream (``<external><execute name="masc_gadget.serving.gadget" target="masc"
type="python"/>``). Connect mode: ``python -m masc_gadget.serving.gadget PORT [--config
FILE.yaml]`` loads and warms the models, then serves every stream Gadgetron opens on PORT,
concurrently, through ``masc serve``'s own listener (:mod:`masc_gadget.serving.server`, dialect
``gadgetron``). Both run the gadget loop :func:`~masc_gadget.serving.stages.process` with a
:class:`~masc_gadget.serving.host.Host`: the stream's ``<configuration>`` comes from whoever
opened the stream, so its model settings must be names the server offers, its side channel
an allowed endpoint, its header within ``server.max_matrix`` and ``server.max_slices``.

For every acquired line the loop updates the slice's k-space buffer (the scanner is the
authority on what was acquired), and once the slice's initial lines are in it reconstructs,
corrects (MAR) and asks the policy for the next line, which goes back in-band (a header-only
``ACQ_USER1`` acquisition, opt-in) and / or over the ZeroMQ side channel. Each finished slice
goes back as an ``ismrmrd.Image``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

from masc_gadget import __version__
from masc_gadget.config import ConfigError
from masc_gadget.mrd import tcp
from masc_gadget.mrd.frames import ConnectionClosed
from masc_gadget.serving.connection import check_header
from masc_gadget.serving.host import Host, serving_config
from masc_gadget.serving.models import ModelCache, build_engine, load_models, warm_up
from masc_gadget.serving.server import serve_connect_mode
from masc_gadget.serving.settings import GadgetSettings, settings_from_json, settings_from_xml
from masc_gadget.serving.stages import make_image, process

__all__ = ["GadgetSettings", "Host", "ModelCache", "build_engine", "load_models",
           "make_image", "masc", "process", "settings_from_json", "settings_from_xml", "warm_up"]

log = logging.getLogger(__name__)


def _low_latency(connection: Any) -> None:
    """TCP_NODELAY on the stream's socket (decisions are small messages Gadgetron waits for) and
    TCP_QUICKACK before each read (Gadgetron does not set TCP_NODELAY, so a delayed ACK here
    would hold its next send): see :mod:`masc_gadget.mrd.tcp`."""
    wrapper = getattr(connection, "socket", None)
    sock = getattr(wrapper, "socket", None)
    if not isinstance(sock, socket.socket):
        return
    tcp.no_delay(sock)

    def read_quickly(nbytes: int) -> bytes:
        # the client library's own read loops for ever on a closed socket (recv returns b"" at
        # once): end the stream instead, so that its open slices are finished and sent
        tcp.quick_ack(sock)
        data = bytearray()
        while len(data) < nbytes:
            got = sock.recv(nbytes - len(data), socket.MSG_WAITALL)
            if not got:
                raise ConnectionClosed(f"the stream ended without a close message ({len(data)} of {nbytes} bytes "
                                       "of a message read)", clean=not data)
            data += got
        return bytes(data)

    wrapper.read = read_quickly


def _until_closed(connection: Any) -> Iterator[Any]:
    """The stream's items until its close message, or until the peer closes the socket without
    one (logged): either way the open slices are then finished and sent."""
    try:
        yield from iter(connection)
    except ConnectionClosed as err:
        log.warning("%s: finishing the open slices", err)


_EXECUTE_HOST: Host | None = None


def execute_host() -> Host:
    """The host of execute mode: one per module process, serving the recommended shipped model
    under the defaults of every other section (Gadgetron starts the module without a config file;
    the stream XML's properties choose otherwise)."""
    global _EXECUTE_HOST
    if _EXECUTE_HOST is None:
        from masc_gadget.serving.host import serving_config

        _EXECUTE_HOST = Host.from_config(serving_config(None), batch=False)
    return _EXECUTE_HOST


def masc(connection, host: Host | None = None) -> None:
    """Gadgetron external-module entry point: ``connection`` is a
    ``gadgetron.external.Connection`` (config, header, iterable of items, ``send``).

    The stream's ``<configuration>`` properties override the host's settings as a client's
    would (model settings must be names the host offers); the header must be within its
    caps; the engine is built as soon as the stream starts."""
    _low_latency(connection)
    host = host or execute_host()
    settings = settings_from_xml(getattr(connection, "config", None), host.default)
    if settings.feedback == "fire":
        raise ConfigError("feedback fire (message 1028) is for masc serve; through Gadgetron use "
                          "feedback inband or a zmq_address")
    check_header(connection.header, host.limits)
    log.info("MASC gadget %s: policy %s, %d + %d lines, MAR %s, feedback %s%s", __version__, settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.feedback,
             f", zmq {settings.zmq_address}" if settings.zmq_address else "")
    stats = process(_until_closed(connection), connection.header, settings, connection.send, host=host,
                    trusted=host.default, eager=True)
    log.info("MASC gadget done: %s", stats)


def main(argv: list[str] | None = None) -> int:
    """``python -m masc_gadget.serving.gadget PORT [--config FILE.yaml] [--host HOST]``: the
    gadget in Gadgetron's connect mode (module started by you, e.g. on a GPU host); stops on
    SIGTERM / SIGINT after sending every open stream its slices."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m masc_gadget.serving.gadget",
                                     description="Serve Gadgetron streams in connect mode.")
    parser.add_argument("port", type=int)
    parser.add_argument("--config", help="YAML config: its acquisition / gadget sections are the "
                        "defaults under each stream's <configuration> properties, its server section "
                        "the limits (but host and port); default: the recommended shipped model")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.port < 65536:
        parser.error(f"port must be in [0, 65535], got {args.port}")
    try:
        config = serving_config(args.config)
    except (ConfigError, OSError) as err:
        parser.error(str(err))
    serve_connect_mode(config, args.port, args.host)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
