"""The acquisition engine: obeyed, it plays exactly the policy's episode; ignored, it still
reconstructs what arrived; wanting slices are decided in one batched pass; randomness per slice."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.models.checkpoint import load_mar, save_checkpoint
from masc_gadget.config import to_dict
from masc_gadget.acquisition.engine import AcquisitionEngine, Decision, EngineSettings, SliceResult
from masc_gadget.core.kspace import ifft2c, zero_filled
from masc_gadget.models.unet import MarModelConfig, build_mar
from masc_gadget.acquisition.policies import SamplingPolicy, make_policy, run_episode, slice_rng

N_PE, N_RO, INITIAL, BUDGET = 16, 16, 2, 6


def settings(**kw):
    """One decision per line (these tests follow an episode step by step; deciding ahead has its
    own tests below)."""
    base = dict(n_pe=N_PE, n_readout=N_RO, initial=INITIAL, budget=BUDGET, seed=0, device="cpu", decide_ahead=False)
    return EngineSettings(**{**base, **kw})


def make_engine(policy="center-out", mar_checkpoint="", mar=None, **kw):
    """An engine with ready models, as the gadget builds one: a policy by name (or object),
    the MAR network from a checkpoint path (named "file (epoch N)") or given as a module."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    name = ""
    if mar is None and mar_checkpoint:
        mar, meta = load_mar(mar_checkpoint, "cpu")
        name = f"{Path(mar_checkpoint).name} (epoch {meta['epoch']})"
    return AcquisitionEngine(settings(**kw), policy, mar, name)


@pytest.fixture(scope="module")
def mar_path(tmp_path_factory):
    """A width-4 MAR checkpoint whose head is not zero, so the network is not the identity."""
    cfg = MarModelConfig(width=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_mar(cfg)
        nn.init.normal_(model.residual.head.weight, std=0.5)
        nn.init.normal_(model.residual.head.bias, std=0.1)
    path = tmp_path_factory.mktemp("mar") / "mar.pt"
    save_checkpoint(path, {"mar": model}, {"kind": "mar", "mar_model": to_dict(cfg), "epoch": 7})
    return path


@pytest.fixture(scope="module")
def kspace():
    """(3, N_PE, N_RO) complex64: three slices of a smooth object plus noise."""
    rng = np.random.default_rng(42)
    y, x = np.mgrid[:N_PE, :N_RO]
    images = []
    for s in range(3):
        blob = np.exp(-((y - 8 - s) ** 2 + (x - 7) ** 2) / (2 * (3 + s) ** 2))
        images.append(blob + 0.05 * rng.standard_normal((N_PE, N_RO)))
    k = np.fft.fftshift(np.fft.fft2(np.fft.ifftshift(np.array(images), axes=(-2, -1)),
                                    norm="ortho"), axes=(-2, -1))
    return k.astype(np.complex64)


def reference_zero_filled(k, lines):
    """(N_PE, N_RO) float32 |ifft2c| of ``k`` with only ``lines`` kept."""
    mask = np.zeros(N_PE, dtype=bool)
    mask[list(lines)] = True
    return zero_filled(torch.from_numpy(k), torch.from_numpy(mask)).numpy()


class CountingMar(nn.Module):
    """Wraps a MAR network and records the input shape of every forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = []

    def forward(self, x):
        self.calls.append(tuple(x.shape))
        return self.inner(x)


class BrightestRow(SamplingPolicy):
    """Needs the image: the free line whose image row is brightest. Records what it saw."""

    name = "brightest-row"
    needs_image = True

    def __init__(self):
        self.seen = []
        self.batches = []

    def choose(self, state, rng):
        self.seen.append(state.image.copy())
        energy = state.image.astype(np.float64).sum(axis=1)
        energy[state.mask] = -np.inf
        return int(np.argmax(energy))

    def select_batch(self, states, rngs=None):
        self.batches.append(len(states))
        return super().select_batch(states, rngs)


class CountingPolicy(SamplingPolicy):
    """Centre-out, counting calls of select_batch."""

    name = "counting"

    def __init__(self):
        self.inner = make_policy("center-out")
        self.calls = 0

    def choose(self, state, rng):
        return self.inner.choose(state, rng)

    def select_batch(self, states, rngs=None):
        self.calls += 1
        return super().select_batch(states, rngs)


def obedient_scan(engine, k, slices=(0,)):
    """A scanner that acquires the initial lines of every slice, then exactly the lines it is
    told, slice by slice (on_line). Returns {slice: lines acquired} and all decisions."""
    lines, decisions = {}, []
    for s in slices:
        lines[s] = []
        todo = list(initial_lines(N_PE, engine.settings.initial))
        while todo:
            line = int(todo.pop(0))
            lines[s].append(line)
            new = engine.on_line(s, line, k[s][line])
            decisions += new
            todo += [d.line for d in new]
    return lines, decisions


def batched_scan(engine, k, slices):
    """A scanner that acquires the initial lines of all ``slices`` first, then in rounds: one
    batched decide() for every wanting slice, then those lines in the given slice order."""
    lines = {s: [] for s in slices}
    for s in slices:
        for line in initial_lines(N_PE, engine.settings.initial):
            engine.add_line(s, int(line), k[s][line])
            lines[s].append(int(line))
    rounds = []
    while True:
        decisions = engine.decide()
        if not decisions:
            break
        rounds.append(decisions)
        by_slice = {d.slice: d for d in decisions}
        for s in slices:
            if s in by_slice:
                line = by_slice[s].line
                engine.add_line(s, line, k[s][line])
                lines[s].append(line)
    return lines, rounds


# --- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(initial=10, budget=7), r"initial \+ budget must be <= number of PE lines \(16\), got 10 \+ 7"),
        (dict(n_pe=0), "number of PE lines must be >= 1"),
        (dict(n_readout=0), "n_readout must be >= 1"),
        (dict(initial=0), "initial must be >= 1"),
        (dict(budget=0), "budget must be >= 1"),
        (dict(seed=-1), "seed must be >= 0"),
        (dict(n_readout=True), "n_readout must be an integer"),
        (dict(n_pe=16.0), "n_pe must be an integer"),
        (dict(device=""), "device must be"),
    ],
)
def test_settings_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        settings(**kw)


def test_engine_rejects_unknown_policy_and_device():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_engine(policy="nope")
    with pytest.raises(ValueError, match="unknown device"):
        make_engine(device="tpu")


# --- obeyed: the policy's own episode --------------------------------------------------------------


@pytest.mark.parametrize("name", ["center-out", "equispaced", "random", "random-lowbias"])
def test_obedient_scanner_reproduces_run_episode(name, kspace):
    engine = make_engine(policy=name, seed=5)
    lines, decisions = obedient_scan(engine, kspace, slices=(0, 2))
    policy = make_policy(name)
    for s in (0, 2):
        rng = None if policy.deterministic else slice_rng(5, s)
        expected = run_episode(policy, N_PE, INITIAL, BUDGET, rng).tolist()
        assert lines[s] == expected
        mine = [d for d in decisions if d.slice == s]
        assert [d.step for d in mine] == list(range(BUDGET))
        assert all(isinstance(d.latency_us, int) and d.latency_us >= 0 for d in mine)
        assert engine.complete(s) and s not in engine.wanting()
        result = engine.finish_slice(s)
        assert result.lines == expected
        assert result.decided == expected[INITIAL:]
        assert result.policy == name and result.mar == "none"


def test_final_image_is_zero_filled_when_mar_off(kspace):
    engine = make_engine(policy="center-out")
    lines, _ = obedient_scan(engine, kspace, slices=(1,))
    result = engine.finish_slice(1)
    assert isinstance(result, SliceResult)
    assert result.image.dtype == np.float32 and result.image.shape == (N_PE, N_RO)
    expected = reference_zero_filled(kspace[1], lines[1])
    np.testing.assert_array_equal(result.image, expected)
    np.testing.assert_array_equal(result.zero_filled, expected)


def test_final_image_is_mar_of_zero_filled_when_mar_on(kspace, mar_path):
    engine = make_engine(policy="center-out", mar_checkpoint=str(mar_path))
    lines, _ = obedient_scan(engine, kspace, slices=(0,))
    result = engine.finish_slice(0)
    model, _ = load_mar(mar_path, "cpu")
    zf = reference_zero_filled(kspace[0], lines[0])
    with torch.no_grad():
        raw = model(torch.from_numpy(zf)[None])[0].numpy()
    expected = np.maximum(raw, 0)  # served as a magnitude: clamped at 0
    assert (raw < 0).any()  # so the clamp is exercised
    np.testing.assert_array_equal(result.zero_filled, zf)
    np.testing.assert_allclose(result.image, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(result.image - zf).max() > 1e-3 * zf.max()  # the MAR net is not the identity
    assert result.image.dtype == np.float32
    assert result.mar == "mar.pt (epoch 7)"


def test_mar_on_any_device(kspace, mar_path, device):
    """The same path on CUDA where present: the image matches the CPU engine's."""
    results = []
    for dev in dict.fromkeys(["cpu", str(device)]):
        engine = make_engine(policy="center-out", mar_checkpoint=str(mar_path),
                                            device=dev)
        obedient_scan(engine, kspace, slices=(0,))
        results.append(engine.finish_slice(0).image)
    np.testing.assert_allclose(results[-1], results[0], rtol=1e-4, atol=1e-5)


# --- batching ------------------------------------------------------------------------------------


def test_wanting_slices_are_decided_in_one_batched_pass(kspace, mar_path):
    model, _ = load_mar(mar_path, "cpu")
    mar, policy = CountingMar(model), BrightestRow()
    engine = make_engine(mar_checkpoint=str(mar_path), policy=policy, mar=mar)
    for s in range(3):
        for line in initial_lines(N_PE, INITIAL):
            engine.add_line(s, int(line), kspace[s][line])
    assert engine.wanting() == [0, 1, 2]
    mar.calls.clear()
    policy.batches.clear()
    policy.seen.clear()
    decisions = engine.decide()
    assert mar.calls == [(3, N_PE, N_RO)]  # one MAR forward for the batch
    assert policy.batches == [3]  # one select_batch
    assert [d.slice for d in decisions] == [0, 1, 2]
    assert len({d.latency_us for d in decisions}) == 1  # one pass, one latency
    assert engine.wanting() == []
    # the policy saw the MAR image of each slice's zero-filled reconstruction
    for s in range(3):
        zf = reference_zero_filled(kspace[s], initial_lines(N_PE, INITIAL))
        with torch.no_grad():
            expected = model(torch.from_numpy(zf)[None])[0].numpy()
        np.testing.assert_allclose(policy.seen[s], expected, rtol=1e-5, atol=1e-6)


def test_batched_decisions_equal_one_at_a_time(kspace, mar_path):
    model, _ = load_mar(mar_path, "cpu")
    batched_mar = CountingMar(model)
    batched = make_engine(mar_checkpoint=str(mar_path), policy=BrightestRow(),
                                mar=batched_mar)
    batched_mar.calls.clear()
    lines_b, rounds = batched_scan(batched, kspace, [0, 1, 2])
    assert len(rounds) == BUDGET and all(len(r) == 3 for r in rounds)
    assert batched_mar.calls == [(3, N_PE, N_RO)] * BUDGET  # one forward per round
    single = make_engine(mar_checkpoint=str(mar_path), policy=BrightestRow())
    lines_s, _ = obedient_scan(single, kspace, slices=(0, 1, 2))
    assert lines_b == lines_s
    for s in range(3):
        assert len(set(lines_b[s])) == INITIAL + BUDGET


def test_policy_without_image_skips_mar_when_deciding(kspace, mar_path):
    model, _ = load_mar(mar_path, "cpu")
    mar = CountingMar(model)
    engine = make_engine(policy="center-out", mar=mar)
    mar.calls.clear()
    _, decisions = obedient_scan(engine, kspace, slices=(0, 1))
    assert len(decisions) == 2 * BUDGET and mar.calls == []
    results = engine.finish_slices([0, 1])
    assert mar.calls == [(2, N_PE, N_RO)]  # the output still gets MAR, batched
    for s, result in zip((0, 1), results):
        with torch.no_grad():
            expected = model(torch.from_numpy(result.zero_filled)[None])[0].clamp_min(0).numpy()
        np.testing.assert_allclose(result.image, expected, rtol=1e-5, atol=1e-6)
        assert result.mar == "CountingMar"


def test_policy_sees_zero_filled_image_when_mar_off(kspace):
    policy = BrightestRow()
    engine = make_engine(policy=policy)
    policy.seen.clear()
    lines, _ = obedient_scan(engine, kspace, slices=(0,))
    np.testing.assert_array_equal(policy.seen[0],
                                  reference_zero_filled(kspace[0], initial_lines(N_PE, INITIAL)))
    np.testing.assert_array_equal(policy.seen[-1], reference_zero_filled(kspace[0], lines[0][:-1]))


# --- the scanner is the authority ------------------------------------------------------------------


def test_scanner_acquiring_other_lines_gets_image_of_what_arrived(kspace):
    engine = make_engine(policy="center-out")
    arrived, decisions = [], []
    for line in initial_lines(N_PE, INITIAL):
        decisions += engine.on_line(0, int(line), kspace[0][line])
        arrived.append(int(line))
    assert len(decisions) == 1
    edge = iter(range(N_PE))  # this scanner acquires from the k-space edge, whatever it is told
    while not engine.complete(0):
        line = next(edge)
        new = engine.on_line(0, line, kspace[0][line])
        arrived.append(line)
        decisions += new
        assert len(new) == (0 if engine.complete(0) else 1)
    assert len(arrived) == INITIAL + BUDGET and len(decisions) == BUDGET
    assert [d.step for d in decisions] == list(range(BUDGET))
    # nothing more is decided, whatever else arrives
    for line in range(BUDGET, N_PE):
        if line not in arrived:
            assert engine.on_line(0, line, kspace[0][line]) == []
            arrived.append(line)
            break
    assert engine.wanting() == [] and engine.decide() == []
    result = engine.finish_slice(0)
    assert result.lines == arrived and result.decided == []
    np.testing.assert_array_equal(result.image, reference_zero_filled(kspace[0], arrived))


def test_scanner_streaming_all_lines_gets_the_full_image(kspace):
    engine = make_engine(policy="center-out")
    counts = []
    for line in range(N_PE):
        counts.append(len(engine.on_line(0, line, kspace[0][line])))
    # decisions only while initial <= lines acquired < initial + budget
    assert counts == [0] * (INITIAL - 1) + [1] * BUDGET + [0] * (N_PE - INITIAL - BUDGET + 1)
    assert engine.wanting() == []
    result = engine.finish_slice(0)
    assert result.lines == list(range(N_PE))
    # centre-out asked for line 8 after each of lines 1..6; it arrived after the budget was spent
    assert result.decided == [8]
    full = ifft2c(torch.from_numpy(kspace[0])).abs().numpy()
    np.testing.assert_allclose(result.image, full, rtol=1e-6, atol=1e-6)


def test_no_decision_before_the_initial_lines(kspace):
    engine = make_engine(initial=4, budget=4)
    assert engine.on_line(0, 3, kspace[0][3]) == []
    assert engine.on_line(0, 12, kspace[0][12]) == []
    assert engine.on_line(0, 5, kspace[0][5]) == []
    assert engine.wanting() == [] and engine.decide([0]) == []
    [decision] = engine.on_line(0, 0, kspace[0][0])  # any 4 lines count as the initial ones
    assert decision.step == 0 and decision.line not in (0, 3, 5, 12)


def test_repeated_line_overwrites_and_is_not_new(kspace):
    engine = make_engine(policy="center-out")
    engine.add_line(0, 7, kspace[0][7])
    [first] = engine.on_line(0, 8, np.zeros(N_RO))
    assert engine.on_line(0, 8, kspace[0][8][None]) == []  # (1, n_readout) accepted too
    assert engine.wanting() == []
    assert engine.acquired(0) == [7, 8]
    result = engine.finish_slice(0)
    assert result.lines == [7, 8]
    np.testing.assert_array_equal(result.image, reference_zero_filled(kspace[0], [7, 8]))
    assert first.line == 9


def test_decide_reissues_for_named_slices(kspace):
    engine = make_engine(policy="center-out")
    [first] = engine.on_line(0, 7, kspace[0][7]) + engine.on_line(0, 8, kspace[0][8])
    assert engine.decide() == []  # already decided
    [again] = engine.decide([0])  # re-issued on request
    assert (again.slice, again.line, again.step) == (first.slice, first.line, first.step)
    engine.add_line(1, 7, kspace[1][7])
    assert engine.decide([1]) == []  # fewer than initial lines: skipped
    with pytest.raises(ValueError, match="unknown slice 5"):
        engine.decide([5])


def test_finish_releases_the_slice(kspace):
    engine = make_engine(policy="center-out")
    obedient_scan(engine, kspace, slices=(0, 1))
    assert engine.slices() == [0, 1]
    with pytest.raises(ValueError, match="unknown slice 4"):
        engine.finish_slice(4)
    engine.finish_slice(0)
    assert engine.slices() == [1] and not engine.complete(0)
    with pytest.raises(ValueError, match="unknown slice 0"):
        engine.finish_slice(0)
    # a partial slice (e.g. ACQ_LAST_IN_SLICE early) is finished from what it has
    engine.add_line(2, 3, kspace[2][3])
    result = engine.finish_slice(2)
    np.testing.assert_array_equal(result.image, reference_zero_filled(kspace[2], [3]))
    # a new line of a finished slice starts a new episode
    engine.add_line(0, 8, kspace[0][8])
    assert engine.acquired(0) == [8]


# --- randomness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["random", "random-lowbias"])
def test_random_policy_reproducible_per_slice_whatever_the_interleaving(name, kspace):
    runs = []
    for order in ([0, 1, 2], [2, 0, 1]):
        engine = make_engine(policy=name, seed=11)
        runs.append(obedient_scan(engine, kspace, slices=order)[0])
        engine = make_engine(policy=name, seed=11)
        runs.append(batched_scan(engine, kspace, order)[0])
    for run in runs[1:]:
        assert run == runs[0]
    policy = make_policy(name)
    for s in range(3):
        assert runs[0][s] == run_episode(policy, N_PE, INITIAL, BUDGET, slice_rng(11, s)).tolist()
    other = obedient_scan(make_engine(policy=name, seed=12), kspace, (0, 1, 2))[0]
    assert other != runs[0]


def test_global_rng_untouched(kspace, mar_path, global_rng_guard):
    engine = make_engine(policy="random", mar_checkpoint=str(mar_path))
    obedient_scan(engine, kspace, slices=(0, 1))
    engine.finish_slices([0, 1])
    engine = make_engine(mar_checkpoint=str(mar_path), policy=BrightestRow())
    batched_scan(engine, kspace, [0, 1])


# --- warm-up ---------------------------------------------------------------------------------------


def test_warm_up_runs_every_stage_before_the_first_line(mar_path):
    model, _ = load_mar(mar_path, "cpu")
    mar, policy = CountingMar(model), CountingPolicy()
    host_warmed: set = set()  # a serving host's set
    engine = AcquisitionEngine(settings(), policy, mar, warmed=host_warmed)
    assert engine.warmup_us > 0
    assert mar.calls == [(1, N_PE, N_RO)] and policy.calls == 1
    # the host's next engine of the same models and matrix starts at once: its passes already ran
    again = AcquisitionEngine(settings(), policy, mar, warmed=host_warmed)
    assert again.warmup_us == 0 and len(mar.calls) == 1 and policy.calls == 1
    assert engine.slices() == [] and engine.wanting() == []
    # the warm-up marked nothing as decided (nor consumed a slice's random stream: the random
    # policies reproduce run_episode with slice_rng, see the tests above and below)
    [d] = engine.on_line(0, 7, np.zeros(N_RO)) + engine.on_line(0, 8, np.zeros(N_RO))
    assert d.step == 0 and policy.calls == 2 and len(mar.calls) == 1
    alone = AcquisitionEngine(settings(), policy, mar)  # no host: it warms up on its own
    assert alone.warmup_us > 0 and len(mar.calls) == 2 and policy.calls == 3


def test_given_mar_module_eval_mode_and_name(mar_path, kspace):
    model, _ = load_mar(mar_path, "cpu")
    model.train()
    engine = AcquisitionEngine(settings(), make_policy("center-out"), model, "mar.pt (epoch 7)")
    assert not engine.mar.training
    engine.add_line(0, 8, kspace[0][8])
    assert engine.finish_slice(0).mar == "mar.pt (epoch 7)"
    engine = AcquisitionEngine(settings(), make_policy("center-out"), model)
    engine.add_line(0, 8, kspace[0][8])
    assert engine.finish_slice(0).mar == type(model).__name__


# --- rejected lines ----------------------------------------------------------------------------------


def _bad(value, index=None):
    data = np.ones(N_RO, dtype=np.complex64)
    if index is not None:
        data[index] = value
    return data


@pytest.mark.parametrize(
    "slice_, line, data, match",
    [
        (3, 9, _bad(np.nan, 4), "slice 3 line 9 contains NaN/inf samples"),
        (3, 8, _bad(np.inf, 0), "slice 3 line 8 contains NaN/inf samples"),
        (3, 9, _bad(complex(1, np.nan), 2), "slice 3 line 9 contains NaN/inf"),
        (3, 9, np.full(N_RO, 1e300, dtype=np.complex128), "slice 3 line 9 contains NaN/inf"),
        (3, -1, _bad(0), r"line must be an integer in \[0, 16\)"),
        (3, N_PE, _bad(0), r"line must be an integer in \[0, 16\).*got 16"),
        (3, 9.0, _bad(0), "line must be an integer"),
        (3, 9, np.ones(N_RO - 1), r"expected one channel of 16 readout samples.*got shape \(15,\)"),
        (3, 9, np.ones((2, N_RO)), r"shape \(16,\) or \(1, 16\), got shape \(2, 16\)"),
        (3, 9, np.ones((N_RO, 1)), r"got shape \(16, 1\)"),
        (3, 9, np.array(["a"] * N_RO), "samples must be numbers"),
        (-1, 9, _bad(0), "slice must be a non-negative integer, got -1"),
        (5, 20, _bad(0), r"slice 5: line must be"),  # a new slice is not created either
    ],
)
def test_rejected_lines_leave_buffers_unchanged(slice_, line, data, match, kspace):
    engine = make_engine(policy="center-out")
    engine.add_line(3, 7, kspace[0][7])
    [decision] = engine.on_line(3, 8, kspace[0][8])
    with pytest.raises(ValueError, match=match):
        engine.on_line(slice_, line, data)
    assert engine.slices() == [3] and engine.acquired(3) == [7, 8]
    assert engine.wanting() == []  # the outstanding decision stands
    assert engine.on_line(3, decision.line, kspace[0][decision.line])  # and the episode goes on
    result = engine.finish_slice(3)
    np.testing.assert_array_equal(
        result.image, reference_zero_filled(kspace[0], [7, 8, decision.line])
    )


# --- layering ----------------------------------------------------------------------------------------


def test_engine_imports_no_protocol_code():
    code = ("import sys, masc_gadget.acquisition.engine; "
            "bad = [m for m in ('ismrmrd', 'zmq') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decision_is_a_frozen_record():
    d = Decision(slice=1, line=2, step=3, latency_us=4)
    with pytest.raises(AttributeError):
        d.line = 5
    assert d == Decision(1, 2, 3, 4)


@pytest.mark.parametrize("policy", ["center-out", "equispaced", "random"])
def test_a_policy_that_reads_no_image_decides_a_slice_ahead_with_the_same_lines(policy):
    """Serving round 4, item 5: a policy that reads no image sends a slice's whole episode at its
    first decision, each decision with its step: the lines a step-by-step scan gets."""
    row = np.ones(N_RO, np.complex64)
    ahead = make_engine(policy, decide_ahead=True)
    assert ahead.ahead
    stepwise = AcquisitionEngine(settings(), make_policy(policy))
    for line in (N_PE // 2 - 1, N_PE // 2):
        first = ahead.on_line(3, line, row)
        decision = stepwise.on_line(3, line, row)
    assert [d.step for d in first] == list(range(BUDGET)) and {d.slice for d in first} == {3}
    assert len(decision) == 1
    followed = []
    while decision:  # the step-by-step engine, one decision per arriving line
        followed.append(decision[0].line)
        decision = stepwise.on_line(3, decision[0].line, row)
    assert [d.line for d in first] == followed
    for d in first:  # the decided lines arrive: nothing more is asked, the slice completes
        assert ahead.on_line(3, d.line, row) == []
    assert ahead.complete(3) and ahead.followed(3)


def test_a_policy_that_reads_the_image_is_still_asked_line_by_line():
    assert not make_engine(BrightestRow(), decide_ahead=True).ahead


@pytest.mark.parametrize("score", ["holdout", "halves"])
def test_a_rule_that_gives_the_network_some_lines_costs_one_network_pass_at_the_switch_point(score):
    """A policy that reads no image, under an early rule scored by ``holdout`` or ``halves`` after
    3 lines: at the switch point the engine runs the network once, on the image of the lines the
    score gives it (not also on the image of the lines so far, which the score does not read),
    and decides the rest of the plan from its verdict."""
    from masc_gadget.core.ood import OodCalibration

    torch.manual_seed(0)
    mar = build_mar(MarModelConfig(width=4)).eval()
    calls = []
    mar.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    mar.ood = OodCalibration("consistency", 1e9)
    mar.ood_early = OodCalibration(score, 1e-9, "early", after_lines=INITIAL + 1)  # flags what it scores
    engine = make_engine("equispaced", mar=mar, n_pe=32, n_readout=32)
    assert engine.switch_at == INITIAL + 1
    k = np.fft.fftshift(np.fft.fft2(np.random.default_rng(0).random((32, 32)))).astype(np.complex64)
    lines = [int(x) for x in initial_lines(32, INITIAL)]
    for line in lines[:-1]:
        assert engine.on_line(0, line, k[line]) == []
    warm = len(calls)
    (first,) = engine.on_line(0, lines[-1], k[lines[-1]])  # the first decision: no network pass
    assert len(calls) == warm
    calls.clear()
    decided = engine.on_line(0, first.line, k[first.line])  # the switch point: the verdict, then the rest
    assert calls == [(1, 32, 32)]
    assert engine._slices[0].episode.switched[0] and decided  # flagged: continues with centre-out's lines


def test_a_slice_the_early_rule_cannot_score_at_its_switch_point_is_never_scored_later(caplog):
    """An open-loop stream in file order: at the switch point the slice's lines are k-space edges,
    not its initial centre lines, so ``holdout`` cannot score it. It is then never scored: no
    network pass and no warning on every later line, and not switched once the centre lines
    arrive (the verdict belongs to the switch point)."""
    from masc_gadget.core.ood import OodCalibration

    torch.manual_seed(0)
    mar = build_mar(MarModelConfig(width=4)).eval()
    calls = []
    mar.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    mar.ood = OodCalibration("consistency", 1e9)
    mar.ood_early = OodCalibration("holdout", 1e-9, "early", after_lines=INITIAL + 1)  # flags what it scores
    engine = make_engine("equispaced", mar=mar, n_pe=32, n_readout=32)
    k = np.fft.fftshift(np.fft.fft2(np.random.default_rng(0).random((32, 32)))).astype(np.complex64)
    with caplog.at_level("WARNING", logger="masc_gadget.acquisition.engine"):
        for line in range(31):  # every line but the last in file order, whatever the engine asks for
            engine.on_line(0, line, k[line])
            if line == 0:
                calls.clear()  # a slice's first line warms the network up
    warned = [r for r in caplog.records if "not scored by the early rule" in r.getMessage()]
    assert len(warned) == 1 and len(calls) == 1  # tried once, at the switch point (was: on every line after it)
    assert not engine._slices[0].episode.switched[0] and not engine._slices[0].episode.scored(0)[0]
