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
    assert "| 16 |" in format_serve_table(result)
    json.dumps(result, default=str)


def test_bench_serve_command_checks_its_arguments(tmp_path):
    from masc_gadget.cli import common_options
    from training.bench.cli import register

    parser = argparse.ArgumentParser(prog="masc")
    register(parser.add_subparsers(dest="command"), common_options())
    args = parser.parse_args(["bench", "serve", "--data", str(tmp_path), "--max-slices", "-1"])
    with pytest.raises(ValueError, match="max-slices must be >= 0"):
        args.func(args)
