"""The cross-dataset importer: fastMRI, ISMRMRD and DICOM files round-trip; the 2D artifact model
conserves signal away from the implant and moves it near it; the written set loads for eval."""

import numpy as np
import pytest
import torch

from masc_gadget.config import load_config
from sim_scanner.dataset.external import Volume, prepare_slice, read_volumes, simulate_external
from sim_scanner.physics.artifact2d import Artifact2DConfig, add_implant, displace_readout, field_ppm
from training.data import load_split

from tests.conftest import CONFIGS


def _phantom(n=48, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:n, :n]
    image = ((y - n / 2) ** 2 / (0.4 * n) ** 2 + (x - n / 2) ** 2 / (0.35 * n) ** 2 < 1).astype(float)
    return image * (1.0 + 0.2 * rng.random((n, n)))


def _ifft2c(k):
    return np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(k, axes=(-2, -1)), norm="ortho"), axes=(-2, -1))


def _fft2c(x):
    return np.fft.fftshift(np.fft.fft2(np.fft.ifftshift(x, axes=(-2, -1)), norm="ortho"), axes=(-2, -1))


def _header(n_x, n_y, oversampling=1):
    """A minimal ISMRMRD header: an encoded matrix of n_x x n_y over 300 mm times the readout
    oversampling, reconstructed on n_x / oversampling x n_y over 300 mm."""
    return (f"<?xml version='1.0'?><ismrmrdHeader xmlns='http://www.ismrm.org/ISMRMRD'>"
            f"<experimentalConditions><H1resonanceFrequency_Hz>127000000</H1resonanceFrequency_Hz>"
            f"</experimentalConditions><encoding><encodedSpace><matrixSize><x>{n_x}</x><y>{n_y}</y><z>1</z>"
            f"</matrixSize><fieldOfView_mm><x>{300 * oversampling}</x><y>300</y><z>3</z></fieldOfView_mm>"
            f"</encodedSpace><reconSpace><matrixSize><x>{n_x // oversampling}</x><y>{n_y}</y><z>1</z></matrixSize>"
            f"<fieldOfView_mm><x>300</x><y>300</y><z>3</z></fieldOfView_mm></reconSpace><encodingLimits/>"
            f"<trajectory>cartesian</trajectory></encoding></ismrmrdHeader>")


def test_fastmri_file_round_trips(tmp_path):
    import h5py

    images = np.stack([_phantom(seed=s) for s in range(3)])
    path = tmp_path / "file1000.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("kspace", data=_fft2c(images).astype(np.complex64))
        f.create_dataset("reconstruction_esc", data=images.astype(np.float32))
        f.create_dataset("ismrmrd_header", data=b"<ismrmrdHeader/>")
    (volume,) = read_volumes(path)
    assert volume.source == "fastmri" and np.allclose(volume.images, images, atol=1e-6)
    with h5py.File(path, "a") as f:  # without the reconstruction: the magnitude of the k-space's IFFT
        del f["reconstruction_esc"]
    (volume,) = read_volumes(path)
    assert np.allclose(volume.images, images, atol=1e-5)


def test_ismrmrd_file_round_trips_with_coil_combination(tmp_path):
    import ismrmrd

    n, coils = 32, 2
    image = _phantom(n)
    sens = np.stack([np.full((n, n), 0.6), np.full((n, n), 0.8)])  # RSS of these is 1
    k = _fft2c(sens * image)
    xml = _header(n, n)
    path = tmp_path / "scan.h5"
    dset = ismrmrd.Dataset(str(path), "dataset", create_if_needed=True)
    dset.write_xml_header(xml)
    for pe in range(n):
        acq = ismrmrd.Acquisition.from_array(k[:, pe, :].astype(np.complex64))
        acq.idx.kspace_encode_step_1 = pe
        dset.append_acquisition(acq)
    dset.close()
    (volume,) = read_volumes(path)
    assert volume.source == "ismrmrd" and volume.images.shape == (1, n, n)
    assert np.allclose(volume.images[0], image, atol=1e-4)


def test_dicom_file_and_series_round_trip(tmp_path):
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

    def write(path, pixels, number):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = MRImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
        ds.Modality, ds.InstanceNumber = "MR", number
        ds.Rows, ds.Columns = pixels.shape
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.RescaleSlope, ds.RescaleIntercept = 2, 0
        ds.PixelData = pixels.astype(np.uint16).tobytes()
        ds.save_as(str(path), enforce_file_format=True)

    slices = [(1000 * _phantom(seed=s)).astype(np.uint16) for s in range(3)]
    series = tmp_path / "series"
    series.mkdir()
    for i in (2, 0, 1):  # written out of order: read back by InstanceNumber
        write(series / f"IM{i:04d}", slices[i], i + 1)
    (volume,) = read_volumes(series)
    assert volume.source == "dicom" and np.array_equal(volume.images, 2.0 * np.stack(slices))
    (single,) = read_volumes(series / "IM0001")
    assert np.array_equal(single.images[0], 2.0 * slices[1])


def test_unknown_files_get_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a fastMRI / ISMRMRD HDF5, NIfTI or DICOM file"):
        read_volumes(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError):
        read_volumes(tmp_path / "missing.h5")


def test_model_conserves_signal_away_from_the_implant_and_moves_it_near_it():
    image = np.zeros((96, 96))
    image[4:-4, 4:-4] = 1.0  # an object inside the field of view: no signal leaves it
    cfg = Artifact2DConfig(chi_ppm=200.0, semi_axes_fraction=(0.04, 0.03), shift_fraction=0.0, rotation_deg=0.0)
    result = add_implant(image, cfg, np.random.default_rng(0))
    assert result.implant.sum() > 0 and (result.clean[result.implant] == 0).all()
    y, x = np.mgrid[:96, :96]
    r = np.hypot(y - 48, x - 48)
    inner = np.zeros_like(image, dtype=bool)
    inner[10:-10, 10:-10] = True  # away from the object's edges too (a sub-pixel shift moves an edge)
    far = (r > 36) & inner
    assert np.abs(result.metal - result.clean)[far].max() < 0.02  # the field falls off as 1 / r^2
    near = (r > 5) & (r < 14)
    moved = np.abs(result.metal - result.clean)[near]
    assert moved.max() > 0.5 and (result.metal[near] > 1.2).any() and (result.metal[near] < 0.5).any()
    # displacement moves signal and loses none that stays in the image
    shifts = np.random.default_rng(1).uniform(-3, 3, (96, 96)) * (r < 30)
    shifted = displace_readout(image, shifts)
    assert shifted.sum() == pytest.approx(image.sum(), rel=1e-12)
    # the 2D dipole field of a cylinder perpendicular to B0 (along y): dB/B0 = chi/2 a^2 / r^2 cos 2 phi outside
    disc = (r <= 6).astype(float)
    field = field_ppm(disc * 100.0, pad=4)
    area_radius2 = disc.sum() / np.pi  # the pixelated disc's effective a^2
    assert field[48 + 12, 48] == pytest.approx(50.0 * area_radius2 / 144, rel=0.1)  # along B0: phi = 0
    assert field[48, 48 + 12] == pytest.approx(-50.0 * area_radius2 / 144, rel=0.1)  # across B0: phi = 90 deg


def test_external_dataset_loads_as_a_test_split(tmp_path):
    config = load_config(CONFIGS / "tiny.yaml")
    volumes = [Volume("a", np.stack([_phantom(40, s) for s in range(2)]), "test"),
               Volume("b", _phantom(56, 5)[None], "test")]
    simulate_external(config, volumes, tmp_path / "ext", draws=2, progress=False)
    data = load_split(tmp_path / "ext", "test")
    assert len(data) == 6 and data.n_pe == 32
    assert data.implant_mask.sum() > 0
    # the clean k-space is the FFT of the clean target: zero-filled with every line equals it
    image = np.abs(_ifft2c(data.kspace_clean[0].numpy()))
    assert np.allclose(image, data.target[0].numpy(), atol=1e-4)
    assert prepare_slice(_phantom(40), (32, 32)).shape == (32, 32)


def test_an_imported_volume_keeps_its_own_slice_positions_and_its_preview_says_so(tmp_path):
    from sim_scanner.dataset.layout import read_manifest, read_subject, subject_path
    from sim_scanner.dataset.preview import write_preview

    config = load_config(CONFIGS / "tiny.yaml")
    volumes = [Volume("dicom", np.stack([_phantom(40, s) for s in range(3)]), "dicom", np.array([0.0, 4.0, 12.0])),
               Volume("nifti", np.stack([_phantom(40, s) for s in range(2)]), "nifti")]
    simulate_external(config, volumes, tmp_path / "ext", progress=False)
    manifest = read_manifest(tmp_path / "ext")
    first, second = manifest["splits"]["test"]
    dicom = read_subject(subject_path(tmp_path / "ext", first, manifest))
    assert list(dicom.slice_centres_mm) == [0.0, 4.0, 12.0] and dicom.anatomy["external"]["positions"] is True
    assert read_subject(subject_path(tmp_path / "ext", second, manifest)).anatomy["external"]["positions"] is False
    for subject in (first, second):
        assert write_preview(tmp_path / "ext", subject, tmp_path / f"{subject}.png").stat().st_size > 5000


def test_a_held_out_set_is_evaluated_with_the_population_order_of_the_training_set(tmp_path, tiny_dataset):
    from training.evaluation.evaluate import evaluate

    config = load_config(CONFIGS / "tiny.yaml", ["eval.accelerations={10x: [1, 2]}"])
    simulate_external(config, [Volume("a", np.stack([_phantom(40, s) for s in range(3)]), "test")],
                      tmp_path / "ext", progress=False)
    with pytest.raises(ValueError, match="train"):  # the held-out set has no training split of its own
        evaluate(config, tmp_path / "ext", "test", ["population"], None, progress=False)
    trained_on = load_config(CONFIGS / "tiny.yaml", ["eval.accelerations={10x: [1, 2]}",
                                                     f"eval.population_data={tiny_dataset}"])
    results, _ = evaluate(trained_on, tmp_path / "ext", "test", ["population", "random"], None, progress=False)
    assert results["population"]["data"] == str(tiny_dataset) and results["n_slices"] == 3


def _write_dicom(path, pixels, number, series_uid, modality="MR", description="t1", syntax=None, position=None):
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.encaps import encapsulate
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, MRImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = MRImageStorage if modality == "MR" else CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = syntax or ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.Modality, ds.InstanceNumber, ds.SeriesInstanceUID, ds.SeriesDescription = modality, number, series_uid, description
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    if position is not None:
        ds.ImagePositionPatient, ds.ImageOrientationPatient = [0, 0, position], [1, 0, 0, 0, 1, 0]
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
    if syntax is None:
        ds.PixelData = pixels.astype(np.uint16).tobytes()
    else:  # a compressed file this machine has no decoder for
        ds.PixelData = encapsulate([b"\xff\xd8" + b"\0" * 32])
        ds["PixelData"].VR = "OB"
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(str(path), enforce_file_format=True)


def test_a_folder_imports_every_series_recursively_and_refuses_what_it_cannot_read(tmp_path, caplog):
    """Two MR series of different sizes in nested folders (one sorted by slice position against its
    instance numbers), a CT series and a JPEG-LS file without decoder: the MR series import, the
    others are one-line warnings that say why and what to install."""
    from pydicom.uid import JPEGLSLossless

    a = [(1000 * _phantom(n=32, seed=s)).astype(np.uint16) for s in range(3)]
    b = [(1000 * _phantom(n=24, seed=10 + s)).astype(np.uint16) for s in range(2)]
    for i, pixels in enumerate(a):  # instance numbers against the slice order: position decides
        _write_dicom(tmp_path / "patient" / "t1" / f"IM{i}", pixels, 10 - i, "1.2.3.1", position=float(i))
    for i, pixels in enumerate(b):
        _write_dicom(tmp_path / "patient" / "deeper" / "t2" / f"IM{i}.dcm", pixels, i + 1, "1.2.3.2", description="t2")
    _write_dicom(tmp_path / "patient" / "ct" / "CT0", a[0], 1, "1.2.3.3", modality="CT", description="pelvis")
    _write_dicom(tmp_path / "patient" / "jls" / "IM0", a[0], 1, "1.2.3.4", syntax=JPEGLSLossless)
    with caplog.at_level("WARNING"):
        volumes = read_volumes(tmp_path)
    by_size = {v.images.shape: v for v in volumes}
    assert sorted(by_size) == [(2, 24, 24), (3, 32, 32)]
    assert np.array_equal(by_size[3, 32, 32].images, np.stack(a).astype(float))
    said = [r.getMessage() for r in caplog.records]
    assert any("modality CT (pelvis), not MR" in m for m in said)
    assert any("JPEG-LS" in m and "pip install pylibjpeg pylibjpeg-libjpeg" in m for m in said)
    assert all("\n" not in m for m in said)
    from sim_scanner.dataset.external import ImportRefused

    with pytest.raises(ImportRefused, match="modality CT"):
        read_volumes(tmp_path / "patient" / "ct" / "CT0")
    with pytest.raises(ValueError, match="no importable .* modality CT"):
        read_volumes(tmp_path / "patient" / "ct")


def test_a_damaged_or_undecodable_file_costs_only_itself_and_is_named(tmp_path, caplog):
    """A series of 9 files with one JPEG-LS file (no decoder here) and one truncated file, seven
    exact copies of one image, a gap in the slice positions, and a series without a description:
    the series keeps its 7 readable distinct images, each refused file is named with its reason,
    copies and the gap are warnings, the positions are the series' own, and the names are the
    description or the folder."""
    from pydicom.uid import JPEGLSLossless

    from sim_scanner.dataset.external import ImportSummary

    images = [(1000 * _phantom(n=24, seed=s)).astype(np.uint16) for s in range(9)]
    series = tmp_path / "study" / "knee"
    positions = [0, 3, 6, 9, 12, 15, 24, 27, 30]  # 18 and 21 mm missing
    for i, (pixels, z) in enumerate(zip(images, positions)):
        _write_dicom(series / f"IM{i}", pixels, i + 1, "1.2.9.1", description="PD sag", position=float(z))
    _write_dicom(series / "IMjls", images[0], 20, "1.2.9.1", description="PD sag", syntax=JPEGLSLossless,
                 position=40.0)
    _write_dicom(series / "IMcut", images[1], 21, "1.2.9.1", description="PD sag", position=43.0)
    (series / "IMcut").write_bytes((series / "IMcut").read_bytes()[:-500])  # truncated pixel data
    copies = tmp_path / "study" / "copies"
    for i in range(7):
        _write_dicom(copies / f"C{i}", images[0], i + 1, "1.2.9.2", description="", position=5.0)
    summary = ImportSummary()
    with caplog.at_level("WARNING"):
        volumes = {v.name: v for v in read_volumes(tmp_path, summary)}
    assert sorted(volumes) == ["PD_sag", "study/copies"]
    knee = volumes["PD_sag"]
    assert knee.images.shape == (9, 24, 24) and np.array_equal(knee.images, np.stack(images).astype(float))
    np.testing.assert_allclose(knee.positions_mm, positions)
    assert volumes["study/copies"].images.shape == (1, 24, 24)
    assert len(summary.skipped) == 2
    assert any("IMjls" in r and "pip install pylibjpeg pylibjpeg-libjpeg" in r for r in summary.skipped)
    assert any("IMcut" in r for r in summary.skipped)
    assert any("6 exact copies" in w for w in summary.warnings)
    assert any("missing slice positions" in w and "15.0 to 24.0 mm" in w for w in summary.warnings)
    said = summary.render()
    assert "imported 2 volume(s)" in said and "skipped 2" in said and "IMcut" in said
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_nifti_volumes_import(tmp_path):
    nibabel = pytest.importorskip("nibabel")
    data = np.stack([_phantom(n=20, seed=s) for s in range(4)], axis=-1).transpose(1, 0, 2)  # (x, y, z)
    nibabel.save(nibabel.Nifti1Image(data.astype(np.float32), np.eye(4)), str(tmp_path / "head.nii.gz"))
    (volume,) = read_volumes(tmp_path / "head.nii.gz")
    assert volume.name == "head" and volume.source == "nifti" and volume.images.shape == (4, 20, 20)
    np.testing.assert_allclose(volume.images[2], _phantom(n=20, seed=2), rtol=1e-6)
    assert [v.name for v in read_volumes(tmp_path)] == ["head"]


def test_volumes_go_to_the_named_splits_whole_and_several_folders_load_as_one(tmp_path, tiny_dataset):
    from sim_scanner.dataset.external import assign_splits

    config = load_config(CONFIGS / "tiny.yaml")
    volumes = [Volume(name, np.stack([_phantom(40, s + i) for s in range(n)]), "test")
               for i, (name, n) in enumerate((("dipy-a", 2), ("dipy-b", 1), ("nilearn-c", 3)))]
    splits = assign_splits(volumes, train=["nilearn"], val=["dipy-b"])
    assert splits == ["test", "val", "train"]
    manifest = simulate_external(config, volumes, tmp_path / "real", progress=False, splits=splits)
    assert manifest["splits"] == {"train": ["sub-0002"], "val": ["sub-0001"], "test": ["sub-0000"]}
    assert [v["split"] for v in manifest["external"]] == splits
    both = load_split(f"{tiny_dataset},{tmp_path / 'real'}", "train")
    hip = load_split(tiny_dataset, "train")
    assert len(both) == len(hip) + 3
    assert both.subjects[-1] == "real/sub-0002" and both.subjects[0].startswith(f"{tiny_dataset.name}/")
    assert torch.equal(both.target[: len(hip)], hip.target)
    with pytest.raises(ValueError, match="--val 'nope' matches no volume; the volumes are: dipy-a, dipy-b, nilearn-c"):
        assign_splits(volumes, val=["nope"])
    with pytest.raises(ValueError, match="named for both train and val"):
        assign_splits(volumes, train=["dipy"], val=["dipy-b"])
    simulate_external(config, volumes[:1], tmp_path / "only-train", progress=False, splits=["train"])
    with pytest.raises(ValueError, match="no subject of split 'val' in"):
        load_split([tmp_path / "only-train", tmp_path / "only-train"], "val")


def test_builtin_sources_are_named_and_an_unknown_one_is_refused():
    from sim_scanner.dataset.external import BUILTIN, builtin_volumes

    assert list(BUILTIN) == ["pydicom", "scikit-image", "nilearn", "dipy", "pydicom-examples", "matplotlib",
                             "procedural"]
    with pytest.raises(ValueError, match="unknown builtin source\\(s\\) pydicom-data: choose from pydicom"):
        builtin_volumes(["pydicom-data"])
    volumes = builtin_volumes(["pydicom", "pydicom-examples", "matplotlib"])
    assert [(v.name, v.images.shape) for v in volumes] == [
        ("pydicom-MR_small", (1, 64, 64)), ("pydicom-overlay", (1, 300, 484)), ("matplotlib-s1045", (1, 256, 256))]


def test_augmented_training_draws_are_the_slice_in_one_of_its_eight_orientations():
    from sim_scanner.dataset.external import augment

    image = np.arange(12.0).reshape(3, 4)
    seen = {augment(image, np.random.default_rng(seed)).tobytes() for seed in range(200)}
    orientations = {np.ascontiguousarray(m).tobytes() for k in range(4)
                    for m in (np.rot90(image, k), np.rot90(image, k)[:, ::-1])}
    assert seen == orientations


def test_ismrmrd_import_skips_what_is_not_an_image_line_and_crops_readout_oversampling(tmp_path):
    """The import reads through the one MRD reader: noise and separate reference lines are left
    out, and a 2x oversampled readout comes back at the recon field of view."""
    import ismrmrd

    from masc_gadget.mrd.header import NOT_IMAGING, is_imaging_line

    n = 32
    image = np.zeros((n, 2 * n))
    image[:, n // 2:n // 2 + n] = _phantom(n)  # the object inside the central recon field of view
    k = _fft2c(image)
    xml = _header(2 * n, n, oversampling=2)
    path = tmp_path / "oversampled.h5"
    dset = ismrmrd.Dataset(str(path), "dataset", create_if_needed=True)
    dset.write_xml_header(xml)
    junk = ismrmrd.Acquisition.from_array(np.full((1, 2 * n), 1e3, dtype=np.complex64))
    junk.set_flag(ismrmrd.ACQ_IS_NOISE_MEASUREMENT)
    dset.append_acquisition(junk)
    for pe in range(n):
        acq = ismrmrd.Acquisition.from_array(k[None, pe, :].astype(np.complex64))
        acq.idx.kspace_encode_step_1 = pe
        dset.append_acquisition(acq)
    reference = ismrmrd.Acquisition.from_array(np.full((1, 2 * n), 1e3, dtype=np.complex64))
    reference.idx.kspace_encode_step_1 = n // 2
    reference.set_flag(ismrmrd.ACQ_IS_PARALLEL_CALIBRATION)  # a separate reference line, after the image's
    dset.append_acquisition(reference)
    dset.close()
    (volume,) = read_volumes(path)
    assert volume.images.shape == (1, n, n)
    assert np.allclose(volume.images[0], _phantom(n), atol=1e-4)
    assert not is_imaging_line(reference.flags) and not is_imaging_line(junk.flags)
    both = ismrmrd.Acquisition()
    both.set_flag(ismrmrd.ACQ_IS_PARALLEL_CALIBRATION_AND_IMAGING)
    assert is_imaging_line(both.flags) and is_imaging_line(0) and NOT_IMAGING & (1 << (ismrmrd.ACQ_IS_NOISE_MEASUREMENT - 1))


def test_dead_leaves_are_seeded_cover_the_image_and_keep_a_body_outline():
    import numpy as np

    from sim_scanner.dataset.external import BUILTIN, dead_leaves

    a = dead_leaves(64, np.random.default_rng(3), leaves=400)
    b = dead_leaves(64, np.random.default_rng(3), leaves=400)
    np.testing.assert_array_equal(a, b)
    assert np.isfinite(a).all() and a.min() >= 0 and a.max() <= 1
    assert a[0, 0] == 0 and a[32, 32] > 0  # dark outside the body, tissue inside
    full = dead_leaves(64, np.random.default_rng(4), leaves=400, body=False)
    assert (full > 0).mean() > 0.95 and len(np.unique(full.round(3))) > 20  # many leaves, the whole field
    volumes = BUILTIN["procedural"](count=2, slices=2, size=32)
    assert [v.name for v in volumes] == ["procedural-dead-leaves-0", "procedural-dead-leaves-1"]
    assert volumes[0].images.shape == (2, 32, 32) and volumes[0].source == "builtin:procedural"
    from sim_scanner.dataset import external

    called = []
    real = {name: (lambda name=name: called.append(name) or []) for name in BUILTIN}
    original = dict(external.BUILTIN)
    try:
        external.BUILTIN.update(real)
        with pytest.raises(ValueError, match="no builtin real MR image"):
            external.builtin_volumes()
    finally:
        external.BUILTIN.update(original)
    assert "procedural" not in called and "pydicom" in called  # real images only, unless asked by name
