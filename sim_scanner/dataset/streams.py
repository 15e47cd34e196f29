"""Scanner-like ISMRMRD streams from a simulated one: what real scanners send, on request.

The simulator writes one line per phase-encoding step, sampled exactly over the image's field of
view, in acquisition order 0..n-1 per slice, through one or a few receive coils. Real scanners
send more than that, and a reconstruction must cope with all of it. :func:`scanner_like`
rewrites a stream (header + acquisitions) the way a scanner would have recorded the same slices:

* ``readout_oversampling``: 2 samples the readout over twice the field of view (Siemens and GE
  default): the encoded space is 2n x n_pe over 2 FOV_x, the recon space n x n_pe over FOV_x;
* ``coils``: the simulator's receive array (:func:`sim_scanner.physics.coils.body_array`: N
  loops on an ellipse around the field of view, normalised to a root-sum-of-squares of 1, so
  the combined image is the original one);
* ``noise`` and ``noise_correlation``: the simulator's receive-chain noise
  (:func:`sim_scanner.physics.coils.correlated_noise`): complex Gaussian of that standard
  deviation per sample (``E|n|^2 = noise^2``), correlated between neighbouring elements of the
  ring (covariance ``rho^(ring distance)``);
* ``order``: the lines of each slice ``linear`` (0..n-1), ``reverse``, ``centric`` (centre out,
  alternating) or ``interleaved`` (even lines, then odd ones);
* ``asymmetric_echo``: drop this fraction of the readout samples before the echo (the centre
  sample then sits ``that many`` samples from the line's start: ``center_sample`` says where);
* ``partial_fourier``: acquire only this fraction of the phase-encoding lines, the top ones
  (the header's encoding limits say which; the k-space centre stays line ``n_pe // 2``);
* ``channel_mask``: ``set`` (one bit per carried channel, as most scanners), ``none`` (no bit:
  the row count says) or ``first`` (only channel 0's bit, as some converters write).

Everything is drawn from the generator passed in. No physics here: it works on any stream whose
acquisitions hold one full line per phase-encoding step.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import h5py
import ismrmrd
import torch
import ismrmrd.xsd as xsd
import numpy as np

from masc_gadget.core.kspace import fft2c, ifft2c
from masc_gadget.mrd.header import parse_header, serialize_header
from sim_scanner.physics.coils import body_array, correlated_noise, noise_covariance

__all__ = ["ORDERS", "StreamStyle", "field_of_view_mm", "line_order", "read_stream", "scanner_like",
           "styled_acquisition", "styled_header", "styled_kspace", "write_stream"]

ORDERS = ("linear", "reverse", "centric", "interleaved")
"""The line orders of :func:`line_order`."""

CHANNEL_MASKS = ("set", "none", "first")


@dataclass(frozen=True)
class StreamStyle:
    """How the rewritten stream is recorded (module docstring)."""

    readout_oversampling: int = 1
    """1 (none) or 2: samples per readout over 2x the field of view."""
    coils: int = 0
    """Receive coils; 0 keeps the stream's own channels."""
    noise: float = 0.0
    """Standard deviation of the complex noise per sample (``E|n|^2 = noise^2``, the simulator's
    definition)."""
    noise_correlation: float = 0.0
    """Correlation of the noise of neighbouring channels, in [0, 1)."""
    order: str = "linear"
    """Line order per slice: linear, reverse, centric or interleaved."""
    asymmetric_echo: float = 0.0
    """Fraction of the readout samples before the echo that are not acquired, in [0, 0.5)."""
    partial_fourier: float = 1.0
    """Fraction of the phase-encoding lines acquired (the top ones), in (0.5, 1]."""
    channel_mask: str = "set"
    """set, none or first."""

    def __post_init__(self) -> None:
        if self.readout_oversampling not in (1, 2):
            raise ValueError(f"readout_oversampling must be 1 or 2, got {self.readout_oversampling}")
        if not 0 <= self.coils <= 64:
            raise ValueError(f"coils must be in [0, 64], got {self.coils}")
        if self.noise < 0 or not 0 <= self.noise_correlation < 1:
            raise ValueError(f"noise must be >= 0 and noise_correlation in [0, 1), got {self.noise}, "
                             f"{self.noise_correlation}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if not 0 <= self.asymmetric_echo < 0.5:
            raise ValueError(f"asymmetric_echo must be in [0, 0.5), got {self.asymmetric_echo}")
        if not 0.5 < self.partial_fourier <= 1:
            raise ValueError(f"partial_fourier must be in (0.5, 1], got {self.partial_fourier}")
        if self.channel_mask not in CHANNEL_MASKS:
            raise ValueError(f"channel_mask must be one of {', '.join(CHANNEL_MASKS)}, got {self.channel_mask!r}")


def line_order(n_pe: int, order: str, lines: Sequence[int] | None = None) -> list[int]:
    """The acquisition order of ``lines`` (default: 0..n_pe-1) in a named order (module docstring)."""
    lines = sorted(range(n_pe) if lines is None else lines)
    if order == "linear":
        return lines
    if order == "reverse":
        return lines[::-1]
    if order == "centric":
        return sorted(lines, key=lambda line: (abs(line - n_pe // 2), line < n_pe // 2))
    if order == "interleaved":
        return [line for line in lines if line % 2 == 0] + [line for line in lines if line % 2 == 1]
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


def field_of_view_mm(header_xml: str) -> tuple[float, float]:
    """(phase encoding, readout) field of view of a header's encoded space, mm."""
    fov = parse_header(header_xml).encoding[0].encodedSpace.fieldOfView_mm
    return float(fov.y), float(fov.x)


def _slices(acquisitions: Sequence[ismrmrd.Acquisition], n_pe: int, n_ro: int
            ) -> dict[int, tuple[ismrmrd.AcquisitionHeader, np.ndarray]]:
    """Per slice: the header of its first line and its (coils, n_pe, n_ro) k-space."""
    out: dict[int, tuple[ismrmrd.AcquisitionHeader, np.ndarray]] = {}
    for acq in acquisitions:
        s, line = int(acq.idx.slice), int(acq.idx.kspace_encode_step_1)
        data = np.asarray(acq.data)
        if data.ndim != 2 or data.shape[1] != n_ro or not 0 <= line < n_pe:
            raise ValueError(f"slice {s} line {line}: expected (coils, {n_ro}) samples of a line in [0, {n_pe}), "
                             f"got {data.shape}")
        if s not in out:
            out[s] = (acq.getHead(), np.zeros((data.shape[0], n_pe, n_ro), np.complex64))
        out[s][1][:, line] = data
    return out


def _kept_lines(n_pe: int, style: StreamStyle) -> list[int]:
    """The phase-encoding lines acquired: all, or the top ``partial_fourier`` of them."""
    count = max(n_pe // 2 + 1, int(round(style.partial_fourier * n_pe)))
    return list(range(n_pe - count, n_pe))


def styled_kspace(kspace: np.ndarray, style: StreamStyle, rng: np.random.Generator,
                  fov_mm: tuple[float, float] | None = None) -> np.ndarray:
    """(S, C, n_pe, n_ro) k-space of S slices -> (S, C', n_pe, n_ro x oversampling) complex64 as the
    scanner's receive array records it: the same pixels in the middle of the oversampled field
    of view, through ``style.coils`` elements of the simulator's body array placed around the
    (phase, readout) field of view ``fov_mm`` (None: 1 mm pixels; C' = C when 0), plus the
    simulator's correlated noise."""
    n_slices, own, n_pe, n_ro = kspace.shape
    coils = style.coils or own
    n_out = n_ro * style.readout_oversampling
    maps = body_array(coils, (n_pe, n_ro), fov_mm or (float(n_pe), float(n_ro))) if style.coils else None
    cov = noise_covariance(coils, style.noise_correlation)
    out = np.zeros((n_slices, coils, n_pe, n_out), np.complex64)
    for s in range(n_slices):
        image = ifft2c(torch.from_numpy(kspace[s].astype(np.complex128))).numpy()  # (own coils, n_pe, n_ro)
        if maps is not None:
            combined = image[0] if own == 1 else np.sqrt((np.abs(image) ** 2).sum(0)) * np.exp(1j * np.angle(image[0]))
            image = maps * combined[None]
        if style.readout_oversampling == 2:  # the object in the middle of twice the field of view
            pad = np.zeros((*image.shape[:-1], n_out), np.complex128)
            pad[..., n_ro // 2:n_ro // 2 + n_ro] = image
            image = pad
        k = fft2c(torch.from_numpy(image)).numpy()
        if style.noise > 0:
            k = k + correlated_noise((coils, n_pe, n_out), cov, style.noise, rng)
        out[s] = k
    return out


def styled_acquisition(template: ismrmrd.AcquisitionHeader, line_samples: np.ndarray, style: StreamStyle
                       ) -> ismrmrd.Acquisition:
    """One line of :func:`styled_kspace` (``(coils, n)`` samples) as the scanner sends it: the
    ``template`` header (geometry, idx, flags, counters) with its samples, the asymmetric echo's
    first samples left out (``center_sample`` says where the echo is) and the channel mask
    written in ``style.channel_mask``'s way."""
    n = line_samples.shape[-1]
    skip = int(round(style.asymmetric_echo * n))
    data = np.ascontiguousarray(line_samples[:, skip:], dtype=np.complex64)
    head = ismrmrd.AcquisitionHeader.from_buffer_copy(template)
    head.number_of_samples = data.shape[1]
    head.center_sample = n // 2 - skip
    head.active_channels = head.available_channels = data.shape[0]
    words = [0] * len(head.channel_mask)
    for channel in {"set": range(data.shape[0]), "none": (), "first": (0,)}[style.channel_mask]:
        words[channel // 64] |= 1 << (channel % 64)
    head.channel_mask[:] = words
    return ismrmrd.Acquisition(head, data=data)


def styled_header(header_xml: str, style: StreamStyle, coils: int) -> str:
    """The header of the styled stream: encoded space over the oversampled readout, recon space
    the original one, phase-encoding limits of the lines acquired, ``coils`` receiver channels."""
    header = parse_header(header_xml)
    encoding = header.encoding[0]
    recon = encoding.encodedSpace
    n_ro, n_pe = int(recon.matrixSize.x), int(recon.matrixSize.y)
    encoded = xsd.encodingSpaceType(
        matrixSize=xsd.matrixSizeType(x=n_ro * style.readout_oversampling, y=n_pe, z=recon.matrixSize.z),
        fieldOfView_mm=xsd.fieldOfViewMm(x=recon.fieldOfView_mm.x * style.readout_oversampling,
                                         y=recon.fieldOfView_mm.y, z=recon.fieldOfView_mm.z))
    encoding.encodedSpace = encoded
    encoding.reconSpace = recon
    kept = _kept_lines(n_pe, style)
    limits = encoding.encodingLimits
    if limits is not None:
        limits.kspace_encoding_step_0 = xsd.limitType(minimum=0, maximum=n_ro * style.readout_oversampling - 1,
                                                      center=n_ro * style.readout_oversampling // 2)
        limits.kspace_encoding_step_1 = xsd.limitType(minimum=kept[0], maximum=kept[-1], center=n_pe // 2)
    if header.acquisitionSystemInformation is None:
        header.acquisitionSystemInformation = xsd.acquisitionSystemInformationType()
    header.acquisitionSystemInformation.receiverChannels = coils
    return serialize_header(header)


def scanner_like(header_xml: str, acquisitions: Sequence[ismrmrd.Acquisition], style: StreamStyle,
                 rng: np.random.Generator) -> tuple[str, list[ismrmrd.Acquisition]]:
    """The stream (header XML, acquisitions in order) a scanner would send for the same slices
    (module docstring). ``acquisitions``: every line of every slice of a 2D Cartesian stream
    whose encoded space is ``header_xml``'s; the imaging lines only. Slices follow one another,
    each in ``style.order``; the last line of each slice carries ``ACQ_LAST_IN_SLICE``."""
    space = parse_header(header_xml).encoding[0].encodedSpace
    n_ro, n_pe = int(space.matrixSize.x), int(space.matrixSize.y)
    by_slice = _slices(acquisitions, n_pe, n_ro)
    keys = sorted(by_slice)
    if not keys:
        raise ValueError("the stream has no imaging acquisition")
    kspace = styled_kspace(np.stack([by_slice[s][1] for s in keys]), style, rng, field_of_view_mm(header_xml))
    order = line_order(n_pe, style.order, _kept_lines(n_pe, style))
    out: list[ismrmrd.Acquisition] = []
    for i, s in enumerate(keys):
        for j, line in enumerate(order):
            head = ismrmrd.AcquisitionHeader.from_buffer_copy(by_slice[s][0])
            head.idx.kspace_encode_step_1, head.idx.slice = line, s
            head.scan_counter = len(out)
            head.flags = 0
            acq = styled_acquisition(head, kspace[i, :, line], style)
            if j == len(order) - 1:
                acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
            out.append(acq)
    return styled_header(header_xml, style, kspace.shape[1]), out


def write_stream(path: str | os.PathLike, header_xml: str, acquisitions: Sequence[ismrmrd.Acquisition],
                 group: str = "dataset") -> Path:
    """An ISMRMRD file of the stream, as scanners' converters write them (the header and every
    acquisition in order, in ``group``: ``dataset`` is what ``gadgetron_ismrmrd_client`` and
    python-ismrmrd-server's ``client.py`` read by default). An existing group is replaced; the
    file appears only once complete."""
    def fill(dataset: ismrmrd.Dataset) -> None:
        dataset.write_xml_header(header_xml)
        for acq in acquisitions:
            dataset.append_acquisition(acq)

    return write_group(path, group, fill)


def write_group(path: str | os.PathLike, group: str, fill: Callable[[ismrmrd.Dataset], None]) -> Path:
    """Write the ISMRMRD group ``group`` of ``path`` with ``fill(dataset)``: the file's other groups
    kept, an existing ``group`` replaced, the file in place only once complete (a partial copy
    beside it until then)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.unlink(missing_ok=True)
    if path.exists():
        shutil.copyfile(path, partial)
        with h5py.File(partial, "a") as f:
            if group in f:
                del f[group]
    dataset = ismrmrd.Dataset(str(partial), group, create_if_needed=True)
    try:
        fill(dataset)
    finally:
        dataset.close()
    os.replace(partial, path)
    return path


def check_group(path: str | os.PathLike, group: str) -> Path:
    """``path`` as a Path; ValueError naming a missing file or group (and the groups it has)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with h5py.File(path, "r") as f:
        if group not in f:
            raise ValueError(f"{path}: no group {group!r} (the file has {sorted(f.keys())})")
    return path


def read_stream(path: str | os.PathLike, group: str) -> tuple[str, list[ismrmrd.Acquisition]]:
    """(header XML, every acquisition in file order) of an ISMRMRD group; ValueError naming a
    missing file or group."""
    path = check_group(path, group)
    dataset = ismrmrd.Dataset(str(path), group, create_if_needed=False)
    try:
        header = dataset.read_xml_header()
        header = header.decode() if isinstance(header, bytes) else str(header)
        acquisitions = [dataset.read_acquisition(i) for i in range(dataset.number_of_acquisitions())]
    finally:
        dataset.close()
    return header.strip("\x00 \t\r\n"), acquisitions


def read_mrd_scan_input(path: str | os.PathLike, group: str = "dataset") -> Any:
    """A recorded scan (an ISMRMRD file: a scanner's converted raw data, ``masc simulate stream``'s
    output) as what ``masc scan`` replays in closed loop: every line of every slice, placed by
    ``kspace_encode_step_1`` around the header's centre line, the recorded acquisition headers to
    send them with (``templates``), and as the reference it is scored against the file's own fully
    sampled image (root-sum-of-squares over the coils): a recorded scan has no metal-free truth.

    ValueError naming what a closed-loop replay needs and the file lacks: one readout of the
    encoded matrix per line (no oversampling or asymmetric echo), every line of every slice."""
    from masc_gadget.mrd.feedback import is_feedback
    from masc_gadget.mrd.header import encoding_geometry, is_imaging_line, parse_header
    from sim_scanner.dataset.layout import ScanInput
    from sim_scanner.physics.sequence import SequenceConfig

    header_xml, acquisitions = read_stream(path, group)
    header = parse_header(header_xml)
    geometry = encoding_geometry(header)
    n_pe, n_ro, n_slices = geometry.n_pe, geometry.n_readout, geometry.n_slices
    lines = [a for a in acquisitions if is_imaging_line(a.flags) and not is_feedback(a)]
    if not lines:
        raise ValueError(f"{path}/{group}: no imaging acquisition to replay")
    coils = int(lines[0].active_channels)
    kspace = np.zeros((n_slices, coils, n_pe, n_ro), dtype=np.complex64)
    templates: dict[tuple[int, int], ismrmrd.AcquisitionHeader] = {}
    shift = n_pe // 2 - geometry.pe_centre
    for acq in lines:
        s, row = int(acq.idx.slice), int(acq.idx.kspace_encode_step_1) + shift
        if int(acq.number_of_samples) != n_ro or int(acq.active_channels) != coils:
            raise ValueError(f"{path}/{group}: slice {s} line {row - shift} has {acq.number_of_samples} samples x "
                             f"{acq.active_channels} channels; a closed-loop replay needs {n_ro} x {coils} on every line "
                             "(no readout oversampling, asymmetric echo or changing channels)")
        if not (0 <= s < n_slices and 0 <= row < n_pe):
            raise ValueError(f"{path}/{group}: slice {s} line {row - shift} is outside the header's "
                             f"{n_slices} slices x {n_pe} lines")
        kspace[s, :, row] = np.asarray(acq.data)
        templates[(s, row)] = acq.getHead()
    missing = [(s, r) for s in range(n_slices) for r in range(n_pe) if (s, r) not in templates]
    if missing:
        raise ValueError(f"{path}/{group}: {len(missing)} of {n_slices * n_pe} lines are not recorded (first: slice "
                         f"{missing[0][0]}, line {missing[0][1] - shift}); a closed-loop replay needs every line, "
                         "the gadget may ask for any")
    image = np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(kspace, axes=(-2, -1)), norm="ortho"), axes=(-2, -1))
    reference = np.sqrt((np.abs(image) ** 2).sum(axis=1)).astype(np.float32)
    params = getattr(header, "sequenceParameters", None)
    tr = float(params.TR[0]) if params is not None and params.TR else 1000.0
    seq = SequenceConfig(tr_ms=tr, te_ms=min(tr / 2, 10.0), echo_train_length=1, n_slices=n_slices,
                         matrix=(n_ro, n_pe), fov_mm=(geometry.fov_mm[0], geometry.fov_mm[1]))
    return ScanInput(header_xml, kspace, reference, seq, [0.0] * n_slices, (0.0, 0.0), templates)
