"""Shared fixtures: a tiny simulated dataset written once per test session."""

from pathlib import Path

import numpy as np
import pytest
import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="session")
def tiny_config():
    from masc_gadget.config import load_config

    return load_config(CONFIGS / "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory, tiny_config):
    """The tiny dataset (4 subjects), simulated with two worker processes."""
    from masc_gadget.config import load_config
    from sim_scanner.dataset.simulate import simulate_dataset

    out = tmp_path_factory.mktemp("tiny") / "data"
    config = load_config(CONFIGS / "tiny.yaml", ["dataset.workers=2"])
    simulate_dataset(config, out, progress=False)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def device():
    """CPU always; CUDA too where present (tests parametrise over it themselves)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def global_rng_guard():
    """Fails the test if library code touched numpy's or torch's global RNG."""
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    yield
    after = np.random.get_state()
    assert np_state[0] == after[0] and np.array_equal(np_state[1], after[1]) and np_state[2:] == after[2:], \
        "numpy global RNG state changed"
    assert torch.equal(torch_state, torch.random.get_rng_state()), "torch global RNG state changed"


def write_perturbed_mar(path, seed: int = 1, scale: float = 0.05):
    """A width-4 MAR checkpoint whose weights are perturbed, so that MAR is not the identity."""
    from masc_gadget.models.checkpoint import save_checkpoint
    from masc_gadget.config import to_dict
    from masc_gadget.models.unet import MarModelConfig, build_mar

    gen = torch.Generator().manual_seed(seed)
    cfg = MarModelConfig(width=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_mar(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    save_checkpoint(path, {"mar": model.eval()}, {"kind": "mar", "mar_model": to_dict(cfg), "epoch": 0})
    return path


@pytest.fixture(scope="session")
def perturbed_mar(tmp_path_factory):
    """Path of a width-4, non-identity MAR checkpoint (untrained, perturbed weights)."""
    return write_perturbed_mar(tmp_path_factory.mktemp("mar") / "mar.pt")


@pytest.fixture(scope="session")
def tiny_masc(tmp_path_factory, tiny_dataset, perturbed_mar):
    """Path of a MASC checkpoint trained once on the tiny dataset (two rollouts), for the tests
    that need a trained model rather than test the training."""
    from masc_gadget.config import load_config
    from training.coadapt import train_masc

    out = tmp_path_factory.mktemp("masc") / "masc.pt"
    train_masc(load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2"]), tiny_dataset, perturbed_mar, out,
               progress=False)
    return out


@pytest.fixture
def one_thread():
    """One torch thread, restored afterwards: tiny networks run fastest on one thread, and on 2
    cores shared with other processes torch's default pool oversubscribes them (10-100x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
