"""Multi-coil datasets: the body array, correlated noise, the single-coil data unchanged, and a
closed-loop scan of the multi-coil test split through masc serve."""

import numpy as np
import pytest

from masc_gadget.config import load_config
from masc_gadget.serving.server import MascServer
from sim_scanner.dataset.layout import read_scan_input, split_files
from sim_scanner.dataset.simulate import simulate_dataset
from sim_scanner.physics.coils import body_array, correlated_noise, noise_covariance
from sim_scanner.scanner.session import run_scan
from training.data import load_split

from tests.conftest import CONFIGS


def test_body_array_is_normalised_and_the_noise_correlated():
    sens = body_array(8, (48, 40), (300.0, 250.0))
    assert sens.shape == (8, 48, 40)
    np.testing.assert_allclose((np.abs(sens) ** 2).sum(axis=0), 1.0, rtol=1e-5)
    # each element is brightest on its own side of the body
    peaks = {np.unravel_index(np.argmax(np.abs(s)), s.shape) for s in sens}
    assert len(peaks) == 8
    psi = noise_covariance(8, 0.4)
    assert psi[0, 1] == pytest.approx(0.4) and psi[0, 7] == pytest.approx(0.4) and psi[0, 4] == pytest.approx(0.4**4)
    noise = correlated_noise((4000, 8, 1, 1), psi, 2.0, np.random.default_rng(0))[..., 0, 0]
    empirical = (noise.T @ noise.conj()).real / len(noise)
    np.testing.assert_allclose(empirical, 4.0 * psi, atol=0.25)


def test_scanner_like_streams_use_the_simulators_array_and_noise():
    """One receive model: a scanner-like stream's channels are the body array's maps times the
    image, and its noise has the simulator's covariance (ring distance, E|n|^2 = sigma^2)."""
    from masc_gadget.core.kspace import fft2c, ifft2c
    import torch
    from sim_scanner.dataset.streams import StreamStyle, styled_kspace

    rng = np.random.default_rng(3)
    image = rng.normal(size=(1, 24, 20)) + 1j * rng.normal(size=(1, 24, 20))
    kspace = fft2c(torch.from_numpy(image)).numpy()[None]  # (1 slice, 1 coil, 24, 20)
    fov = (240.0, 200.0)
    out = styled_kspace(kspace, StreamStyle(coils=8), rng, fov)[0]
    channels = ifft2c(torch.from_numpy(out.astype(np.complex128))).numpy()
    np.testing.assert_allclose(channels, body_array(8, (24, 20), fov) * image, atol=1e-5)
    silent = styled_kspace(np.zeros((1, 1, 32, 32), np.complex64), StreamStyle(coils=8, noise=2.0,
                                                                                noise_correlation=0.4), rng, fov)[0]
    samples = silent.reshape(8, -1).T
    empirical = (samples.T @ samples.conj()).real / len(samples)
    np.testing.assert_allclose(empirical, 4.0 * noise_covariance(8, 0.4), atol=0.3)


@pytest.fixture(scope="module")
def multicoil(tmp_path_factory):
    base = tmp_path_factory.mktemp("coils")
    single = load_config(CONFIGS / "tiny.yaml", ["dataset.subjects=2", "dataset.split_fractions=[0.5, 0.0, 0.5]"])
    array = load_config(CONFIGS / "tiny.yaml", ["dataset.subjects=2", "dataset.split_fractions=[0.5, 0.0, 0.5]",
                                                "physics.coils=4", "physics.coil_correlation=0.3"])
    simulate_dataset(single, base / "single", progress=False)
    simulate_dataset(array, base / "array", progress=False)
    return base / "single", base / "array"


def test_the_array_sends_multi_coil_lines_and_leaves_the_single_coil_data_alone(multicoil):
    single, array = multicoil
    a, b = load_split(single, "test"), load_split(array, "test")
    assert np.array_equal(a.kspace_metal.numpy(), b.kspace_metal.numpy())  # training data unchanged
    scan = read_scan_input(split_files(array, "test")[0])
    assert scan.kspace.shape[:2] == (4, 4)  # 4 slices x 4 coils
    assert read_scan_input(split_files(single, "test")[0]).kspace.shape[1] == 1
    coil_images = np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(scan.kspace, axes=(-2, -1)), norm="ortho"),
                                  axes=(-2, -1))
    rss = np.sqrt((np.abs(coil_images) ** 2).sum(axis=1))
    np.testing.assert_allclose(rss, b.metal_image.numpy(), atol=1e-4 * float(rss.max()))  # noiseless tiny config


@pytest.mark.parametrize("combine", ["rss", "sensitivity"])
def test_multi_coil_test_split_scans_in_closed_loop(multicoil, tmp_path, combine):
    _, array = multicoil
    server = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", f"gadget.coil_combine={combine}"]),
                        address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        scan_config = load_config(CONFIGS / "tiny.yaml", [f"scanner.server=127.0.0.1:{port}", "scanner.feedback=inband",
                                                          "scanner.deadline_ms=2000", "acquisition.policy=equispaced", "scanner.policy=equispaced"])
        report = run_scan(scan_config, array, "test", tmp_path / "scan", progress=False)
    finally:
        server.shutdown()
    assert report.totals.fallbacks == 0 and report.totals.connections_lost == 0
    for subject in report.subjects:
        for sl in subject.slices:
            assert sl.sources == ["initial"] + ["gadget"] * 2 and sl.image_source == "gadget"
            # the gadget's combined image scores as the scanner's root-sum-of-squares of the same lines
            assert sl.metrics["ssim"] == pytest.approx(sl.zero_filled_metrics["ssim"], abs=1e-3)
