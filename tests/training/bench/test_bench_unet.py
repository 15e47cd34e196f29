"""masc bench unet: every variant timed and checked against fp32, failures reported as rows, the command writes JSON."""

import argparse
import json

import pytest
import torch


def test_bench_unet_tiny(global_rng_guard):
    from training.bench.unet import ROW_KEYS, bench_unet, format_table

    rows = bench_unet("cpu", widths=[4], sizes=[16], batch_sizes=[1, 2], repeats=1,
                      variants=["fp32", "nchw"])
    assert len(rows) == 4
    for row in rows:
        assert set(row) == set(ROW_KEYS)
        assert row["status"] == "ok", row["error"]
        assert row["latency_median_ms"] > 0 and row["latency_p90_ms"] >= row["latency_median_ms"]
        assert row["throughput_img_s"] == pytest.approx(row["batch"] / row["latency_median_ms"] * 1e3)
        assert row["device"] == "cpu" and row["width"] == 4 and (row["height"], row["width_px"]) == (16, 16)
        assert row["peak_mem_mb"] is None
    assert [r["max_abs_diff"] for r in rows if r["variant"] == "fp32"] == [0.0, 0.0]
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)
    json.dumps(rows)
    assert "nchw" in format_table(rows)


def test_bench_reports_a_failing_variant_instead_of_crashing(monkeypatch):
    from training.bench import unet as bench

    def broken(variant, base):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(bench, "_make_variant", broken)
    rows = bench.bench_unet("cpu", widths=[4], sizes=[16], batch_sizes=[1, 2], repeats=1,
                            variants=["compile"])
    assert [r["status"] for r in rows] == ["failed", "skipped"]
    assert "no compiler here" in rows[0]["error"]


def test_bench_command(tmp_path, capsys):
    from masc_gadget.cli import common_options
    from training.bench.cli import register

    parser = argparse.ArgumentParser(prog="masc")
    register(parser.add_subparsers(dest="command"), common_options())
    out = tmp_path / "bench.json"
    args = parser.parse_args(["bench", "unet", "--device", "cpu", "--sizes", "16,12x20",
                              "--widths", "4", "--batch-sizes", "1", "--repeats", "1",
                              "--out", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "img/s" in text and "12x20" in text
    data = json.loads(out.read_text())
    assert data["environment"]["device"] == "cpu" and len(data["rows"]) == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "unet", "--variants", "fp64"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_unet_cuda_variants():
    from training.bench.unet import bench_unet

    rows = bench_unet("cuda", widths=[4], sizes=[16], batch_sizes=[2], repeats=2,
                      variants=["fp32", "bf16", "nchw", "nchw_bf16"])
    assert all(r["status"] == "ok" for r in rows), rows
    assert all(r["peak_mem_mb"] > 0 for r in rows)
