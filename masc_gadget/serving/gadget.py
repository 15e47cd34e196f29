"""The MASC streaming gadget: one plain function over a connection.

``masc(connection)`` runs inside Gadgetron as an external Python module (``<external><execute
name="masc_gadget.serving.gadget" target="masc" type="python"/>``), reading its settings from the stream's
``<configuration>`` element, and the standalone ``masc serve`` runs the very same
:func:`process` loop over its own connections. For every acquired line it updates the slice's
k-space buffer (the scanner is the authority on what was acquired), and once the slice's initial
lines are in it reconstructs, corrects (MAR) and asks the policy for the next line, which goes
back in-band (a header-only ``ACQ_USER1`` acquisition, opt-in) and / or over the ZeroMQ side
channel. Each finished slice goes back as an ``ismrmrd.Image``. :func:`process` chains the
generator stages of :mod:`masc_gadget.serving.stages`; settings are in
:mod:`masc_gadget.serving.settings`, models and the engine are built in
:mod:`masc_gadget.serving.models`.

Connect mode: ``python -m masc_gadget.serving.gadget PORT [--config FILE.yaml]`` loads and warms
the models, then serves every stream Gadgetron opens on PORT, concurrently.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from masc_gadget import __version__
from masc_gadget.acquisition.batcher import DecisionBatcher
from masc_gadget.acquisition.engine import AcquisitionEngine
from masc_gadget.config import Config, ConfigError
from masc_gadget.mrd import tcp
from masc_gadget.mrd.feedback import set_allowed_endpoints
from masc_gadget.serving.models import DEFAULT_CACHE, ModelCache, build_engine, load_models
from masc_gadget.serving.settings import GadgetSettings, settings_from_json, settings_from_xml
from masc_gadget.serving import stages
from masc_gadget.serving.stages import Context, make_image

__all__ = ["DEFAULT_CACHE", "GadgetSettings", "ModelCache", "build_engine", "load_models",
           "make_image", "masc", "process", "settings_from_json", "settings_from_xml"]

log = logging.getLogger(__name__)


def process(items: Iterable[Any], header: Any, settings: GadgetSettings, send: Callable[[Any], None],
            on_error: Callable[[str], None] | None = None, cache: ModelCache = DEFAULT_CACHE,
            eager: bool = False, trusted: GadgetSettings | None = None,
            batcher: DecisionBatcher | None = None,
            max_kspace_bytes: tuple[int, int] | None = None) -> dict[str, int]:
    """The gadget loop, transport-free: ``items`` yields acquisitions (and, from a standalone
    client, JSON parameter strings before the first acquisition); ``send`` delivers images and
    in-band feedback. Bad acquisitions are reported through ``on_error`` and skipped;
    nothing already acquired is lost. Runs the stages of :mod:`masc_gadget.serving.stages`.

    ``eager``: build and warm up the engine now, from the header, instead of at the first
    acquisition (for streams whose settings cannot change later, as through Gadgetron, which
    drops the client's text messages), so the first decision does not wait for model loading.

    ``trusted``: the operator's settings (default: ``settings`` itself); checkpoints that a
    connection's later parameters name differently must be names the server offers
    (:func:`masc_gadget.serving.models.load_models`). ``batcher``: a decision batcher shared
    by the connections of one process (:class:`~masc_gadget.acquisition.batcher.DecisionBatcher`).

    ``max_kspace_bytes``: (budget, slices): a scan whose k-space (slices x coils x matrix x 8
    bytes) would exceed the budget is refused when its channels are known (the server's
    ``server.max_kspace_bytes``); None: no budget.

    Returns counters (acquisitions, decisions, images, rejected)."""
    ctx = Context(header, settings, send, on_error=on_error, cache=cache, trusted=trusted,
                  batcher=batcher, max_kspace_bytes=max_kspace_bytes)
    try:
        if eager:
            ctx.start()
        stages.send(stages.pipeline(items, ctx), ctx)
    finally:
        ctx.close()
    return ctx.stats


def _low_latency(connection: Any) -> None:
    """TCP_NODELAY on the stream's socket (decisions are small messages Gadgetron waits for) and
    TCP_QUICKACK before each read (Gadgetron does not set TCP_NODELAY, so a delayed ACK here
    would hold its next send): see :mod:`masc_gadget.mrd.tcp`."""
    wrapper = getattr(connection, "socket", None)
    sock = getattr(wrapper, "socket", None)
    if not isinstance(sock, socket.socket):
        return
    tcp.no_delay(sock)
    read = wrapper.read

    def read_quickly(nbytes: int) -> bytes:
        tcp.quick_ack(sock)
        return read(nbytes)

    wrapper.read = read_quickly


def masc(connection, settings: GadgetSettings | None = None, cache: ModelCache = DEFAULT_CACHE,
         batcher: DecisionBatcher | None = None) -> None:
    """Gadgetron external-module entry point: ``connection`` is a
    ``gadgetron.external.Connection`` (config, header, iterable of items, ``send``).

    The stream's ``<configuration>`` properties override ``settings`` (default: the config
    dataclasses' defaults); the engine is built as soon as the stream starts."""
    _low_latency(connection)
    base = settings or GadgetSettings()
    settings = settings_from_xml(getattr(connection, "config", None), base)
    if settings.feedback == "fire":
        raise ConfigError("feedback fire (message 1028) is for masc serve; through Gadgetron use "
                          "feedback inband or a zmq_address")
    log.info("MASC gadget %s: policy %s, %d + %d lines, MAR %s, feedback %s%s", __version__, settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.feedback,
             f", zmq {settings.zmq_address}" if settings.zmq_address else "")
    stats = process(iter(connection), connection.header, settings, connection.send, cache=cache,
                    eager=True, batcher=batcher)
    log.info("MASC gadget done: %s", stats)


def _serve_one(sock: socket.socket, peer: Any, settings: GadgetSettings, cache: ModelCache,
               batcher: DecisionBatcher) -> None:
    """One Gadgetron stream of connect mode, on its own thread; its failure ends only it."""
    from gadgetron.external.connection import Connection

    try:
        with Connection(sock) as connection:
            masc(connection, settings, cache, batcher)
    except Exception:  # noqa: BLE001 - one stream's failure must not end the module
        log.exception("stream from %s failed", peer)


def serve_connect_mode(port: int, settings: GadgetSettings, host: str = "127.0.0.1",
                       cache: ModelCache = DEFAULT_CACHE, stop: threading.Event | None = None,
                       ready: Callable[[int], None] | None = None) -> None:
    """Connect mode (``<external><connect port=.../>``): listen on ``host:port`` and serve every
    stream Gadgetron opens, concurrently, each on its own thread, until ``stop`` is set; the
    streams' decisions that wait at the same moment share one batched forward pass.

    The models of ``settings`` are loaded and warmed up before the port opens, so the first
    stream's first decision does not pay for them. ``ready(port)`` is called once listening
    (port 0 picks a free one)."""
    warm_up(settings, cache)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(16)
    listener.settimeout(0.2)
    if host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("listening on %s: any host that can reach this port can stream to the gadget", host)
    log.info("MASC gadget (connect mode) listening on %s:%d", host, listener.getsockname()[1])
    if ready is not None:
        ready(listener.getsockname()[1])
    stop = stop or threading.Event()
    batcher = DecisionBatcher(AcquisitionEngine.run_group)
    try:
        while not stop.is_set():
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(None)
            threading.Thread(target=_serve_one, args=(sock, peer, settings, cache, batcher),
                             name=f"masc-stream-{peer}", daemon=True).start()
    finally:
        listener.close()
        batcher.close()


def warm_up(settings: GadgetSettings, cache: ModelCache = DEFAULT_CACHE, n_pe: int = 64,
            n_readout: int = 64) -> float:
    """Load the models of ``settings`` into ``cache`` and run one decision and one final
    reconstruction on a dummy slice (a learned policy on its own image size), so that the first
    line of a scan does not pay for the process's kernel set-up; returns the seconds it took."""
    start = time.perf_counter()
    policy = load_models(settings, cache).policy
    net = getattr(policy, "net", None)
    if net is not None:
        n_pe, n_readout = net.n_pe, net.width
    initial = min(settings.initial, n_pe - 1)
    engine = build_engine(settings, n_pe, n_readout, cache, initial=initial, budget=1)
    zeros = np.zeros(n_readout, np.complex64)
    for line in range(n_pe // 2 - initial // 2, n_pe // 2 - initial // 2 + initial):
        engine.on_line(0, line, zeros)
    engine.finish_slice(0)
    seconds = time.perf_counter() - start
    log.info("warmed up in %.2f s (policy %s, MAR %s, device %s)", seconds, settings.policy,
             settings.mar_checkpoint or "off", engine.device)
    return seconds


def configure(config: Config, cache: ModelCache = DEFAULT_CACHE) -> None:
    """Apply a config's ``models`` and ``feedback`` sections to this process: which checkpoints
    connections may choose, how many models stay loaded, where the side channel may connect."""
    cache.configure(config["models"])
    set_allowed_endpoints(config["feedback"].zmq_allow)


def main(argv: list[str] | None = None) -> int:
    """``python -m masc_gadget.serving.gadget PORT [--config FILE.yaml] [--host HOST]``: the
    gadget in Gadgetron's connect mode (module started by you, e.g. on a GPU host)."""
    import argparse

    from masc_gadget.config import load_config

    parser = argparse.ArgumentParser(prog="python -m masc_gadget.serving.gadget",
                                     description="Serve Gadgetron streams in connect mode.")
    parser.add_argument("port", type=int)
    parser.add_argument("--config", help="YAML config whose acquisition / gadget sections are "
                        "the defaults under each stream's <configuration> properties")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args.config)
    settings = GadgetSettings.from_config(config)
    configure(config)
    try:
        serve_connect_mode(args.port, settings, args.host)
    except KeyboardInterrupt:
        log.info("stopped")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
