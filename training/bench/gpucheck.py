"""``masc bench gpu-check``: the GPU measurements of the project in one run, one JSON, one table.

Each step is its own child process (``masc ...`` or ``pytest``) with its own time limit, so a
step that fails or hangs is recorded and the next one still runs. The steps:

``tests``      the ``gpu``-marked tests (they skip themselves without CUDA)
``unet``       MAR U-Net forward at paper width (64) and 256 x 200: fp32 / bf16, channels-last
               or not, ``torch.compile``
``data``       a few subjects of ``configs/small.yaml`` for the next two steps
``env``        the batched environment against the one-slice loop and the Gymnasium env, and our
               PPO against sb3-contrib's MaskablePPO (when installed), MAR width 16
``serve``      ``masc serve`` under 1 and 16 concurrent closed-loop scans, the model on the
               default device (CUDA when present)
``serve-cpu``  the same scans with the model on the CPU, for comparison on the same machine
``paper-sim``  one subject of ``configs/paper.yaml`` simulated with the field on CUDA

Without CUDA the CPU-safe parts run (``unet`` in fp32 only, ``data``, ``env``, ``serve``) and
the CUDA-only ones are recorded as skipped with the reason. ``--quick`` shrinks every step to
tiny sizes (for the tests of this command, not for figures).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


STEPS = ("tests", "unet", "data", "env", "serve", "serve-cpu", "paper-sim")
CUDA_ONLY = {"serve-cpu", "paper-sim"}
NEEDS_DATA = {"env", "serve", "serve-cpu"}


@dataclass
class Plan:
    """What each step runs; :func:`make_plan` fills it for the device and ``quick``."""

    device: str  # "cuda" or "cpu"
    quick: bool
    out: Path
    config_small: str
    config_paper: str
    timeouts: dict[str, float] = field(default_factory=dict)

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def data(self) -> Path:
        return self.work / "data"


def _masc(*args: str) -> list[str]:
    return [sys.executable, "-m", "masc_gadget.cli", *args]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def make_plan(out: str | Path, device: str = "auto", quick: bool = False,
              config_small: str = "configs/small.yaml",
              config_paper: str = "configs/paper.yaml") -> Plan:
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda, cpu or auto, got {device!r}")
    if device == "cuda" and not cuda_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device "
                         "(torch.cuda.is_available() is False); use --device auto or cpu")
    for path in (config_small, config_paper):
        if not Path(path).is_file():
            raise FileNotFoundError(f"config {path} not found; run from the repository root "
                                    "or pass --config-small / --config-paper")
    timeouts = {"tests": 180, "unet": 300, "data": 180, "env": 240, "serve": 240, "serve-cpu": 240,
                "paper-sim": 300}
    return Plan(device=device, quick=quick, out=Path(out), config_small=config_small,
                config_paper=config_paper, timeouts=timeouts)


def step_command(step: str, plan: Plan) -> tuple[list[str], str | None]:
    """(argv, JSON file the step writes or None) of one step."""
    out, work, q = plan.out, plan.work, plan.quick
    if step == "tests":
        return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                f"--junitxml={out / 'gpu_tests.xml'}"], None
    if step == "unet":
        cmd = _masc("bench", "unet", "--device", plan.device, "--out", str(out / "unet.json"))
        if q:
            cmd += ["--widths", "4", "--sizes", "16x12", "--batch-sizes", "1", "--repeats", "1"]
        else:
            cmd += ["--widths", "64", "--sizes", "256x200", "--batch-sizes", "1,16",
                    "--repeats", "10" if plan.device == "cuda" else "2"]
        if plan.device == "cpu":
            cmd += ["--variants", "fp32"]
        return cmd, str(out / "unet.json")
    if step == "data":
        subjects = 3 if q else 6
        cmd = _masc("simulate", "dataset", "--config", plan.config_small, "--out", str(plan.data),
                    "--subjects", str(subjects), "--set", "dataset.seed=2000",
                    "--set", f"dataset.workers={min(8, os.cpu_count() or 1)}",
                    "--set", "dataset.split_fractions=[0.34,0.33,0.33]", "--log-level", "WARNING")
        if q:
            cmd += ["--set", "sequence.matrix=[32,32]", "--set", "sequence.n_slices=2",
                    "--set", "acquisition.initial=2", "--set", "acquisition.budget=3"]
        return cmd, None
    if step == "env":
        n_envs, steps, ppo = (4, 2, 64) if q else (64, 10, 1024)
        cmd = _masc("bench", "env", "--config", plan.config_small, "--data", str(plan.data),
                    "--device", plan.device, "--n-envs", str(n_envs), "--steps", str(steps),
                    "--mar-width", "4" if q else "16", "--sb3", "--ppo-steps", str(ppo),
                    "--set", f"ppo.rollout_steps={ppo if q else 512}",
                    "--out", str(out / "env.json"), "--log-level", "WARNING")
        if q:
            cmd += ["--set", "acquisition.budget=3", "--set", "ppo.minibatch_size=16"]
        return cmd, str(out / "env.json")
    if step in ("serve", "serve-cpu"):
        name = step.replace("-", "_")
        cmd = _masc("bench", "serve", "--config", plan.config_small, "--data", str(plan.data),
                    "--scans", "1,2" if q else "1,16", "--max-slices", "1" if q else "2",
                    "--out", str(out / f"{name}.json"), "--log-level", "WARNING")
        if step == "serve-cpu":
            cmd += ["--server-set", "gadget.device=cpu"]
        if q:
            cmd += ["--set", "acquisition.budget=3", "--set", "acquisition.policy=center-out"]
        return cmd, str(out / f"{name}.json")
    if step == "paper-sim":
        cmd = _masc("simulate", "dataset", "--config", plan.config_paper, "--out",
                    str(work / "paper"), "--subjects", "1", "--set", f"physics.device={plan.device}",
                    "--set", "dataset.split_fractions=[1.0,0.0,0.0]", "--log-level", "WARNING")
        return cmd, None
    raise ValueError(f"unknown step {step!r}; known: {', '.join(STEPS)}")


def _junit_counts(path: Path) -> dict[str, int] | None:
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _dataset_summary(folder: Path) -> dict[str, Any] | None:
    """Subjects, slices and the matrix of a simulated data set, from its files."""
    import h5py

    files = sorted(folder.rglob("*.h5"))
    if not files:
        return None
    out: dict[str, Any] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    with h5py.File(files[0], "r") as f:
        shapes = {}
        f.visititems(lambda name, obj: shapes.setdefault(name, list(obj.shape))
                     if isinstance(obj, h5py.Dataset) and obj.ndim >= 3 else None)
        out["arrays"] = shapes
    return out


def portable(obj: Any, out: str | Path, python: str = sys.executable) -> Any:
    """``obj`` with this run's output folder written ``<out>`` and the interpreter ``python``,
    so that a report can be shared or committed without this machine's paths."""
    if isinstance(obj, str):
        return obj.replace(str(out), "<out>").replace(python, "python")
    if isinstance(obj, dict):
        return {k: portable(v, out, python) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, out, python) for v in obj]
    return obj


def run_step(step: str, plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one step; its record: status ok | failed | timeout | skipped, wall_s, result, reason."""
    record: dict[str, Any] = {"step": step, "status": "skipped", "wall_s": None, "result": None,
                              "reason": None, "command": None}
    if step in CUDA_ONLY and plan.device != "cuda":
        record["reason"] = "needs CUDA (torch sees no CUDA device)"
        return record
    if step in NEEDS_DATA and not (plan.data / "manifest.json").is_file():
        record["reason"] = "needs the data step's data set, which is missing"
        return record
    cmd, json_out = step_command(step, plan)
    record["command"] = cmd
    log_path = plan.out / f"{step}.log"
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as logf:
        try:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                  timeout=plan.timeouts.get(step))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    record["wall_s"] = round(time.monotonic() - t0, 2)
    record["log"] = log_path.name
    if rc is None:
        record["status"] = "timeout"
        record["reason"] = f"stopped at its {plan.timeouts.get(step):.0f} s limit"
    elif rc != 0:
        record["status"] = "failed"
        tail = [t for t in log_path.read_text(errors="replace").strip().splitlines() if t.strip()][-2:]
        record["reason"] = f"exit status {rc}: " + " | ".join(tail)
    else:
        record["status"] = "ok"
    if step == "tests":
        counts = _junit_counts(plan.out / "gpu_tests.xml")
        record["result"] = counts
        if counts and rc == 0 and plan.device != "cuda" and counts["skipped"] == counts["tests"]:
            record["reason"] = "no CUDA: every gpu-marked test skipped itself"
    elif json_out and Path(json_out).is_file():
        record["result"] = json.loads(Path(json_out).read_text())
    elif step == "data":
        record["result"] = _dataset_summary(plan.data)
    elif step == "paper-sim":
        record["result"] = _dataset_summary(plan.work / "paper")
    record = portable(record, plan.out)
    log(f"[gpu-check] {step}: {record['status']} in {record['wall_s']:.1f} s"
        + (f" ({record['reason']})" if record["reason"] else ""))
    return record


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: the steps, then one table per step that has figures."""
    env = report["environment"]
    lines = [f"# masc bench gpu-check ({env.get('device_name') or report['device']})", "",
             f"torch {env['torch']}, CUDA {env.get('cuda') or '-'}, {env['cpu_count']} CPUs, "
             f"python {env['python']}; total {report['wall_s']:.0f} s"
             + (", quick sizes (not figures)" if report["quick"] else ""), "",
             "| step | status | wall s | note |", "|---|---|---|---|"]
    for r in report["steps"]:
        lines.append(f"| {r['step']} | {r['status']} | {_f(r['wall_s'])} | {r['reason'] or ''} |")
    by = {r["step"]: r for r in report["steps"]}
    tests = (by.get("tests") or {}).get("result")
    if tests:
        lines += ["", f"**gpu-marked tests**: {tests['passed']} passed, {tests['skipped']} skipped, "
                      f"{tests['failures']} failed, {tests['errors']} errors"]
    unet = (by.get("unet") or {}).get("result")
    if unet:
        lines += ["", "**MAR U-Net forward** (eval, no_grad, seeded weights)", "",
                  "| variant | H x W | batch | width | ms / call | images / s | first call s "
                  "| max rel diff | peak MB |", "|---|---|---|---|---|---|---|---|---|"]
        for row in unet["rows"]:
            lines.append(f"| {row['variant']} | {row['height']}x{row['width_px']} | {row['batch']} "
                         f"| {row['width']} | {_f(row['latency_median_ms'], 2)} "
                         f"| {_f(row['throughput_img_s'])} | {_f(row['first_call_s'], 2)} "
                         f"| {_f(row['max_rel_diff'], 4)} | {_f(row['peak_mem_mb'])} |"
                         + (f" {row['status']}: {row['error']}" if row["status"] != "ok" else ""))
    envr = (by.get("env") or {}).get("result")
    if envr:
        e, p = envr["env"], envr.get("ppo") or {}
        lines += ["", f"**Environment and PPO** ({e['device']}, {e['image_shape'][0]}x{e['image_shape'][1]}, "
                      f"MAR width {e['mar_width']}, {e['n_envs']} envs)", "",
                  "| loop | steps / s |", "|---|---|",
                  f"| batched env, {e['n_envs']} slices | {_f(e['batched_steps_per_s'])} |",
                  f"| one-slice loop | {_f(e['single_steps_per_s'])} |",
                  f"| Gymnasium env | {_f(e['gym_steps_per_s'])} |",
                  f"| batched / one-slice | {_f(e['speedup'], 2)}x |"]
        if p:
            lines += [f"| our PPO (collect + update) | {_f(p.get('ours_steps_per_s'))} |",
                      f"| MaskablePPO ({p.get('sb3_status')}) | {_f(p.get('sb3_steps_per_s'))} |"]
    serve_rows = [(model, row) for step, model in (("serve", report["device"]), ("serve-cpu", "cpu"))
                  for row in ((by.get(step) or {}).get("result") or {}).get("rows", [])]
    if serve_rows:
        lines += ["", "**masc serve under concurrent closed-loop scans**", "",
                  "| model on | scans | decisions | in deadline | p50 ms | p99 ms | max ms |",
                  "|---|---|---|---|---|---|---|"]
        for model, row in serve_rows:
            lines.append(f"| {model} | {row['scans']} | {row['decisions']} | {row['in_deadline']} "
                         f"| {_f(row['p50_ms'])} | {_f(row['p99_ms'])} | {_f(row['max_ms'])} |")
    for name in ("data", "paper-sim"):
        r = by.get(name)
        if r and r["status"] == "ok" and r["result"]:
            lines += ["", f"**{name}**: {r['result']['files']} subject files, "
                          f"{r['result']['bytes'] / 2**20:.0f} MiB in {r['wall_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def gpu_check(out: str | Path, device: str = "auto", quick: bool = False,
              steps: Sequence[str] = STEPS, config_small: str = "configs/small.yaml",
              config_paper: str = "configs/paper.yaml", budget_s: float = 480.0,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``steps`` within ``budget_s`` seconds (a step's time limit is cut to what is left,
    the steps after the budget are skipped); writes ``gpu_check.json`` and ``gpu_check.md`` in
    ``out`` after every step; returns the report."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"unknown step {unknown[0]!r}; known: {', '.join(STEPS)}")
    plan = make_plan(out, device, quick, config_small, config_paper)
    plan.out.mkdir(parents=True, exist_ok=True)
    plan.work.mkdir(exist_ok=True)
    if plan.device != "cuda":
        log("[gpu-check] no CUDA device: running the CPU-safe parts; the CUDA-only ones are skipped")
    t0 = time.monotonic()
    from training.bench.common import environment

    report = {"device": plan.device, "quick": quick, "environment": environment(plan.device),
              "budget_s": budget_s, "wall_s": 0.0, "steps": []}
    for step in (s for s in STEPS if s in steps):
        left = budget_s - (time.monotonic() - t0)
        if left < 10:
            record = {"step": step, "status": "skipped", "wall_s": None, "result": None,
                      "command": None, "reason": f"the {budget_s:.0f} s budget was spent"}
            log(f"[gpu-check] {step}: skipped ({record['reason']})")
        else:
            plan.timeouts[step] = min(plan.timeouts[step], left)
            record = run_step(step, plan, log)
        report["steps"].append(record)
        report["wall_s"] = time.monotonic() - t0
        # written after every step, so a run stopped from outside keeps what it measured
        (plan.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (plan.out / "gpu_check.md").write_text(render_markdown(report))
    return report
