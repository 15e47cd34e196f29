"""TCP options for the small request / reply messages of closed-loop acquisition.

A decision is a few hundred bytes that the other side waits for. Nagle's algorithm holds a small
send while an earlier one is unacknowledged, and the peer delays its ACK by up to 40 ms, so a
reply can wait ~40-90 ms for nothing. The sender sets TCP_NODELAY (:func:`no_delay`); a receiver
whose peer does not (stock Gadgetron) acknowledges at once with TCP_QUICKACK
(:func:`quick_ack`), which Linux clears after a while, so it is set again before every read.
Both are best effort: on platforms without them nothing happens.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

_QUICKACK = getattr(socket, "TCP_QUICKACK", None)


def _is_tcp(sock: object) -> bool:
    return isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6)


def no_delay(sock: object) -> None:
    """Send small messages at once (TCP_NODELAY)."""
    if _is_tcp(sock):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as err:
            log.debug("could not set TCP_NODELAY: %s", err)


def quick_ack(sock: object) -> None:
    """Acknowledge what arrives next at once (TCP_QUICKACK, Linux); call before each read."""
    if _QUICKACK is not None and _is_tcp(sock):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        except OSError as err:
            log.debug("could not set TCP_QUICKACK: %s", err)
