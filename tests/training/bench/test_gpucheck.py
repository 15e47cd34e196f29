"""masc bench gpu-check: the steps it plans for each device, a CPU run of its quick sizes (the
CUDA-only steps are reported as skipped, the JSON and the Markdown are written), and the errors."""

import json

import pytest
import torch

from tests.conftest import CONFIGS
from training.bench.gpucheck import STEPS, Plan, gpu_check, make_plan, render_markdown, step_command

SMALL, PAPER = str(CONFIGS / "small.yaml"), str(CONFIGS / "paper.yaml")


def _plan(tmp_path, device, quick=False):
    return Plan(device=device, quick=quick, out=tmp_path, config_small=SMALL, config_paper=PAPER)


def test_cuda_plan_asks_for_paper_width_and_every_variant(tmp_path):
    cmd, out = step_command("unet", _plan(tmp_path, "cuda"))
    assert cmd[cmd.index("--widths") + 1] == "64" and cmd[cmd.index("--sizes") + 1] == "256x200"
    assert "--variants" not in cmd  # CUDA: bench unet's default, all of fp32/bf16/nchw/compile
    assert out.endswith("unet.json")
    cpu_cmd, _ = step_command("unet", _plan(tmp_path, "cpu"))
    assert cpu_cmd[cpu_cmd.index("--variants") + 1] == "fp32"
    paper, _ = step_command("paper-sim", _plan(tmp_path, "cuda"))
    assert "physics.device=cuda" in paper and PAPER in paper
    serve_cpu, _ = step_command("serve-cpu", _plan(tmp_path, "cuda"))
    assert "gadget.device=cpu" in serve_cpu
    with pytest.raises(ValueError, match="unknown step"):
        step_command("nope", _plan(tmp_path, "cpu"))


def test_quick_cpu_run_writes_json_and_markdown(tmp_path):
    messages = []
    report = gpu_check(tmp_path, device="cpu", quick=True, steps=["unet", "env", "paper-sim"],
                       config_small=SMALL, config_paper=PAPER, log=messages.append)
    by = {r["step"]: r for r in report["steps"]}
    assert list(by) == ["unet", "env", "paper-sim"]
    assert by["unet"]["status"] == "ok", by["unet"]["reason"]
    rows = by["unet"]["result"]["rows"]
    assert [r["variant"] for r in rows] == ["fp32"] and rows[0]["latency_median_ms"] > 0
    assert by["env"]["status"] == "skipped" and "data step" in by["env"]["reason"]
    assert by["paper-sim"]["status"] == "skipped" and "needs CUDA" in by["paper-sim"]["reason"]
    assert any("no CUDA" in m for m in messages)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["step"] for r in saved["steps"]] == ["unet", "env", "paper-sim"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| paper-sim | skipped |" in md and "| fp32 | 16x12 | 1 |" in md
    assert (tmp_path / "unet.log").is_file()


def test_failed_step_is_recorded_and_the_rest_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mar_model:\n  depth: -1\n")
    plan = make_plan(tmp_path, "cpu", True, config_small=SMALL, config_paper=PAPER)
    assert plan.device == "cpu"
    report = gpu_check(tmp_path, device="cpu", quick=True, steps=["data", "env"],
                       config_small=str(bad), config_paper=PAPER, log=lambda m: None)
    data, env = report["steps"]
    assert data["status"] == "failed" and "exit status" in data["reason"]
    assert env["status"] == "skipped"
    assert "| data | failed |" in render_markdown(report)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown step 'gpu'"):
        gpu_check(tmp_path, steps=["gpu"], config_small=SMALL, config_paper=PAPER)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        make_plan(tmp_path, config_small=str(tmp_path / "missing.yaml"), config_paper=PAPER)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_plan(tmp_path, "cuda", config_small=SMALL, config_paper=PAPER)
    assert set(STEPS) >= {"tests", "unet", "env", "serve", "paper-sim"}


def test_budget_skips_the_steps_it_cannot_start(tmp_path):
    report = gpu_check(tmp_path, device="cpu", quick=True, steps=["unet", "data"], budget_s=5,
                       config_small=SMALL, config_paper=PAPER, log=lambda m: None)
    assert [r["status"] for r in report["steps"]] == ["skipped", "skipped"]
    assert "budget" in report["steps"][0]["reason"]


def test_report_has_no_machine_paths(tmp_path):
    report = gpu_check(tmp_path, device="cpu", quick=True, steps=["unet"], config_small=SMALL,
                       config_paper=PAPER, log=lambda m: None)
    text = json.dumps(report)
    assert str(tmp_path) not in text and "<out>/unet.json" in text
