"""Shipped checkpoints: export to float16 with provenance, resolve shipped:NAME."""

import json

import pytest
import torch

from tests.conftest import CONFIGS

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


def test_the_provenance_names_the_data_the_mar_pretraining_and_the_export(tmp_path, tiny_dataset, perturbed_mar,
                                                                          monkeypatch):
    from training.data import data_identity

    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = PolicyNet(16, 16, 16, PolicyNetConfig(channels=(4, 8), hidden=16, pool_size=4))
        mar = build_mar(MarModelConfig(width=4))
    src = tmp_path / "masc.pt"
    meta = policy_metadata(net, True, mar, rollout=7, config={"masc_train": {"seed": 3}})
    save_checkpoint(src, {"policy": net, "mar": mar},
                    {**meta, "data": f"{tiny_dataset},{tmp_path / 'gone'}", "mar_pretrained": str(perturbed_mar)})
    record = export_checkpoint(src, tmp_path / "out.pt", command="masc train ...", export_command="masc export ...")
    assert record["export_command"] == "masc export ..." and record["git_commit"]
    expected = {k: v for k, v in data_identity(tiny_dataset).items() if k != "train_anatomies"}
    assert record["training_data"] == [expected, {"folder": "gone"}]
    assert len(expected["manifest_sha256"]) == 64
    assert set(record["config"]) == {"masc_train", "mar_pretraining"}
    assert record["config"]["mar_pretraining"]["checkpoint"] == perturbed_mar.name
    stored = load_checkpoint(tmp_path / "out.pt").metadata["training_data"][0]
    assert stored["train_anatomies"] and all(":sub-" in a for a in stored["train_anatomies"])


def test_a_set_that_repeats_the_training_anatomies_is_named(tmp_path, tiny_dataset):
    """Same dataset seed and generator, another subject count: subject i is drawn alike, so the
    smaller set's test subjects are training subjects of the larger one."""
    from masc_gadget.cli import main
    from sim_scanner.dataset.layout import read_manifest
    from training.data import data_identity, repeats_training_anatomies
    from training.evaluation.evaluate import warn_repeated_anatomies

    trained_on = [data_identity(tiny_dataset)]
    assert repeats_training_anatomies(tiny_dataset, "test", trained_on) is None  # its own held-out split
    smaller = tmp_path / "smaller"
    assert main(["simulate", "dataset", "--config", str(CONFIGS / "tiny.yaml"), "--subjects", "3", "--out", str(smaller),
                 "--set", "dataset.split_fractions=[0.34,0.33,0.33]"]) == 0
    train = set(read_manifest(tiny_dataset)["splits"]["train"])
    named = []
    for split in ("train", "val", "test"):  # subjects 0-2 of 4: at least one was trained on
        overlap = [s for s in read_manifest(smaller)["splits"][split] if s in train]
        why = repeats_training_anatomies(smaller, split, trained_on)
        assert (why is not None) == bool(overlap)
        named += [why] if why else []
    assert named and all("repeat training anatomies" in w and "another dataset.seed" in w for w in named)
    other = tmp_path / "other"
    assert main(["simulate", "dataset", "--config", str(CONFIGS / "tiny.yaml"), "--subjects", "3", "--out", str(other),
                 "--set", "dataset.seed=99", "--set", "dataset.split_fractions=[0.34,0.33,0.33]"]) == 0
    for split in ("train", "val", "test"):
        assert repeats_training_anatomies(other, split, trained_on) is None
    ckpt = tmp_path / "ck.pt"
    save_checkpoint(ckpt, {"mar": build_mar(MarModelConfig(width=4))},
                    {"kind": "mar", "training_data": [{**trained_on[0]}]})
    assert bool(warn_repeated_anatomies([str(ckpt)], smaller, "train")) == bool(
        set(read_manifest(smaller)["splits"]["train"]) & train)


def test_scoring_on_subjects_that_selected_or_calibrated_the_model_is_named(tmp_path, tiny_dataset, perturbed_mar):
    """masc eval warns (log, results.json, table.md) when the provenance says the scored subjects
    selected the model (its validation) or calibrated its OOD rule, on the very same data set."""
    from masc_gadget.models.checkpoint import load_checkpoint, save_checkpoint
    from training.data import data_identity, load_split
    from training.evaluation.evaluate import warn_repeated_anatomies

    ck = load_checkpoint(perturbed_mar)
    val = sorted(set(load_split(tiny_dataset, "val").subjects))
    identity = {k: v for k, v in data_identity(tiny_dataset).items() if k != "train_anatomies"}
    touched = save_checkpoint(tmp_path / "touched.pt", ck.state_dicts, {
        **ck.metadata, "provenance": {"data": [identity], "subjects": {"val": val}},
        "ood": {"score": "residual", "threshold": 1.0, "calibrated_on": {"data": [
            {"manifest_sha256": identity["manifest_sha256"], "subjects": val}]}}})
    said = warn_repeated_anatomies([str(touched)], tiny_dataset, "val")
    assert len(said) == 2 and "selected it" in said[0] and "calibrated its OOD rule" in said[1]
    assert warn_repeated_anatomies([str(touched)], tiny_dataset, "test") == []  # other subjects: nothing to say
    assert warn_repeated_anatomies([str(perturbed_mar)], tiny_dataset, "val") == []
    # selected on another folder whose subjects share a name with these: nothing to say
    elsewhere = save_checkpoint(tmp_path / "elsewhere.pt", ck.state_dicts, {
        **ck.metadata, "provenance": {"data": [identity], "subjects": {"val": [*val, "sub-9999"]}}})
    assert warn_repeated_anatomies([str(elsewhere)], tiny_dataset, "val") == []
    named = save_checkpoint(tmp_path / "named.pt", ck.state_dicts, {
        **ck.metadata, "provenance": {"data": [identity], "subjects": {"val": [f"{tiny_dataset.name}/{val[0]}",
                                                                             f"other/{val[-1]}"]}}})
    (said,) = warn_repeated_anatomies([str(named)], tiny_dataset, "val")
    assert f"1 of the {len(val)} subjects" in said and val[0] in said


def test_every_shipped_model_keeps_its_promises_and_says_so():
    """A network that breaks a promise of masc check mar is not shipped (docs/mar-safety.md): each
    shipped model's provenance carries the check it passed, on the folders it is held to."""
    from masc_gadget.models.shipped import available, provenance

    for name in available():
        check = provenance(name).get("mar_check")
        assert check is not None, f"{name}: no masc check mar in its provenance"
        assert check["promises_kept"] is True and check["promised_on"], name
        for folder in check["promised_on"]:
            promises = check["folders"][folder]["promises"]
            assert promises["identity_ssim"]["value"] >= 0.98 and promises["noise_share"]["value"] >= 0.95, name
            assert all(promises[k]["kept"] for k in ("identity_ssim", "noise_share", "center_out")), name
