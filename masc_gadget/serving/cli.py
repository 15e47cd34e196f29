"""``masc serve``: the command line of the standalone server (:class:`~masc_gadget.serving.
server.MascServer`), imported lazily so that ``masc --help`` does not load torch."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("masc_gadget.serving.server")


def port_number(text: str) -> int:
    """A TCP port for argparse: 0 (any free port, printed when listening) to 65535; a one-line
    error otherwise."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 (any free port) to 65535, got {text!r}")
    return port


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc serve``."""
    serve = subparsers.add_parser(
        "serve", parents=[common], help="run the MASC gadget as a standalone MRD server",
        description="Standalone MRD server running the MASC gadget (gadgetron_ismrmrd_client and "
        "python-ismrmrd-server client dialects). Without --config it serves the recommended shipped "
        "model (masc_gadget.models.shipped.RECOMMENDED). Clients change only what server.client_overrides "
        "allows. Stops on SIGTERM / Ctrl-C.",
    )
    serve.add_argument("--host", help="address to listen on (default: server.host, 127.0.0.1)")
    serve.add_argument("--port", type=port_number, help="port, 0 (any free port) to 65535 (default: server.port, 9002)")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from masc_gadget.serving.host import serving_config
    from masc_gadget.serving.server import MascServer

    config = serving_config(getattr(args, "config", None), getattr(args, "overrides", []))
    server = MascServer(config, address=args.host, port=args.port)
    settings = server.host.default
    log.info("default settings: policy %s, %d + %d lines, MAR %s, device %s", settings.policy,
             settings.initial, settings.budget, settings.mar_checkpoint or "off", settings.device)
    server.serve_forever()
    return 0
