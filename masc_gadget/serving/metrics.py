"""What an operator watches: a host's Prometheus metrics and a health check on an operator port.

Each :class:`~masc_gadget.serving.host.Host` owns one :class:`Metrics` with its own registry (no
process global, so two servers in one process never mix their counts). Every label value is a
fixed word chosen here (:data:`REJECTIONS`, :data:`SERVED`): nothing taken from a header, a
patient or a protocol name ever becomes a label.

The metrics are counted only when the optional ``metrics`` extra (``prometheus-client``) is
installed; without it a :class:`Metrics` counts nothing and costs nothing (a Gadgetron install
has no extras). ``server.metrics_port`` (-1: off) serves them over HTTP on
``server.metrics_host`` (loopback by default): ``GET /metrics`` in Prometheus' text format,
``GET /health`` a JSON line (``{"status": "ok", "scans_open": N}``).

==================================  =========  ============================================
name                                type       what
==================================  =========  ============================================
``masc_scans_open``                 gauge      scans being served now
``masc_scans_total``                counter    scans started (a first line arrived)
``masc_decisions_total``            counter    next-line decisions sent
``masc_decision_seconds``           histogram  a line in to its decisions out (engine time)
``masc_images_total{served}``       counter    series-1 images by what was served (:data:`SERVED`)
``masc_rejections_total{reason}``   counter    acquisitions rejected, by rule (:data:`REJECTIONS`)
``masc_memory_budget_used_bytes``   gauge      k-space held by all scans (``server.memory_budget_bytes``)
``masc_memory_budget_bytes``        gauge      the budget
==================================  =========  ============================================
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["REJECTIONS", "SERVED", "Metrics", "MetricsServer", "available", "served_kind"]

log = logging.getLogger(__name__)

REJECTIONS = ("slice_limit", "no_channel", "samples", "channels", "grid", "line", "memory")
"""Why an acquisition was rejected (label ``reason``): beyond the header's slice limit, no
receive channel, more samples than the matrix, missing channels, off the reconstruction grid,
refused by the engine (line out of range, non-finite samples, ...), or no memory left for a
new slice (which ends the scan)."""

SERVED = ("mar", "zero_filled", "ood_fallback", "not_finite", "shutdown")
"""What a series-1 image is (label ``served``): the network's, zero-filled because no network
is loaded, zero-filled by the OOD rule (the fallback), because the network's output was not
finite, or because a shutdown left no time for the network."""

DECISION_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""Histogram buckets of ``masc_decision_seconds`` (a TR is 2-5 ms to a few s)."""


def available() -> bool:
    """Whether the ``metrics`` extra (prometheus-client) is installed."""
    import importlib.util

    return importlib.util.find_spec("prometheus_client") is not None


def served_kind(mar_label: str, mar_loaded: bool) -> str:
    """The :data:`SERVED` word of an image from its ``MASC.mar`` text."""
    if not mar_loaded:
        return "zero_filled"
    if not mar_label.startswith("none"):
        return "mar"
    if "OOD score" in mar_label:
        return "ood_fallback"
    if "no time left" in mar_label:
        return "shutdown"
    return "not_finite"


class Metrics:
    """One host's counters (see the module's table); every method is a no-op without the extra.
    ``budget``: called for the memory gauges, ``(used, total)`` bytes."""

    def __init__(self, budget: Callable[[], tuple[int, int]] | None = None) -> None:
        self.enabled = available()
        self.registry: Any = None
        self._open = 0
        self._lock = threading.Lock()
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.scans_open = Gauge("masc_scans_open", "Scans being served now", registry=r)
        self.scans = Counter("masc_scans", "Scans started (a first imaging line arrived)", registry=r)
        self.decisions = Counter("masc_decisions", "Next-line decisions sent", registry=r)
        self.latency = Histogram("masc_decision_seconds", "A line in to its decisions out (engine time)",
                                 buckets=DECISION_BUCKETS, registry=r)
        self.images = Counter("masc_images", "Series-1 images by what was served", ["served"], registry=r)
        self.rejections = Counter("masc_rejections", "Acquisitions rejected, by rule", ["reason"], registry=r)
        for word in SERVED:
            self.images.labels(word)
        for word in REJECTIONS:
            self.rejections.labels(word)
        if budget is not None:
            Gauge("masc_memory_budget_used_bytes", "K-space held by all scans", registry=r).set_function(
                lambda: budget()[0])
            Gauge("masc_memory_budget_bytes", "The memory budget of all scans", registry=r).set_function(
                lambda: budget()[1])

    def scan_started(self) -> None:
        with self._lock:
            self._open += 1
        if self.enabled:
            self.scans.inc()
            self.scans_open.inc()

    def scan_ended(self) -> None:
        with self._lock:
            self._open -= 1
        if self.enabled:
            self.scans_open.dec()

    def decided(self, n: int, seconds: float) -> None:
        """``n`` decisions out of one line, which took ``seconds`` in the engine."""
        if self.enabled and n:
            self.decisions.inc(n)
            self.latency.observe(seconds)

    def image(self, served: str) -> None:
        if self.enabled:
            self.images.labels(served if served in SERVED else "not_finite").inc()

    def rejected(self, reason: str) -> None:
        if self.enabled:
            self.rejections.labels(reason if reason in REJECTIONS else "line").inc()

    def scans_now(self) -> int:
        """Scans being served now."""
        return self._open

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        if not self.enabled:
            return b""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class MetricsServer:
    """``GET /metrics`` and ``GET /health`` of one host's :class:`Metrics` on ``host:port``
    (port 0: a free one, :attr:`port` after :meth:`start`); nothing else is served."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        if not metrics.enabled:
            raise RuntimeError("server.metrics_port needs the metrics extra: pip install 'masc[metrics]' "
                               "(prometheus-client)")
        self.metrics = metrics
        self.host = host
        self.port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                if self.path == "/metrics":
                    body, kind = metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8"
                elif self.path == "/health":
                    body = json.dumps({"status": "ok", "scans_open": metrics.scans_now()}).encode() + b"\n"
                    kind = "application/json"
                else:
                    self.send_error(404, "GET /metrics or /health")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server name
                log.debug("metrics %s: " + format, self.client_address[0], *args)

        try:
            self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as err:
            raise OSError(f"cannot serve metrics on {self.host}:{self.port}: {err.strerror or err}") from None
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="masc-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics (health: /health)", self.host, self.port)
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
