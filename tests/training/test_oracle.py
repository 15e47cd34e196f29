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


def _start(n, n_pe, initial):
    from masc_gadget.acquisition.episode import initial_lines

    start = np.zeros((n, n_pe), dtype=bool)
    start[:, initial_lines(n_pe, initial)] = True
    return start


def test_beam_of_one_is_the_greedy_oracle_and_a_wider_beam_never_falls_below(tiny_dataset, perturbed_mar):
    from masc_gadget.acquisition.episode import EpisodeBatch
    from masc_gadget.core.kspace import zero_filled
    from masc_gadget.core.metrics import quality
    from training.oracle import BeamOracle

    data = load_split(tiny_dataset, "train")
    mar = load_mar(perturbed_mar, "cpu")[0].eval()
    device = torch.device("cpu")
    kspace, target = data.kspace_metal, data.target
    start = _start(len(data), data.n_pe, 1)
    with torch.no_grad():
        greedy = run_method(GreedyOracle(), data, 1, 3, mar, 0, 8, device)
        lines1, q1 = BeamOracle(1).plan(start, 3, kspace, target, mar)
        lines4, q4 = BeamOracle(4).plan(start, 3, kspace, target, mar)
        assert np.array_equal(lines1, greedy.lines[:, 1:])
        assert np.all(q4 >= q1 - 1e-9)
        mask = start.copy()
        mask[np.arange(len(data))[:, None], lines4] = True  # the reported Q is the returned lines' Q
        again = quality(mar(zero_filled(kspace, torch.from_numpy(mask))), target).double().numpy()
        assert np.allclose(again, q4, atol=1e-5)
        assert all(len(set(row)) == 3 and not start[0, row].any() for row in lines4)
        # with a region of interest, the score is Q in that region
        roi = torch.zeros(len(data), *data.target.shape[1:], dtype=torch.bool)
        roi[:, 8:24, 4:16] = True
        episodes = EpisodeBatch(data.n_pe, 1, 3, len(data), device)
        scores = GreedyOracle().scores(episodes, kspace, target, mar, roi)
        cand = start.copy()
        cand[:, 3] = True
        direct = quality(mar(zero_filled(kspace, torch.from_numpy(cand))), target, roi=roi).double().numpy()
        assert np.allclose(scores[:, 3], direct, atol=1e-6)
        assert not np.allclose(scores[:, 3], GreedyOracle().scores(episodes, kspace, target, mar)[:, 3])
    with pytest.raises(ValueError, match="beam width"):
        BeamOracle(0)
