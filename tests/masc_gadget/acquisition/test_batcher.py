"""DecisionBatcher: concurrent requests share passes by key, within max_batch; expired requests
are not computed; a full queue and a failing pass are errors for the callers, never hangs."""

import threading
import time

import pytest

from masc_gadget.acquisition.batcher import (
    DeadlineExpired,
    DecisionBatcher,
    DecisionRequest,
    QueueFull,
    split_rows,
)


class Recorder:
    """A pass that records its groups; blocks on ``gate`` so requests pile up meanwhile
    (``entered``: a pass has started)."""

    def __init__(self):
        self.groups = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, group):
        self.entered.set()
        self.gate.wait(5)
        self.groups.append([r.payload for r in group])
        return [r.payload * 10 for r in group]


def test_waiting_requests_share_one_pass_per_key():
    run = Recorder()
    batcher = DecisionBatcher(run, max_batch=8)
    try:
        run.gate.clear()
        first = batcher.submit(DecisionRequest("a", 0, 1))  # occupies the worker
        assert run.entered.wait(5)  # the pass is running (gated)
        futures = [batcher.submit(DecisionRequest("a" if i % 2 else "b", i, 1)) for i in range(1, 7)]
        run.gate.set()
        assert first.result(5) == 0
        assert [f.result(5) for f in futures] == [10 * i for i in range(1, 7)]
    finally:
        batcher.close()
    assert run.groups[0] == [0]
    assert sorted(map(sorted, run.groups[1:])) == [[1, 3, 5], [2, 4, 6]]  # one pass per key
    assert batcher.passes == 3 and batcher.batched == 7


def test_max_batch_splits_a_group():
    run = Recorder()
    batcher = DecisionBatcher(run, max_batch=2)
    try:
        run.gate.clear()
        batcher.submit(DecisionRequest("k", -1, 1))
        assert run.entered.wait(5)  # the pass is running (gated)
        futures = [batcher.submit(DecisionRequest("k", i, 1)) for i in range(5)]
        run.gate.set()
        assert [f.result(5) for f in futures] == [0, 10, 20, 30, 40]
    finally:
        batcher.close()
    assert all(len(g) <= 2 for g in run.groups)


def test_expired_requests_are_not_computed():
    run = Recorder()
    batcher = DecisionBatcher(run)
    try:
        run.gate.clear()
        batcher.submit(DecisionRequest("k", 1, 1))
        assert run.entered.wait(5)  # the pass is running (gated)
        late = batcher.submit(DecisionRequest("k", 2, 1, deadline=time.monotonic() + 0.01))
        time.sleep(0.05)  # past the late request's deadline
        run.gate.set()
        with pytest.raises(DeadlineExpired):
            late.result(5)
    finally:
        batcher.close()
    assert [2] not in run.groups


def test_full_queue_and_failing_pass_are_errors():
    run = Recorder()
    batcher = DecisionBatcher(run, max_queue=1)
    try:
        run.gate.clear()
        batcher.submit(DecisionRequest("k", 1, 1))
        assert run.entered.wait(5)  # the pass is running (gated)
        batcher.submit(DecisionRequest("k", 2, 1))
        with pytest.raises(QueueFull, match="1 decisions are already waiting"):
            batcher.submit(DecisionRequest("k", 3, 1))
        run.gate.set()
    finally:
        batcher.close()

    def broken(group):
        raise ValueError("no model")

    batcher = DecisionBatcher(broken)
    try:
        with pytest.raises(ValueError, match="no model"):
            batcher(DecisionRequest("k", 1, 1), timeout=5)
    finally:
        batcher.close()


def test_closed_batcher_refuses_and_answers_nobody_silently():
    batcher = DecisionBatcher(Recorder())
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(DecisionRequest("k", 1, 1))


def test_split_rows():
    import numpy as np

    parts = split_rows(np.arange(6), [1, 2, 3])
    assert [p.tolist() for p in parts] == [[0], [1, 2], [3, 4, 5]]


# --- engines sharing one batcher ------------------------------------------------------------------


class _GatedBrightest:
    """A policy reading images (brightest free row); blocks its first pass until ``gate`` is set,
    so that the other engines' requests queue up meanwhile. Records its batch sizes."""

    def __new__(cls):
        from masc_gadget.acquisition.policies import SamplingPolicy
        import numpy as np

        class Gated(SamplingPolicy):
            name = "gated-brightest"
            needs_image = True

            def __init__(self):
                self.gate = threading.Event()
                self.batches = []

            def choose(self, state, rng):
                energy = state.image.astype(np.float64).sum(axis=1)
                energy[state.mask] = -np.inf
                return int(np.argmax(energy))

            def select_batch(self, states, rngs=None):
                self.gate.wait(5)
                self.batches.append(len(states))
                return super().select_batch(states, rngs)

        return Gated()


def _kspace(seed, n=16):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))).astype(np.complex64)


def _queued_behind_the_first(policy, jobs):
    """Run ``jobs`` (callables) in threads: the first one's pass runs while ``policy``'s gate is
    closed, the others queue behind it in order (one shared pass); then the gate opens."""
    policy.gate.clear()
    threads = [threading.Thread(target=job) for job in jobs]
    threads[0].start()
    time.sleep(0.1)  # the first pass is running (gated); the others queue behind it
    for t in threads[1:]:
        t.start()
        time.sleep(0.05)
    time.sleep(0.2)
    policy.gate.set()
    for t in threads:
        t.join(10)


def test_engines_sharing_a_batcher_decide_as_alone_in_fewer_passes():
    from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings

    settings = EngineSettings(n_pe=16, n_readout=16, initial=2, budget=3, seed=0, device="cpu")
    policy = _GatedBrightest()
    policy.gate.set()
    alone = [AcquisitionEngine(settings, policy) for _ in range(4)]
    expected = []
    for i, engine in enumerate(alone):
        k = _kspace(i)
        engine.on_line(0, 7, k[7])
        expected.append([d.line for d in engine.on_line(0, 8, k[8])])
    batcher = DecisionBatcher(AcquisitionEngine.run_group)
    try:
        engines = [AcquisitionEngine(settings, policy, batcher=batcher) for _ in range(4)]
        policy.batches.clear()
        got = [None] * 4

        def scan(i):
            k = _kspace(i)
            engines[i].on_line(0, 7, k[7])
            got[i] = [d.line for d in engines[i].on_line(0, 8, k[8])]

        _queued_behind_the_first(policy, [lambda i=i: scan(i) for i in range(4)])
    finally:
        batcher.close()
    assert got == expected
    assert policy.batches == [1, 3]  # the three waiting engines: one pass


def test_a_full_queue_costs_a_decision_not_the_scan():
    """Regression: QueueFull from the server's batcher ended the scan as an internal error; now the
    line stays stored, no decision is sent (the scanner takes its own line) and the next line asks
    again."""
    import numpy as np

    from masc_gadget.acquisition.batcher import QueueFull
    from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
    from masc_gadget.acquisition.policies import CenterOut

    class Reading(CenterOut):  # a policy that reads the image, so its passes go through the batcher
        needs_image = True

    calls = []

    def saturated(request):
        calls.append(request)
        raise QueueFull("64 decisions are already waiting")

    engine = AcquisitionEngine(EngineSettings(n_pe=16, n_readout=8, initial=2, budget=3, seed=0, device="cpu"),
                               Reading(), batcher=saturated)
    row = np.ones((1, 8), dtype=np.complex64)
    assert engine.on_line(0, 7, row) == [] and engine.on_line(0, 8, row) == []
    assert engine.on_line(0, 9, row) == []  # the scanner's own line: asked again, refused again
    assert engine.acquired(0) == [7, 8, 9] and len(calls) == 2


def test_engines_of_one_model_with_different_early_rules_are_not_batched_together():
    """Regression: the batch key named the models but not the early rule, so a connection that
    turned the fallback off (``mar_fallback`` is a per-connection setting) and one that kept it,
    in one pass, were both decided under the first one's rule: the second's flagged slice was
    not switched to centre-out."""
    import torch

    from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
    from masc_gadget.core.ood import OodCalibration
    from masc_gadget.models.unet import MarModelConfig, build_mar

    torch.manual_seed(0)
    mar = build_mar(MarModelConfig(width=4)).eval()
    with torch.no_grad():  # built as the identity: perturbed, so that it changes an image
        for p in mar.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    mar.ood = OodCalibration("consistency", 1e9)
    mar.ood_early = OodCalibration("residual", 1e-9, "early")  # flags every slice it scores
    policy = _GatedBrightest()
    policy.gate.set()
    n = 32

    def settings(fallback):
        return EngineSettings(n_pe=n, n_readout=n, initial=2, budget=3, seed=0, device="cpu", mar_fallback=fallback)

    def first_decision(engine, seed):
        k = _kspace(seed, n)
        engine.on_line(0, 15, k[15])
        return [d.line for d in engine.on_line(0, 16, k[16])]

    expected = {f: first_decision(AcquisitionEngine(settings(f), policy, mar), 1) for f in ("off", "auto")}
    assert expected["off"] != expected["auto"]  # the switch changes the line
    batcher = DecisionBatcher(AcquisitionEngine.run_group)
    try:
        lead, off, auto = (AcquisitionEngine(settings(f), policy, mar, batcher=batcher) for f in ("off", "off", "auto"))
        got = {}
        _queued_behind_the_first(policy, [lambda: first_decision(lead, 2)] + [
            lambda e=e, f=f: got.__setitem__(f, first_decision(e, 1)) for e, f in ((off, "off"), (auto, "auto"))])
    finally:
        batcher.close()
    assert got == expected
