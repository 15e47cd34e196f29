"""Shipped checkpoints: export to float16 with provenance, resolve shipped:NAME."""

import json

import pytest
import torch

from masc_gadget.models import shipped
from masc_gadget.models.checkpoint import load_checkpoint, save_checkpoint
from masc_gadget.acquisition.learned import load_masc, policy_metadata
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.unet import MarModelConfig, build_mar
from training.export import export_checkpoint


def test_export_halves_weights_and_keeps_behaviour(tmp_path):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = PolicyNet(16, 16, 16, PolicyNetConfig(channels=(4, 8), hidden=16, pool_size=4))
        mar = build_mar(MarModelConfig(width=4))
    src = tmp_path / "masc.pt"
    save_checkpoint(src, {"policy": net, "mar": mar}, policy_metadata(net, True, mar, rollout=7, val={"ssim": 0.5},
                                                                        config={"masc_train": {"seed": 3}}))
    record = export_checkpoint(src, tmp_path / "shipped" / "tiny.pt", command="masc train masc ...")
    assert record["seed"] == 3 and record["trained_rollouts"] == 7 and record["validation"] == {"ssim": 0.5}
    assert json.loads((tmp_path / "shipped" / "tiny.json").read_text())["command"] == "masc train masc ..."
    ck = load_checkpoint(tmp_path / "shipped" / "tiny.pt")
    assert all(v.dtype == torch.float16 for v in ck.state_dicts["policy"].values() if v.is_floating_point())
    policy, mar2, meta = load_masc(tmp_path / "shipped" / "tiny.pt", "cpu")
    image = torch.rand(2, 16, 16)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 8] = True
    with torch.no_grad():
        a, _ = net(image, mask, torch.ones(2))
        b, _ = policy.net(image, mask, torch.ones(2))
    assert torch.allclose(a, b, atol=1e-2)
    assert (tmp_path / "shipped" / "tiny.pt").stat().st_size < 0.6 * src.stat().st_size


def test_shipped_names_resolve_or_say_what_exists():
    with pytest.raises(FileNotFoundError, match="no shipped checkpoint 'shipped:nope'; shipped checkpoints:"):
        shipped.resolve("shipped:nope")
    assert str(shipped.resolve("some/file.pt")) == "some/file.pt"
    for name in shipped.available():
        path = shipped.resolve(f"shipped:{name}")
        assert path.is_file() and shipped.provenance(name)["name"] == name
