"""What a scanner sends, reconstructed as Gadgetron's Cartesian chain does: readout oversampling
removed, asymmetric echoes and partial Fourier zero-filled, lines placed by the header's centre,
and image headers that describe the pixels returned. Checked against a numpy reference of the
same steps, written here from the ISMRMRD fields alone."""

import ismrmrd
import numpy as np
import pytest

from masc_gadget.mrd.header import encoding_geometry, parse_header
from masc_gadget.serving.gadget import GadgetSettings, process
from sim_scanner.dataset.streams import StreamStyle, scanner_like

from tests.scanner_streams import POSITION, base_header, base_stream, smooth_object

N_PE, N_RO, FOV = 32, 40, (200.0, 250.0, 5.0)


def _base_header() -> str:
    return base_header(N_PE, N_RO, FOV)


def _object(seed: int) -> np.ndarray:
    return smooth_object(N_PE, N_RO, seed)


def _base_stream(seed: int = 0):
    return base_stream(N_PE, N_RO, FOV, seed)


def reference_image(header_xml: str, acqs: list, slice_index: int) -> np.ndarray:
    """Independent numpy reference of the Cartesian chain for one slice: per line, remove the
    readout oversampling (centred inverse FFT over the line, keep the centre n / ratio samples,
    FFT back), put center_sample on the recon grid's centre, put line + (n_pe / 2 - centre) in
    its row; then the 2D centred inverse FFT per coil and the root-sum-of-squares."""
    header = parse_header(header_xml)
    enc = header.encoding[0]
    ratio = enc.encodedSpace.fieldOfView_mm.x / enc.reconSpace.fieldOfView_mm.x
    nx, ny = int(enc.reconSpace.matrixSize.x), int(enc.encodedSpace.matrixSize.y)
    shift = ny // 2 - int(enc.encodingLimits.kspace_encoding_step_1.center)
    grid = None
    for acq in acqs:
        if int(acq.idx.slice) != slice_index:
            continue
        data = np.asarray(acq.data, dtype=np.complex128)
        centre = int(acq.getHead().center_sample)
        if ratio != 1:
            m = data.shape[1]
            keep = int(m / ratio)
            img = np.fft.fftshift(np.fft.ifft(np.fft.ifftshift(data, axes=1), axis=1, norm="ortho"), axes=1)
            img = img[:, (m - keep) // 2:(m - keep) // 2 + keep]
            data = np.fft.fftshift(np.fft.fft(np.fft.ifftshift(img, axes=1), axis=1, norm="ortho"), axes=1)
            centre = int(centre / ratio)
        if grid is None:
            grid = np.zeros((data.shape[0], ny, nx), np.complex128)
        start = nx // 2 - centre if data.shape[1] != nx else 0
        grid[:, int(acq.idx.kspace_encode_step_1) + shift, start:start + data.shape[1]] = data
    coil_images = np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(grid, axes=(1, 2)), norm="ortho"), axes=(1, 2))
    return np.sqrt((np.abs(coil_images) ** 2).sum(axis=0))


def _gadget(header_xml, acqs):
    sent, errors = [], []
    stats = process(iter(acqs), parse_header(header_xml),
                    GadgetSettings(policy="center-out", initial=2, budget=3, device="cpu"), sent.append,
                    on_error=errors.append)
    return stats, {im.slice: im for im in sent if isinstance(im, ismrmrd.Image)}, errors


STYLES = {
    "2x oversampling, 2 coils": StreamStyle(readout_oversampling=2, coils=2),
    "2x oversampling, asymmetric echo, reverse": StreamStyle(readout_oversampling=2, asymmetric_echo=0.2,
                                                             order="reverse"),
    "partial Fourier 5/8, centric, 4 coils": StreamStyle(partial_fourier=0.625, order="centric", coils=4),
    "8 correlated noisy coils, interleaved, mask of one channel": StreamStyle(
        readout_oversampling=2, coils=8, noise=0.01, noise_correlation=0.4, order="interleaved",
        channel_mask="first"),
}


@pytest.mark.parametrize("name", list(STYLES))
def test_a_scanners_stream_is_reconstructed_as_the_cartesian_chain_does(name):
    header_xml, acqs = scanner_like(*_base_stream(), STYLES[name], np.random.default_rng(1))
    stats, images, errors = _gadget(header_xml, acqs)
    assert errors == [] and stats["rejected"] == 0 and sorted(images) == [0, 1]
    for s, image in images.items():
        pixels = image.data[0, 0]
        # recon space: the oversampling is gone, pixels of FOV / matrix mm in both directions
        assert pixels.shape == (N_PE, N_RO)
        assert tuple(image.matrix_size) == (N_RO, N_PE, 1)
        assert tuple(image.field_of_view) == pytest.approx(FOV)
        assert tuple(image.position) == pytest.approx((*POSITION[:2], POSITION[2] + 5 * s))
        assert tuple(image.read_dir) == (0, 1, 0) and tuple(image.phase_dir) == (1, 0, 0)
        reference = reference_image(header_xml, acqs, s)
        nmse = float(((pixels - reference) ** 2).sum() / (reference ** 2).sum())
        assert nmse < 1e-8, (name, s, nmse)
        lines = image.meta["MASC.lines"]
        assert sorted(int(v) for v in lines) == sorted({int(a.idx.kspace_encode_step_1) for a in acqs
                                                        if int(a.idx.slice) == s})


def test_oversampling_removal_returns_the_objects_pixels():
    """Without noise, truncation or partial Fourier, the reconstruction of the 2x-oversampled
    stream is the object itself, at the simulator's grid."""
    header_xml, acqs = scanner_like(*_base_stream(), StreamStyle(readout_oversampling=2), np.random.default_rng(0))
    geometry = encoding_geometry(header_xml)
    assert (geometry.n_readout, geometry.grid_readout, geometry.readout_ratio) == (2 * N_RO, N_RO, 2.0)
    _, images, _ = _gadget(header_xml, acqs)
    np.testing.assert_allclose(images[0].data[0, 0], np.abs(_object(0)), rtol=1e-4, atol=1e-5)


def test_a_line_that_does_not_fit_the_grid_is_rejected_by_name():
    header_xml, acqs = _base_stream()
    head = acqs[3].getHead()
    head.center_sample = 2  # a short line whose centre would start before the grid
    short = ismrmrd.Acquisition(head, data=np.asarray(acqs[3].data)[:, :30].copy())
    stats, images, errors = _gadget(header_xml, [*acqs[:3], short, *acqs[4:]])
    assert stats["rejected"] == 1 and "does not fit the reconstruction grid" in errors[0]
    assert sorted(images) == [0, 1]


def test_phase_oversampling_is_cut_to_the_recon_field_of_view():
    """Encoded 32 lines over 250 mm, recon 16 over 125 mm: the centre 16 rows, 125 mm."""
    header_xml, acqs = _base_stream()
    header_xml = header_xml.replace(f"<reconSpace><matrixSize><x>{N_RO}</x><y>{N_PE}</y>",
                                    f"<reconSpace><matrixSize><x>{N_RO}</x><y>{N_PE // 2}</y>")
    header_xml = header_xml.replace(f"<y>{FOV[1]}</y><z>{FOV[2]}</z></fieldOfView_mm></reconSpace>",
                                    f"<y>{FOV[1] / 2}</y><z>{FOV[2]}</z></fieldOfView_mm></reconSpace>")
    _, images, errors = _gadget(header_xml, acqs)
    full = reference_image(_base_header(), acqs, 0)
    assert errors == [] and images[0].data.shape[-2:] == (N_PE // 2, N_RO)
    assert tuple(images[0].field_of_view) == pytest.approx((FOV[0], FOV[1] / 2, FOV[2]))
    np.testing.assert_allclose(images[0].data[0, 0], full[N_PE // 4:N_PE // 4 + N_PE // 2], rtol=1e-4, atol=1e-5)
