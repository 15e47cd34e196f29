"""The greedy oracle: at its first step it is at least as good as every other method (Q under
the same MAR network, scored independently by the evaluation's metrics), and the tables report
the share of its gain over Random that each method captures."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.policies import make_policy
from masc_gadget.cli import main
from masc_gadget.models.checkpoint import load_mar
from tests.conftest import CONFIGS
from training.data import load_split
from training.evaluation.evaluate import run_method
from training.oracle import GreedyOracle
from training.evaluation.tables import oracle_gain


def _q(traj, step, mar=True):
    c = traj.curves[mar]
    return 0.5 * c["ssim"][:, step] + 0.5 * (1 - c["nmse"][:, step])


@pytest.mark.parametrize("with_mar", [True, False])
def test_oracle_first_step_beats_every_method(tiny_dataset, perturbed_mar, with_mar):
    data = load_split(tiny_dataset, "test")
    mar = load_mar(perturbed_mar, "cpu")[0].eval() if with_mar else None
    device = torch.device("cpu")
    with torch.no_grad():
        oracle = run_method(GreedyOracle(), data, 1, 1, mar, 0, 8, device)
        for name in ("center-out", "random", "random-lowbias", "equispaced"):
            other = run_method(make_policy(name), data, 1, 1, mar, 0, 8, device)
            assert np.all(_q(oracle, 1, with_mar) >= _q(other, 1, with_mar) - 1e-5), name
    assert np.array_equal(oracle.lines[:, 0], other.lines[:, 0])  # same start: the centre line
    assert len(set(map(tuple, oracle.lines))) >= 1 and oracle.lines.shape == (len(data), 2)


def test_tables_report_the_oracle_gain_captured(tiny_dataset, perturbed_mar, tmp_path):
    args = ["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "test",
            "--methods", "random,center-out,oracle"]
    assert main([*args, "--mar", str(perturbed_mar), "--out", str(tmp_path / "mar")]) == 0
    with_mar = json.loads((tmp_path / "mar" / "results.json").read_text())
    for block in with_mar["accelerations"].values():  # lines chosen under MAR: no bound without it
        assert all(v is None for k, v in oracle_gain(block).items() if k.endswith("+nomar"))
    assert main([*args, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    for block in results["accelerations"].values():
        share = oracle_gain(block)
        ssim = {row["key"]: row["summary"]["ssim"]["mean"] for row in block["rows"]}
        assert ssim["oracle+nomar"] > ssim["random+nomar"]  # the oracle has headroom here
        assert share["oracle+nomar"] == pytest.approx(1.0) and share["random+nomar"] == 0.0
        assert share["center-out+nomar"] == pytest.approx(
            (ssim["center-out+nomar"] - ssim["random+nomar"]) / (ssim["oracle+nomar"] - ssim["random+nomar"]))
    table = (tmp_path / "table.md").read_text()
    assert "Oracle (greedy, uses the ground truth)" in table and "oracle gain captured over Random (SSIM)" in table


def test_oracle_gain_is_none_without_a_gain():
    row = lambda key, mar, ssim: {"key": key, "mar": mar, "summary": {"ssim": {"mean": ssim}}}  # noqa: E731
    block = {"rows": [row("oracle", True, 0.5), row("random", True, 0.5), row("masc", True, 0.6)]}
    assert oracle_gain(block) == {"oracle": None, "random": None, "masc": None}
    block["rows"][0] = row("oracle", True, 0.7)
    assert oracle_gain(block)["masc"] == pytest.approx(0.5)
