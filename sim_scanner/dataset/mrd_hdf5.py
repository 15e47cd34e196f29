"""ISMRMRD (MRD v1) headers, acquisitions and HDF5 groups for the simulated TSE scan.

Geometry (see ``grid.py``): patient coordinates in mm, DICOM LPS; readout along x (L-R), phase
encoding along y (A-P), axial slices along z. ISMRMRD vectors are (x, y, z), so an acquisition's
``position`` is ``(fov_centre_x, fov_centre_y, slice_centre_z)``, ``read_dir`` (1, 0, 0),
``phase_dir`` (0, 1, 0), ``slice_dir`` (0, 0, 1), even though our volumes are indexed [z, y, x].
``fov_centre_mm`` arguments follow the grid (and ``physics.object_grid``): **(y, x)**, i.e.
(PE, readout); the swap into ISMRMRD's (x, y, z) happens here and nowhere else. (Unlike
``SequenceConfig.fov_mm`` and ``matrix``, which are (readout, PE).)

Time stamps follow the Siemens convention that most MRD converters keep: ``acquisition_time_stamp``
counts 2.5 ms ticks (``TIMESTAMP_TICK_MS``).

HDF5 layout is exactly the one of ``ismrmrd.Dataset``: ``<group>/xml`` (shape (1,), variable-length
string) and ``<group>/data`` (1-D, resizable, compound ``head`` / ``traj`` (vlen float32) /
``data`` (vlen float32, interleaved re/im)). :func:`write_mrd_group` writes all acquisitions in one
h5py call (``Dataset.append_acquisition`` costs ~1.5 ms per line, ~11 s per 7,200-line group) and
:func:`read_mrd_group` reads them in one call; ``ismrmrd.Dataset`` reads and appends to the result.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, NamedTuple

import h5py
import ismrmrd
import ismrmrd.xsd as xsd
import numpy as np
from ismrmrd.hdf5 import acquisition_dtype, acquisition_header_dtype

from masc_gadget.mrd.feedback import FEEDBACK_FLAG
from masc_gadget.mrd.header import (
    NOT_IMAGING,
    EncodingGeometry,
    encoding_geometry,
    flag_mask,
    parse_header,
    receiver_channels,
    serialize_header,
)
from sim_scanner.physics.sequence import SequenceConfig

TIMESTAMP_TICK_MS = 2.5
"""Duration of one ``acquisition_time_stamp`` tick, ms (Siemens convention)."""

PROTOCOL_NAME = "MASC TSE"
SYSTEM_VENDOR = "MASC simulator"

_UINT32_MAX = 2**32 - 1
_UINT16_MAX = 2**16 - 1
_H5_CHUNK = 128
"""Acquisitions per HDF5 chunk of ``<group>/data`` (~48 KB of headers and heap references)."""

_SKIPPED_FLAGS = NOT_IMAGING | flag_mask(FEEDBACK_FLAG)  # and MASC's in-band next-line feedback
"""Acquisitions that are not imaging lines; :func:`read_mrd_group` leaves them out."""


# --------------------------------------------------------------------------------------- header


def _limit(maximum: int, center: int) -> xsd.limitType:
    return xsd.limitType(minimum=0, maximum=maximum, center=center)


def _user_parameter(
    name: str, value: object
) -> xsd.userParameterLongType | xsd.userParameterDoubleType | xsd.userParameterStringType:
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return xsd.userParameterLongType(name=name, value=int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"user parameter {name!r} must be finite, got {value}")
        return xsd.userParameterDoubleType(name=name, value=float(value))
    if isinstance(value, str):
        return xsd.userParameterStringType(name=name, value=value)
    raise ValueError(
        f"user parameter {name!r} must be an int, float or str, got {type(value).__name__}"
    )


def _fov_centre_xy(fov_centre_mm: tuple[float, float]) -> tuple[float, float]:
    """(x, y) of an FOV centre given, as everywhere in the simulator, as (y, x)."""
    if len(fov_centre_mm) != 2 or not all(math.isfinite(float(v)) for v in fov_centre_mm):
        raise ValueError(
            f"fov_centre_mm must be two finite numbers (y, x) in mm, got {fov_centre_mm}"
        )
    return float(fov_centre_mm[1]), float(fov_centre_mm[0])


def _user_parameters(params: dict[str, object]) -> xsd.userParametersType:
    user = xsd.userParametersType()
    for name, value in params.items():
        item = _user_parameter(name, value)
        if isinstance(item, xsd.userParameterLongType):
            user.userParameterLong.append(item)
        elif isinstance(item, xsd.userParameterDoubleType):
            user.userParameterDouble.append(item)
        else:
            user.userParameterString.append(item)
    return user


def _encoding(seq: SequenceConfig) -> xsd.encodingType:
    """The single 2D Cartesian encoding: matrix, FOV and limits (slices as the slice index)."""
    n_ro, n_pe, n_slices = seq.n_readout, seq.n_pe, seq.n_slices
    space = xsd.encodingSpaceType(
        matrixSize=xsd.matrixSizeType(x=n_ro, y=n_pe, z=1),
        fieldOfView_mm=xsd.fieldOfViewMm(
            x=float(seq.fov_mm[0]), y=float(seq.fov_mm[1]), z=float(seq.slice_thickness_mm)
        ),
    )
    limits = xsd.encodingLimitsType(
        kspace_encoding_step_0=_limit(n_ro - 1, n_ro // 2),
        kspace_encoding_step_1=_limit(n_pe - 1, n_pe // 2),
        kspace_encoding_step_2=_limit(0, 0),
        average=_limit(0, 0),
        slice=_limit(n_slices - 1, n_slices // 2),
        contrast=_limit(0, 0),
        phase=_limit(0, 0),
        repetition=_limit(0, 0),
        set=_limit(0, 0),
        segment=_limit(0, 0),
    )
    return xsd.encodingType(
        encodedSpace=space,
        reconSpace=space,
        encodingLimits=limits,
        trajectory=xsd.trajectoryType.CARTESIAN,
        echoTrainLength=int(seq.echo_train_length),
    )


def build_header(
    seq: SequenceConfig,
    *,
    subject_id: str,
    slice_centres_mm: Sequence[float],
    fov_centre_mm: tuple[float, float],
    measurement_id: str = "",
    extra_user_parameters: dict[str, object] | None = None,
    receiver_channels: int = 1,
) -> str:
    """The ISMRMRD XML header of a simulated 2D multi-slice Cartesian TSE scan
    (``receiver_channels`` receive coils).

    slice_centres_mm: z of each slice centre (``seq.n_slices`` values, inferior to superior);
    fov_centre_mm: (y, x) of the in-plane FOV centre (grid order). Both are also stored as user parameters
    (``fov_centre_x_mm``, ``fov_centre_y_mm`` doubles, ``slice_centres_mm`` a JSON list string)
    next to the bandwidths, slice thickness / gap and ``extra_user_parameters`` (int and bool ->
    userParameterLong, float -> userParameterDouble, str -> userParameterString).
    """
    if not isinstance(subject_id, str) or not subject_id:
        raise ValueError(f"subject_id must be a non-empty string, got {subject_id!r}")
    if isinstance(receiver_channels, bool) or not isinstance(receiver_channels, int) or receiver_channels < 1:
        raise ValueError(f"receiver_channels must be an integer >= 1, got {receiver_channels!r}")
    centres = [float(z) for z in slice_centres_mm]
    if len(centres) != seq.n_slices:
        raise ValueError(
            f"slice_centres_mm must have one value per slice ({seq.n_slices}), got {len(centres)}"
        )
    if not all(math.isfinite(z) for z in centres):
        raise ValueError(f"slice_centres_mm must be finite, got {centres}")
    centre_x, centre_y = _fov_centre_xy(fov_centre_mm)
    params: dict[str, object] = {
        "readout_bandwidth_hz_per_px": float(seq.readout_bw_hz_per_px),
        "rf_bandwidth_hz": float(seq.rf_bw_hz),
        "slice_thickness_mm": float(seq.slice_thickness_mm),
        "slice_gap_mm": float(seq.slice_gap_mm),
        "dwell_time_us": float(seq.dwell_time_us),
        "fov_centre_x_mm": centre_x,
        "fov_centre_y_mm": centre_y,
        "slice_centres_mm": json.dumps(centres),
    }
    for name, value in (extra_user_parameters or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"user parameter names must be non-empty strings, got {name!r}")
        if name in params:
            raise ValueError(
                f"user parameter {name!r} is written by build_header; choose another name"
            )
        params[name] = value
    user = _user_parameters(params)

    header = xsd.ismrmrdHeader(
        subjectInformation=xsd.subjectInformationType(patientID=subject_id),
        measurementInformation=xsd.measurementInformationType(
            measurementID=measurement_id or None,
            patientPosition=xsd.patientPositionType.HFS,
            protocolName=PROTOCOL_NAME,
            sequenceName="tse",
        ),
        acquisitionSystemInformation=xsd.acquisitionSystemInformationType(
            systemVendor=SYSTEM_VENDOR,
            systemModel="sim_scanner",
            systemFieldStrength_T=float(seq.b0_t),
            receiverChannels=receiver_channels,
        ),
        experimentalConditions=xsd.experimentalConditionsType(
            H1resonanceFrequency_Hz=int(round(seq.larmor_hz))
        ),
        encoding=[_encoding(seq)],
        sequenceParameters=xsd.sequenceParametersType(
            TR=[float(seq.tr_ms)],
            TE=[float(seq.te_ms)],
            flipAngle_deg=[90.0],
            sequence_type="TurboSpinEcho",
        ),
        userParameters=user,
    )
    return serialize_header(header)


# --------------------------------------------------------------------------------- acquisitions


def _base_header(
    seq: SequenceConfig, slice_centre_mm: float, fov_centre_mm: tuple[float, float]
) -> ismrmrd.AcquisitionHeader:
    """The fields shared by every line of one slice."""
    centre_x, centre_y = _fov_centre_xy(fov_centre_mm)
    if not math.isfinite(float(slice_centre_mm)):
        raise ValueError(f"slice_centre_mm must be finite, got {slice_centre_mm}")
    head = ismrmrd.AcquisitionHeader()
    head.version = 1
    head.number_of_samples = seq.n_readout
    head.available_channels = 1
    head.active_channels = 1
    head.channel_mask[0] = 1
    head.center_sample = seq.n_readout // 2
    head.encoding_space_ref = 0
    head.trajectory_dimensions = 0
    head.sample_time_us = seq.dwell_time_us
    head.position[:] = (centre_x, centre_y, float(slice_centre_mm))
    head.read_dir[:] = (1.0, 0.0, 0.0)
    head.phase_dir[:] = (0.0, 1.0, 0.0)
    head.slice_dir[:] = (0.0, 0.0, 1.0)
    head.patient_table_position[:] = (0.0, 0.0, 0.0)
    return head


def _line_acquisition(
    base: ismrmrd.AcquisitionHeader,
    line_data: np.ndarray,
    *,
    line: int,
    slice_index: int,
    scan_counter: int,
    timestamp: int,
    flags: int,
) -> ismrmrd.Acquisition:
    head = ismrmrd.AcquisitionHeader.from_buffer_copy(base)
    head.flags = flags
    head.scan_counter = scan_counter
    head.acquisition_time_stamp = timestamp
    head.idx.kspace_encode_step_1 = line
    head.idx.slice = slice_index
    data = np.array(line_data, dtype=np.complex64, copy=True)
    data = data.reshape(1, -1) if data.ndim == 1 else data
    head.active_channels = head.available_channels = data.shape[0]
    words = [0] * len(head.channel_mask)
    for channel in range(data.shape[0]):  # channels 0 .. coils - 1 are active
        words[channel // 64] |= 1 << (channel % 64)
    head.channel_mask[:] = words
    return ismrmrd.Acquisition(head, data=data)


def make_acquisition(
    line_data: np.ndarray,
    *,
    line: int,
    slice_index: int,
    seq: SequenceConfig,
    slice_centre_mm: float,
    fov_centre_mm: tuple[float, float],
    scan_counter: int,
    timestamp: int,
    flags: int = 0,
    n_slices: int | None = None,
) -> ismrmrd.Acquisition:
    """One readout line as an ``ismrmrd.Acquisition``.

    line_data: (n_readout,) complex samples of one channel, or (coils, n_readout) of several
    (stored as complex64); data shape (coils, n_readout), ``active_channels`` = coils.
    line: PE line (``idx.kspace_encode_step_1``) in [0, n_pe); slice_index (``idx.slice``) in
    [0, n_slices) (``n_slices`` defaults to ``seq.n_slices``); timestamp: 2.5 ms ticks;
    flags: bit mask (see ``masc_gadget.mrd.header.flag_mask``). ``position`` is
    (fov_centre_mm[1], fov_centre_mm[0], slice_centre_mm): fov_centre_mm is (y, x).
    """
    n_slices = seq.n_slices if n_slices is None else int(n_slices)
    line_data = np.asarray(line_data)
    if line_data.shape[-1:] != (seq.n_readout,) or line_data.ndim not in (1, 2) or 0 in line_data.shape:
        raise ValueError(
            f"line_data must have shape ({seq.n_readout},) (n_readout) or (coils, {seq.n_readout}), "
            f"got {line_data.shape}"
        )
    if not (
        np.issubdtype(line_data.dtype, np.complexfloating)
        or np.issubdtype(line_data.dtype, np.floating)
    ):
        raise ValueError(
            f"line_data must be complex (or real) floating point, got {line_data.dtype}"
        )
    if not np.all(np.isfinite(line_data)):
        raise ValueError(
            f"line_data of line {line}, slice {slice_index} has NaN or infinite samples"
        )
    if not 0 <= int(line) < seq.n_pe:
        raise ValueError(f"line must be in [0, {seq.n_pe}) (n_pe), got {line}")
    if not 0 <= int(slice_index) < min(n_slices, _UINT16_MAX + 1):
        raise ValueError(f"slice_index must be in [0, {n_slices}) (n_slices), got {slice_index}")
    for name, value in (("scan_counter", scan_counter), ("timestamp", timestamp)):
        if not 0 <= int(value) <= _UINT32_MAX:
            raise ValueError(f"{name} must be in [0, 2**32), got {value}")
    if not 0 <= int(flags) < 2**64:
        raise ValueError(f"flags must be a 64-bit mask, got {flags}")
    base = _base_header(seq, slice_centre_mm, fov_centre_mm)
    return _line_acquisition(
        base,
        line_data,
        line=int(line),
        slice_index=int(slice_index),
        scan_counter=int(scan_counter),
        timestamp=int(timestamp),
        flags=int(flags),
    )


def line_period_ms(seq: SequenceConfig, order: Literal["sequential", "interleaved"]) -> float:
    """Time between consecutive delivered lines, ms.

    A TSE excitation acquires ``echo_train_length`` lines per slice and TR. Interleaved, one TR
    holds an echo train of every slice: TR / (ETL * n_slices) per line. Sequential (each slice
    scanned on its own before the next): TR / ETL per line.
    """
    slices_per_tr = seq.n_slices if order == "interleaved" else 1
    return seq.tr_ms / (seq.echo_train_length * slices_per_tr)


def delivery_order(
    line_orders: Sequence[Sequence[int]],
    order: Literal["sequential", "interleaved"] = "sequential",
    *,
    block: int = 1,
) -> list[tuple[int, int]]:
    """(slice, line) pairs in the order they are acquired.

    sequential: all lines of slice 0, then slice 1, ...; interleaved: round-robin over slices,
    ``block`` consecutive lines of a slice per turn (1: line by line; ``echo_train_length``: one
    echo train per slice per turn, as a multi-slice TSE). Slices that run out are skipped.
    """
    if order not in ("sequential", "interleaved"):
        raise ValueError(f"order must be 'sequential' or 'interleaved', got {order!r}")
    if int(block) < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if order == "sequential":
        return [(s, int(line)) for s, lines in enumerate(line_orders) for line in lines]
    result: list[tuple[int, int]] = []
    cursors = [0] * len(line_orders)
    remaining = sum(len(lines) for lines in line_orders)
    while remaining:
        for s, lines in enumerate(line_orders):
            take = lines[cursors[s] : cursors[s] + block]
            result.extend((s, int(line)) for line in take)
            cursors[s] += len(take)
            remaining -= len(take)
    return result


def _check_line_orders(
    lines: Sequence[Sequence[int] | None] | None, n_slices: int, n_pe: int
) -> list[list[int]]:
    if lines is None:
        return [list(range(n_pe)) for _ in range(n_slices)]
    if len(lines) != n_slices:
        raise ValueError(f"lines must give one line order per slice ({n_slices}), got {len(lines)}")
    orders = []
    for s, order in enumerate(lines):
        if order is None:
            orders.append(list(range(n_pe)))
            continue
        values = [int(v) for v in order]
        bad = [v for v in values if not 0 <= v < n_pe]
        if bad:
            raise ValueError(f"lines[{s}] must be in [0, {n_pe}) (n_pe), got {bad[:5]}")
        if len(set(values)) != len(values):
            raise ValueError(f"lines[{s}] repeats a line: {values}")
        orders.append(values)
    return orders


def acquisitions_from_kspace(
    kspace: np.ndarray,
    seq: SequenceConfig,
    slice_centres_mm: Sequence[float],
    fov_centre_mm: tuple[float, float],
    *,
    order: Literal["sequential", "interleaved"] = "sequential",
    lines: Sequence[Sequence[int] | None] | None = None,
    block: int = 1,
    start_timestamp: int = 0,
) -> Iterator[ismrmrd.Acquisition]:
    """Yield the lines of ``kspace`` as a scanner delivers them.

    kspace: (n_slices, n_pe, n_readout) complex, or (n_slices, coils, n_pe, n_readout) for a
    multi-coil scan, matching ``seq``; slice_centres_mm: z per
    slice; fov_centre_mm: (y, x), as in :func:`build_header`. lines: per slice, the line
    order to deliver (a subset is allowed; ``None`` = 0..n_pe-1). order / block: see
    :func:`delivery_order`. Flags: ACQ_FIRST_IN_SLICE / ACQ_LAST_IN_SLICE on the first / last
    line delivered of each slice, ACQ_FIRST_IN_ENCODE_STEP1 / ACQ_LAST_IN_ENCODE_STEP1 on lines
    0 and n_pe-1, ACQ_LAST_IN_MEASUREMENT on the last. ``scan_counter`` counts 0, 1, 2, ...;
    ``acquisition_time_stamp`` is ``start_timestamp`` plus the elapsed time in 2.5 ms ticks,
    :func:`line_period_ms` per line (non-decreasing; strictly increasing at periods >= 2.5 ms).
    """
    kspace = np.asarray(kspace)
    expected = (seq.n_slices, seq.n_pe, seq.n_readout)
    coils = kspace.ndim == 4
    if (kspace.shape[:1] + kspace.shape[2:] if coils else kspace.shape) != expected or (coils and kspace.shape[1] < 1):
        raise ValueError(f"kspace must have shape {expected} (slice, pe, ro) or (slice, coil, pe, ro), "
                         f"got {kspace.shape}")
    if not np.iscomplexobj(kspace):
        raise ValueError(f"kspace must be complex, got {kspace.dtype}")
    if not np.all(np.isfinite(kspace)):
        raise ValueError("kspace has NaN or infinite samples")
    centres = [float(z) for z in slice_centres_mm]
    if len(centres) != seq.n_slices:
        raise ValueError(
            f"slice_centres_mm must have one value per slice ({seq.n_slices}), got {len(centres)}"
        )
    orders = _check_line_orders(lines, seq.n_slices, seq.n_pe)
    sequence = delivery_order(orders, order, block=block)
    if not 0 <= int(start_timestamp) <= _UINT32_MAX:
        raise ValueError(f"start_timestamp must be in [0, 2**32), got {start_timestamp}")
    ticks_per_line = line_period_ms(seq, order) / TIMESTAMP_TICK_MS
    last_tick = int(start_timestamp) + int(round((len(sequence) - 1) * ticks_per_line))
    if len(sequence) > _UINT32_MAX or last_tick > _UINT32_MAX:
        raise ValueError("the scan does not fit the 32-bit scan counter / time stamp")

    bases = [_base_header(seq, z, fov_centre_mm) for z in centres]
    first = {s: lines_s[0] for s, lines_s in enumerate(orders) if lines_s}
    last = {s: lines_s[-1] for s, lines_s in enumerate(orders) if lines_s}
    f_first_slice = flag_mask(ismrmrd.ACQ_FIRST_IN_SLICE)
    f_last_slice = flag_mask(ismrmrd.ACQ_LAST_IN_SLICE)
    f_first_e1 = flag_mask(ismrmrd.ACQ_FIRST_IN_ENCODE_STEP1)
    f_last_e1 = flag_mask(ismrmrd.ACQ_LAST_IN_ENCODE_STEP1)
    f_last_meas = flag_mask(ismrmrd.ACQ_LAST_IN_MEASUREMENT)
    for counter, (s, line) in enumerate(sequence):
        flags = 0
        if line == first[s]:
            flags |= f_first_slice
        if line == last[s]:
            flags |= f_last_slice
        if line == 0:
            flags |= f_first_e1
        if line == seq.n_pe - 1:
            flags |= f_last_e1
        if counter == len(sequence) - 1:
            flags |= f_last_meas
        yield _line_acquisition(
            bases[s],
            kspace[s, :, line] if coils else kspace[s, line],
            line=line,
            slice_index=s,
            scan_counter=counter,
            timestamp=int(start_timestamp) + int(round(counter * ticks_per_line)),
            flags=flags,
        )


# ------------------------------------------------------------------------------------ HDF5 I/O


class MrdGroup(NamedTuple):
    """One ISMRMRD group read back from a subject file."""

    header_xml: str
    """The XML header as stored (NULs and surrounding whitespace stripped)."""
    kspace: np.ndarray
    """(n_slices, n_pe, n_readout) complex64, zero where nothing was acquired; (n_slices, coils,
    n_pe, n_readout) when the header has ``receiverChannels`` > 1."""
    acquired: np.ndarray
    """(n_slices, n_pe) bool: the lines present in the group."""


def _records(acquisitions: Iterable[ismrmrd.Acquisition]) -> np.ndarray:
    """The ``ismrmrd.hdf5.acquisition_dtype`` records of ``acquisitions``, as append_acquisition."""
    heads: list[bytes] = []
    datas: list[np.ndarray] = []
    trajs: list[np.ndarray] = []
    for i, acq in enumerate(acquisitions):
        if not isinstance(acq, ismrmrd.Acquisition):
            raise ValueError(
                f"acquisition {i} must be an ismrmrd.Acquisition, got {type(acq).__name__}"
            )
        heads.append(bytes(acq.getHead()))
        datas.append(
            np.ascontiguousarray(acq.data, dtype=np.complex64).view(np.float32).reshape(-1)
        )
        trajs.append(np.ascontiguousarray(acq.traj, dtype=np.float32).reshape(-1))
    records = np.empty(len(heads), dtype=acquisition_dtype)
    if heads:
        records["head"] = np.frombuffer(b"".join(heads), dtype=acquisition_header_dtype)
    data_field = records["data"]
    traj_field = records["traj"]
    for i in range(len(heads)):
        data_field[i] = datas[i]
        traj_field[i] = trajs[i]
    return records


def write_mrd_group(
    path: str | os.PathLike,
    group: str,
    header_xml: str,
    acquisitions: Iterable[ismrmrd.Acquisition],
    *,
    overwrite: bool = False,
) -> int:
    """Write an ISMRMRD group (header + acquisitions) into ``path``; returns the count written.

    The file is created if needed and may hold other groups and datasets, which are kept. An
    existing ``group`` is an error unless ``overwrite``. The header must parse
    (``masc_gadget.mrd.header.parse_header``). The result reads with
    ``ismrmrd.Dataset(path, group, create_if_needed=False)``.
    """
    if not isinstance(group, str) or not group.strip("/"):
        raise ValueError(f"group must be a non-empty HDF5 group name, got {group!r}")
    if isinstance(header_xml, bytes):
        header_xml = header_xml.decode("utf-8")
    header_xml = header_xml.rstrip("\x00")
    parse_header(header_xml)  # refuse to write a header nobody can read
    records = _records(acquisitions)
    with h5py.File(path, "a") as f:
        if group in f:
            if not overwrite:
                raise ValueError(
                    f"{path} already has a group {group!r} (pass overwrite=True to replace it)"
                )
            del f[group]
        g = f.create_group(group)
        xml = g.create_dataset("xml", shape=(1,), dtype=h5py.special_dtype(vlen=bytes))
        xml[0] = header_xml.encode("utf-8")
        g.create_dataset(
            "data",
            data=records,
            maxshape=(None,),
            chunks=(max(1, min(_H5_CHUNK, len(records))),),
        )
    return len(records)


def _read_group(
    path: str | os.PathLike, group: str, where: str
) -> tuple[str, EncodingGeometry, np.ndarray]:
    """The header XML, its encoding geometry and the raw acquisition records of a group."""
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    try:
        f = h5py.File(path, "r")
    except OSError as error:
        raise ValueError(f"{where}: not an HDF5 file ({error})") from None
    with f:
        if group not in f or not isinstance(f[group], h5py.Group):
            raise ValueError(f"{where}: no such group (the file has {sorted(f.keys())})")
        g = f[group]
        if "xml" not in g or "data" not in g:
            missing = [name for name in ("xml", "data") if name not in g]
            raise ValueError(f"{where}: malformed, no {' / '.join(missing)} dataset")
        raw = g["xml"][0] if g["xml"].shape else g["xml"][()]
        header_xml = (raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)).strip(
            "\x00 \t\r\n"
        )
        try:
            geometry = encoding_geometry(header_xml)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        dset = g["data"]
        names = dset.dtype.names or ()
        head_names = set(dset.dtype["head"].names or ()) if "head" in names else set()
        if (
            dset.ndim != 1
            or "data" not in names
            or not set(acquisition_header_dtype.names) <= head_names
        ):
            raise ValueError(
                f"{where}: 'data' is not an ISMRMRD acquisition dataset ({dset.dtype})"
            )
        records = dset[...]
    return header_xml, geometry, records


def read_mrd_group(path: str | os.PathLike, group: str) -> MrdGroup:
    """Read an ISMRMRD group into a (slice, pe, ro) k-space, by ``idx.slice`` and line; a
    (slice, coil, pe, ro) one when the header has ``receiverChannels`` > 1, or has none and the
    lines carry more than one channel (every line must then carry all of them).

    Cartesian data only; non-imaging acquisitions (noise, navigators, phase
    correction, dummy scans, in-band feedback ``ACQ_USER1``) are skipped; a line delivered twice
    keeps its last copy. Raises ValueError naming the group and file when missing or malformed.
    """
    where = f"MRD group {group!r} in {path}"
    header_xml, geometry, records = _read_group(path, group, where)
    declared = receiver_channels(parse_header(header_xml))
    shape = (geometry.n_slices, geometry.n_pe, geometry.n_readout)
    heads = records["head"] if len(records) else None
    keep = None
    if heads is not None:
        keep = ((heads["flags"] & np.uint64(_SKIPPED_FLAGS)) == 0) & (heads["number_of_samples"] > 0)
    found = sorted(set(heads["active_channels"][keep].tolist())) if heads is not None else []
    # without receiverChannels in the header, the lines say how many coils there are
    n_coils = declared or (found[0] if len(found) == 1 else 1)
    kspace = np.zeros(shape if n_coils == 1 else (shape[0], n_coils, *shape[1:]), dtype=np.complex64)
    acquired = np.zeros(shape[:2], dtype=bool)
    if heads is None or not keep.any():
        return MrdGroup(header_xml, kspace, acquired)
    heads = heads[keep]
    payload = records["data"][keep]
    if found != [n_coils]:
        raise ValueError(
            f"{where}: every acquisition must carry the header's {n_coils} receiver channel(s), "
            f"found {found} channels"
        )
    samples = heads["number_of_samples"]
    if np.any(samples != geometry.n_readout):
        raise ValueError(
            f"{where}: acquisitions must have {geometry.n_readout} samples (encoded matrix x), "
            f"found {sorted(set(samples.tolist()))}"
        )
    slices = heads["idx"]["slice"].astype(np.int64)
    lines = heads["idx"]["kspace_encode_step_1"].astype(np.int64)
    if slices.max() >= geometry.n_slices:
        raise ValueError(
            f"{where}: idx.slice {slices.max()} outside the header's {geometry.n_slices} slices"
        )
    if lines.max() >= geometry.n_pe:
        raise ValueError(
            f"{where}: kspace_encode_step_1 {lines.max()} outside the header's "
            f"{geometry.n_pe} lines"
        )
    lengths = np.fromiter((len(d) for d in payload), dtype=np.int64, count=len(payload))
    if np.any(lengths != 2 * n_coils * geometry.n_readout):
        raise ValueError(f"{where}: acquisition data lengths do not match number_of_samples")
    data = np.stack(payload).astype(np.float32, copy=False).view(np.complex64)
    if n_coils > 1:
        data = data.reshape(len(data), n_coils, geometry.n_readout)
    key = slices * geometry.n_pe + lines
    _, first_in_reversed = np.unique(key[::-1], return_index=True)
    last = len(key) - 1 - first_in_reversed
    if n_coils == 1:
        kspace[slices[last], lines[last]] = data[last]
    else:
        kspace[slices[last], :, lines[last]] = data[last]
    acquired[slices[last], lines[last]] = True
    return MrdGroup(header_xml, kspace, acquired)
