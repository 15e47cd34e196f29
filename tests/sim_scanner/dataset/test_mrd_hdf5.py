"""ISMRMRD headers, acquisitions and HDF5 groups against the reference ``ismrmrd`` package."""

from __future__ import annotations

import json
import logging

import h5py
import ismrmrd
import ismrmrd.xsd
import numpy as np
import pytest

from masc_gadget.mrd.header import (
    EncodingGeometry,
    encoding_geometry,
    flag_mask,
    parse_header,
    serialize_header,
)
from sim_scanner.dataset.mrd_hdf5 import (
    TIMESTAMP_TICK_MS,
    acquisitions_from_kspace,
    build_header,
    delivery_order,
    line_period_ms,
    make_acquisition,
    read_mrd_group,
    write_mrd_group,
)
from sim_scanner.physics.sequence import SequenceConfig

FOV_CENTRE = (-40.0, 12.5)  # (y, x) mm, grid order; ISMRMRD position gets (x, y, z)



def line_of(acq: ismrmrd.Acquisition) -> int:
    """The phase-encoding line of an acquisition (``idx.kspace_encode_step_1``)."""
    return int(acq.idx.kspace_encode_step_1)


def slice_of(acq: ismrmrd.Acquisition) -> int:
    """The slice of an acquisition (``idx.slice``)."""
    return int(acq.idx.slice)


def user_parameters(header_xml: str) -> dict[str, float | int | str]:
    """The header's ``userParameterLong`` / ``Double`` / ``String`` values by name."""
    params = parse_header(header_xml).userParameters
    if params is None:
        return {}
    values: dict[str, float | int | str] = {item.name: int(item.value) for item in params.userParameterLong}
    values.update({item.name: float(item.value) for item in params.userParameterDouble})
    values.update({item.name: str(item.value) for item in params.userParameterString})
    return values


@pytest.fixture(scope="module")
def seq() -> SequenceConfig:
    return SequenceConfig(matrix=(16, 12), n_slices=3, fov_mm=(240.0, 180.0), slice_gap_mm=0.5)


@pytest.fixture(scope="module")
def centres(seq) -> list[float]:
    return [100.0 + z for z in seq.slice_offsets_mm()]


@pytest.fixture(scope="module")
def header_xml(seq, centres) -> str:
    return build_header(
        seq,
        subject_id="subj-007",
        slice_centres_mm=centres,
        fov_centre_mm=FOV_CENTRE,
        measurement_id="meas-1",
        extra_user_parameters={
            "seed": 42,
            "susceptibility_ppm": 180.5,
            "material": "CoCr",
            "metal": True,
        },
    )


@pytest.fixture(scope="module")
def kspace(seq) -> np.ndarray:
    rng = np.random.default_rng(1234)
    shape = (seq.n_slices, seq.n_pe, seq.n_readout)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def _flags_set(acq: ismrmrd.Acquisition, flag: int) -> bool:
    return acq.is_flag_set(flag)


# ------------------------------------------------------------------------------------- headers


def test_header_loads_with_reference_parser_and_ours(seq, header_xml):
    for header in (ismrmrd.xsd.CreateFromDocument(header_xml), parse_header(header_xml)):
        enc = header.encoding[0]
        assert enc.trajectory == ismrmrd.xsd.trajectoryType.CARTESIAN
        for space in (enc.encodedSpace, enc.reconSpace):
            assert (space.matrixSize.x, space.matrixSize.y, space.matrixSize.z) == (16, 12, 1)
            assert (space.fieldOfView_mm.x, space.fieldOfView_mm.y, space.fieldOfView_mm.z) == (
                240.0,
                180.0,
                3.0,
            )
        e1 = enc.encodingLimits.kspace_encoding_step_1
        assert (e1.minimum, e1.maximum, e1.center) == (0, 11, 6)
        sl = enc.encodingLimits.slice
        assert (sl.minimum, sl.maximum, sl.center) == (0, 2, 1)
        assert enc.echoTrainLength == seq.echo_train_length
        assert header.acquisitionSystemInformation.systemFieldStrength_T == 3.0
        assert header.acquisitionSystemInformation.systemVendor == "MASC simulator"
        assert header.acquisitionSystemInformation.receiverChannels == 1
        assert header.experimentalConditions.H1resonanceFrequency_Hz == round(seq.larmor_hz)
        assert header.sequenceParameters.TR == [4050.0]
        assert header.sequenceParameters.TE == [32.0]
        assert header.sequenceParameters.flipAngle_deg == [90.0]
        assert header.subjectInformation.patientID == "subj-007"
        assert header.measurementInformation.measurementID == "meas-1"
        assert header.measurementInformation.patientPosition == ismrmrd.xsd.patientPositionType.HFS
        assert header.measurementInformation.protocolName == "MASC TSE"
        assert header.version is None
    assert "<version>" not in header_xml


def test_header_user_parameters(seq, centres, header_xml):
    params = user_parameters(header_xml)
    assert params["readout_bandwidth_hz_per_px"] == 710.0
    assert params["rf_bandwidth_hz"] == 1000.0
    assert params["slice_thickness_mm"] == 3.0
    assert params["slice_gap_mm"] == 0.5
    assert params["dwell_time_us"] == seq.dwell_time_us
    assert (params["fov_centre_x_mm"], params["fov_centre_y_mm"]) == (12.5, -40.0)
    assert params["seed"] == 42 and isinstance(params["seed"], int)
    assert params["metal"] == 1
    assert params["susceptibility_ppm"] == 180.5
    assert params["material"] == "CoCr"

    assert json.loads(params["slice_centres_mm"]) == centres


def test_encoding_geometry(header_xml):
    geometry = encoding_geometry(header_xml)
    assert geometry == EncodingGeometry(16, 12, 3, (240.0, 180.0, 3.0), 6, 16, 12, (240.0, 180.0, 3.0), 0, 11)
    assert geometry.grid_readout == 16 and not geometry.removes_oversampling and geometry.pe_offset == 0
    assert encoding_geometry(parse_header(header_xml)) == geometry
    header = parse_header(header_xml)
    header.encoding = []
    with pytest.raises(ValueError, match="no <encoding>"):
        encoding_geometry(header)


def test_serialize_round_trip(header_xml):
    header = parse_header(header_xml)
    header.version = 7
    text = serialize_header(header)
    assert "<version>" not in text
    assert header.version == 7  # the caller's object is left alone
    again = parse_header(text)
    assert ismrmrd.xsd.CreateFromDocument(text) == again
    header.version = None
    assert again == header


@pytest.mark.parametrize("tail", ["\x00", "\x00\x00\x00", "\n\x00", "  \r\n"])
def test_parse_header_strips_trailing_nuls(header_xml, tail):
    expected = parse_header(header_xml)
    assert parse_header(header_xml + tail) == expected
    assert parse_header((header_xml + tail).encode("utf-8")) == expected


@pytest.mark.parametrize("version", ["2.0", "2.0.1", "abc", "", "<major>2</major>"])
def test_parse_header_drops_unsupported_version(header_xml, version):
    text = header_xml.replace(
        "<subjectInformation>", f"<version>{version}</version><subjectInformation>"
    )
    header = parse_header(text + "\x00")
    assert header.version is None
    assert encoding_geometry(header).n_pe == 12
    assert "<version>" not in serialize_header(header)


def test_parse_header_keeps_integer_version(header_xml):
    text = header_xml.replace("<subjectInformation>", "<version>2</version><subjectInformation>")
    assert parse_header(text).version == 2


def test_parse_header_without_namespace(header_xml):
    text = header_xml.replace(' xmlns="http://www.ismrm.org/ISMRMRD"', "")
    assert parse_header(text) == parse_header(header_xml)


def test_parse_header_ignores_unknown_elements_with_warning(header_xml, caplog):
    text = header_xml.replace(
        "<subjectInformation>", "<futureThing>1</futureThing><subjectInformation>"
    )
    with caplog.at_level(logging.WARNING, logger="masc_gadget.mrd.header"):
        header = parse_header(text)
    assert encoding_geometry(header).n_readout == 16
    assert "futureThing" in caplog.text


@pytest.mark.parametrize(
    "garbage",
    [
        "garbage",
        b"\x00\x00",
        "",
        "<foo/>",
        "<ismrmrdHeader xmlns='http://www.ismrm.org/ISMRMRD'/>",
        "<ismrmrdHeader><unclosed>",
    ],
)
def test_parse_header_rejects_garbage(garbage):
    with pytest.raises(ValueError, match="ISMRMRD header does not parse"):
        parse_header(garbage)


def test_parse_header_rejects_unconvertible_values(header_xml):
    with pytest.raises(ValueError, match="ISMRMRD header does not parse.*matrixSize"):
        parse_header(header_xml.replace("<x>16</x>", "<x>sixteen</x>"))


def test_build_header_validates(seq, centres):
    with pytest.raises(ValueError, match="one value per slice"):
        build_header(seq, subject_id="s", slice_centres_mm=centres[:2], fov_centre_mm=FOV_CENTRE)
    with pytest.raises(ValueError, match="subject_id"):
        build_header(seq, subject_id="", slice_centres_mm=centres, fov_centre_mm=FOV_CENTRE)
    with pytest.raises(ValueError, match="'weird'"):
        build_header(
            seq,
            subject_id="s",
            slice_centres_mm=centres,
            fov_centre_mm=FOV_CENTRE,
            extra_user_parameters={"weird": [1, 2]},
        )
    with pytest.raises(ValueError, match="written by build_header"):
        build_header(
            seq,
            subject_id="s",
            slice_centres_mm=centres,
            fov_centre_mm=FOV_CENTRE,
            extra_user_parameters={"slice_gap_mm": 1.0},
        )


# -------------------------------------------------------------------------------- acquisitions


def test_make_acquisition_fields(seq, centres, kspace):
    acq = make_acquisition(
        kspace[2, 5],
        line=5,
        slice_index=2,
        seq=seq,
        slice_centre_mm=centres[2],
        fov_centre_mm=FOV_CENTRE,
        scan_counter=17,
        timestamp=1234,
        flags=flag_mask(ismrmrd.ACQ_LAST_IN_SLICE),
        n_slices=3,
    )
    assert acq.data.shape == (1, 16) and acq.data.dtype == np.complex64
    np.testing.assert_array_equal(acq.data[0], kspace[2, 5])
    assert line_of(acq) == 5 and slice_of(acq) == 2
    assert acq.number_of_samples == 16 and acq.center_sample == 8
    assert acq.active_channels == 1 and acq.available_channels == 1
    assert acq.sample_time_us == pytest.approx(seq.dwell_time_us)
    assert acq.position[2] == pytest.approx(centres[2])
    assert tuple(acq.position) == pytest.approx((12.5, -40.0, centres[2]))  # x, y, z
    assert tuple(acq.read_dir) == (1, 0, 0)
    assert tuple(acq.phase_dir) == (0, 1, 0)
    assert tuple(acq.slice_dir) == (0, 0, 1)
    assert tuple(acq.patient_table_position) == (0, 0, 0)
    assert acq.encoding_space_ref == 0
    assert acq.scan_counter == 17 and acq.acquisition_time_stamp == 1234
    assert acq.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE)
    assert not acq.is_flag_set(ismrmrd.ACQ_FIRST_IN_SLICE)
    # the acquisition owns its samples and survives the wire format
    assert not np.shares_memory(acq.data, kspace)
    assert ismrmrd.Acquisition.from_bytes(acq.to_bytes()) == acq


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"line": -1}, "line must be in"),
        ({"line": 12}, "line must be in"),
        ({"slice_index": 3}, "slice_index"),
        ({"line_data": np.full(16, np.nan, np.complex64)}, "NaN"),
        ({"line_data": np.zeros(15, np.complex64)}, "shape"),
        ({"line_data": np.zeros((1, 1, 16), np.complex64)}, "shape"),
        ({"timestamp": -1}, "timestamp"),
    ],
)
def test_make_acquisition_rejects(seq, centres, change, match):
    args = dict(
        line_data=np.zeros(16, np.complex64),
        line=0,
        slice_index=0,
        seq=seq,
        slice_centre_mm=centres[0],
        fov_centre_mm=FOV_CENTRE,
        scan_counter=0,
        timestamp=0,
        n_slices=3,
    )
    args.update(change)
    line_data = args.pop("line_data")
    with pytest.raises(ValueError, match=match):
        make_acquisition(line_data, **args)


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_flags_counters_and_timestamps(seq, centres, kspace, order):
    acqs = list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, order=order))
    assert len(acqs) == 3 * 12
    slices = [slice_of(a) for a in acqs]
    if order == "sequential":
        assert slices == [s for s in range(3) for _ in range(12)]
    else:
        assert slices[:6] == [0, 1, 2, 0, 1, 2]
    for s in range(3):
        mine = [a for a in acqs if slice_of(a) == s]
        assert [line_of(a) for a in mine] == list(range(12))
        first = [a for a in mine if a.is_flag_set(ismrmrd.ACQ_FIRST_IN_SLICE)]
        last = [a for a in mine if a.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE)]
        assert first == [mine[0]] and last == [mine[-1]]
        assert all(a.position[2] == pytest.approx(centres[s]) for a in mine)
    for a in acqs:
        assert a.is_flag_set(ismrmrd.ACQ_FIRST_IN_ENCODE_STEP1) == (line_of(a) == 0)
        assert a.is_flag_set(ismrmrd.ACQ_LAST_IN_ENCODE_STEP1) == (line_of(a) == 11)
    assert [a.is_flag_set(ismrmrd.ACQ_LAST_IN_MEASUREMENT) for a in acqs] == [False] * 35 + [True]
    assert [a.scan_counter for a in acqs] == list(range(36))
    stamps = np.array([a.acquisition_time_stamp for a in acqs])
    assert np.all(np.diff(stamps) > 0)
    period = line_period_ms(seq, order)
    assert stamps[-1] * TIMESTAMP_TICK_MS == pytest.approx(35 * period, abs=TIMESTAMP_TICK_MS)


def test_custom_line_orders_and_blocks(seq, centres, kspace):
    lines = [[6, 5, 7], None, [11, 0]]
    acqs = list(
        acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, order="interleaved", lines=lines)
    )
    got = [(slice_of(a), line_of(a)) for a in acqs]
    assert got[:6] == [(0, 6), (1, 0), (2, 11), (0, 5), (1, 1), (2, 0)]
    assert len(got) == 3 + 12 + 2
    firsts = {slice_of(a): line_of(a) for a in acqs if a.is_flag_set(ismrmrd.ACQ_FIRST_IN_SLICE)}
    lasts = {slice_of(a): line_of(a) for a in acqs if a.is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE)}
    assert firsts == {0: 6, 1: 0, 2: 11}
    assert lasts == {0: 7, 1: 11, 2: 0}
    assert delivery_order([[0, 1, 2], [0, 1, 2]], "interleaved", block=2) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (0, 2),
        (1, 2),
    ]
    with pytest.raises(ValueError, match="repeats"):
        list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, lines=[[1, 1], None, None]))
    with pytest.raises(ValueError, match=r"lines\[2\]"):
        list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, lines=[None, None, [12]]))
    with pytest.raises(ValueError, match="shape"):
        list(acquisitions_from_kspace(kspace[:2], seq, centres, FOV_CENTRE))
    with pytest.raises(ValueError, match="order"):
        list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, order="random"))


# ------------------------------------------------------------------------------------ HDF5 I/O


@pytest.mark.parametrize("order", ["sequential", "interleaved"])
def test_write_read_round_trip_two_groups(tmp_path, seq, centres, kspace, header_xml, order):
    path = tmp_path / "subject.h5"
    clean = (kspace * 0.5 + 1).astype(np.complex64)
    n = write_mrd_group(
        path,
        "metal",
        header_xml,
        acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, order=order),
    )
    assert n == 36
    write_mrd_group(
        path,
        "clean",
        header_xml,
        acquisitions_from_kspace(clean, seq, centres, FOV_CENTRE, order=order),
    )
    with h5py.File(path, "a") as f:  # fast arrays written next to the groups, as datasets do
        f["kspace/metal"] = kspace
    for group, expected in (("metal", kspace), ("clean", clean)):
        got = read_mrd_group(path, group)
        assert got.kspace.dtype == np.complex64
        np.testing.assert_array_equal(got.kspace, expected)
        assert got.acquired.shape == (3, 12) and got.acquired.all()
        assert parse_header(got.header_xml) == parse_header(header_xml)

    # the reference reader sees the same thing
    with ismrmrd.Dataset(str(path), "clean", create_if_needed=False) as dset:
        assert parse_header(dset.read_xml_header()) == parse_header(header_xml)
        assert dset.number_of_acquisitions() == 36
        for i in range(36):
            acq = dset.read_acquisition(i)
            assert acq.scan_counter == i
            np.testing.assert_array_equal(
                acq.data[0], clean[acq.idx.slice, acq.idx.kspace_encode_step_1]
            )
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["kspace/metal"][...], kspace)


def test_layout_matches_ismrmrd_dataset(tmp_path, seq, centres, kspace, header_xml):
    acqs = list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE))
    ours, ref = tmp_path / "ours.h5", tmp_path / "ref.h5"
    write_mrd_group(ours, "dataset", header_xml, acqs)
    with ismrmrd.Dataset(str(ref), "dataset") as dset:
        dset.write_xml_header(header_xml)
        for acq in acqs:
            dset.append_acquisition(acq)
    with h5py.File(ours, "r") as a, h5py.File(ref, "r") as b:
        for name in ("xml", "data"):
            assert a[f"dataset/{name}"].id.get_type() == b[f"dataset/{name}"].id.get_type()
            assert a[f"dataset/{name}"].shape == b[f"dataset/{name}"].shape
            assert a[f"dataset/{name}"].maxshape == b[f"dataset/{name}"].maxshape
        assert a["dataset/xml"][0] == b["dataset/xml"][0]
        ra, rb = a["dataset/data"][...], b["dataset/data"][...]
        assert ra["head"].tobytes() == rb["head"].tobytes()
        for x, y in zip(ra["data"], rb["data"], strict=True):
            np.testing.assert_array_equal(x, y)
    # ismrmrd can keep appending to what we wrote, and we read what ismrmrd wrote
    extra = make_acquisition(
        kspace[0, 0],
        line=0,
        slice_index=0,
        seq=seq,
        slice_centre_mm=centres[0],
        fov_centre_mm=FOV_CENTRE,
        scan_counter=36,
        timestamp=0,
    )
    with ismrmrd.Dataset(str(ours), "dataset", create_if_needed=False) as dset:
        dset.append_acquisition(extra)
        assert dset.number_of_acquisitions() == 37
        assert dset.read_acquisition(36) == extra
    np.testing.assert_array_equal(read_mrd_group(ref, "dataset").kspace, kspace)


def test_read_partial_and_skips_feedback(tmp_path, seq, centres, kspace, header_xml):
    lines = [[6, 5, 7], [], [11, 0]]
    acqs = list(acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE, lines=lines))
    feedback = ismrmrd.Acquisition()  # in-band next-line decision: header only, ACQ_USER1
    feedback.set_flag(ismrmrd.ACQ_USER1)
    feedback.idx.kspace_encode_step_1 = 3
    noisy = make_acquisition(
        np.ones(16),
        line=9,
        slice_index=1,
        seq=seq,
        slice_centre_mm=centres[1],
        fov_centre_mm=FOV_CENTRE,
        scan_counter=99,
        timestamp=0,
        flags=flag_mask(ismrmrd.ACQ_IS_NOISE_MEASUREMENT),
    )
    path = tmp_path / "partial.h5"
    write_mrd_group(path, "scan", header_xml, [*acqs, feedback, noisy])
    got = read_mrd_group(path, "scan")
    expected_mask = np.zeros((3, 12), bool)
    expected_mask[0, [5, 6, 7]] = True
    expected_mask[2, [0, 11]] = True
    np.testing.assert_array_equal(got.acquired, expected_mask)
    np.testing.assert_array_equal(got.kspace[expected_mask], kspace[expected_mask])
    assert not got.kspace[~expected_mask].any()


def test_write_refuses_existing_group_and_bad_header(tmp_path, seq, centres, kspace, header_xml):
    path = tmp_path / "s.h5"
    write_mrd_group(
        path, "metal", header_xml, acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE)
    )
    with pytest.raises(ValueError, match="already has a group 'metal'"):
        write_mrd_group(path, "metal", header_xml, [])
    assert write_mrd_group(path, "metal", header_xml, [], overwrite=True) == 0
    got = read_mrd_group(path, "metal")
    assert not got.acquired.any()
    with pytest.raises(ValueError, match="does not parse"):
        write_mrd_group(path, "other", "<nonsense", [])
    with h5py.File(path, "r") as f:
        assert "other" not in f


def test_read_errors_name_group_and_path(tmp_path, seq, centres, kspace, header_xml):
    path = tmp_path / "s.h5"
    with pytest.raises(ValueError, match="no such file"):
        read_mrd_group(path, "metal")
    write_mrd_group(
        path, "metal", header_xml, acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE)
    )
    with pytest.raises(ValueError, match=r"'clean'.*s\.h5.*no such group"):
        read_mrd_group(path, "clean")
    with h5py.File(path, "a") as f:
        f.create_group("broken").create_dataset(
            "xml", data=np.array([b"<x/>"], dtype=object), dtype=h5py.special_dtype(vlen=bytes)
        )
    with pytest.raises(ValueError, match="'broken'.*no data"):
        read_mrd_group(path, "broken")
    small = SequenceConfig(matrix=(8, 12), n_slices=3)
    other_xml = build_header(
        small, subject_id="s", slice_centres_mm=centres, fov_centre_mm=FOV_CENTRE
    )
    write_mrd_group(
        path, "mismatch", other_xml, acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE)
    )
    with pytest.raises(ValueError, match="'mismatch'.*8 samples"):
        read_mrd_group(path, "mismatch")


def test_large_bulk_write_round_trip(tmp_path, header_xml):
    """A scanner-sized group goes through the bulk writer in one piece (timings: masc bench)."""
    seq = SequenceConfig(matrix=(200, 200), n_slices=12)
    kspace = np.ones((12, 200, 200), np.complex64)
    centres = seq.slice_offsets_mm()
    xml = build_header(seq, subject_id="s", slice_centres_mm=centres, fov_centre_mm=(0.0, 0.0))
    n = write_mrd_group(
        tmp_path / "big.h5",
        "metal",
        xml,
        acquisitions_from_kspace(kspace, seq, centres, (0.0, 0.0)),
    )
    got = read_mrd_group(tmp_path / "big.h5", "metal")
    assert n == 2400 and got.acquired.all()


CONVERTED_HEADER = """<?xml version="1.0"?>
<ismrmrdHeader xmlns="http://www.ismrm.org/ISMRMRD"
    xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
    xsi:schemaLocation="http://www.ismrm.org/ISMRMRD ismrmrd.xsd">
  <version>{version}</version>
  <subjectInformation><patientWeight_kg>70.3</patientWeight_kg>
    <patientBirthdate>1980-06-12</patientBirthdate><patientGender>M</patientGender></subjectInformation>
  <studyInformation><studyDate>2012-08-13</studyDate><studyTime>09:00:00</studyTime></studyInformation>
  <measurementInformation><seriesDate>2012-08-13</seriesDate><patientPosition>HFS</patientPosition>
    <relativeTablePosition><x>0</x><y>0</y><z>10</z></relativeTablePosition></measurementInformation>
  <experimentalConditions><H1resonanceFrequency_Hz>63642459</H1resonanceFrequency_Hz></experimentalConditions>
  <encoding>
    <encodedSpace><matrixSize><x>256</x><y>140</y><z>1</z></matrixSize>
      <fieldOfView_mm><x>600</x><y>328.15</y><z>5</z></fieldOfView_mm></encodedSpace>
    <reconSpace><matrixSize><x>128</x><y>116</y><z>1</z></matrixSize>
      <fieldOfView_mm><x>300</x><y>271.875</y><z>5</z></fieldOfView_mm></reconSpace>
    <encodingLimits><kspace_encoding_step_1><minimum>0</minimum><maximum>83</maximum>
      <center>28</center></kspace_encoding_step_1></encodingLimits>
    <trajectory>cartesian</trajectory>
    <parallelImaging><accelerationFactor><kspace_encoding_step_1>2</kspace_encoding_step_1>
      <kspace_encoding_step_2>1</kspace_encoding_step_2></accelerationFactor>
      <calibrationMode>embedded</calibrationMode></parallelImaging>
  </encoding>
  <sequenceParameters><TR>4.6</TR><TE>2.35</TE><TE>4.35</TE></sequenceParameters>
  <userParameters><userParameterBase64><name>P</name><value>VGhpcyBpcw==</value></userParameterBase64>
  </userParameters>
  {custom}
</ismrmrdHeader>
"""


@pytest.mark.parametrize(
    ("version", "custom"),
    [("1", ""), ("2.0", ""), ("1", "<customXML><testName>v</testName></customXML>")],
)
def test_parse_scanner_converted_header(version, custom):
    """Dates, base64, parallel imaging, a partial-Fourier centre, odd versions, unknown elements."""
    text = CONVERTED_HEADER.format(version=version, custom=custom)
    header = parse_header(text + "\x00")
    geometry = encoding_geometry(header)
    assert geometry == EncodingGeometry(256, 140, 1, (600.0, 328.15, 5.0), 28, 128, 116, (300.0, 271.875, 5.0), 0, 83)
    # 2x readout oversampling onto a 128-sample grid; line 28, the centre, lands on row 70
    assert (geometry.readout_ratio, geometry.grid_readout, geometry.pe_offset) == (2.0, 128, 42)
    assert header.version == (1 if version == "1" else None)
    again = parse_header(serialize_header(header))
    assert again.sequenceParameters.TE == [2.35, 4.35]
    assert again.userParameters.userParameterBase64[0].value == b"This is"
    assert again.studyInformation == header.studyInformation


def test_non_ascii_header_survives_the_file(tmp_path, seq, centres, kspace):
    xml = build_header(
        seq, subject_id="Müller-Ø", slice_centres_mm=centres, fov_centre_mm=FOV_CENTRE
    )
    path = tmp_path / "u.h5"
    write_mrd_group(path, "metal", xml, acquisitions_from_kspace(kspace, seq, centres, FOV_CENTRE))
    with ismrmrd.Dataset(str(path), "metal", create_if_needed=False) as dset:
        assert parse_header(dset.read_xml_header()).subjectInformation.patientID == "Müller-Ø"
    assert (
        parse_header(read_mrd_group(path, "metal").header_xml).subjectInformation.patientID
        == "Müller-Ø"
    )
