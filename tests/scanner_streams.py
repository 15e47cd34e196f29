"""A small 2D Cartesian stream (two slices of a smooth complex object) for the tests that rewrite
it as scanners record it (sim_scanner.dataset.streams.scanner_like)."""

import ismrmrd
import numpy as np

POSITION = (12.5, -30.0, 41.0)


def base_header(n_pe: int, n_ro: int, fov: tuple[float, float, float], slices: int = 2) -> str:
    """Encoded = recon space, one coil, ``slices`` slices; the k-space centre is line n_pe / 2."""
    space = (f"<matrixSize><x>{n_ro}</x><y>{n_pe}</y><z>1</z></matrixSize>"
             f"<fieldOfView_mm><x>{fov[0]}</x><y>{fov[1]}</y><z>{fov[2]}</z></fieldOfView_mm>")
    return (f"<?xml version='1.0'?><ismrmrdHeader xmlns='http://www.ismrm.org/ISMRMRD'>"
            f"<experimentalConditions><H1resonanceFrequency_Hz>127000000</H1resonanceFrequency_Hz>"
            f"</experimentalConditions><encoding><encodedSpace>{space}</encodedSpace>"
            f"<reconSpace>{space}</reconSpace><encodingLimits><kspace_encoding_step_1><minimum>0</minimum>"
            f"<maximum>{n_pe - 1}</maximum><center>{n_pe // 2}</center></kspace_encoding_step_1><slice>"
            f"<minimum>0</minimum><maximum>{slices - 1}</maximum><center>0</center></slice></encodingLimits>"
            f"<trajectory>cartesian</trajectory></encoding></ismrmrdHeader>")


def smooth_object(n_pe: int, n_ro: int, seed: int) -> np.ndarray:
    """A complex object inside the field of view, (y = PE, x = RO)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:n_pe, :n_ro]
    disc = ((y - n_pe / 2) / (0.4 * n_pe)) ** 2 + ((x - n_ro / 2) / (0.35 * n_ro)) ** 2 < 1
    return disc * (1 + 0.5 * rng.random((n_pe, n_ro))) * np.exp(0.3j * rng.standard_normal((n_pe, n_ro)))


def base_stream(n_pe: int, n_ro: int, fov: tuple[float, float, float], seed: int = 0, slices: int = 2):
    """(header XML, acquisitions): every line of every slice, linear, one coil."""
    acqs = []
    for s in range(slices):
        obj = smooth_object(n_pe, n_ro, seed + s)
        k = np.fft.fftshift(np.fft.fft2(np.fft.ifftshift(obj), norm="ortho")).astype(np.complex64)
        for line in range(n_pe):
            acq = ismrmrd.Acquisition.from_array(k[line][None].copy())
            acq.idx.slice, acq.idx.kspace_encode_step_1 = s, line
            head = acq.getHead()
            head.center_sample = n_ro // 2
            head.position[:] = POSITION[:2] + (POSITION[2] + 5 * s,)
            head.read_dir[:], head.phase_dir[:], head.slice_dir[:] = (0, 1, 0), (1, 0, 0), (0, 0, 1)
            acq.setHead(head)
            acqs.append(acq)
    return base_header(n_pe, n_ro, fov, slices), acqs
