"""``masc bench serve``: decision latency of ``masc serve`` under concurrent closed-loop scans.

For each concurrency level N, N simulated scanners (:func:`sim_scanner.scanner.session.
scan_subject`, one thread each, subjects of the split taken in turn) scan against one server at
once, in-band or over ZeroMQ, with the scanner's deadline and fallback. Reported per level:
decisions made, how many came from the gadget in time, scanner-side latency percentiles (the
round trip from sending a line to receiving the decision for the next one), the slowest first
decision of a scan, and the server's resident memory before and after.

The server is started here as its own process (``masc serve``, with ``--set`` overrides) unless
``server`` names one that is already running; scanners and server then do not share a GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from masc_gadget.config import Config
from sim_scanner.dataset.layout import split_subjects, subject_path
from sim_scanner.scanner.config import ScannerConfig
from sim_scanner.scanner.report import SubjectReport
from sim_scanner.scanner.session import scan_subject

log = logging.getLogger(__name__)

ROW_KEYS = ("scans", "decisions", "in_deadline", "in_deadline_frac", "fallbacks", "p50_ms", "p90_ms",
            "p99_ms", "max_ms", "first_decision_max_ms", "decisions_per_s", "paced_late_max_ms", "slices",
            "images", "image_p50_ms", "image_p99_ms", "wall_s",
            "rss_before_mb", "rss_after_mb")


def _rss_mb(pid: int | None) -> float | None:
    """Resident memory of process ``pid`` in MB (Linux /proc), None when unknown."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config_path: str | None, overrides: Sequence[str], port: int,
                 timeout_s: float = 120.0) -> subprocess.Popen:
    """``masc serve`` as a child process on ``port``; returns once it answers connections."""
    cmd = [sys.executable, "-m", "masc_gadget.cli", "serve", "--port", str(port), "--log-level", "WARNING"]
    if config_path:
        cmd += ["--config", str(config_path)]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"masc serve exited with status {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"masc serve did not listen on port {port} within {timeout_s:.0f} s")


def _summary(n: int, reports: list[SubjectReport], wall_s: float, rss: tuple[Any, Any],
             deadline_ms: float) -> dict[str, Any]:
    # every decision that arrived, late ones (after the deadline: the fallback line was taken) too
    latencies = [v for r in reports for s in r.slices for v in s.latencies_ms if v is not None]
    latencies += [v for r in reports for v in r.late_latencies_ms]
    firsts = [s.latencies_ms[0] for r in reports for s in r.slices if s.latencies_ms]
    decisions = sum(len(s.latencies_ms) for r in reports for s in r.slices)
    in_deadline = sum(r.from_gadget for r in reports)
    lat = np.asarray(latencies, dtype=np.float64)
    pct = (lambda q: float(np.percentile(lat, q))) if lat.size else (lambda q: None)
    image_lat = np.asarray([s.image_latency_ms for r in reports for s in r.slices
                            if s.image_latency_ms is not None], dtype=np.float64)
    image_pct = (lambda q: float(np.percentile(image_lat, q))) if image_lat.size else (lambda q: None)
    return {
        "scans": n,
        "decisions": decisions,
        "in_deadline": in_deadline,
        "in_deadline_frac": in_deadline / decisions if decisions else None,
        "fallbacks": sum(r.fallbacks for r in reports),
        "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
        "max_ms": float(lat.max()) if lat.size else None,
        "first_decision_max_ms": max((v for v in firsts if v is not None), default=None),
        "decisions_per_s": decisions / wall_s if wall_s > 0 else None,
        "paced_late_max_ms": max((r.paced_late_ms for r in reports), default=0.0),
        "slices": sum(len(r.slices) for r in reports),
        "images": int(image_lat.size),
        "image_p50_ms": image_pct(50), "image_p99_ms": image_pct(99),
        "wall_s": wall_s,
        "rss_before_mb": rss[0], "rss_after_mb": rss[1],
        "deadline_ms": deadline_ms,
    }


def run_level(n: int, paths: list[tuple[str, Path]], scfg: ScannerConfig, config: Config,
              server_pid: int | None, stagger_s: float = 0.0) -> dict[str, Any]:
    """N concurrent scans (one thread each) against ``scfg.server``; one summary row. With
    ``stagger_s`` scan i starts ``i * stagger_s / n`` seconds after the first (scanners of a
    site do not start in the same millisecond), else all at once."""
    acq = config["acquisition"]
    reports: list[SubjectReport | None] = [None] * n
    errors: list[str] = []

    def scan(i: int) -> None:
        sid, path = paths[i % len(paths)]
        if stagger_s > 0:
            time.sleep(i * stagger_s / n)
        try:
            reports[i] = scan_subject(path, f"{sid}#{i}", scfg, acq, require_gadget=True)
        except (ConnectionError, OSError, ValueError) as err:
            errors.append(f"scan {i} ({sid}): {err}")

    rss_before = _rss_mb(server_pid)
    threads = [threading.Thread(target=scan, args=(i,), name=f"bench-scan-{i}") for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} scans failed; first: {errors[0]}")
    row = _summary(n, [r for r in reports if r is not None], wall, (rss_before, _rss_mb(server_pid)),
                   scfg.deadline_ms)
    row["paced"] = scfg.pace
    row["stagger_s"] = stagger_s
    log.info("%d scans: %d/%d decisions in deadline, p50 %s ms, p99 %s ms", n, row["in_deadline"],
             row["decisions"], row["p50_ms"], row["p99_ms"])
    return row


def in_time(row: dict[str, Any]) -> bool:
    """Whether every decision of a level came from the gadget within the deadline (and, paced,
    no line went out after its slot)."""
    return (row.get("error") is None and row["decisions"] > 0 and row["in_deadline"] == row["decisions"]
            and row.get("paced_late_max_ms", 0.0) == 0.0)


def capacity_levels(run, max_scans: int) -> tuple[list[dict[str, Any]], int]:
    """The largest number of concurrent scans that get every decision in time (:func:`in_time`):
    ``run(n)`` (one level's row) at 1, 2, 4, ... up to ``max_scans``, then bisection between the
    last level that passed and the first that did not. Returns (rows in the order run, capacity;
    0 when a single scan already misses)."""
    rows, best, failed, n = [], 0, None, 1
    while n <= max_scans:
        row = run(n)
        rows.append(row)
        if not in_time(row):
            failed = n
            break
        best, n = n, min(2 * n, max_scans) if n < max_scans else max_scans + 1
    while failed is not None and failed - best > 1:
        mid = (best + failed) // 2
        row = run(mid)
        rows.append(row)
        best, failed = (mid, failed) if in_time(row) else (best, mid)
    return rows, best


def bench_serve(config: Config, data_dir: str | Path, split: str, levels: Sequence[int],
                scanner: ScannerConfig, config_path: str | None = None,
                server_overrides: Sequence[str] = (), external_server: str = "",
                capacity: bool = False, max_scans: int = 64, stagger_s: float = 0.0) -> dict[str, Any]:
    """Every concurrency level of ``levels`` against one server (started here unless
    ``external_server`` is HOST:PORT), or with ``capacity`` the search of
    :func:`capacity_levels` up to ``max_scans``; returns ``{"rows": [...], "server": ...,
    "capacity": N or None}``. A server started here allows as many connections from this
    address as the levels need (``--server-set`` overrides still win)."""
    subjects = split_subjects(data_dir, split)
    paths = [(sid, subject_path(data_dir, sid)) for sid in subjects]
    most = max_scans if capacity else max(levels)
    proc = None
    if external_server:
        scanner = dataclasses.replace(scanner, server=external_server)
    else:
        port = _free_port()
        room = [f"server.max_connections={max(32, most)}", f"server.max_connections_per_peer={max(16, most)}",
                f"server.max_pending={max(64, most)}", f"server.max_pending_per_peer={max(16, most)}"]
        proc = start_server(config_path, [*room, *server_overrides], port)
        scanner = dataclasses.replace(scanner, server=f"127.0.0.1:{port}")
    pid = None if proc is None else proc.pid

    def run(n: int) -> dict[str, Any]:
        try:
            return run_level(n, paths, scanner, config, pid, stagger_s)
        except RuntimeError as err:
            if not capacity:
                raise
            log.warning("%d scans: %s", n, err)
            return {"scans": n, "decisions": 0, "in_deadline": 0, "error": str(err)}

    found = None
    try:
        if capacity:
            rows, found = capacity_levels(run, max_scans)
        else:
            rows = [run(n) for n in levels]
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"rows": rows, "server": scanner.server, "started_here": proc is not None, "capacity": found,
            "server_overrides": list(server_overrides), "scanner": dataclasses.asdict(scanner), "stagger_s": stagger_s,
            "cpu_count": os.cpu_count()}


def _images(row: dict[str, Any], f: Any) -> str:
    """``returned / slices (p50 / p99)`` of a row (rows written before the images were timed: -)."""
    if "images" not in row:
        return "-"
    return f"{row['images']} / {row['slices']} ({f(row['image_p50_ms'])} / {f(row['image_p99_ms'])})"


def format_serve_table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table (and the capacity, when searched)."""
    out = ["| scans | decisions | in deadline | p50 ms | p90 ms | p99 ms | max ms | slowest first ms "
           "| images (last line -> image p50 / p99 ms) | decisions/s | wall s | server RSS MB (before -> after) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(v: Any, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    for r in result["rows"]:
        if r.get("error"):
            out.append(f"| {r['scans']} | failed: {r['error'][:80]} ||||||||||")
            continue
        share = "-" if r["in_deadline_frac"] is None else f"{100 * r['in_deadline_frac']:.1f} %"
        late = f", a line {r['paced_late_max_ms']:.0f} ms late" if r.get("paced_late_max_ms") else ""
        out.append(f"| {r['scans']} | {r['decisions']} | {r['in_deadline']} ({share}{late}) | {f(r['p50_ms'], 2)} "
                   f"| {f(r['p90_ms'], 2)} | {f(r['p99_ms'], 2)} | {f(r['max_ms'])} "
                   f"| {f(r['first_decision_max_ms'])} | {_images(r, f)} | {f(r.get('decisions_per_s'))} | {f(r['wall_s'])} "
                   f"| {f(r['rss_before_mb'], 0)} -> {f(r['rss_after_mb'], 0)} |")
    if result.get("capacity") is not None:
        paced = "paced " if result["scanner"].get("pace") else ""
        out.append(f"\nCapacity: {result['capacity']} concurrent {paced}scans get every decision in time.")
    return "\n".join(out)


def bare_decisions_per_s(config: Config, n_pe: int, n_readout: int, batch: int, threads: int = 1,
                         seconds: float = 5.0, seed: int = 0) -> dict[str, Any]:
    """The bare batched decision pass the server's worker runs (zero-filled recon -> MAR ->
    policy, :meth:`~masc_gadget.acquisition.engine.AcquisitionEngine.run_group`) on ``batch``
    slices at once, in this process with ``threads`` torch threads and no transport: decisions
    per second, the yardstick of a saturated server's throughput."""
    import torch

    from masc_gadget.acquisition.engine import AcquisitionEngine
    from masc_gadget.serving.models import build_engine
    from masc_gadget.serving.settings import GadgetSettings

    settings = GadgetSettings.from_config(config)
    captured = []

    def capture(request):
        captured.append(request)
        return AcquisitionEngine.run_group([request])[0]

    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        engine = build_engine(settings, n_pe, n_readout, batcher=capture)
        rng = np.random.default_rng(seed)
        centre = n_pe // 2 - settings.initial // 2
        for s in range(batch):
            for line in range(centre, centre + settings.initial):
                engine.on_line(s, line, (rng.standard_normal(n_readout)
                                         + 1j * rng.standard_normal(n_readout)).astype(np.complex64))
        group = captured[:batch]
        if len(group) < batch:
            raise RuntimeError(f"policy {settings.policy} made {len(group)} decision requests for {batch} slices "
                               "(a decision that needs no network pass, a policy without an image and no early OOD rule, "
                               "decides without the batcher)")
        AcquisitionEngine.run_group(group)  # warm
        passes, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            AcquisitionEngine.run_group(group)
            passes += 1
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    return {"batch": batch, "threads": threads, "passes": passes, "decisions_per_s": passes * batch / wall,
            "pass_ms": 1e3 * wall / passes}
