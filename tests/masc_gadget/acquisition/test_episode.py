"""EpisodeBatch: the one record of acquisition episodes (engine, scanner, environment, evaluation)."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import EpisodeBatch, check_counts, initial_lines
from masc_gadget.acquisition.policies import select_lines, select_next
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy, run_episode, slice_rng

N_PE, INITIAL, BUDGET = 16, 2, 4


def test_start_has_the_initial_centre_lines():
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 3)
    assert ep.mask.shape == (3, N_PE) and ep.mask.dtype == torch.bool
    assert ep.mask.sum(1).tolist() == [INITIAL] * 3
    assert ep.mask[0, initial_lines(N_PE, INITIAL)].all()
    assert ep.steps_left.tolist() == [BUDGET] * 3 and ep.step.tolist() == [0] * 3
    assert not ep.done.any() and ep.deciding.all()
    assert ep.lines(1) == initial_lines(N_PE, INITIAL).tolist()


def test_acquire_steps_every_episode_and_records_the_order():
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 2)
    before = ep.mask
    ep.acquire([0, 15])
    assert ep.mask is not before and before.sum().item() == 2 * INITIAL  # never written in place
    assert ep.steps_left.tolist() == [BUDGET - 1] * 2 and ep.step.tolist() == [1, 1]
    ep.acquire([3], rows=[1])
    assert ep.n_acquired.tolist() == [INITIAL + 1, INITIAL + 2]
    assert ep.lines(1)[INITIAL:] == [15, 3]


@pytest.mark.parametrize(
    "lines, allow, match",
    [
        ([7, 0], False, r"env 0: line 7 is already acquired"),
        ([0, 16], False, r"env 1: action \(PE line\) must be in \[0, 16\), got 16"),
        ([0, -1], False, r"env 1: action \(PE line\) must be in"),
        ([0.0, 1.0], False, "integer"),
        ([0], False, "one per env"),
    ],
)
def test_acquire_rejects_bad_lines_and_changes_nothing(lines, allow, match):
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 2, name="env")
    mask, counts = ep.mask, ep.n_acquired.copy()
    with pytest.raises(ValueError, match=match):
        ep.acquire(np.asarray(lines), allow_finished=allow)
    assert ep.mask is mask and np.array_equal(ep.n_acquired, counts)


def test_finished_episode_cannot_step_until_reset():
    ep = EpisodeBatch(N_PE, 1, 1, 1, name="env")
    ep.acquire([0])
    assert ep.done.all() and ep.steps_left.tolist() == [0]
    with pytest.raises(ValueError, match="env 0 has finished its episode"):
        ep.acquire([1])
    ep.reset()
    assert ep.n_acquired.tolist() == [1] and ep.lines(0) == initial_lines(N_PE, 1).tolist()


def test_reset_some_rows_keeps_the_others():
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 3)
    ep.acquire([0, 1, 2])
    ep.reset([1])
    assert ep.n_acquired.tolist() == [INITIAL + 1, INITIAL, INITIAL + 1]
    assert not ep.mask[1, 1] and ep.mask[0, 0] and ep.mask[2, 2]


def test_record_counts_any_line_a_scanner_sends():
    ep = EpisodeBatch(N_PE, INITIAL, 1, 1, start=False, name="slice")
    assert ep.n_acquired.tolist() == [0] and not ep.deciding.any()
    assert ep.record(0, 3) and ep.record(0, 12)  # not the centre: the scanner decides
    assert not ep.record(0, 3)  # a repeat changes nothing
    assert ep.deciding.all() and ep.step.tolist() == [0]
    assert ep.record(0, 5) and ep.done.all()
    assert ep.record(0, 6)  # past the budget: still recorded, no step left
    assert ep.steps_left.tolist() == [0] and ep.lines(0) == [3, 12, 5, 6]
    with pytest.raises(ValueError, match=r"slice 0: line must be in \[0, 16\)"):
        ep.record(0, 16)


@pytest.mark.parametrize("name", ["center-out", "random", "random-lowbias", "equispaced"])
def test_select_then_acquire_plays_the_policy_episode(name):
    policy = make_policy(name)
    rngs = [None if policy.deterministic else slice_rng(3, s) for s in range(4)]
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 4, rngs=rngs)
    for _ in range(BUDGET):
        ep.acquire(select_next(policy, ep))
    for s in range(4):
        rng = None if policy.deterministic else slice_rng(3, s)
        assert ep.chosen()[s].tolist() == run_episode(policy, N_PE, INITIAL, BUDGET, rng).tolist()


def test_states_match_the_counts():
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 2)
    ep.acquire([0], rows=[0])
    image = np.ones((N_PE, N_PE), np.float32)
    s0, s1 = ep.states(images=[image, None])
    assert (s0.step, s0.steps_left, s0.n_initial) == (1, BUDGET - 1, INITIAL)
    assert (s1.step, s1.steps_left) == (0, BUDGET)
    assert s0.mask[0] and not s1.mask[0] and s0.image is image and s1.image is None


class _Broken(SamplingPolicy):
    name = "broken"

    def choose(self, state, rng):
        return 0

    def select_batch(self, states, rngs=None):
        return np.array([int(np.flatnonzero(s.mask)[0]) for s in states])  # an acquired line


def test_select_lines_catches_a_broken_policy():
    ep = EpisodeBatch(N_PE, INITIAL, BUDGET, 1)
    with pytest.raises(RuntimeError, match="policy 'broken' chose line 7, which is not a free line"):
        select_lines(_Broken(), ep.states(), ep.rngs)


def test_one_rule_for_line_counts():
    with pytest.raises(ValueError, match="budget must be >= 1 line, got 0"):
        check_counts(2, 0)
    with pytest.raises(ValueError, match="initial must be >= 1 centre line"):
        EpisodeBatch(N_PE, 0, 2, 1)
    with pytest.raises(ValueError, match=r"initial \+ budget must be <= number of PE lines \(16\)"):
        EpisodeBatch(N_PE, 8, 9, 1)


def test_a_switched_episode_continues_with_centre_out_whatever_the_policy():
    from masc_gadget.acquisition.policies import select_trains

    episodes = EpisodeBatch(16, 2, 5, 3, rngs=[np.random.default_rng(i) for i in range(3)])
    assert not episodes.scored().any()
    episodes.switch([1], [True], [0.9])
    episodes.switch([2], [False], [0.1])
    assert episodes.scored().tolist() == [False, True, True] and episodes.switched.tolist() == [False, True, False]
    assert [s.switched for s in episodes.states()] == [False, True, False]
    trains = select_trains(make_policy("random"), episodes.states(), episodes.rngs, 3)
    assert trains[1].tolist() == run_episode(make_policy("center-out"), 16, 2, 3)[2:].tolist()
    policy = make_policy("random")
    for _ in range(5):
        episodes.acquire(select_next(policy, episodes))
    safe = run_episode(make_policy("center-out"), 16, 2, 5).tolist()
    lines = episodes.chosen()
    assert lines[1].tolist() == safe and lines[0].tolist() != safe and lines[2].tolist() != safe
    episodes.reset([1])
    assert not episodes.switched[1] and np.isnan(episodes.switch_score[1])
    with pytest.raises(ValueError, match="one verdict and score per"):
        episodes.switch([0, 1], [True], [0.5])
