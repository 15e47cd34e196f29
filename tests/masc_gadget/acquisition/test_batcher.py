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
    """A pass that records its groups; blocks on ``gate`` so requests pile up meanwhile."""

    def __init__(self):
        self.groups = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, group):
        self.gate.wait(5)
        self.groups.append([r.payload for r in group])
        return [r.payload * 10 for r in group]


def test_waiting_requests_share_one_pass_per_key():
    run = Recorder()
    batcher = DecisionBatcher(run, max_batch=8)
    try:
        run.gate.clear()
        first = batcher.submit(DecisionRequest("a", 0, 1))  # occupies the worker
        time.sleep(0.05)
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
        time.sleep(0.05)
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
        time.sleep(0.05)
        late = batcher.submit(DecisionRequest("k", 2, 1, deadline=time.monotonic() + 0.01))
        time.sleep(0.05)
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
        time.sleep(0.05)
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
