"""Echo-train decisions: k lines per decision in the engine, the policies and a closed-loop scan."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.engine import AcquisitionEngine, EngineSettings
from masc_gadget.acquisition.episode import AcquisitionConfig, AcquisitionState
from masc_gadget.acquisition.policies import select_trains
from masc_gadget.acquisition.learned import LearnedPolicy
from masc_gadget.acquisition.policies import make_policy, run_episode
from masc_gadget.config import load_config
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.serving.server import MascServer
from sim_scanner.scanner.session import run_scan

from tests.conftest import CONFIGS

N = 32


def _engine(k, policy="center-out", budget=7):
    settings = EngineSettings(n_pe=N, n_readout=8, initial=2, budget=budget, seed=0, device="cpu",
                              lines_per_decision=k, decide_ahead=False)
    return AcquisitionEngine(settings, make_policy(policy))


def test_a_decision_is_a_train_of_k_lines_and_the_next_waits_for_all_of_them():
    engine = _engine(3)
    row = np.ones(8, np.complex64)
    assert engine.on_line(0, 15, row) == []
    train = engine.on_line(0, 16, row)
    assert [d.step for d in train] == [0, 1, 2]
    expected = list(run_episode(make_policy("center-out"), N, 2, 7))[2:]
    assert [d.line for d in train] == expected[:3]  # the policy's next three lines
    assert engine.on_line(0, train[1].line, row) == []  # in any order: wait for the rest of the train
    assert engine.on_line(0, train[0].line, row) == []
    second = engine.on_line(0, train[2].line, row)
    assert [d.step for d in second] == [3, 4, 5] and [d.line for d in second] == expected[3:6]
    # a line nobody asked for ends the train: decide again from what is there
    third = engine.on_line(0, 0, row)
    assert [d.step for d in third] == [4, 5, 6]  # 6 of 9 lines in: a new train of the 3 left
    assert engine.followed(0) is False


def test_the_last_train_is_shorter_and_random_trains_are_distinct():
    engine = _engine(3, "random", budget=4)
    row = np.ones(8, np.complex64)
    engine.on_line(0, 15, row)
    first = engine.on_line(0, 16, row)
    assert len({d.line for d in first}) == 3
    for d in first:
        last = engine.on_line(0, d.line, row)
    assert len(last) == 1 and last[0].step == 3  # 4 = 3 + 1
    states = [AcquisitionState.initial(N, 2, 2)]
    assert select_trains(make_policy("random"), states, [np.random.default_rng(0)], 3)[0, 2] == -1


def test_learned_trains_are_the_top_k_of_one_forward_pass():
    torch.manual_seed(0)
    net = PolicyNet(N, N, 16, PolicyNetConfig(channels=(4,), hidden=8, pool_size=2))
    policy = LearnedPolicy(net, observes_mar=False)
    state = AcquisitionState.initial(N, 2, 5)
    state = AcquisitionState(mask=state.mask, steps_left=5, step=0, image=np.random.rand(N, 16).astype(np.float32),
                             n_initial=2)
    train = select_trains(policy, [state], [None], 4)[0]
    scores = policy._scores([state])[0]
    assert list(train) == list(np.argsort(-scores, kind="stable")[:4])
    assert train[0] == policy.select_batch([state])[0]  # k = 1 is the argmax, as before


def test_config_rejects_a_train_outside_the_budget():
    with pytest.raises(ValueError, match="lines_per_decision"):
        AcquisitionConfig(lines_per_decision=0)
    with pytest.raises(ValueError, match=r"\[1, budget = 18\]"):  # a client cannot ask for a huge train
        AcquisitionConfig(budget=18, lines_per_decision=10**12)
    with pytest.raises(ValueError, match="lines_per_decision"):
        EngineSettings(n_pe=N, n_readout=8, initial=2, budget=3, seed=0, device="cpu", lines_per_decision=4)


def test_a_connection_asking_for_a_huge_train_gets_an_error():
    from masc_gadget.config import ConfigError
    from masc_gadget.serving.settings import GadgetSettings, settings_from_json

    with pytest.raises(ConfigError, match="lines_per_decision"):
        settings_from_json('{"budget": 5, "lines_per_decision": 1000000000000}', GadgetSettings())


@pytest.mark.parametrize("interleave", [False, True])
def test_closed_loop_scan_with_echo_trains(tiny_dataset, tmp_path, interleave):
    server = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu"]), address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        config = load_config(CONFIGS / "tiny.yaml", [
            f"scanner.server=127.0.0.1:{port}", "scanner.feedback=inband", "scanner.deadline_ms=2000",
            f"scanner.interleave={str(interleave).lower()}", "acquisition.policy=center-out", "scanner.policy=center-out",
            "acquisition.budget=7", "acquisition.lines_per_decision=3"])
        report = run_scan(config, tiny_dataset, "test", tmp_path / "scan", progress=False)
    finally:
        server.shutdown()
    expected = list(run_episode(make_policy("center-out"), N, 1, 7))
    for subject in report.subjects:
        for sl in subject.slices:
            assert sl.lines == expected and sl.sources == ["initial"] + ["gadget"] * 7
            assert all(latency is not None and latency >= 0 for latency in sl.latencies_ms)
    assert report.totals.fallbacks == 0
