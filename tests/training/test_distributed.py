"""torchrun data parallelism on CPU (gloo): two ranks equal one process with the same global
batch; a run killed mid-way resumes from its last checkpoint with another number of ranks."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from masc_gadget.models.checkpoint import load_checkpoint

from tests.conftest import CONFIGS, free_port

SETTINGS = ["mar_model.norm=group", "mar_train.batch_size=4", "mar_train.run.device=cpu", "mar_train.input=mixed"]


def _cmd(data, out, epochs, ranks, port, resume=None):
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(port), "-m"] if ranks > 1 else [sys.executable, "-m"]
    cmd = [*base, "masc_gadget.cli", "train", "mar", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(data),
           "--out", str(out)]
    for s in [*SETTINGS, f"mar_train.epochs={epochs}"]:
        cmd += ["--set", s]
    return cmd + (["--resume", str(resume)] if resume else [])


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _weights(path):
    return load_checkpoint(path).state_dicts["mar"]


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


def test_two_ranks_equal_one_process_with_the_same_global_batch(tiny_dataset, tmp_path):
    subprocess.run(_cmd(tiny_dataset, tmp_path / "two.pt", 2, 2, free_port()), check=True, env=_env(),
                   capture_output=True, timeout=300)
    subprocess.run(_cmd(tiny_dataset, tmp_path / "one.pt", 2, 1, 0), check=True, env=_env(), capture_output=True,
                   timeout=300)
    assert _max_diff(_weights(tmp_path / "two.last.pt"), _weights(tmp_path / "one.last.pt")) < 1e-4
    two = (tmp_path / "two.csv").read_text().splitlines()
    assert len(two) == 3  # rank 0 alone writes the log: one header, one row per epoch


def test_a_run_killed_mid_way_resumes_from_its_last_checkpoint_on_other_ranks(tiny_dataset, tmp_path):
    epochs = 8
    proc = subprocess.Popen(_cmd(tiny_dataset, tmp_path / "run.pt", epochs, 2, free_port()), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = tmp_path / "run.csv"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 2:  # epoch 1 is checkpointed
            os.killpg(proc.pid, signal.SIGKILL)  # every rank dies at once, mid-run
            break
        time.sleep(0.02)
    proc.wait(30)
    done = int(load_checkpoint(tmp_path / "run.last.pt").metadata["epoch"])
    if done >= epochs:
        pytest.skip("the run finished before it could be killed (a very fast machine)")
    # resume on one process: the result is the uninterrupted run's
    subprocess.run(_cmd(tiny_dataset, tmp_path / "run.pt", epochs, 1, 0, resume=tmp_path / "run.last.pt"),
                   check=True, env=_env(), capture_output=True, timeout=300)
    subprocess.run(_cmd(tiny_dataset, tmp_path / "ref.pt", epochs, 1, 0), check=True, env=_env(),
                   capture_output=True, timeout=300)
    assert int(load_checkpoint(tmp_path / "run.last.pt").metadata["epoch"]) == epochs
    assert _max_diff(_weights(tmp_path / "run.last.pt"), _weights(tmp_path / "ref.last.pt")) < 1e-4
    assert torch.get_num_threads() >= 1


def _simulate(out, ranks, port):
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(port), "-m"] if ranks > 1 else [sys.executable, "-m"]
    return subprocess.run([*base, "masc_gadget.cli", "simulate", "dataset", "--config", str(CONFIGS / "tiny.yaml"),
                           "--out", str(out), "--set", "dataset.subjects=4"], check=True, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_simulation_spreads_subjects_over_ranks_and_reruns_resume(tmp_path):
    import h5py
    import numpy as np

    from sim_scanner.dataset.layout import read_manifest, split_files

    _simulate(tmp_path / "two", 2, free_port())
    _simulate(tmp_path / "one", 1, 0)
    assert read_manifest(tmp_path / "two")["splits"] == read_manifest(tmp_path / "one")["splits"]
    files = {p.relative_to(tmp_path / "one") for split in ("train", "val", "test")
             for p in split_files(tmp_path / "one", split)}
    assert len(files) == 4
    for rel in files:  # the same subjects, bit for bit, whichever rank simulated them
        with h5py.File(tmp_path / "one" / rel) as a, h5py.File(tmp_path / "two" / rel) as b:
            assert np.array_equal(a["kspace/metal"][()], b["kspace/metal"][()])
    victim = sorted(files)[0]
    (tmp_path / "two" / victim).unlink()
    kept = {rel: (tmp_path / "two" / rel).stat().st_mtime_ns for rel in files if rel != victim}
    result = _simulate(tmp_path / "two", 3, free_port())  # a rerun on another number of ranks
    assert "already simulated" in result.stderr + result.stdout
    assert (tmp_path / "two" / victim).is_file()
    assert all((tmp_path / "two" / rel).stat().st_mtime_ns == t for rel, t in kept.items())


def test_coadaptive_training_on_two_ranks_stays_in_sync_and_resumes_on_one(tiny_dataset, tmp_path, perturbed_mar):
    def masc(out, ranks, rollouts, resume=None):
        base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                str(free_port()), "-m"] if ranks > 1 else [sys.executable, "-m"]
        cmd = [*base, "masc_gadget.cli", "train", "masc", "--config", str(CONFIGS / "tiny.yaml"), "--data",
               str(tiny_dataset), "--mar", str(perturbed_mar), "--out", str(out), "--set",
               f"masc_train.rollouts={rollouts}", "--set", "masc_train.val_every=2"]
        return subprocess.run(cmd + (["--resume", str(resume)] if resume else []), env=_env(), capture_output=True,
                              text=True, timeout=300)

    two = masc(tmp_path / "m.pt", 2, 2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "rank 1 of 2" in two.stderr  # both ranks trained (each checks the parameters are in sync)
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 3  # rank 0 alone logs its 2 rollouts
    one = masc(tmp_path / "m.pt", 1, 4, resume=tmp_path / "m.last.pt")
    assert one.returncode == 0, one.stderr[-2000:]
    assert load_checkpoint(tmp_path / "m.last.pt").metadata["rollout"] == 4


def _train(what, tiny_dataset, out, ranks, settings):
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port()), "-m"] if ranks > 1 else [sys.executable, "-m"]
    cmd = [*base, "masc_gadget.cli", "train", what, "--config", str(CONFIGS / "tiny.yaml"), "--data",
           str(tiny_dataset), "--out", str(out)]
    for s in settings:
        cmd += ["--set", s]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def test_learned_mask_on_two_ranks_equals_one_process(tiny_dataset, tmp_path):
    settings = ["mar_model.norm=group", "loupe.epochs=2", "loupe.batch_size=4", "loupe.run.device=cpu"]
    for name, ranks in (("two", 2), ("one", 1)):
        result = _train("loupe", tiny_dataset, tmp_path / f"{name}.pt", ranks, settings)
        assert result.returncode == 0, result.stderr[-2000:]
    a, b = load_checkpoint(tmp_path / "two.last.pt"), load_checkpoint(tmp_path / "one.last.pt")
    assert _max_diff(a.state_dicts["mask"], b.state_dicts["mask"]) < 1e-4
    assert _max_diff(a.state_dicts["mar"], b.state_dicts["mar"]) < 1e-4


def test_dqn_on_two_ranks_stays_in_sync(tiny_dataset, tmp_path):
    settings = ["dqn.steps=64", "dqn.learning_starts=16", "dqn.val_every=32", "dqn.target_update=32",
                "dqn.run.device=cpu", "q_net.channels=[8]", "q_net.hidden=16", "q_net.pool_size=2"]
    result = _train("dqn", tiny_dataset, tmp_path / "dqn.pt", 2, settings)
    assert result.returncode == 0, result.stderr[-2000:]  # each validation compares the ranks' parameters
    assert load_checkpoint(tmp_path / "dqn.last.pt").metadata["transitions"] == 64
    assert len((tmp_path / "dqn.csv").read_text().splitlines()) == 3
