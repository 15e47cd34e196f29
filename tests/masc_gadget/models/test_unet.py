"""MAR U-Net: architecture of the paper, any image size, identity at init, scale equivariance,
learns."""


import pytest
import torch
from torch import nn

from masc_gadget.config import ConfigError, from_dict
from masc_gadget.models import MarModelConfig, MarNet, UNet, build_mar, image_scale


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights everywhere (the head too, so r != 0) and non-trivial BatchNorm statistics."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * (2 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.1 * torch.randn(m.num_features, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
    return model.eval()


@pytest.mark.parametrize("shape", [(2, 1, 20, 28), (1, 1, 33, 17), (3, 1, 16, 16), (1, 1, 5, 7)])
def test_unet_preserves_shape_for_any_size(shape):
    net = randomise(UNet(width=4, depth=4))
    x = torch.rand(shape)
    with torch.no_grad():
        y = net(x)
    assert y.shape == x.shape
    assert torch.isfinite(y).all()


def test_unet_channels_in_and_out():
    net = UNet(in_channels=2, out_channels=3, width=4, depth=2)
    assert net(torch.rand(2, 2, 9, 11)).shape == (2, 3, 9, 11)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        net(torch.rand(2, 9, 11))


@pytest.mark.parametrize("shape", [(2, 20, 28), (2, 1, 20, 28), (1, 33, 17), (1, 1, 33, 17)])
def test_marnet_accepts_both_input_forms(shape):
    net = randomise(MarNet(width=4))
    x = torch.rand(shape)
    with torch.no_grad():
        y = net(x)
    assert y.shape == x.shape
    with torch.no_grad():  # the two forms give the same numbers
        other = net(x.unsqueeze(1) if x.dim() == 3 else x.squeeze(1))
    torch.testing.assert_close(other.reshape(y.shape), y)


@pytest.mark.parametrize("shape", [(2, 2, 8, 8), (2, 1, 1, 8, 8), (8, 8)])
def test_marnet_rejects_other_shapes(shape):
    with pytest.raises(ValueError, match=r"\(B, H, W\) or \(B, 1, H, W\)"):
        MarNet(width=4)(torch.rand(shape))


def test_paper_channel_counts_reach_1024():
    with torch.device("meta"):  # no memory, no forward needed
        net = UNet(width=64, depth=4)
    convs = lambda stage: [m for m in stage if isinstance(m, nn.Conv2d)]
    enc = [[(c.in_channels, c.out_channels) for c in convs(s)] for s in net.encoder]
    assert enc == [[(1, 64), (64, 64)], [(64, 128), (128, 128)], [(128, 256), (256, 256)],
                   [(256, 512), (512, 512)]]
    assert [(c.in_channels, c.out_channels) for c in convs(net.bottleneck)] == [(512, 1024), (1024, 1024)]
    dec = [[(c.in_channels, c.out_channels) for c in convs(s)] for s in net.decoder]
    assert dec == [[(1024 + 512, 512), (512, 512)], [(512 + 256, 256), (256, 256)],
                   [(256 + 128, 128), (128, 128)], [(128 + 64, 64), (64, 64)]]
    assert (net.head.in_channels, net.head.out_channels, net.head.kernel_size) == (64, 1, (1, 1))
    # every stage: two 3x3 conv + BatchNorm + ReLU
    for stage in [*net.encoder, net.bottleneck, *net.decoder]:
        kinds = [type(m) for m in stage]
        assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU] * 2
        assert all(c.kernel_size == (3, 3) for c in convs(stage))
    n_params = sum(p.numel() for p in net.parameters())
    assert 31e6 < n_params < 32e6


def test_identity_at_init_and_when_head_is_zero():
    torch.manual_seed(0)
    net = MarNet(width=4)
    x = 100 * torch.rand(3, 20, 28)
    for mode in (net.train, net.eval):
        mode()
        with torch.no_grad():
            assert torch.equal(net(x), x)
    randomise(net, seed=1)
    with torch.no_grad():
        assert not torch.allclose(net(x), x)
        net.residual.head.weight.zero_()
        net.residual.head.bias.zero_()
        assert torch.equal(net(x), x)
        assert torch.equal(net(x.unsqueeze(1)), x.unsqueeze(1))


@pytest.mark.parametrize("c", [1e-3, 0.37, 5.0, 2e4])
def test_marnet_is_scale_equivariant(c):
    net = randomise(MarNet(width=4, depth=3), seed=2)
    x = torch.rand(2, 1, 33, 17) ** 2
    with torch.no_grad():
        y = net(x)
        yc = net(c * x)
    assert not torch.allclose(y, x, atol=1e-2)  # the residual is not trivial
    torch.testing.assert_close(yc / c, y, rtol=1e-4, atol=1e-5)


def test_image_scale_is_the_per_image_quantile():
    x = torch.rand(3, 1, 20, 28)
    x[1] *= 7.0
    s = image_scale(x, 0.99)
    assert s.shape == (3, 1, 1, 1)
    expected = torch.quantile(x.flatten(1), 0.99, dim=1)
    torch.testing.assert_close(s.flatten(), expected)
    # the partial selection gives torch.quantile's linear interpolation at any q and size
    gen = torch.Generator().manual_seed(0)
    for q in (1.0, 0.999, 0.9, 0.5, 0.01, 1e-6):
        for shape in ((2, 1, 1, 1), (2, 1, 1, 2), (4, 1, 7, 9), (2, 1, 64, 64)):
            y = torch.rand(shape, generator=gen) + 0.1
            torch.testing.assert_close(image_scale(y, q).flatten(),
                                       torch.quantile(y.flatten(1), q, dim=1))
    # mostly-zero image: falls back to the maximum; all-zero image: no NaN
    sparse = torch.zeros(2, 1, 20, 20)
    sparse[0, 0, 3, 4] = 5.0
    s = image_scale(sparse, 0.99).flatten()
    assert s[0] == 5.0 and 0 < s[1] < 1e-30
    out = MarNet(width=4)(sparse)
    assert torch.isfinite(out).all()


def test_batch_items_are_independent_in_eval_mode():
    net = randomise(MarNet(width=4), seed=3)
    x = torch.rand(3, 1, 20, 28)
    x[2] *= 50
    with torch.no_grad():
        whole = net(x)
        parts = torch.cat([net(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)


def test_overfits_a_tiny_batch():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        yy, xx = torch.meshgrid(torch.arange(24.0), torch.arange(24.0), indexing="ij")
        clean = torch.stack([
            0.5 + 0.4 * torch.sin(xx / (2 + k)) * torch.cos(yy / (3 + k)) for k in range(4)
        ]).unsqueeze(1)
        artifact = torch.zeros_like(clean)
        for k in range(4):  # a bright pile-up and a signal void near a "metal" spot per image
            cy, cx = torch.randint(6, 18, (2,), generator=gen).tolist()
            artifact[k, 0, cy - 2 : cy + 2, cx + 2 : cx + 4] += 0.8
            artifact[k, 0, cy - 3 : cy + 3, cx - 2 : cx + 2] -= 0.4
        metal = (clean + artifact).clamp_min(0)
        net = MarNet(width=8)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        losses = []
        for _ in range(150):
            loss = torch.mean((net(metal) - clean) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])


def test_config_defaults_validation_and_build():
    cfg = MarModelConfig()
    assert (cfg.width, cfg.depth, cfg.scale_quantile) == (64, 4, 0.99)
    for kwargs, name in [({"width": 0}, "width"), ({"depth": 0}, "depth"), ({"width": 8.0}, "width"),
                         ({"scale_quantile": 0.0}, "scale_quantile"),
                         ({"scale_quantile": 1.5}, "scale_quantile")]:
        with pytest.raises(ValueError, match=name):
            MarModelConfig(**kwargs)
    with pytest.raises(ConfigError, match="mar_model.chans"):
        from_dict(MarModelConfig, {"chans": 32}, "mar_model")
    with pytest.raises(ConfigError, match="mar_model.width"):
        from_dict(MarModelConfig, {"width": "wide"}, "mar_model")
    net = build_mar(from_dict(MarModelConfig, {"width": 8, "depth": 3, "scale_quantile": 0.95}, "mar_model"))
    assert isinstance(net, MarNet) and net.config == MarModelConfig(8, 3, 0.95)
    assert net.residual.bottleneck[0].out_channels == 64 and len(net.residual.encoder) == 3


def test_models_do_not_import_ismrmrd_or_training():
    import pathlib

    from masc_gadget import models

    for path in pathlib.Path(models.__file__).parent.glob("*.py"):
        text = path.read_text()
        for banned in ("ismrmrd", "sim_scanner", "training"):
            assert f"import {banned}" not in text and f"from {banned}" not in text, (path, banned)


# --- benchmark ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_marnet_cuda_matches_cpu():
    net = randomise(MarNet(width=8), seed=4)
    x = torch.rand(2, 1, 33, 17)
    with torch.no_grad():
        cpu = net(x)
        gpu = net.cuda()(x.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_torch_compile_handles_changing_sizes():
    """Dynamic-shape recompilation (seen on torch 2.13: a Python ``%`` on a symbolic size broke
    inductor); ~1 min on 2 CPU cores."""
    net = randomise(MarNet(width=4, depth=2), seed=5)
    compiled = torch.compile(net)
    with torch.no_grad():
        for shape in [(1, 1, 16, 16), (2, 1, 33, 17), (1, 1, 20, 28)]:
            x = torch.rand(shape)
            torch.testing.assert_close(compiled(x), net(x), rtol=1e-4, atol=1e-4)


def test_channels_last_default_and_nchw_layouts_agree():
    net = randomise(MarNet(width=4, depth=2), seed=5).eval()
    conv = net.residual.encoder[0][0].weight
    assert net.residual.memory_format == torch.channels_last
    assert conv.is_contiguous(memory_format=torch.channels_last)
    nchw = MarNet(width=4, depth=2)
    nchw.residual.set_memory_format(torch.contiguous_format)
    nchw.load_state_dict(net.state_dict())
    nchw.eval()
    assert nchw.residual.encoder[0][0].weight.is_contiguous()
    x = torch.rand(3, 1, 20, 28)
    with torch.no_grad():
        y = net(x)
        assert y.is_contiguous()
        torch.testing.assert_close(y, nchw(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="memory_format"):
        net.residual.set_memory_format(torch.preserve_format)
