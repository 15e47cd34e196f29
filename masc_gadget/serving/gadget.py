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

Debugging: ``python -m masc_gadget.serving.gadget PORT`` listens on PORT for one Gadgetron connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from masc_gadget import __version__
from masc_gadget.serving.models import DEFAULT_CACHE, ModelCache, build_engine, load_models
from masc_gadget.serving.settings import GadgetSettings, settings_from_json, settings_from_xml
from masc_gadget.serving import stages
from masc_gadget.serving.stages import Context, make_image

__all__ = ["DEFAULT_CACHE", "GadgetSettings", "ModelCache", "build_engine", "load_models",
           "make_image", "masc", "process", "settings_from_json", "settings_from_xml"]

log = logging.getLogger(__name__)


def process(items: Iterable[Any], header: Any, settings: GadgetSettings, send: Callable[[Any], None],
            on_error: Callable[[str], None] | None = None, cache: ModelCache = DEFAULT_CACHE) -> dict[str, int]:
    """The gadget loop, transport-free: ``items`` yields acquisitions (and, from a standalone
    client, JSON parameter strings before the first acquisition); ``send`` delivers images and
    in-band feedback. Bad acquisitions are reported through ``on_error`` and skipped;
    nothing already acquired is lost. Runs the stages of :mod:`masc_gadget.serving.stages`.
    Returns counters (acquisitions, decisions, images, rejected)."""
    ctx = Context(header, settings, send, on_error=on_error, cache=cache)
    try:
        stages.send(stages.pipeline(items, ctx), ctx)
    finally:
        ctx.close()
    return ctx.stats


def masc(connection, settings: GadgetSettings | None = None) -> None:
    """Gadgetron external-module entry point: ``connection`` is a
    ``gadgetron.external.Connection`` (config, header, iterable of items, ``send``)."""
    base = settings or GadgetSettings()
    settings = settings_from_xml(getattr(connection, "config", None), base)
    log.info("MASC gadget %s: policy %s, %d + %d lines, MAR %s, feedback %s%s", __version__, settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.feedback,
             f", zmq {settings.zmq_address}" if settings.zmq_address else "")
    stats = process(iter(connection), connection.header, settings, connection.send)
    log.info("MASC gadget done: %s", stats)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - debugging entry
    import sys

    from gadgetron.external import listen

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m masc_gadget.serving.gadget PORT", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    listen(int(argv[0]), masc)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
