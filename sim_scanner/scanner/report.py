"""What a scan reports (``OUTDIR/report.json``): per slice, per subject and in total."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from masc_gadget import __version__
from masc_gadget.core.metrics import METRICS
from sim_scanner.scanner.config import IMAGE_FROM_GADGET, IMAGE_ZERO_FILLED

if TYPE_CHECKING:
    from sim_scanner.scanner.config import ScannerConfig

log = logging.getLogger(__name__)


class LatencySummary(NamedTuple):
    """Percentiles of decision latencies, ms (None when there were none)."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: list[float]) -> LatencySummary:
        if not values:
            return cls(0, None, None, None, None)
        v = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
        return cls(int(v.size), p50, p90, p99, float(v.max()))


@dataclass
class SliceReport:
    """One slice of one subject: what was acquired, from where, and how good the image is."""

    slice: int
    lines: list[int] = field(default_factory=list)
    """PE lines in acquisition order (initial + budget)."""
    sources: list[str] = field(default_factory=list)
    """Per line: "initial", "gadget" or "fallback"."""
    fallback_reasons: list[str | None] = field(default_factory=list)
    """Per chosen line (budget steps): None when the gadget's line was taken, else "miss",
    "invalid", "disconnected" or "open-loop"."""
    latencies_ms: list[float | None] = field(default_factory=list)
    """Per budget step: scanner-side round trip from sending the previous line of the slice to
    receiving the decision (None: no decision by the deadline)."""
    gadget_latencies_ms: list[float | None] = field(default_factory=list)
    """Per budget step: the decision latency the gadget reported (``user_int[1]`` / 1000)."""
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    """Deadline misses (no decision in time while the gadget was connected)."""
    invalid: int = 0
    """Decisions whose line was out of range or already acquired."""
    image_source: str = ""
    """"gadget" (the returned image) or "scanner zero-filled" (no image came back)."""
    image_lines: list[int] | None = None
    """The lines the returned image says it was built from (meta ``MASC.lines``), if any; a
    mismatch with ``lines`` is reported as a gadget error."""
    policy: str = ""
    """The policy the returned image says chose its lines (meta ``MASC.policy``), "" when none came back."""
    image_latency_ms: float | None = None
    """From sending the slice's last line to receiving its image, ms (None when no image came
    back); a slice whose image came before its last line (the gadget ended it early) is 0."""
    served: str = ""
    """What the returned image is (meta ``MASC.mar``): the MAR network, or ``none (...)`` when the
    gadget served it zero-filled (MAR off, the OOD fallback, a non-finite output)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """ssim, psnr, mse, nmse, mae of the scored image vs the clean fully sampled image."""
    zero_filled_metrics: dict[str, float] = field(default_factory=dict)
    """The same metrics of the scanner's zero-filled reconstruction of its acquired lines."""


@dataclass
class SubjectReport:
    """One subject's scan."""

    subject: str
    path: str
    n_slices: int
    """Slices scanned (``max_slices`` may be fewer than the file holds)."""
    n_pe: int
    reference: str = "clean, every line"
    """What the images are scored against: the simulation's metal-free truth, or for a recorded
    scan its own fully sampled image."""
    fov_mm: float = 0.0
    """The images' field of view along the readout (the header's recon space), mm; 0 when unknown.
    For the figure's scale bar."""
    slices: list[SliceReport] = field(default_factory=list)
    connection: str = "ok"
    """"ok", "lost" (the gadget went away mid-scan: the rest was acquired on the fallback
    order) or "unreachable" (no connection for a later subject: all on the fallback order)."""
    connection_lost_at: int | None = None
    """Scan counter of the first line acquired after the connection was found lost."""
    connection_error: str = ""
    server_closed: bool = False
    """Whether the gadget answered the scanner's close with its own close message (id 4)."""
    gadget_errors: list[str] = field(default_factory=list)
    """Text / error messages from the gadget and problems with what it sent."""
    gadget_warnings: list[str] = field(default_factory=list)
    """The gadget's ``MASC warning:`` texts: settings it did not apply as asked (the scan went on)."""
    images_returned: int = 0
    paced_late_ms: float = 0.0
    """Paced scans: how far behind its slot in the sequence the latest line went out (waiting
    for a decision), ms; 0 when every line went out on time."""
    late_decisions: int = 0
    """Decisions that arrived after their deadline (the fallback line was taken)."""
    late_latencies_ms: list[float] = field(default_factory=list)
    lines: int = 0
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    invalid: int = 0
    duration_s: float = 0.0


@dataclass
class ScanTotals:
    """Totals over every subject of a scan."""

    subjects: int = 0
    slices: int = 0
    lines: int = 0
    from_gadget: int = 0
    fallbacks: int = 0
    misses: int = 0
    invalid: int = 0
    late_decisions: int = 0
    gadget_errors: int = 0
    connections_lost: int = 0
    images_from_gadget: int = 0
    images_zero_filled: int = 0
    latency_ms: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """Scanner-side decision latencies, every decision received (late ones included)."""
    gadget_latency_ms: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """Latencies the gadget reported for the decisions that arrived in time."""
    image_latency_ms: LatencySummary = field(default_factory=lambda: LatencySummary.of([]))
    """From each slice's last line to its returned image (slices whose image came back)."""
    metrics_mean: dict[str, float] = field(default_factory=dict)
    metrics_std: dict[str, float] = field(default_factory=dict)


@dataclass
class ScanReport:
    """``report.json``: the configuration, every subject and the totals."""

    data_dir: str
    split: str
    scanner: dict[str, Any]
    acquisition: dict[str, Any]
    subjects: list[SubjectReport] = field(default_factory=list)
    totals: ScanTotals = field(default_factory=ScanTotals)
    created: str = ""
    masc_version: str = __version__

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def summary(self) -> str:
        """A few human-readable lines (what ``masc scan`` prints)."""
        t = self.totals
        lat = t.latency_ms
        lines = [
            (
                f"scanned {t.subjects} subject(s), {t.slices} slices, {t.lines} lines "
                f"(feedback {self.scanner.get('feedback')}, deadline "
                f"{self.scanner.get('deadline_ms')} ms, fallback {self.scanner.get('fallback')})"
            ),
            (
                f"decisions from gadget: {t.from_gadget}, fallbacks: {t.fallbacks} "
                f"(deadline misses {t.misses}, invalid {t.invalid}, late {t.late_decisions}), "
                f"gadget errors: {t.gadget_errors}, connections lost: {t.connections_lost}"
            ),
        ]
        if lat.count:
            lines.append(
                f"decision latency ms: p50 {lat.p50:.2f}, p90 {lat.p90:.2f}, p99 {lat.p99:.2f}, "
                f"max {lat.max:.2f} ({lat.count} decisions)"
            )
        if t.image_latency_ms.count:
            img = t.image_latency_ms
            lines.append(f"last line to image ms: p50 {img.p50:.2f}, p99 {img.p99:.2f}, max {img.max:.2f} "
                         f"({img.count} images)")
        if t.metrics_mean:
            lines.append(
                "images: "
                f"{t.images_from_gadget} from gadget, {t.images_zero_filled} scanner zero-filled; "
                + ", ".join(
                    f"{k} {t.metrics_mean[k]:.4g} +- {t.metrics_std.get(k, 0.0):.2g}"
                    for k in METRICS
                    if k in t.metrics_mean
                )
            )
        return "\n".join(lines)


def _plain(obj: Any) -> Any:
    """JSON-able data: NamedTuples become dicts, non-finite floats None."""
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {k: _plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def log_subject(report: SubjectReport, scfg: ScannerConfig) -> None:
    latencies = [v for r in report.slices for v in r.latencies_ms if v is not None]
    ssim = [r.metrics.get("ssim", float("nan")) for r in report.slices]
    from_gadget_images = sum(r.image_source == IMAGE_FROM_GADGET for r in report.slices)
    log.info(
        "%s: %d slices, %d lines, %d from gadget, %d fallbacks (%d misses, %d invalid), "
        "latency p50 %s ms, connection %s, %d/%d images from gadget, mean SSIM %.4f",
        report.subject,
        report.n_slices,
        report.lines,
        report.from_gadget,
        report.fallbacks,
        report.misses,
        report.invalid,
        f"{np.median(latencies):.2f}" if latencies else "-",
        report.connection,
        from_gadget_images,
        report.n_slices,
        float(np.mean(ssim)) if ssim else float("nan"),
    )


def scan_totals(subjects: list[SubjectReport]) -> ScanTotals:
    t = ScanTotals(subjects=len(subjects))
    latencies: list[float] = []
    gadget_latencies: list[float] = []
    image_latencies: list[float] = []
    metrics: dict[str, list[float]] = {k: [] for k in METRICS}
    for sub in subjects:
        t.slices += len(sub.slices)
        t.lines += sub.lines
        t.from_gadget += sub.from_gadget
        t.fallbacks += sub.fallbacks
        t.misses += sub.misses
        t.invalid += sub.invalid
        t.late_decisions += sub.late_decisions
        t.gadget_errors += len(sub.gadget_errors)
        t.connections_lost += sub.connection != "ok"
        latencies += sub.late_latencies_ms
        for rep in sub.slices:
            latencies += [v for v in rep.latencies_ms if v is not None]
            gadget_latencies += [
                g for v, g in zip(rep.latencies_ms, rep.gadget_latencies_ms)
                if v is not None and g is not None
            ]
            if rep.image_latency_ms is not None:
                image_latencies.append(rep.image_latency_ms)
            t.images_from_gadget += rep.image_source == IMAGE_FROM_GADGET
            t.images_zero_filled += rep.image_source == IMAGE_ZERO_FILLED
            for k in METRICS:
                if k in rep.metrics:
                    metrics[k].append(rep.metrics[k])
    t.latency_ms = LatencySummary.of(latencies)
    t.gadget_latency_ms = LatencySummary.of(gadget_latencies)
    t.image_latency_ms = LatencySummary.of(image_latencies)
    t.metrics_mean = {k: float(np.mean(v)) for k, v in metrics.items() if v}
    t.metrics_std = {k: float(np.std(v)) for k, v in metrics.items() if v}
    return t
