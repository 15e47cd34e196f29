"""Checkpoints: round trips, weights_only loading, clear errors for foreign or damaged files."""

import json
import pathlib
import re

import pytest
import torch
from torch import nn

import masc_gadget
from masc_gadget.models import checkpoint as ckpt
from masc_gadget.models.checkpoint import (
    Checkpoint,
    load_checkpoint,
    load_mar,
    save_checkpoint,
)
from masc_gadget.config import to_dict
from masc_gadget.models import MarModelConfig, MarNet, build_mar


def trained_like(cfg: MarModelConfig, seed: int = 0) -> MarNet:
    """A MarNet with non-default weights and BatchNorm statistics."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_mar(cfg)
        nn.init.normal_(model.residual.head.weight, std=0.3)
        model.train()
        with torch.no_grad():
            model(torch.rand(4, 1, 20, 28))
    return model.eval()


class Opaque:
    """Not a tensor or plain data: weights_only loading must refuse it."""


@pytest.fixture
def cfg():
    return MarModelConfig(width=4, depth=3, scale_quantile=0.95)


def test_mar_round_trip_restores_identical_outputs(tmp_path, cfg):
    model = trained_like(cfg)
    x = torch.rand(2, 1, 33, 17)
    with torch.no_grad():
        expected = model(x)
    metadata = {"kind": "mar", "mar_model": to_dict(cfg), "epoch": 3,
                "val": {"ssim": 0.91, "psnr": 31.5}, "notes": ["a", None, True]}
    path = save_checkpoint(tmp_path / "sub" / "mar.pt", {"mar": model}, metadata)
    assert path == tmp_path / "sub" / "mar.pt" and path.is_file()
    loaded, meta = load_mar(path, "cpu")
    assert not loaded.training
    assert loaded.config == cfg
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
    assert meta == {**metadata, "code_version": masc_gadget.__version__}
    assert list(meta)[: len(metadata)] == list(metadata)  # key order kept


def test_metadata_keeps_a_given_code_version_and_is_not_mutated(tmp_path, cfg):
    metadata = {"mar_model": to_dict(cfg), "code_version": "0.0.1-test"}
    save_checkpoint(tmp_path / "a.pt", {"mar": trained_like(cfg)}, metadata)
    assert metadata == {"mar_model": to_dict(cfg), "code_version": "0.0.1-test"}
    assert load_checkpoint(tmp_path / "a.pt").metadata["code_version"] == "0.0.1-test"


def test_state_dicts_and_extra_state_round_trip(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.rand(5, 3)).sum().backward()
    opt.step()
    gen_state = torch.Generator().manual_seed(5).get_state()
    path = tmp_path / "x.pt"
    save_checkpoint(path, {"net": model, "raw": {"w": torch.arange(4)}}, {"step": 1},
                    extra_state={"optimizer": opt.state_dict(), "shuffle_state": gen_state,
                                 "history": [1.0, 2.0]})
    ck = load_checkpoint(path)
    assert isinstance(ck, Checkpoint)
    assert set(ck.state_dicts) == {"net", "raw"}
    for key, value in model.state_dict().items():
        assert torch.equal(ck.state_dicts["net"][key], value)
    assert torch.equal(ck.state_dicts["raw"]["w"], torch.arange(4))
    opt2 = torch.optim.Adam(nn.Linear(3, 2).parameters(), lr=1e-3)
    opt2.load_state_dict(ck.extra["optimizer"])
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(ck.extra["shuffle_state"], gen_state)
    assert ck.extra["history"] == [1.0, 2.0]
    assert ck.metadata["step"] == 1


def test_save_is_atomic_and_overwrites(tmp_path, cfg):
    path = tmp_path / "mar.pt"
    save_checkpoint(path, {"mar": trained_like(cfg, 0)}, {"mar_model": to_dict(cfg), "epoch": 1})
    save_checkpoint(path, {"mar": trained_like(cfg, 1)}, {"mar_model": to_dict(cfg), "epoch": 2})
    assert load_checkpoint(path).metadata["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mar.pt"]  # no temporary files left


def test_failed_save_keeps_the_previous_file(tmp_path, cfg, monkeypatch):
    path = tmp_path / "mar.pt"
    save_checkpoint(path, {"mar": trained_like(cfg)}, {"mar_model": to_dict(cfg), "epoch": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"mar": trained_like(cfg)}, {"mar_model": to_dict(cfg), "epoch": 2})
    monkeypatch.undo()
    assert load_checkpoint(path).metadata["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mar.pt"]


def test_save_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path / "a.pt", {"m": nn.Linear(1, 1)}, {"bad": object()})
    with pytest.raises(ValueError, match="non-empty dict"):
        save_checkpoint(tmp_path / "a.pt", {}, {})
    with pytest.raises(TypeError, match=r"modules\['m'\]"):
        save_checkpoint(tmp_path / "a.pt", {"m": 3}, {})
    assert not list(tmp_path.iterdir())


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        load_checkpoint(tmp_path / "nothing.pt")
    with pytest.raises(FileNotFoundError, match="nothing.pt"):
        load_mar(tmp_path / "nothing.pt")


def _not_checkpoints(tmp_path, cfg):
    """(path, what) for files that load_checkpoint must refuse with a ValueError."""
    files = []
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00\x01not a checkpoint at all" * 10)
    files.append(garbage)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    files.append(empty)
    good = save_checkpoint(tmp_path / "good.pt", {"mar": trained_like(cfg)}, {"mar_model": to_dict(cfg)})
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    files.append(truncated)
    plain = tmp_path / "plain_state_dict.pt"
    torch.save(trained_like(cfg).state_dict(), plain)
    files.append(plain)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"format": "masc-checkpoint", "version": 1, "state_dicts": {}, "metadata_json": "{}",
                "extra": {"obj": Opaque()}}, unsafe)
    files.append(unsafe)
    future = tmp_path / "future.pt"
    torch.save({"format": "masc-checkpoint", "version": 99, "state_dicts": {}, "metadata_json": "{}",
                "extra": {}}, future)
    files.append(future)
    bad_json = tmp_path / "bad_json.pt"
    torch.save({"format": "masc-checkpoint", "version": 1, "state_dicts": {}, "metadata_json": "{oops",
                "extra": {}}, bad_json)
    files.append(bad_json)
    return files


def test_foreign_or_damaged_files_are_value_errors_naming_the_path(tmp_path, cfg):
    for path in _not_checkpoints(tmp_path, cfg):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            load_checkpoint(path)
    with pytest.raises(ValueError, match="not a file"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="weights-only unpickler: Unsupported global"):
        load_checkpoint(tmp_path / "unsafe.pt")


def test_load_mar_needs_mar_weights_and_config(tmp_path, cfg):
    model = trained_like(cfg)
    no_cfg = save_checkpoint(tmp_path / "no_cfg.pt", {"mar": model}, {"epoch": 1})
    with pytest.raises(ValueError, match="mar_model"):
        load_mar(no_cfg)
    no_mar = save_checkpoint(tmp_path / "no_mar.pt", {"policy": model}, {"mar_model": to_dict(cfg)})
    with pytest.raises(ValueError, match="no MAR network"):
        load_mar(no_mar)
    wrong = save_checkpoint(tmp_path / "wrong.pt", {"mar": model},
                            {"mar_model": {**to_dict(cfg), "width": 8}})
    with pytest.raises(ValueError, match=re.escape(str(wrong))):
        load_mar(wrong)
    unknown = save_checkpoint(tmp_path / "unknown.pt", {"mar": model},
                              {"mar_model": {**to_dict(cfg), "chans": 8}})
    with pytest.raises(ValueError, match="chans"):
        load_mar(unknown)


def test_torch_load_always_uses_weights_only(tmp_path, cfg, monkeypatch):
    source = pathlib.Path(ckpt.__file__).read_text()
    calls = re.findall(r"torch\.load\(([^)]*)\)", source)
    assert calls and all("weights_only=True" in c for c in calls), calls
    assert "weights_only=False" not in source and "import pickle" not in source

    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "load", spy)
    path = save_checkpoint(tmp_path / "m.pt", {"mar": trained_like(cfg)}, {"mar_model": to_dict(cfg)})
    load_checkpoint(path)
    load_mar(path)
    assert seen == [True, True]


def test_checkpoint_metadata_is_plain_json(tmp_path, cfg):
    path = save_checkpoint(tmp_path / "m.pt", {"mar": trained_like(cfg)}, {"mar_model": to_dict(cfg)})
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "masc-checkpoint" and raw["version"] == 1
    assert json.loads(raw["metadata_json"])["mar_model"] == to_dict(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checkpoint_loads_on_cpu_and_back(tmp_path, cfg):
    model = trained_like(cfg).cuda()
    x = torch.rand(2, 1, 20, 28)
    with torch.no_grad():
        expected = model(x.cuda()).cpu()
    path = save_checkpoint(tmp_path / "m.pt", {"mar": model}, {"mar_model": to_dict(cfg)})
    cpu_model, _ = load_mar(path, "cpu")
    gpu_model, _ = load_mar(path, "cuda")
    assert next(gpu_model.parameters()).is_cuda
    with torch.no_grad():
        torch.testing.assert_close(cpu_model(x), expected, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(gpu_model(x.cuda()).cpu(), expected, rtol=1e-5, atol=1e-5)
