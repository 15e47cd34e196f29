"""One image path: a closed-loop scan against masc serve scores exactly what masc eval scores.

For every registered policy (the baselines, and a checkpoint of each learned kind: MASC and the
learned mask with their own MAR network, DQN and SS-DDQN observing the operator's), the lines
the gadget chose and the per-slice metrics of the image it served equal those of ``masc eval`` on
the same slices, MAR on (the baselines with ``--mar``, MASC with its own network, whatever
``--mar`` says)."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.learned import KINDS, policy_metadata, q_metadata
from masc_gadget.acquisition.policies import POLICIES
from masc_gadget.config import load_config, to_dict
from masc_gadget.models.checkpoint import save_checkpoint
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.q_net import QNet, QNetConfig
from masc_gadget.models.unet import MarModelConfig, build_mar
from training.evaluation.evaluate import evaluate

from tests.conftest import CONFIGS
from tests.sim_scanner.scanner.serve import scan_against_serve

N = 32  # the tiny configuration's matrix
INITIAL, BUDGET, SEED = 1, 2, 3


@pytest.fixture(scope="module")
def masc_checkpoint(tmp_path_factory):
    """An untrained MASC checkpoint with a spread of line preferences and its own (non-identity)
    MAR network: its choices depend on what it observes."""
    path = tmp_path_factory.mktemp("masc") / "masc.pt"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        net = PolicyNet(N, N, N, PolicyNetConfig(channels=(4, 8), hidden=16, pool_size=4),
                        generator=torch.Generator().manual_seed(5))
        mar = build_mar(MarModelConfig(width=4))
        with torch.no_grad():
            net.actor.bias.copy_(0.1 * torch.randn(N))
            for p in mar.parameters():
                p.add_(0.05 * torch.randn(p.shape))
    save_checkpoint(path, {"policy": net.eval(), "mar": mar.eval()}, policy_metadata(net, True, mar))
    return path


@pytest.fixture(scope="module")
def learned_checkpoints(tmp_path_factory, masc_checkpoint):
    """A checkpoint of every learned kind: MASC and the learned mask with their own MAR network,
    DQN and SS-DDQN without one (they observe the operator's MAR network, ``--mar`` offline)."""
    folder = tmp_path_factory.mktemp("learned")
    paths = {"masc": masc_checkpoint}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        for kind, spectral in (("dqn", False), ("ss-ddqn", True)):
            net = QNet(N, N, N, QNetConfig(channels=(4, 8), hidden=16), spectral=spectral,
                       generator=torch.Generator().manual_seed(7))
            paths[kind] = save_checkpoint(folder / f"{kind}.pt", {"q": net.eval()}, q_metadata(net, kind, True))
        mar = build_mar(MarModelConfig(width=4))
        with torch.no_grad():
            for p in mar.parameters():
                p.add_(0.05 * torch.randn(p.shape))
    order = [int(x) for x in np.random.default_rng(8).permutation(N)[:BUDGET]]
    for kind in ("loupe", "fixed-order"):  # a fixed order and its MAR network
        paths[kind] = save_checkpoint(folder / f"{kind}.pt", {"mar": mar.eval()},
                                      {"kind": kind, "n_pe": N, "order": order, "mar_model": to_dict(mar.config)})
    return paths


def _scan(tiny_dataset, out, policy, gadget):
    report, _ = scan_against_serve(tiny_dataset, out, gadget, [
        "scanner.feedback=inband", f"acquisition.policy={policy}", f"scanner.policy={policy}", f"acquisition.initial={INITIAL}",
        f"acquisition.budget={BUDGET}"])
    assert report.totals.fallbacks == 0 and report.totals.connections_lost == 0
    return {f"{sub.subject}/{sl.slice}": sl for sub in report.subjects for sl in sub.slices}


@pytest.mark.parametrize("policy", sorted(POLICIES) + sorted(KINDS))
def test_served_image_scores_equal_masc_eval(tiny_dataset, tmp_path, perturbed_mar, learned_checkpoints, policy):
    learned = policy in KINDS
    own_mar = policy in ("masc", "loupe", "fixed-order")
    gadget = [f"acquisition.seed={SEED}"]
    if learned:
        gadget.append(f"gadget.policy_checkpoint={learned_checkpoints[policy]}")
    if not own_mar:  # the operator's MAR network (a learned checkpoint's own one otherwise)
        gadget.append(f"gadget.mar_checkpoint={perturbed_mar}")
    served = _scan(tiny_dataset, tmp_path / "scan", policy, gadget)

    config = load_config(CONFIGS / "tiny.yaml", [
        f"eval.accelerations={{10x: [{INITIAL}, {BUDGET}]}}", f"eval.seed={SEED}", "eval.examples=0"])
    # --mar names another network: a learned method still observes and is served through its own
    results, _ = evaluate(config, tiny_dataset, "test", [policy], perturbed_mar, progress=False,
                          checkpoint=learned_checkpoints[policy] if learned else None)
    row = next(r for r in results["accelerations"]["10x"]["rows"] if r["key"] == policy)
    assert sorted(served) == sorted(results["slices"])
    for i, label in enumerate(results["slices"]):
        sl = served[label]
        assert sl.image_source == "gadget"
        assert sl.lines == row["lines"][i], label
        assert abs(sl.metrics["ssim"] - row["per_slice"]["ssim"][i]) < 1e-5, label
        assert sl.metrics["psnr"] == pytest.approx(row["per_slice"]["psnr"][i], abs=1e-3)
    # MAR is on and changes the image: the equality is not that of two zero-filled images
    nomar = next(r for r in results["accelerations"]["10x"]["rows"] if r["key"] == f"{policy}+nomar")
    assert np.max(np.abs(np.subtract(row["per_slice"]["ssim"], nomar["per_slice"]["ssim"]))) > 1e-3


def test_the_ood_fallback_is_served_and_scored_alike(tiny_dataset, tmp_path, perturbed_mar):
    """A MAR network calibrated so that about half the slices score above its threshold: the
    gadget serves those zero-filled, and masc eval scores exactly what it served."""
    from masc_gadget.acquisition.policies import make_policy, run_episode
    from masc_gadget.core.kspace import zero_filled
    from masc_gadget.core.ood import residual_score
    from masc_gadget.models.checkpoint import load_mar
    from training.data import load_split
    from training.export import export_checkpoint

    data = load_split(tiny_dataset, "test")
    mask = torch.zeros(len(data), N, dtype=torch.bool)
    mask[:, torch.as_tensor(run_episode(make_policy("center-out"), N, INITIAL, BUDGET))] = True
    with torch.no_grad():
        zf = zero_filled(data.kspace_metal, mask)
        scores = residual_score(zf, load_mar(perturbed_mar)[0](zf))
    threshold = float(scores.median())
    calibrated = tmp_path / "calibrated.pt"
    export_checkpoint(perturbed_mar, calibrated, ood={"score": "residual", "threshold": threshold})
    served = _scan(tiny_dataset, tmp_path / "scan", "center-out",
                   [f"acquisition.seed={SEED}", f"gadget.mar_checkpoint={calibrated}"])
    config = load_config(CONFIGS / "tiny.yaml", [
        f"eval.accelerations={{10x: [{INITIAL}, {BUDGET}]}}", f"eval.seed={SEED}", "eval.examples=0"])
    results, _ = evaluate(config, tiny_dataset, "test", ["center-out"], calibrated, progress=False)
    rows = {r["key"]: r for r in results["accelerations"]["10x"]["rows"]}
    mar, nomar = rows["center-out"]["per_slice"]["ssim"], rows["center-out+nomar"]["per_slice"]["ssim"]
    for i, label in enumerate(results["slices"]):
        assert abs(served[label].metrics["ssim"] - mar[i]) < 1e-5, label
    fell_back = (scores > threshold).numpy()
    assert fell_back.any() and not fell_back.all()
    np.testing.assert_allclose(np.asarray(mar)[fell_back], np.asarray(nomar)[fell_back], atol=1e-6)
    assert np.abs(np.subtract(mar, nomar))[~fell_back].max() > 1e-3


def _with_early_rule(checkpoint, mar, data, out, after=(), score="residual"):
    """``checkpoint`` with an early rule (``score``) whose threshold lies between the two
    middle slices of ``data``: about half are flagged, scored on the initial lines' image, or
    with ``after`` (the first lines a slice chooses) on the image of those lines too, the rule's
    ``after_lines``; ``after`` (slices, k): each slice's own. Returns (calibrated path, early
    scores, threshold)."""
    from masc_gadget.core.kspace import zero_filled
    from masc_gadget.core.ood import OodCalibration, initial_of, ood_score
    from masc_gadget.models.checkpoint import load_checkpoint
    from training.scoring import line_masks

    after = np.asarray(after, dtype=np.int64)  # (k,) on every slice, or (slices, k): each its own
    after_lines = INITIAL + after.shape[-1] if after.size else None
    rule = OodCalibration(score, 1.0, "early", after_lines)
    with torch.no_grad():
        mask = torch.as_tensor(line_masks(len(data), N, INITIAL, after))
        zf = zero_filled(data.kspace_metal, mask)
        scores = ood_score(score, zf, mar(zf), mask, mar, initial_of(rule, data.kspace_metal, INITIAL, mask))
    ranked = scores.sort().values
    threshold = float(ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2
    ck = load_checkpoint(checkpoint)
    early = {"score": score, "threshold": threshold, **({"after_lines": after_lines} if after_lines else {})}
    calibrated = save_checkpoint(out, ck.state_dicts, {
        **ck.metadata, "ood": {"score": "flip", "threshold": 1e-9, "early": early}})
    return calibrated, scores, threshold


def _eval_rows(tiny_dataset, policy, checkpoint):
    """masc eval's rows of ``policy`` from ``checkpoint`` on the tiny test split, by key."""
    config = load_config(CONFIGS / "tiny.yaml", [
        f"eval.accelerations={{10x: [{INITIAL}, {BUDGET}]}}", f"eval.seed={SEED}", "eval.examples=0"])
    results, _ = evaluate(config, tiny_dataset, "test", [policy], None, progress=False, checkpoint=checkpoint)
    return results["slices"], {r["key"]: r for r in results["accelerations"]["10x"]["rows"]}


def test_the_early_switch_is_played_served_and_scored_alike(tiny_dataset, tmp_path, masc_checkpoint):
    """A MASC checkpoint whose early rule flags about half the slices from the image of their
    initial lines: the gadget plays centre-out's lines on those and serves them zero-filled
    (doing nothing), the others get MASC's lines and its MAR image; masc eval plays and scores
    exactly the same."""
    from masc_gadget.acquisition.learned import load_masc
    from masc_gadget.acquisition.policies import make_policy, run_episode
    from training.data import load_split

    data = load_split(tiny_dataset, "test")
    _, mar, _ = load_masc(masc_checkpoint, "cpu")
    calibrated, scores, threshold = _with_early_rule(masc_checkpoint, mar, data, tmp_path / "masc_early.pt")
    served = _scan(tiny_dataset, tmp_path / "scan", "masc",
                   [f"acquisition.seed={SEED}", f"gadget.policy_checkpoint={calibrated}"])
    slices, rows = _eval_rows(tiny_dataset, "masc", calibrated)
    own = _eval_rows(tiny_dataset, "masc", masc_checkpoint)[1]["masc"]
    safe = run_episode(make_policy("center-out"), N, INITIAL, BUDGET).tolist()
    switched = (scores > threshold).numpy()
    assert switched.any() and not switched.all()
    assert any(own["lines"][i] != safe for i in np.flatnonzero(switched))  # the switch changes lines
    mar_ssim, nomar = rows["masc"]["per_slice"]["ssim"], rows["masc+nomar"]["per_slice"]["ssim"]
    for i, label in enumerate(slices):
        sl = served[label]
        assert sl.lines == rows["masc"]["lines"][i], label
        assert abs(sl.metrics["ssim"] - mar_ssim[i]) < 1e-5, label
        if switched[i]:  # centre-out's lines, served zero-filled: doing nothing
            assert sl.lines == safe and abs(mar_ssim[i] - nomar[i]) < 1e-6, label
        else:  # MASC's own lines and its MAR image (the end rule is not applied)
            assert sl.lines == own["lines"][i] and abs(mar_ssim[i] - own["per_slice"]["ssim"][i]) < 1e-6, label


def _assert_switched_alike(served, slices, row, nomar_row, switched, switched_lines, order):
    """Every slice served as ``masc eval`` played and scored it (``row``): the switched ones on
    ``switched_lines``, served zero-filled (``nomar_row``'s score), the others on ``order``."""
    mar_ssim, nomar = row["per_slice"]["ssim"], nomar_row["per_slice"]["ssim"]
    for i, label in enumerate(slices):
        sl = served[label]
        assert sl.lines == row["lines"][i], label
        assert abs(sl.metrics["ssim"] - mar_ssim[i]) < 1e-5, label
        if switched[i]:  # the switched plan, served zero-filled
            assert sl.lines == switched_lines and abs(mar_ssim[i] - nomar[i]) < 1e-6, label
        else:  # the order's plan and its network's image
            assert sl.lines == order, label


def test_a_fixed_order_decided_ahead_takes_the_early_switch_alike(tiny_dataset, tmp_path, learned_checkpoints):
    """A fixed order (reads no image, decided ahead) whose network carries an early rule that
    flags about half the slices: the gadget scores each slice's initial lines at its first
    decision and sends the whole plan at once, the order's or centre-out's (served zero-filled:
    doing nothing); masc eval plays and scores exactly the same."""
    from masc_gadget.acquisition.episode import initial_lines
    from masc_gadget.acquisition.policies import make_policy, run_episode
    from masc_gadget.models.checkpoint import load_checkpoint, load_mar
    from training.data import load_split

    fixed = learned_checkpoints["fixed-order"]
    data = load_split(tiny_dataset, "test")
    calibrated, scores, threshold = _with_early_rule(fixed, load_mar(fixed)[0], data, tmp_path / "fixed_early.pt")
    served = _scan(tiny_dataset, tmp_path / "scan", "fixed-order",
                   [f"acquisition.seed={SEED}", f"gadget.policy_checkpoint={calibrated}"])
    slices, rows = _eval_rows(tiny_dataset, "fixed-order", calibrated)
    ck = load_checkpoint(fixed)
    order = [int(x) for x in initial_lines(N, INITIAL)] + ck.metadata["order"]
    safe = run_episode(make_policy("center-out"), N, INITIAL, BUDGET).tolist()
    switched = (scores > threshold).numpy()
    assert switched.any() and not switched.all() and order != safe
    _assert_switched_alike(served, slices, rows["fixed-order"], rows["fixed-order+nomar"], switched, safe, order)


@pytest.mark.parametrize("score", ["residual", "holdout", "halves"])
def test_a_fixed_order_switched_after_its_first_lines_is_played_served_and_scored_alike(tiny_dataset, tmp_path,
                                                                                      learned_checkpoints, score):
    """An early rule with ``after_lines`` (``masc check mar --early-lines``): the gadget sends
    the fixed order's plan up to the switch point, scores the image of those lines, then sends
    the rest, the order's or centre-out's next free lines (served zero-filled); masc eval plays
    and scores exactly the same. ``holdout`` also makes the image of the initial lines alone from
    the lines it holds; ``halves`` the image of the initial lines and
    the inner half of the others (none of one: the tiny protocol has 2 lines to choose)."""
    from masc_gadget.acquisition.episode import initial_lines
    from masc_gadget.acquisition.policies import center_out_rank
    from masc_gadget.models.checkpoint import load_checkpoint, load_mar
    from training.data import load_split

    fixed = learned_checkpoints["fixed-order"]
    data = load_split(tiny_dataset, "test")
    order = [int(x) for x in initial_lines(N, INITIAL)] + load_checkpoint(fixed).metadata["order"]
    first = order[INITIAL:INITIAL + 1]  # the switch after the initial lines and the order's first choice
    calibrated, scores, threshold = _with_early_rule(fixed, load_mar(fixed)[0], data, tmp_path / "later.pt",
                                                     after=first, score=score)
    served = _scan(tiny_dataset, tmp_path / "scan", "fixed-order",
                   [f"acquisition.seed={SEED}", f"gadget.policy_checkpoint={calibrated}"])
    slices, rows = _eval_rows(tiny_dataset, "fixed-order", calibrated)
    kept = order[:INITIAL + 1]
    centre_out = [int(x) for x in np.argsort(center_out_rank(N), kind="stable")]
    switched_lines = kept + [x for x in centre_out if x not in kept][:BUDGET - 1]
    switched = (scores > threshold).numpy()
    assert switched.any() and not switched.all() and switched_lines != order
    _assert_switched_alike(served, slices, rows["fixed-order"], rows["fixed-order+nomar"], switched, switched_lines,
                           order)


def test_masc_switched_after_its_first_line_by_the_holdout_score_is_played_served_and_scored_alike(
        tiny_dataset, tmp_path, masc_checkpoint):
    """The shipped models' rule on a policy that reads the image: MASC chooses its first line
    from the image, the holdout score of the image of those lines (the network's prediction of
    that line from the initial lines' image) flags about half the slices, which continue with
    centre-out's next lines and are served zero-filled; masc eval plays and scores the same."""
    from masc_gadget.acquisition.learned import load_masc
    from masc_gadget.acquisition.policies import center_out_rank
    from training.data import load_split

    data = load_split(tiny_dataset, "test")
    _, mar, _ = load_masc(masc_checkpoint, "cpu")
    slices, own_rows = _eval_rows(tiny_dataset, "masc", masc_checkpoint)
    own = own_rows["masc"]["lines"]
    assert [o[:INITIAL] for o in own] == [own[0][:INITIAL]] * len(own)  # the initial lines lead every slice
    first = np.array([o[INITIAL:INITIAL + 1] for o in own])  # each slice's own first choice
    calibrated, scores, threshold = _with_early_rule(masc_checkpoint, mar, data, tmp_path / "masc_holdout.pt",
                                                     after=first, score="holdout")
    served = _scan(tiny_dataset, tmp_path / "scan", "masc",
                   [f"acquisition.seed={SEED}", f"gadget.policy_checkpoint={calibrated}"])
    slices, rows = _eval_rows(tiny_dataset, "masc", calibrated)
    centre_out = [int(x) for x in np.argsort(center_out_rank(N), kind="stable")]
    switched = (scores > threshold).numpy()
    assert switched.any() and not switched.all()
    mar_ssim, nomar = rows["masc"]["per_slice"]["ssim"], rows["masc+nomar"]["per_slice"]["ssim"]
    for i, label in enumerate(slices):
        sl = served[label]
        assert sl.lines == rows["masc"]["lines"][i], label
        assert abs(sl.metrics["ssim"] - mar_ssim[i]) < 1e-5, label
        kept = own[i][:INITIAL + 1]
        if switched[i]:  # the lines it kept, then centre-out's next ones, served zero-filled
            assert sl.lines == kept + [x for x in centre_out if x not in kept][:BUDGET - 1], label
            assert abs(mar_ssim[i] - nomar[i]) < 1e-6, label
        else:  # MASC's own lines and its MAR image
            assert sl.lines == own[i], label
