"""OOD scores of MAR images and the zero-filled fallback of the one serving path."""

import math

import numpy as np
import pytest
import torch

from masc_gadget.core.kspace import fft2c, zero_filled
from masc_gadget.core.ood import (SCORES, OodCalibration, check_fallback_setting, consistency_score, early_switch,
                                  fallback_rule, flip_score, ood_score, residual_score)
from masc_gadget.core.served import served_images


def _scan(seed=0, n=16):
    gen = torch.Generator().manual_seed(seed)
    image = torch.zeros(2, n, n)
    image[:, 4:12, 3:13] = 1.0 + 0.2 * torch.rand(2, 8, 10, generator=gen)
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[:, n // 2 - 3: n // 2 + 3] = True
    return zero_filled(fft2c(image.to(torch.complex64)), mask), mask


def test_untouched_images_score_low_and_invented_structure_scores_high():
    zf, mask = _scan()
    invented = zf.clone()
    invented[:, 2:4, 2:4] += 3 * zf.max()  # structure the acquired lines do not hold
    for kind in ("consistency", "residual"):
        calm = ood_score(kind, zf, zf, mask)
        wild = ood_score(kind, zf, invented, mask)
        assert (wild > 2 * calm).all() and (wild > 0.1).all(), kind
    assert torch.equal(residual_score(zf, zf), torch.zeros(2))
    assert consistency_score(zf, zf, mask).max() < 0.2  # magnitude only: small, not zero


def test_the_flip_score_is_zero_for_a_mirror_symmetric_network_and_not_for_a_lopsided_one():
    zf, mask = _scan(1)
    assert torch.allclose(flip_score(lambda x: 2 * x, zf, 2 * zf), torch.zeros(2), atol=1e-6)
    ramp = torch.linspace(0, 1, zf.shape[-1])
    lopsided = lambda x: x * ramp  # noqa: E731
    assert (flip_score(lopsided, zf, lopsided(zf)) > 0.3).all()


def test_non_finite_outputs_score_infinite_and_unknown_scores_are_refused():
    zf, mask = _scan()
    bad = zf.clone()
    bad[0, 0, 0] = float("nan")
    assert torch.isinf(ood_score("residual", zf, bad, mask))[0]
    with pytest.raises(ValueError, match="unknown OOD score 'x': choose from consistency, residual, flip"):
        ood_score("x", zf, zf, mask)
    with pytest.raises(ValueError, match="flip score needs the MAR network"):
        ood_score("flip", zf, zf, mask)


def test_served_images_fall_back_to_zero_filled_above_the_threshold_only():
    zf, mask = _scan()
    corrected = zf.clone()
    corrected[0, 2:4, 2:4] += 5 * zf.max()  # slice 0 strays far, slice 1 is left alone
    scores = residual_score(zf, corrected)
    rule = OodCalibration("residual", float(scores.mean()))
    served = served_images(zf, corrected, ood=rule, mask=mask)
    assert served.mar_used.tolist() == [False, True]
    assert torch.equal(served.image[0], zf[0].clamp_min(0)) and torch.equal(served.image[1], corrected[1].clamp_min(0))
    assert torch.allclose(served.ood_score, scores)
    never = served_images(zf, corrected, ood=OodCalibration("residual", math.inf), mask=mask)
    assert never.mar_used.all() and torch.isfinite(never.ood_score).all()
    plain = served_images(zf, corrected)
    assert plain.mar_used.all() and torch.isnan(plain.ood_score).all()
    with pytest.raises(ValueError, match="consistency score needs the"):
        served_images(zf, corrected, ood=OodCalibration("consistency", 1.0))


def test_the_fallback_setting_and_the_stored_calibration():
    class Net(torch.nn.Module):
        pass

    net = Net()
    assert fallback_rule(None, "auto") is None and fallback_rule(net, "auto") is None
    assert fallback_rule(net, "0.5") == OodCalibration("consistency", 0.5)
    net.ood = OodCalibration("flip", 0.25)
    assert fallback_rule(net, "auto") == net.ood
    assert fallback_rule(net, "off") == OodCalibration("flip", math.inf)
    assert fallback_rule(net, "0.1") == OodCalibration("flip", 0.1)
    assert [check_fallback_setting(v) for v in ("AUTO", " off", "0.3", 2)] == ["auto", "off", "0.3", "2.0"]
    for bad in ("-1", "0", "nan", "inf", "sometimes"):
        with pytest.raises(ValueError, match="mar_fallback must be auto, off or a threshold > 0"):
            check_fallback_setting(bad)
    assert OodCalibration.from_metadata(None, "x.pt") is None
    assert OodCalibration.from_metadata({"score": "residual", "threshold": 0.2, "auc": {}}, "x.pt").threshold == 0.2
    for bad in ({"score": "residual"}, {"score": "nope", "threshold": 1}, {"score": "flip", "threshold": -1}, "x"):
        with pytest.raises(ValueError, match="x.pt: metadata 'ood' must be"):
            OodCalibration.from_metadata(bad, "x.pt")
    assert set(SCORES) == {"consistency", "residual", "flip"}


def test_an_exported_calibration_is_loaded_with_the_network(tmp_path, perturbed_mar):
    from masc_gadget.models.checkpoint import load_mar
    from training.export import export_checkpoint

    record = export_checkpoint(perturbed_mar, tmp_path / "m.pt", ood={"score": "residual", "threshold": 0.3})
    mar, meta = load_mar(tmp_path / "m.pt")
    assert mar.ood == OodCalibration("residual", 0.3) and meta["ood"]["threshold"] == 0.3
    assert record["ood"]["score"] == "residual" and "git_commit" in record
    assert load_mar(perturbed_mar)[0].ood is None
    with pytest.raises(ValueError, match="metadata 'ood' must be"):
        export_checkpoint(perturbed_mar, tmp_path / "n.pt", ood={"score": "residual"})
    assert not (tmp_path / "n.pt").exists()
    np.testing.assert_equal(sorted(meta), sorted(set(meta)))


def test_yaml_off_and_on_are_the_fallback_settings():
    """Regression: ``--set gadget.mar_fallback=off`` reached the gadget section as YAML's false
    and was refused ("must be str or float, got False")."""
    from masc_gadget.config import load_config

    assert load_config(None, ["gadget.mar_fallback=off"])["gadget"].mar_fallback == "off"
    assert load_config(None, ["gadget.mar_fallback=on"])["gadget"].mar_fallback == "auto"
    assert load_config(None, ["gadget.mar_fallback=0.3"])["gadget"].mar_fallback == "0.3"
    assert check_fallback_setting(False) == "off"


def test_the_early_rule_is_chosen_only_for_a_policy_that_reads_the_image():
    class Net(torch.nn.Module):
        pass

    net = Net()
    net.ood = OodCalibration("flip", 0.25)
    net.ood_early = OodCalibration("residual", 0.5, "early")
    assert fallback_rule(net, "auto", switches_early=True) == net.ood_early
    assert fallback_rule(net, "auto") == net.ood  # a fixed order keeps its lines decidable ahead
    assert fallback_rule(net, "off", switches_early=True) == OodCalibration("flip", math.inf)
    assert fallback_rule(net, "0.1", switches_early=True) == OodCalibration("flip", 0.1)
    section = {"score": "flip", "threshold": 0.2, "early": {"score": "residual", "threshold": 0.4, "auc": {}}}
    assert OodCalibration.early_from_metadata(section, "x.pt") == OodCalibration("residual", 0.4, "early")
    assert OodCalibration.early_from_metadata({"score": "flip", "threshold": 0.2}, "x.pt") is None
    with pytest.raises(ValueError, match="x.pt: metadata 'ood.early' must be"):
        OodCalibration.from_metadata({**section, "early": {"score": "residual"}}, "x.pt")
    with pytest.raises(ValueError, match="unknown OOD stage"):
        OodCalibration("flip", 0.1, "later")


def test_an_early_switch_serves_the_switched_slices_zero_filled():
    image, mask = _scan()
    zf = zero_filled(fft2c(image.to(torch.complex64)), mask)
    corrected = zf * 1.5
    rule = OodCalibration("residual", 0.4, "early")
    flagged, score = early_switch(rule, zf, corrected, mask)
    assert torch.allclose(score, torch.full((2,), 0.5)) and flagged.all()
    switched = torch.tensor([True, False])
    served = served_images(zf, corrected, ood=rule, mask=mask, switched=switched, early_score=score)
    assert served.mar_used.tolist() == [False, True]
    assert torch.equal(served.image[0], served.zero_filled[0]) and torch.allclose(served.image[1], corrected[1])
    assert torch.equal(served.ood_score, score)  # the early score is the one reported
    with pytest.raises(ValueError, match="needs the switched slices"):
        served_images(zf, corrected, ood=rule, mask=mask)
    with pytest.raises(ValueError, match="needs an early rule"):
        early_switch(OodCalibration("residual", 0.4), zf, corrected, mask)


def test_the_holdout_score_is_how_badly_the_network_predicts_the_lines_it_was_not_given():
    """``holdout``: the network's output for the initial lines' image, against the acquired lines
    beyond them; 0 for a network that predicts them exactly, 1 for one that predicts nothing,
    above 1 for one that invents structure."""
    from masc_gadget.core.ood import holdout_score, initial_of

    n = 16
    gen = torch.Generator().manual_seed(3)
    image = torch.zeros(2, n, n)
    image[:, 4:12, 3:13] = 1.0 + 0.5 * torch.rand(2, 8, 10, generator=gen)
    kspace = fft2c(image.to(torch.complex64))
    rule = OodCalibration("holdout", 0.5, "early", after_lines=5)
    first_image, first = initial_of(rule, kspace, 2)
    assert first.tolist() == [i in (7, 8) for i in range(n)]
    assert torch.allclose(first_image, zero_filled(kspace, first.expand(2, -1)))
    mask = first.expand(2, -1).clone()
    mask[:, [3, 6, 11]] = True  # three lines beyond the initial ones
    zf = zero_filled(kspace, mask)
    exact = holdout_score(lambda x: zf, (first_image, first), zf, mask)  # predicts what was acquired
    nothing = holdout_score(lambda x: torch.zeros_like(x), (first_image, first), zf, mask)
    invented = zf.clone()
    invented[:, 0:3, 0:3] += 4 * zf.max()
    wild = holdout_score(lambda x: invented, (first_image, first), zf, mask)
    assert torch.allclose(exact, torch.zeros(2), atol=1e-5) and torch.allclose(nothing, torch.ones(2), atol=1e-5)
    assert (wild > 1.5).all()
    assert torch.equal(ood_score("holdout", zf, zf, mask, lambda x: zf, (first_image, first)), exact)
    flagged, score = early_switch(rule, zf, zf, mask, lambda x: torch.zeros_like(x), (first_image, first))
    assert flagged.all() and torch.allclose(score, torch.ones(2), atol=1e-5)
    assert initial_of(OodCalibration("flip", 0.5, "early"), kspace, 2) is None  # other scores need none
    edges = torch.zeros(2, n, dtype=torch.bool)  # an open-loop stream in file order: no initial line yet
    edges[:, :5] = True
    zf_edges = zero_filled(kspace, edges)
    flagged, score = early_switch(rule, zf_edges, zf_edges, edges, lambda x: torch.zeros_like(x), (first_image, first))
    assert torch.isnan(score).all() and not flagged.any()  # not scored, never switched


def test_the_holdout_score_needs_lines_beyond_the_initial_ones_and_an_early_rule():
    from masc_gadget.core.ood import initial_of, switch_point

    zf, mask = _scan()
    with pytest.raises(ValueError, match="needs the MAR network and the image of the lines it is given"):
        ood_score("holdout", zf, zf, mask, lambda x: x)
    with pytest.raises(ValueError, match="need lines beyond the initial ones"):
        ood_score("holdout", zf, zf, mask, lambda x: x, (zf, mask[0]))  # every acquired line is initial
    for stage, after in (("end", None), ("early", None)):
        with pytest.raises(ValueError, match="holdout score is an early rule's after lines beyond the initial"):
            OodCalibration("holdout", 0.5, stage, after)
    with pytest.raises(ValueError, match="needs lines beyond the 6 initial ones"):
        switch_point(OodCalibration("holdout", 0.5, "early", 6), initial=6)
    assert switch_point(OodCalibration("holdout", 0.5, "early", 6), initial=2, lines_per_decision=3) == 8
    assert initial_of(None, torch.zeros(1, 8, 8, dtype=torch.complex64), 2) is None


def test_the_halves_score_gives_the_network_the_initial_and_inner_lines_and_judges_both_parts():
    """``halves``: the network is given the initial lines and the inner half of the others (by
    distance from the centre, the line below first at equal distance); the score is the geometric
    mean of how badly it predicts the outer half and how far it leaves the lines it was given."""
    from masc_gadget.core.ood import consistency_score, halves_score, holdout_score, initial_of, inner_lines

    n = 16
    mask = torch.zeros(3, n, dtype=torch.bool)
    mask[:, [7, 8]] = True  # initial lines of 16: 7, 8 (centre 8)
    mask[0, [10, 2, 5, 14]] = True  # beyond, nearest first: 10 (2 above), 5 (3 below), 2 / 14 (6)
    mask[1, [9, 6, 3]] = True  # three beyond: one given (9), the outer two held out
    mask[2, [6, 10]] = True  # a tie at distance 2: the line below the centre is given
    inner = inner_lines(mask, 2)
    assert [row.nonzero().flatten().tolist() for row in inner] == [[5, 7, 8, 10], [7, 8, 9], [6, 7, 8]]
    from masc_gadget.core.ood import given_lines

    assert torch.equal(given_lines("halves", mask, 2), inner)
    assert [row.nonzero().flatten().tolist() for row in given_lines("holdout", mask, 2)] == [[7, 8]] * 3
    with pytest.raises(ValueError, match="gives the network no lines"):
        given_lines("flip", mask, 2)

    gen = torch.Generator().manual_seed(4)
    image = torch.zeros(3, n, n)
    image[:, 4:12, 3:13] = 1.0 + 0.5 * torch.rand(3, 8, 10, generator=gen)
    kspace = fft2c(image.to(torch.complex64))
    rule = OodCalibration("halves", 0.5, "early", after_lines=6)
    given = initial_of(rule, kspace, 2, mask)
    assert torch.equal(given[1], inner) and torch.allclose(given[0], zero_filled(kspace, inner))
    zf = zero_filled(kspace, mask)
    exact = lambda x: zf  # noqa: E731  (predicts the held-out lines exactly)
    held = holdout_score(exact, (given[0], inner), zf, mask)
    kept = consistency_score(given[0], zf, inner)
    assert torch.allclose(halves_score(exact, given, zf, mask), (held * kept).sqrt())
    assert torch.allclose(held, torch.zeros(3), atol=1e-5) and (kept > 0).all()
    invented = zf.clone()
    invented[:, 0:3, 0:3] += 4 * zf.max()
    wild, calm = halves_score(lambda x: invented, given, zf, mask), halves_score(lambda x: zf + 1e-3, given, zf, mask)
    assert (wild > calm).all()
    assert torch.allclose(wild, (holdout_score(lambda x: invented, (given[0], inner), zf, mask)
                                 * consistency_score(given[0], invented, inner)).sqrt())
    assert torch.equal(ood_score("halves", zf, None, mask, lambda x: invented, given), wild)
    edges = torch.zeros(3, n, dtype=torch.bool)  # no initial line yet: not scored
    edges[:, :5] = True
    score = ood_score("halves", zero_filled(kspace, edges), None, edges, lambda x: x,
                      initial_of(rule, kspace, 2, edges))
    assert torch.isnan(score).all()
    with pytest.raises(ValueError, match="needs the acquired lines"):
        initial_of(rule, kspace, 2)
    with pytest.raises(ValueError, match="halves score is an early rule's after lines beyond the initial"):
        OodCalibration("halves", 0.5, "early")
