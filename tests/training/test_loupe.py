"""The learned fixed mask (LOUPE-style): exact budget, differentiable image, joint training,
played as a fixed order with its own MAR network."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.acquisition.learned import load_learned
from masc_gadget.acquisition.policies import FixedOrder
from masc_gadget.config import load_config
from masc_gadget.core.kspace import to_hybrid, zero_filled
from masc_gadget.models.checkpoint import load_checkpoint
from masc_gadget.serving.gadget import GadgetSettings
from masc_gadget.serving.models import ModelCache, load_models
from training.evaluation.evaluate import evaluate
from training.loupe import LoupeConfig, LoupeMask, soft_zero_filled, train_loupe

from tests.conftest import CONFIGS


def test_every_draw_keeps_the_exact_budget_and_the_centre_lines():
    gen = torch.Generator().manual_seed(0)
    mask = LoupeMask(64, 4, 9, generator=gen)
    draws = mask.sample(200, gen)
    assert torch.equal(draws.detach().sum(dim=1), torch.full((200,), 13.0))
    assert set(torch.unique(draws.detach()).tolist()) == {0.0, 1.0}
    assert (draws[:, torch.from_numpy(initial_lines(64, 4))] == 1).all()
    # the deployed mask: the budget's largest logits, never a centre line
    order = mask.order()
    assert len(order) == 9 and len(set(order)) == 9 and not set(order) & set(initial_lines(64, 4).tolist())
    assert int(mask.mask().sum()) == 13
    # the draws differ (a relaxed Bernoulli sampler, not a fixed top-k), and gradients reach the logits
    assert len({tuple(d.nonzero().flatten().tolist()) for d in draws.detach()}) > 10
    draws.sum(dim=0).pow(2).sum().backward()
    assert mask.logits.grad is not None and mask.logits.grad.abs().sum() > 0


def test_soft_image_equals_the_zero_filled_image_for_a_binary_mask():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(3, 16, 10, generator=gen, dtype=torch.float64) + 1j * torch.randn(3, 16, 10, generator=gen,
                                                                                     dtype=torch.float64)
    m = torch.rand(3, 16, generator=gen) < 0.4
    assert torch.allclose(soft_zero_filled(to_hybrid(k), m.double()), zero_filled(k, m), atol=1e-10)


def test_config_is_checked():
    with pytest.raises(ValueError, match="temperature"):
        LoupeConfig(temperature=0)


def test_learned_mask_trains_jointly_and_plays_as_a_fixed_order(tiny_dataset, tmp_path, perturbed_mar,
                                                                global_rng_guard):
    config = load_config(CONFIGS / "tiny.yaml", ["loupe.epochs=3", "loupe.run.device=cpu", "loupe.batch_size=4"])
    out = tmp_path / "loupe.pt"
    best = train_loupe(config, tiny_dataset, perturbed_mar, out, progress=False)
    assert np.isfinite(best["ssim"])
    policy, mar, meta = load_learned(out, "cpu")
    assert isinstance(policy, FixedOrder) and policy.name == "loupe" and mar is not None
    acq = config["acquisition"]
    assert len(meta["order"]) == acq.budget and len(meta["probabilities"]) == 32
    # the MAR network was trained with the mask
    before = load_checkpoint(perturbed_mar).state_dicts["mar"]
    after = load_checkpoint(out).state_dicts["mar"]
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    results, _ = evaluate(load_config(CONFIGS / "tiny.yaml", ["eval.accelerations={10x: [1, 2]}"]), tiny_dataset,
                          "test", ["loupe", "center-out"], perturbed_mar, progress=False, checkpoint=str(out))
    row = next(r for r in results["accelerations"]["10x"]["rows"] if r["key"] == "loupe")
    lines = np.array(row["lines"])
    assert (lines[:, 1:] == np.array(meta["order"])).all()  # the same lines on every slice
    models = load_models(GadgetSettings(policy="loupe", policy_checkpoint=str(out), device="cpu"), ModelCache())
    assert models.policy.name == "loupe" and models.mar is not None  # it brings its own MAR network
    # resume continues the epochs
    more = load_config(CONFIGS / "tiny.yaml", ["loupe.epochs=4", "loupe.run.device=cpu", "loupe.batch_size=4"])
    train_loupe(more, tiny_dataset, perturbed_mar, out, resume=tmp_path / "loupe.last.pt", progress=False)
    assert len((tmp_path / "loupe.csv").read_text().splitlines()) == 5
