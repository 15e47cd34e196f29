"""Hostile checkpoints: metadata sizes are checked before any network is built."""

import pytest
import torch

from masc_gadget.acquisition import learned
from masc_gadget.acquisition.learned import load_masc, policy_metadata
from masc_gadget.config import to_dict
from masc_gadget.models import checkpoint, shipped
from masc_gadget.models.checkpoint import load_checkpoint, load_mar, save_checkpoint
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.unet import MarModelConfig, build_mar


@pytest.fixture
def no_real_build(monkeypatch):
    """Fails the test if a real network is built (one on the meta device, which allocates
    nothing, is fine)."""

    def only_on_meta(build):
        def guarded(*args, **kwargs):
            if torch.get_default_device().type != "meta":
                raise AssertionError("a network was built before its sizes were checked")
            return build(*args, **kwargs)
        return guarded

    monkeypatch.setattr(checkpoint, "build_mar", only_on_meta(checkpoint.build_mar))
    monkeypatch.setattr(learned, "PolicyNet", only_on_meta(learned.PolicyNet))


def _small_mar():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_mar(MarModelConfig(width=2, depth=1))


def _small_policy():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return PolicyNet(8, 8, 8, PolicyNetConfig(channels=(2,), hidden=4, pool_size=2))


@pytest.mark.parametrize("section, rule", [
    ({"width": 10**6, "depth": 1}, r"metadata mar_model.width must be an integer in \[1, 1024\], got 1000000"),
    ({"width": 2, "depth": 40}, r"metadata mar_model.depth must be an integer in \[1, 8\], got 40"),
    ({"width": 1024, "depth": 8}, r"describes a 'mar' network of \d+ parameters; at most 268435456"),
    ({"width": 3, "depth": 1}, r"'mar' weights do not match the network its metadata describes"),
])
def test_mar_metadata_sizes_are_checked_before_building(tmp_path, no_real_build, section, rule):
    path = save_checkpoint(tmp_path / "evil.pt", {"mar": _small_mar()}, {"kind": "mar", "mar_model": section})
    with pytest.raises(ValueError, match=rule) as err:
        load_mar(path, "cpu", name="evil")
    assert str(tmp_path) not in str(err.value) and str(err.value).startswith("evil")


@pytest.mark.parametrize("change, rule", [
    ({"n_pe": 10**6, "height": 10**6}, r"metadata n_pe must be an integer in \[1, 8192\]"),
    ({"width": 10**7}, r"metadata width must be an integer in \[1, 8192\]"),
    ({"policy_net": {"channels": [2], "hidden": 10**9, "pool_size": 2}}, r"policy_net.hidden must be an integer in \[1, 65536\]"),
    ({"policy_net": {"channels": [2] * 50, "hidden": 4, "pool_size": 2}}, r"policy_net.channels must be a list of 1 to 8"),
    ({"policy_net": {"channels": [10**6], "hidden": 4, "pool_size": 2}}, r"policy_net.channels\[\] must be an integer in \[1, 4096\]"),
    ({"policy_net": {"channels": [2], "hidden": 4, "pool_size": 10**4}}, r"policy_net.pool_size must be an integer in \[1, 64\]"),
    ({"policy_net": {"channels": [4096] * 8, "hidden": 65536, "pool_size": 64}}, r"parameters; at most 268435456"),
    ({"policy_net": {"channels": [3], "hidden": 4, "pool_size": 2}}, r"'policy' weights do not match"),
])
def test_policy_metadata_sizes_are_checked_before_building(tmp_path, no_real_build, change, rule):
    net = _small_policy()
    meta = {**policy_metadata(net, False), **change}
    path = save_checkpoint(tmp_path / "evil.pt", {"policy": net}, meta)
    with pytest.raises(ValueError, match=rule) as err:
        load_masc(path, "cpu", name="evil")
    assert str(tmp_path) not in str(err.value)


def test_checkpoints_within_bounds_still_load(tmp_path):
    net, mar = _small_policy(), _small_mar()
    path = save_checkpoint(tmp_path / "ok.pt", {"policy": net, "mar": mar}, policy_metadata(net, True, mar))
    policy, mar2, _ = load_masc(path, "cpu")
    assert policy.net.n_pe == 8 and mar2 is not None
    for a, b in zip(net.state_dict().values(), policy.net.state_dict().values()):
        assert torch.equal(a, b)
    assert to_dict(mar2.config) == to_dict(mar.config)


def test_shipped_model_loads_within_bounds():
    from masc_gadget.acquisition.learned import load_learned
    from masc_gadget.acquisition.policies import FixedOrder

    for name in shipped.available():
        policy, mar, meta = load_learned(f"shipped:{name}", "cpu")
        assert mar is not None
        if meta["kind"] == "masc":
            assert policy.net is not None and load_masc(f"shipped:{name}", "cpu")[0].net is not None
        else:
            assert isinstance(policy, FixedOrder) and len(policy.order) == meta["budget"]


@pytest.mark.parametrize("name", ["shipped:../shipped/masc_small", "shipped:./masc_small", "shipped:/etc/passwd",
                                  "shipped:masc_small/../masc_small", "shipped:"])
def test_shipped_names_never_leave_the_shipped_folder(name):
    with pytest.raises(FileNotFoundError, match="no shipped checkpoint .*; shipped checkpoints: shipped:fixed_small, shipped:masc_small"):
        shipped.resolve(name)


def test_messages_name_the_checkpoint_as_given_never_the_resolved_path(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"xnot a checkpoint")
    with pytest.raises(ValueError) as err:
        load_checkpoint(tmp_path / "bad.pt", name="bad")
    assert str(err.value).startswith("bad is not a readable MASC checkpoint") and str(tmp_path) not in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(tmp_path / "nope.pt", name="nope")
    assert str(err.value) == "checkpoint nope does not exist"
