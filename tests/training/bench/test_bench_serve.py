"""A short soak: 16 concurrent closed-loop scans against one masc serve process. Every scan
completes, every slice gets exactly its own lines (nothing mixed or lost), every image comes
back, and the decisions are the gadget's, within a generous deadline."""

import argparse
import json

import pytest

from masc_gadget.config import load_config
from sim_scanner.scanner.config import ScannerConfig
from tests.conftest import CONFIGS
from training.bench.serve import ROW_KEYS, bench_serve, format_serve_table


def test_sixteen_concurrent_scans(tiny_dataset):
    config = load_config(CONFIGS / "tiny.yaml")
    scanner = ScannerConfig(deadline_ms=5000.0, max_slices=2)
    result = bench_serve(config, tiny_dataset, "test", [1, 16], scanner, str(CONFIGS / "tiny.yaml"),
                         ["gadget.device=cpu"])
    rows = result["rows"]
    assert [r["scans"] for r in rows] == [1, 16]
    acq = config["acquisition"]
    for row in rows:
        assert set(ROW_KEYS) <= set(row)
        assert row["decisions"] == row["scans"] * 2 * acq.budget
        assert row["in_deadline"] == row["decisions"] and row["fallbacks"] == 0
        assert row["p99_ms"] is not None and row["p99_ms"] <= row["max_ms"]
        assert row["rss_after_mb"] is not None and row["rss_after_mb"] - row["rss_before_mb"] < 300
        assert row["slices"] == row["images"] == row["scans"] * 2  # every image came back, timed
        assert 0 <= row["image_p50_ms"] <= row["image_p99_ms"] < 5000
    assert "| 16 |" in format_serve_table(result)
    assert f"| {2 * 16} / {2 * 16} (" in format_serve_table(result)
    json.dumps(result, default=str)


def test_bench_serve_command_checks_its_arguments(tmp_path):
    from masc_gadget.cli import common_options
    from training.bench.cli import register

    parser = argparse.ArgumentParser(prog="masc")
    register(parser.add_subparsers(dest="command"), common_options())
    args = parser.parse_args(["bench", "serve", "--data", str(tmp_path), "--max-slices", "-1"])
    with pytest.raises(ValueError, match="max-slices must be >= 0"):
        args.func(args)


def test_capacity_is_the_largest_level_in_time():
    from training.bench.serve import capacity_levels

    def run(n, limit=5):  # a server that keeps up with at most 5 scans
        return {"scans": n, "decisions": 10 * n, "in_deadline": 10 * n if n <= limit else 10 * n - 1}

    rows, capacity = capacity_levels(run, 64)
    assert capacity == 5 and [r["scans"] for r in rows] == [1, 2, 4, 8, 6, 5]
    rows, capacity = capacity_levels(lambda n: run(n, limit=100), 12)
    assert capacity == 12 and [r["scans"] for r in rows] == [1, 2, 4, 8, 12]
    rows, capacity = capacity_levels(lambda n: run(n, limit=0), 64)
    assert capacity == 0 and len(rows) == 1
    late = {"scans": 1, "decisions": 4, "in_deadline": 4, "paced_late_max_ms": 12.0}
    assert capacity_levels(lambda n: late, 8)[1] == 0  # a line after its slot is not in time


def test_paced_scans_keep_the_sequence_timing(tiny_dataset):
    config = load_config(CONFIGS / "tiny.yaml")
    scanner = ScannerConfig(deadline_ms=5000.0, max_slices=1, pace=True, line_period_ms=40.0)
    result = bench_serve(config, tiny_dataset, "test", [2], scanner, str(CONFIGS / "tiny.yaml"),
                         ["gadget.device=cpu"])
    row = result["rows"][0]
    lines = config["acquisition"].initial + config["acquisition"].budget
    assert row["paced"] and row["in_deadline"] == row["decisions"] > 0
    assert row["wall_s"] >= (lines - 1) * 0.040  # the last line's slot; unpaced this takes ~ms
    staggered = bench_serve(config, tiny_dataset, "test", [2], scanner, str(CONFIGS / "tiny.yaml"),
                            ["gadget.device=cpu"], stagger_s=0.5)["rows"][0]
    assert staggered["stagger_s"] == 0.5 and staggered["in_deadline"] == staggered["decisions"]
    assert staggered["wall_s"] >= (lines - 1) * 0.040 + 0.25  # the second scan started 0.25 s later
    with pytest.raises(ValueError, match="line_period_ms"):
        ScannerConfig(line_period_ms=-1.0)


def test_the_bare_decision_pass_is_timed_as_the_worker_runs_it():
    from training.bench.serve import bare_decisions_per_s

    config = load_config(CONFIGS / "small.yaml", ["gadget.device=cpu"])  # the shipped MASC model
    bare = bare_decisions_per_s(config, 128, 128, batch=2, threads=1, seconds=0.2)
    assert bare["batch"] == 2 and bare["passes"] >= 1 and bare["decisions_per_s"] > 0
    with pytest.raises(RuntimeError, match="decides without the batcher"):  # no image, no early rule
        bare_decisions_per_s(load_config(CONFIGS / "small.yaml", ["acquisition.policy=center-out",
                                                                  "gadget.mar_fallback=off"]), 128, 128,
                             batch=2, seconds=0.1)
