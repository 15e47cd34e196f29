"""Physics of the simulator against analytic solutions."""

import math

import numpy as np
import pytest
import torch

from masc_gadget.device import resolve_device
from sim_scanner.physics.grid import Grid
from sim_scanner.physics.field import (
    dipole_field_hz,
    fit_shim,
    sphere_field_analytic_hz,
    sphere_susceptibility,
)
from sim_scanner.physics.forward import (
    PhysicsConfig,
    object_grid,
    slice_profile,
    synthesize_kspace,
    tse_signal,
)
from sim_scanner.physics.sequence import GAMMA_BAR_HZ_PER_T, SequenceConfig


def ifft2c(k):
    return np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(k, axes=(-2, -1)), norm="ortho"), axes=(-2, -1))


@pytest.mark.parametrize("b0,chi", [(3.0, 900.0), (1.5, -20.0)])
def test_sphere_field_matches_analytic_dipole(b0, chi):
    grid = Grid((64, 64, 64), (1.0, 1.0, 1.0))
    radius = 6.0
    field = dipole_field_hz(sphere_susceptibility(grid, radius, chi), grid.voxel_mm, b0, padding=0.5)
    z, y, x = grid.axes_mm()
    analytic = sphere_field_analytic_hz(z, y, x, radius, chi, b0)
    r = np.sqrt(z**2 + y**2 + x**2)
    shell = (r > 1.5 * radius) & (r < 3.5 * radius)
    peak = np.abs(analytic[shell]).max()
    # on the z axis at 1.5 radii the field is chi/3 * 2 / 1.5^3 * gamma B0
    on_axis = sphere_field_analytic_hz(np.array(9.0), np.array(0.0), np.array(0.0), radius, chi, b0)
    assert float(on_axis) == pytest.approx(chi * 1e-6 / 3 * 2 / 1.5**3 * GAMMA_BAR_HZ_PER_T * b0, rel=1e-5)
    assert np.abs(field - analytic)[shell].max() / peak < 0.02
    # sign: positive chi gives a positive shift along B0 (z) and negative in the equatorial plane
    c = 32
    assert np.sign(field[c + 12, c, c]) == np.sign(chi)
    assert np.sign(field[c, c, c + 12]) == -np.sign(chi)
    # inside: Lorentz-corrected field is ~0 (partial volume at the edge aside)
    assert np.abs(field[r < 0.5 * radius]).max() < 0.02 * np.abs(field).max()


def test_dipole_field_of_list_equals_separate_calls():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 10, 12)).astype(np.float32)
    b = rng.standard_normal((8, 10, 12)).astype(np.float32)
    fa, fb = dipole_field_hz([a, b], (1.0, 2.0, 1.5), 3.0, padding=0.25)
    np.testing.assert_allclose(fa, dipole_field_hz(a, (1.0, 2.0, 1.5), 3.0, padding=0.25), atol=1e-3)
    # linearity
    fab = dipole_field_hz(a + b, (1.0, 2.0, 1.5), 3.0, padding=0.25)
    np.testing.assert_allclose(fab, fa + fb, atol=1e-2)


@pytest.mark.parametrize("transition", [0.0, 0.2, 0.5])
def test_slice_profile_samples_sum_to_thickness_over_spacing(transition):
    k = 4  # samples per thickness
    offsets = torch.linspace(-0.37, 0.41, 9, dtype=torch.float64)
    n = torch.arange(-20, 21, dtype=torch.float64)
    for off in offsets:
        total = slice_profile((n / k) - off, transition).sum()
        if transition == 0.0 and abs(float(off) * k * 2 % 1) < 1e-9:
            continue  # sample exactly on a hard edge
        assert float(total) == pytest.approx(k, abs=1e-9)


def _seq(**kw):
    base = dict(matrix=(32, 32), fov_mm=(160.0, 160.0), n_slices=3, slice_thickness_mm=4.0)
    base.update(kw)
    return SequenceConfig(**base)


def _phys(**kw):
    base = dict(inplane_oversampling=2, z_samples_per_slice=4, z_margin_mm=8.0, readout_margin_mm=20.0)
    base.update(kw)
    return PhysicsConfig(**base)


def _blob(grid, sigma=18.0, centre=(0.0, 0.0, 0.0)):
    z, y, x = grid.axes_mm()
    return np.exp(-((y - centre[1]) ** 2 + (x - centre[2]) ** 2) / (2 * sigma**2)
                  - (z - centre[0]) ** 2 / (2 * 40.0**2)).astype(np.float32) * np.ones(grid.shape, np.float32)


def test_no_offresonance_reproduces_the_object_on_the_image_grid():
    seq, phys = _seq(), _phys()
    grid = object_grid(seq, phys, (0.0, 0.0), 0.0)
    obj = _blob(grid)
    centres = [0.0 + o for o in seq.slice_offsets_mm()]
    k = synthesize_kspace(obj, np.zeros(grid.shape, np.float32), grid, seq, phys, centres)
    img = np.abs(ifft2c(k))
    # expected: the blob at the image pixel centres, weighted by the slice profile in z
    n = seq.n_readout
    px = seq.pixel_mm[0]
    xs = (np.arange(n) - (n - 1) / 2) * px
    zz = np.array(centres)[:, None, None]
    expected = np.exp(-(xs[None, :, None] ** 2 + xs[None, None, :] ** 2) / (2 * 18.0**2)
                      - zz**2 / (2 * 40.0**2))
    assert np.abs(img - expected).max() < 0.02 * expected.max()
    assert k.dtype == np.complex64 and k.shape == (3, 32, 32)


def test_uniform_offresonance_shifts_along_readout_by_df_over_bandwidth():
    seq, phys = _seq(), _phys()
    grid = object_grid(seq, phys, (0.0, 0.0), 0.0)
    obj = _blob(grid, sigma=10.0)
    centres = [0.0]
    ref = np.abs(ifft2c(synthesize_kspace(obj, np.zeros(grid.shape, np.float32), grid, seq, phys, centres)))
    # 3 pixels of readout shift; slice shift 3 * 710 / 1000 * 4 mm is harmless (blob is smooth in z)
    df = np.full(grid.shape, 3 * seq.readout_bw_hz_per_px, np.float32)
    shifted = np.abs(ifft2c(synthesize_kspace(obj, df, grid, seq, phys, centres)))
    zscale = math.exp(-(3 * 710 / 1000 * 4.0) ** 2 / (2 * 40.0**2))
    np.testing.assert_allclose(shifted[0], np.roll(ref[0], 3, axis=1) * zscale, atol=2e-3 * ref.max())


def test_uniform_offresonance_moves_the_excited_slice():
    # readout bandwidth so large that there is no in-plane shift; df = rf_bw moves the slice by
    # one thickness: slice at z sees the spins that sit at z - thickness
    seq = _seq(readout_bw_hz_per_px=1e9, rf_bw_hz=1000.0)
    phys = _phys(slice_profile_transition=0.0)
    grid = object_grid(seq, phys, (0.0, 0.0), 0.0)
    z, y, x = grid.axes_mm()
    layered = np.broadcast_to(((z > -6.0) & (z < -2.0)).astype(np.float32), grid.shape).copy()
    layered *= (np.abs(y) < 50) & (np.abs(x) < 50)
    centres = seq.slice_offsets_mm()  # -4, 0, 4
    still = np.abs(ifft2c(synthesize_kspace(layered, np.zeros(grid.shape, np.float32), grid, seq, phys, centres)))
    moved = np.abs(ifft2c(synthesize_kspace(layered, np.full(grid.shape, 1000.0, np.float32), grid, seq, phys, centres)))
    assert still[0].mean() > 0.5 * still[0].max() * 0.5 and still[1].mean() < 0.02 * still[0].mean()
    np.testing.assert_allclose(moved[1], still[0], atol=1e-3 * still.max())
    assert moved[0].mean() < 0.02 * still[0].mean()


def test_displacement_conserves_signal_and_makes_pileup_and_voids():
    seq, phys = _seq(), _phys()
    grid = object_grid(seq, phys, (0.0, 0.0), 0.0)
    z, y, x = grid.axes_mm()
    obj = np.broadcast_to(((np.abs(y) < 40) & (np.abs(x) < 40)).astype(np.float32), grid.shape).copy()
    # a dipole-like bump in the field: spins converge on one side and diverge on the other
    df = (2000.0 * np.exp(-(x**2 + y**2) / (2 * 8.0**2))).astype(np.float32) * np.ones(grid.shape, np.float32)
    centres = [0.0]
    zero = np.zeros(grid.shape, np.float32)
    ref = ifft2c(synthesize_kspace(obj, zero, grid, seq, phys, centres))
    dist = ifft2c(synthesize_kspace(obj, df, grid, seq, phys, centres))
    # total signal (k-space centre) is conserved when nothing leaves the FOV
    assert abs(dist.sum()) == pytest.approx(abs(ref.sum()), rel=1e-3)
    mag, ref_mag = np.abs(dist[0]), np.abs(ref[0])
    level = np.median(ref_mag[10:22, 10:22])  # the square spans pixels 8..23
    assert mag.max() > 1.5 * level  # pile-up
    assert mag[10:22, 10:22].min() < 0.5 * level  # void


def test_fit_shim_removes_a_linear_field():
    grid = Grid((6, 8, 10), (2.0, 3.0, 4.0), (5.0, -3.0, 1.0))
    z, y, x = grid.axes_mm()
    field = (12.0 + 0.5 * z - 2.0 * y + 3.0 * x) * np.ones(grid.shape, np.float32)
    mask = np.ones(grid.shape, bool)
    np.testing.assert_allclose(fit_shim(field, mask, grid, "linear"), field, atol=1e-3)
    np.testing.assert_allclose(fit_shim(field, mask, grid, "f0"), field.mean(), atol=1e-3)
    assert not fit_shim(field, mask, grid, "none").any()


def test_tse_signal_formula():
    s = tse_signal(np.array([0.8]), np.array([1000.0]), np.array([50.0]), 4050.0, 32.0)
    assert s[0] == pytest.approx(0.8 * (1 - math.exp(-4.05)) * math.exp(-32 / 50), rel=1e-6)


def test_object_grid_aligns_fine_and_image_pixel_centres():
    seq = _seq(matrix=(16, 12), fov_mm=(160.0, 120.0))
    phys = _phys(inplane_oversampling=3)
    grid = object_grid(seq, phys, (4.0, -8.0), 2.0)
    assert grid.voxel_mm[1:] == pytest.approx((10.0 / 3, 10.0 / 3))
    assert grid.shape[1] == 36
    # the FFT origin of the fine grid (index n/2) sits at the image grid's FFT origin
    ys = grid.axis_mm(1)
    image_origin_y = 4.0 + (12 / 2 - (12 - 1) / 2) * 10.0
    assert ys[grid.shape[1] // 2] == pytest.approx(image_origin_y, abs=1e-4)
    assert grid.voxel_mm[0] == pytest.approx(1.0)


def test_config_validation_and_device():
    with pytest.raises(ValueError, match="inplane_oversampling"):
        PhysicsConfig(inplane_oversampling=0)
    with pytest.raises(ValueError, match="te_ms"):
        SequenceConfig(te_ms=5000.0)
    with pytest.raises(ValueError, match="matrix"):
        SequenceConfig(matrix=(33, 32))
    assert resolve_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
