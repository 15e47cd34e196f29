"""Hostile samples: values that overflow the reconstruction never reach a decision or an image."""

import numpy as np
import pytest
import torch
from torch import nn

from masc_gadget.acquisition.engine import MAX_SAMPLE_MAGNITUDE, NON_FINITE_MAR, AcquisitionEngine, EngineSettings
from masc_gadget.acquisition.learned import LearnedPolicy
from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig

N_PE, N_RO = 16, 8


def _settings(initial=2, budget=3):
    return EngineSettings(n_pe=N_PE, n_readout=N_RO, initial=initial, budget=budget, seed=0, device="cpu")


def _row(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * (rng.standard_normal(N_RO) + 1j * rng.standard_normal(N_RO))).astype(np.complex64)


class BrightestFree(SamplingPolicy):
    """Reads the image: the free row with the most energy (NaN would make argmax pick it)."""

    name = "brightest"
    needs_image = True
    deterministic = True

    def choose(self, state: AcquisitionState, rng) -> int:
        energy = np.asarray(state.image, dtype=np.float64).sum(axis=1)
        energy[state.mask] = -np.inf
        return int(np.argmax(energy))


class NanWhenHuge(nn.Module):
    """A MAR stand-in that overflows (NaN) on an input brighter than 1e3, else the identity."""

    def forward(self, x):
        return torch.where(x.amax(dim=(-2, -1), keepdim=True) > 1e3, torch.full_like(x, float("nan")), x)


@pytest.mark.parametrize("value", [1e38, -3e37, 1e31, complex(0, 2e35)])
def test_samples_that_would_overflow_the_fft_are_rejected_and_nothing_is_stored(value):
    engine = AcquisitionEngine(_settings(), make_policy("center-out"))
    engine.add_line(0, 7, _row(0))
    bad = _row(1)
    bad[3] = value
    with pytest.raises(ValueError, match=r"slice 0 line 8: samples must have real and imaginary parts of "
                                         r"magnitude <= 1e\+30"):
        engine.add_line(0, 8, bad)
    assert engine.acquired(0) == [7]
    result = engine.finish_slice(0)
    assert np.isfinite(result.image).all() and np.isfinite(result.zero_filled).all()


def test_samples_at_the_limit_give_finite_images_and_decisions():
    engine = AcquisitionEngine(_settings(), BrightestFree())
    for line in (7, 8):  # every sample at the largest accepted magnitude
        engine.on_line(0, line, np.full(N_RO, MAX_SAMPLE_MAGNITUDE * (1 + 1j) / 2, np.complex64))
    result = engine.finish_slice(0)
    assert np.isfinite(result.image).all() and result.image.max() > 0


def test_a_line_that_makes_the_mar_image_non_finite_is_taken_back():
    engine = AcquisitionEngine(_settings(), BrightestFree(), mar=NanWhenHuge())
    assert engine.on_line(0, 7, _row(0)) == []
    with pytest.raises(ValueError, match="slice 0 line 8 rejected: with it the slice's reconstruction is not "
                                         "finite .* keeps its previous lines"):
        engine.on_line(0, 8, _row(1, scale=1e9))  # finite samples, but the MAR output is NaN
    assert engine.acquired(0) == [7] and engine.wanting() == []
    decisions = engine.on_line(0, 8, _row(1))  # the good samples of the same line
    assert len(decisions) == 1 and decisions[0].step == 0
    assert engine.acquired(0) == [7, 8]


def test_a_repeated_line_that_breaks_the_image_keeps_the_old_samples_and_decision_state():
    engine = AcquisitionEngine(_settings(), BrightestFree(), mar=NanWhenHuge())
    engine.on_line(0, 7, _row(0))
    first = engine.on_line(0, 8, _row(1))
    line = first[0].line
    engine.on_line(0, line, _row(2))  # the decided line arrives: a new decision
    with pytest.raises(ValueError, match="not finite"):
        engine.on_line(0, line, _row(3, scale=1e9))  # a repeat with overflowing samples
    assert engine.acquired(0) == [7, 8, line]
    result = engine.finish_slice(0)
    assert result.decided == [line] and np.isfinite(result.image).all()
    assert result.mar != NON_FINITE_MAR


def test_decide_never_runs_the_policy_on_a_non_finite_image():
    seen = []

    class Recording(BrightestFree):
        def select_batch(self, states, rngs=None):
            seen.extend(np.isfinite(s.image).all() for s in states)
            return super().select_batch(states, rngs)

    engine = AcquisitionEngine(_settings(initial=1), Recording(), mar=NanWhenHuge())
    engine.add_line(0, 7, _row(0))
    engine.add_line(1, 7, _row(0, scale=1e9))
    decisions = engine.decide()
    assert [d.slice for d in decisions] == [0] and all(seen)


def test_a_final_mar_image_that_is_not_finite_falls_back_to_the_zero_filled_one():
    engine = AcquisitionEngine(_settings(), make_policy("center-out"), mar=NanWhenHuge())
    engine.add_line(0, 7, _row(0, scale=1e9))  # center-out reads no image: no decision check
    result = engine.finish_slice(0)
    assert np.isfinite(result.image).all() and result.mar == NON_FINITE_MAR
    np.testing.assert_array_equal(result.image, result.zero_filled)


def test_learned_policy_refuses_non_finite_scores():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = PolicyNet(N_PE, N_PE, N_RO, PolicyNetConfig(channels=(2,), hidden=4, pool_size=2))
    policy = LearnedPolicy(net, observes_mar=False, device="cpu")
    engine = AcquisitionEngine(_settings(), policy)
    with torch.no_grad():  # e.g. a network that overflows on some image
        net.actor.bias.fill_(float("nan"))
    engine.on_line(0, 7, _row(0))
    with pytest.raises(ValueError, match="line scores are not finite"):
        engine.on_line(0, 8, _row(1))
    assert engine.acquired(0) == [7]
