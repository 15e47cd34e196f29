"""Acquisition episodes and the conventional sampling policies: budget-exact, never re-acquiring,
reproducible, and usable from any state a scanner leaves behind."""

import numpy as np
import pytest

from masc_gadget.acquisition.episode import (
    AcquisitionConfig,
    AcquisitionState,
    check_episode,
    initial_lines,
)
from masc_gadget.config import ConfigError, from_dict
from masc_gadget.acquisition.policies import (
    POLICIES,
    CenterOut,
    Equispaced,
    Random,
    RandomLowBias,
    SamplingPolicy,
    center_out_rank,
    equispaced_lines,
    farthest_free_line,
    make_policy,
    register_policy,
    run_episode,
    run_episodes,
    slice_rng,
)

NAMES = ["center-out", "random", "random-lowbias", "equispaced"]
N_PES = [16, 33, 64, 200]


def episode_sizes(n_pe):
    """(initial, budget) of the test matrix, capped to fit n_pe lines."""
    return sorted({(2, min(18, n_pe - 2)), (8, min(32, n_pe - 8)), (1, n_pe - 1)})


CASES = [(n, i, b) for n in N_PES for i, b in episode_sizes(n)]


def rng_for(policy, seed=0, *key):
    return None if policy.deterministic else slice_rng(seed, *key)


def circular_distance(a, b, n):
    d = abs(a - b) % n
    return min(d, n - d)


# --- acquisition --------------------------------------------------------------------------------


def test_initial_lines_centred():
    assert initial_lines(200, 2).tolist() == [99, 100]
    assert initial_lines(200, 3).tolist() == [99, 100, 101]
    assert initial_lines(200, 1).tolist() == [100]
    assert initial_lines(200, 8).tolist() == list(range(96, 104))
    assert initial_lines(33, 2).tolist() == [15, 16]
    assert initial_lines(16, 16).tolist() == list(range(16))
    assert initial_lines(33, 33).tolist() == list(range(33))
    assert initial_lines(200, 2).dtype == np.int64
    with pytest.raises(ValueError, match=r"between 1 and the number of PE lines \(16\), got 17"):
        initial_lines(16, 17)


def test_state_initial_and_after():
    s = AcquisitionState.initial(16, 2, 3)
    assert (s.n_pe, s.steps_left, s.step, s.n_initial, s.budget) == (16, 3, 0, 2, 3)
    assert np.flatnonzero(s.mask).tolist() == [7, 8]
    assert s.free_lines().tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15]
    t = s.after(3)
    assert (t.steps_left, t.step, t.n_initial, t.budget) == (2, 1, 2, 3)
    assert t.mask[3] and not s.mask[3]  # s unchanged
    with pytest.raises(ValueError, match=r"line 3 is already acquired \(n_pe = 16\)"):
        t.after(3)
    with pytest.raises(ValueError, match=r"line must be in \[0, 16\) \(n_pe = 16\), got 16"):
        t.after(16)
    with pytest.raises(ValueError, match=r"got -1"):
        t.after(-1)
    with pytest.raises(TypeError, match="integer"):
        t.after(2.0)
    # the mask is a read-only copy: callers cannot change a state behind its back
    mask = np.zeros(8, bool)
    state = AcquisitionState(mask, steps_left=1, step=0)
    mask[0] = True
    assert not state.mask[0]
    with pytest.raises(ValueError):
        state.mask[0] = True
    # a scanner may deliver lines past the budget: recorded, steps_left stays 0
    end = AcquisitionState.initial(8, 1, 1).after(0).after(1)
    assert (end.steps_left, end.step, end.n_acquired) == (0, 2, 3)


def test_state_validation():
    with pytest.raises(ValueError, match="1-D"):
        AcquisitionState(np.zeros((2, 4), bool), 1, 0)
    with pytest.raises(ValueError, match="steps_left must be >= 0"):
        AcquisitionState(np.zeros(4, bool), -1, 0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        AcquisitionState(np.zeros(4, bool), 1, -1)
    with pytest.raises(ValueError, match=r"initial \+ budget must be <= number of PE lines \(16\)"):
        AcquisitionState.initial(16, 2, 15)


def test_acquisition_config():
    cfg = AcquisitionConfig()
    assert (cfg.initial, cfg.budget, cfg.policy, cfg.seed) == (2, 18, "center-out", 0)
    assert cfg.total == 20
    cfg.check(200)
    with pytest.raises(
        ValueError,
        match=r"^initial \+ budget must be <= number of PE lines \(200\), got 2 \+ 250$",
    ):
        AcquisitionConfig(budget=250).check(200)
    with pytest.raises(ValueError, match="initial must be >= 1 centre line, got 0"):
        AcquisitionConfig(initial=0)
    with pytest.raises(ValueError, match="budget must be >= 1 line, got 0"):
        AcquisitionConfig(budget=0)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        AcquisitionConfig(seed=-1)
    with pytest.raises(ValueError, match="policy"):
        AcquisitionConfig(policy="")
    # through the typed config loader, errors name the section
    assert from_dict(AcquisitionConfig, {"initial": 8, "budget": 32}, "acquisition").total == 40
    with pytest.raises(ConfigError, match="acquisition: budget must be >= 1"):
        from_dict(AcquisitionConfig, {"budget": -3}, "acquisition")
    with pytest.raises(ConfigError, match="unknown key acquisition.lines"):
        from_dict(AcquisitionConfig, {"lines": 3}, "acquisition")


def test_check_episode():
    check_episode(16, 1, 15)
    with pytest.raises(ValueError, match=r"number of PE lines \(16\), got 1 \+ 16"):
        check_episode(16, 1, 16)
    with pytest.raises(ValueError, match="initial must be >= 1"):
        check_episode(16, 0, 2)


# --- every policy -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n_pe,initial,budget", CASES)
def test_episode_is_budget_exact(name, n_pe, initial, budget, global_rng_guard):
    policy = make_policy(name)
    lines = run_episode(policy, n_pe, initial, budget, rng=rng_for(policy, 1, n_pe))
    assert lines.dtype == np.int64 and lines.shape == (initial + budget,)
    assert np.unique(lines).size == initial + budget  # never re-acquired
    assert lines.min() >= 0 and lines.max() < n_pe
    assert lines[:initial].tolist() == initial_lines(n_pe, initial).tolist()
    assert abs(lines[:initial].mean() - n_pe // 2) <= 0.5  # centred on the k-space centre


@pytest.mark.parametrize("name", NAMES)
def test_reproducible(name, global_rng_guard):
    policy = make_policy(name)
    runs = [run_episode(policy, 64, 2, 18, rng=rng_for(policy, 5, 3)) for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()
    if not policy.deterministic:
        others = {tuple(run_episode(policy, 64, 2, 18, rng=slice_rng(s, 3))) for s in range(5)}
        assert len(others) == 5  # different seeds, different lines
        assert run_episode(policy, 64, 2, 18, rng=slice_rng(5, 4)).tolist() != runs[0].tolist()
        with pytest.raises(ValueError, match="explicit numpy.random.Generator"):
            run_episode(policy, 64, 2, 18)
        with pytest.raises(TypeError, match="must be a numpy.random.Generator"):
            policy.select(AcquisitionState.initial(64, 2, 18), rng=np.random.RandomState(0))


@pytest.mark.parametrize("name", NAMES)
def test_select_from_any_state(name, global_rng_guard):
    """A scanner acquired extra lines of its own: choices are still free lines, budget-exact."""
    policy = make_policy(name)
    rng = np.random.default_rng(123)
    for trial in range(40):
        n_pe = int(rng.choice([16, 33, 64, 200]))
        mask = rng.random(n_pe) < rng.uniform(0.0, 0.9)
        n_free = int((~mask).sum())
        if n_free == 0:
            continue
        steps_left = int(rng.integers(1, n_free + 1))
        state = AcquisitionState(mask, steps_left=steps_left, step=int(rng.integers(0, 5)))
        prng = rng_for(policy, 9, trial)
        chosen = []
        while state.steps_left:
            line = policy.select(state, prng)
            assert not state.mask[line]
            chosen.append(line)
            state = state.after(line)
        assert len(set(chosen)) == steps_left
        assert state.mask.sum() == mask.sum() + steps_left


@pytest.mark.parametrize("name", NAMES)
def test_select_errors(name):
    policy = make_policy(name)
    full = AcquisitionState(np.ones(8, bool), steps_left=1, step=0)
    with pytest.raises(ValueError, match="no free line left, all 8 PE lines are acquired"):
        policy.select(full, np.random.default_rng(0))
    spent = AcquisitionState.initial(8, 2, 1).after(0)
    with pytest.raises(ValueError, match="no steps left"):
        policy.select(spent, np.random.default_rng(0))


@pytest.mark.parametrize("name", NAMES)
def test_select_batch_matches_select(name, global_rng_guard):
    policy = make_policy(name)
    states = [AcquisitionState.initial(64, 2, 18)]
    states.append(states[0].after(40).after(3))
    states.append(AcquisitionState(np.arange(64) % 3 == 0, steps_left=5, step=0))
    rngs = [rng_for(policy, 2, i) for i in range(3)]
    batch = policy.select_batch(states, rngs)
    assert batch.dtype == np.int64 and batch.shape == (3,)
    assert batch.tolist() == [policy.select(s, rng_for(policy, 2, i)) for i, s in enumerate(states)]
    assert policy.select_batch([], None).shape == (0,)
    with pytest.raises(ValueError, match="one rng per state"):
        policy.select_batch(states, rngs[:2])
    lines = run_episodes(policy, 64, 2, 18, [rng_for(policy, 7, i) for i in range(3)])
    assert lines.shape == (3, 20)
    for i in range(3):
        assert lines[i].tolist() == run_episode(policy, 64, 2, 18, rng_for(policy, 7, i)).tolist()


def test_global_rng_untouched_by_all_calls():
    before = np.random.get_state()
    for name in NAMES:
        policy = make_policy(name)
        for n_pe, initial, budget in CASES:
            run_episode(policy, n_pe, initial, budget, rng=rng_for(policy, 0, n_pe))
    slice_rng(3, 1, 2).random()
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1])
    assert before[2:] == after[2:]


# --- center-out ---------------------------------------------------------------------------------


def test_center_out_exact_sequence():
    # n_pe = 16: centre 8, initial lines [7, 8]; order 8, 9, 7, 10, 6, 11, 5, ... skipping 7, 8
    lines = run_episode(CenterOut(), 16, 2, 14)
    assert lines.tolist() == [7, 8, 9, 10, 6, 11, 5, 12, 4, 13, 3, 14, 2, 15, 1, 0]
    assert run_episode(CenterOut(), 33, 1, 4).tolist() == [16, 17, 15, 18, 14]
    assert center_out_rank(8).tolist() == [8, 6, 4, 2, 0, 1, 3, 5]
    # from a state a scanner left: the next centre-most free line
    state = AcquisitionState.initial(16, 2, 4).after(9).after(6)
    assert CenterOut().select(state) == 10


# --- random-lowbias -----------------------------------------------------------------------------


def test_random_lowbias_prefers_centre(global_rng_guard):
    n_pe = 64
    counts = np.zeros(n_pe)
    policy = RandomLowBias()
    for i in range(400):
        counts[run_episode(policy, n_pe, 2, 8, rng=slice_rng(0, i))[2:]] += 1
    offset = np.abs(np.arange(n_pe) - n_pe // 2)
    central = counts[(offset >= 2) & (offset <= 8)].mean()
    edge = counts[offset >= 24].mean()
    assert central > 5 * edge
    # the uniform policy does not prefer the centre
    uniform = np.zeros(n_pe)
    for i in range(400):
        uniform[run_episode(Random(), n_pe, 2, 8, rng=slice_rng(0, i))[2:]] += 1
    assert uniform[offset >= 24].mean() > 0.5 * uniform[(offset >= 2) & (offset <= 8)].mean()


def test_random_lowbias_probabilities():
    state = AcquisitionState.initial(200, 2, 18)
    p = RandomLowBias(0.15).probabilities(state)
    assert p.shape == (200,) and np.isclose(p.sum(), 1.0)
    assert p[99] == 0 and p[100] == 0
    assert p[101] > p[120] > p[190] > 0
    # tiny sigma: weights of far free lines underflow, but the choice is still well defined
    far = AcquisitionState(np.arange(200) < 190, steps_left=1, step=0)
    assert RandomLowBias(1e-3).select(far, np.random.default_rng(0)) == 190
    with pytest.raises(ValueError, match="sigma_fraction must be > 0"):
        RandomLowBias(0)


# --- equispaced ---------------------------------------------------------------------------------


def ring_gaps(targets, n_pe, initial):
    """Gaps between neighbouring acquired positions on the ring of lines from the top of the
    initial block round the k-space edge to its bottom (the block counted as one position)."""
    block = initial_lines(n_pe, initial)
    hi = int(block[-1])
    ring = n_pe - initial + 1
    offsets = np.sort((np.asarray(targets) - hi) % n_pe)
    return np.diff(np.concatenate([[0], offsets, [ring]]))


@pytest.mark.parametrize("n_pe,initial,budget", CASES + [(200, 2, 18), (200, 8, 32), (200, 3, 17)])
def test_equispaced_pattern(n_pe, initial, budget):
    targets = equispaced_lines(n_pe, initial, budget)
    assert targets.size == budget == np.unique(targets).size
    assert not np.isin(targets, initial_lines(n_pe, initial)).any()
    gaps = ring_gaps(targets, n_pe, initial)
    assert gaps.min() >= 1 and gaps.max() - gaps.min() <= 2
    # symmetric about the centre of the initial block (within one line)
    block = initial_lines(n_pe, initial)
    twice_centre = int(block[0] + block[-1])
    for t in targets:
        mirror = twice_centre - t
        assert min(circular_distance(mirror, u, n_pe) for u in targets) <= 1
    # the episode acquires exactly the pattern, centre-out
    lines = run_episode(Equispaced(), n_pe, initial, budget)
    assert lines[initial:].tolist() == targets.tolist()


def test_equispaced_paper_setting():
    targets = np.sort(equispaced_lines(200, 2, 18))
    assert targets.tolist() == [5, 15, 26, 36, 47, 57, 68, 78, 89,
                                110, 121, 131, 142, 152, 163, 173, 184, 194]
    assert set(np.diff(targets[:9])) <= {10, 11} and set(np.diff(targets[9:])) <= {10, 11}
    assert (targets + targets[::-1] == 199).all()  # mirror image about 99.5
    wide = np.sort(equispaced_lines(200, 8, 32))
    assert set(np.diff(wide[:16])) <= {5, 6} and (wide + wide[::-1] == 199).all()
    assert wide.min() <= 5 and wide.max() >= 194  # spread over the whole PE range


def test_equispaced_targets_are_distinct_exhaustively():
    for n_pe in range(1, 41):
        for initial in range(1, n_pe + 1):
            for budget in range(1, n_pe - initial + 1):
                targets = equispaced_lines(n_pe, initial, budget)
                assert np.unique(targets).size == budget, (n_pe, initial, budget)
                assert not np.isin(targets, initial_lines(n_pe, initial)).any()
                if budget:
                    gaps = ring_gaps(targets, n_pe, initial)
                    assert gaps.max() - gaps.min() <= 2, (n_pe, initial, budget, gaps)


def test_equispaced_same_set_whatever_order(global_rng_guard):
    n_pe, initial, budget = 200, 8, 32
    targets = equispaced_lines(n_pe, initial, budget)
    rng = np.random.default_rng(4)
    policy = Equispaced()
    for _ in range(5):
        state = AcquisitionState.initial(n_pe, initial, budget)
        for line in rng.permutation(targets)[: int(rng.integers(1, budget))]:
            state = state.after(int(line))  # the scanner acquires targets in its own order
        while state.steps_left:
            state = state.after(policy.select(state))
        assert set(np.flatnonzero(state.mask)) == set(targets) | set(initial_lines(n_pe, initial))
    # without n_initial, the initial count is inferred from mask.sum() - step
    state = AcquisitionState.initial(n_pe, initial, budget).after(int(targets[3]))
    bare = AcquisitionState(state.mask, state.steps_left, state.step)
    assert policy.select(bare) == policy.select(state) == targets[0]


def test_equispaced_fallback_farthest_line():
    # a scanner acquired all 6 targets and a line of its own in 5 steps; one step is left
    n_pe, initial, budget = 32, 2, 6
    targets = equispaced_lines(n_pe, initial, budget)
    mask = np.zeros(n_pe, bool)
    mask[initial_lines(n_pe, initial)] = mask[targets] = mask[1] = True
    assert 1 not in targets
    state = AcquisitionState(mask, steps_left=1, step=5, n_initial=initial)
    line = Equispaced().select(state)
    assert line == farthest_free_line(state.mask)
    acquired = np.flatnonzero(state.mask)
    best = max(min(circular_distance(k, a, n_pe) for a in acquired)
               for k in state.free_lines())
    assert min(circular_distance(line, a, n_pe) for a in acquired) == best
    # nothing acquired: the centre
    assert farthest_free_line(np.zeros(16, bool)) == 8
    assert farthest_free_line(np.array([1, 0, 0, 0, 0, 0, 0, 0], bool)) == 4  # opposite, circular
    assert farthest_free_line(np.array([1, 0, 0, 0, 1, 0, 0, 0], bool)) == 6  # tie 2/6: rank 3 < 4


# --- registry, helpers --------------------------------------------------------------------------


def test_registry():
    assert set(POLICIES) >= set(NAMES)
    assert isinstance(make_policy("center-out"), CenterOut)
    assert isinstance(make_policy("equispaced"), Equispaced)
    assert make_policy("random-lowbias", sigma_fraction=0.1).sigma_fraction == 0.1
    assert all(make_policy(n).name == n for n in NAMES)
    with pytest.raises(ValueError, match=r"^unknown policy 'x'; known policies: center-out, "
                                         r"(dqn, )?equispaced, (fixed-order, )?(loupe, )?(masc, )?random, random-lowbias(, ss-ddqn)?"):
        make_policy("x")

    class Fixed(SamplingPolicy):
        name = "test-fixed"

        def choose(self, state, rng):
            return int(state.free_lines()[-1])

    try:
        register_policy("test-fixed", Fixed)
        assert run_episode(make_policy("test-fixed"), 8, 2, 2).tolist() == [3, 4, 7, 6]
        with pytest.raises(ValueError, match="already registered"):
            register_policy("test-fixed", lambda: Fixed())
        with pytest.raises(ValueError, match="already registered"):
            register_policy("center-out", Fixed)
    finally:
        POLICIES.pop("test-fixed", None)


def test_policy_that_needs_image():
    class Brightest(SamplingPolicy):
        name = "test-image"
        needs_image = True

        def choose(self, state, rng):
            score = np.where(state.mask, -np.inf, state.image.sum(axis=1))
            return int(np.argmax(score))

    seen = []

    def image_fn(mask):
        seen.append(mask.copy())
        return np.tile(np.arange(mask.size, dtype=float)[:, None], (1, 4))

    lines = run_episode(Brightest(), 8, 1, 3, image_fn=image_fn)
    assert lines.tolist() == [4, 7, 6, 5]
    assert len(seen) == 3 and seen[0].sum() == 1 and seen[2].sum() == 3
    with pytest.raises(ValueError, match="needs the image"):
        run_episode(Brightest(), 8, 1, 3)
    with pytest.raises(ValueError, match="needs state.image"):
        Brightest().select(AcquisitionState.initial(8, 1, 3))
    # conventional policies never call image_fn
    run_episode(CenterOut(), 8, 1, 3, image_fn=lambda m: pytest.fail("image_fn called"))


def test_slice_rng():
    a = slice_rng(0, 3, 7).random(4)
    assert np.array_equal(a, slice_rng(0, 3, 7).random(4))
    assert not np.array_equal(a, slice_rng(0, 7, 3).random(4))
    assert not np.array_equal(a, slice_rng(1, 3, 7).random(4))
    with pytest.raises(ValueError, match="non-negative integers"):
        slice_rng(-1)
    with pytest.raises(ValueError, match="non-negative integers"):
        slice_rng(0, 1.5)


