"""Paired datasets: layout of DESIGN.md, ISMRMRD groups, determinism, resume, atomic writes."""

import json
import os

import h5py
import ismrmrd
import ismrmrd.xsd
import numpy as np
import pytest
import torch

from masc_gadget.config import load_config
from sim_scanner.dataset import layout
from sim_scanner.dataset.layout import SPLITS, read_manifest, subject_path, write_subject
from sim_scanner.dataset.simulate import assign_splits, simulate_dataset, simulate_subject

from tests.conftest import CONFIGS


def ifft2c_np(kspace):
    """Independent numpy reference of the image convention."""
    axes = (-2, -1)
    return np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(kspace, axes=axes), norm="ortho"), axes=axes)


def _files(folder):
    return sorted(folder.glob("*/*.h5"))


def test_layout_and_manifest(tiny_dataset, tiny_config):
    manifest = read_manifest(tiny_dataset)
    splits = manifest["splits"]
    assert set(splits) == set(SPLITS)
    ids = [s for split in SPLITS for s in splits[split]]
    assert len(ids) == len(set(ids)) == tiny_config["dataset"].subjects  # by subject, never mixed
    assert manifest["config"]["sequence"]["matrix"] == [32, 32]
    assert manifest["seed"] == tiny_config["dataset"].seed
    assert "torch" in manifest["versions"] and "masc" in manifest["versions"]
    for split in SPLITS:
        for sid in splits[split]:
            assert (tiny_dataset / split / f"{sid}.h5").is_file()
    assert not list(tiny_dataset.rglob("*.tmp"))


def test_subject_file_contents(tiny_dataset, tiny_config):
    seq = tiny_config["sequence"]
    for path in _files(tiny_dataset):
        with h5py.File(path, "r") as f:
            k_metal = f["kspace/metal"][()]
            k_clean = f["kspace/clean"][()]
            img_metal = f["images/metal"][()]
            img_clean = f["images/clean"][()]
            mask = f["implant_mask"][()]
            fmap = f["field_map_hz"][()]
            attrs = dict(f.attrs)
        shape = (seq.n_slices, seq.n_pe, seq.n_readout)
        assert k_metal.shape == k_clean.shape == img_metal.shape == mask.shape == fmap.shape == shape
        assert k_metal.dtype == np.complex64 and img_metal.dtype == np.float32 and mask.dtype == np.uint8
        np.testing.assert_allclose(img_metal, np.abs(ifft2c_np(k_metal)), atol=1e-5 * img_metal.max())
        np.testing.assert_allclose(img_clean, np.abs(ifft2c_np(k_clean)), atol=1e-5 * img_clean.max())
        assert np.isfinite(k_metal).all() and np.isfinite(k_clean).all()
        assert mask.any() and set(np.unique(mask)) <= {0, 1}
        assert np.abs(fmap).max() > 10 * seq.readout_bw_hz_per_px  # CoCr: kHz near the implant
        assert attrs["sequence.b0_t"] == seq.b0_t and attrs["sequence.te_ms"] == seq.te_ms
        assert attrs["implant.stem_material"] == "cocr"
        assert attrs["split"] in SPLITS and attrs["subject_id"] == path.stem
        json.loads(attrs["config_json"]), json.loads(attrs["anatomy_json"]), json.loads(attrs["implant_json"])
        # the metal partner differs from the clean one, most where the implant is
        diff = np.abs(img_metal - img_clean)
        assert diff.max() > 0.2 * img_clean.max()
        assert diff[mask.any(axis=(1, 2))].mean() > diff[~mask.any(axis=(1, 2))].mean() if (~mask.any(axis=(1, 2))).any() else True


@pytest.mark.parametrize("group", ["metal", "clean"])
def test_ismrmrd_groups_replay_the_kspace(tiny_dataset, tiny_config, group):
    seq = tiny_config["sequence"]
    path = _files(tiny_dataset)[0]
    with h5py.File(path, "r") as f:
        kspace = f[f"kspace/{group}"][()]
    dset = ismrmrd.Dataset(str(path), group, create_if_needed=False)
    try:
        header = ismrmrd.xsd.CreateFromDocument(dset.read_xml_header())
        enc = header.encoding[0]
        assert (enc.encodedSpace.matrixSize.x, enc.encodedSpace.matrixSize.y) == seq.matrix
        assert header.acquisitionSystemInformation.systemFieldStrength_T == pytest.approx(seq.b0_t)
        n = dset.number_of_acquisitions()
        assert n == seq.n_slices * seq.n_pe
        seen = np.zeros((seq.n_slices, seq.n_pe), bool)
        for i in range(n):
            acq = dset.read_acquisition(i)
            sl, line = acq.idx.slice, acq.idx.kspace_encode_step_1
            np.testing.assert_array_equal(acq.data[0], kspace[sl, line])
            seen[sl, line] = True
        assert seen.all()
    finally:
        dset.close()


def test_same_seed_same_subject_bit_for_bit(tiny_dataset, tiny_config, global_rng_guard):
    sid = read_manifest(tiny_dataset)["splits"]["test"][0]
    index = int(sid.split("-")[1])
    # the worker ran with cpu_count // workers torch threads; FFT sums are split by thread, so
    # bit-for-bit equality holds at the same thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    try:
        data = simulate_subject(index, tiny_config)
    finally:
        torch.set_num_threads(threads)
    with h5py.File(subject_path(tiny_dataset, sid), "r") as f:  # written by a worker process
        np.testing.assert_array_equal(f["kspace/metal"][()], data.kspace_metal)
        np.testing.assert_array_equal(f["kspace/clean"][()], data.kspace_clean)
    other = simulate_subject(index + 1, tiny_config)
    assert not np.array_equal(other.kspace_metal, data.kspace_metal)


def test_splits_are_by_subject_and_seeded():
    cfg = load_config(CONFIGS / "paper.yaml")["dataset"]
    splits = assign_splits(cfg)
    assert [len(splits[s]) for s in SPLITS] == [160, 20, 20]
    assert splits == assign_splits(cfg)
    assert len(set(sum(splits.values(), []))) == 200


def test_rerun_skips_finished_subjects_and_refuses_other_parameters(tmp_path, tiny_config):
    out = tmp_path / "data"
    config = load_config(CONFIGS / "tiny.yaml", ["dataset.subjects=2", "dataset.split_fractions=[0.5, 0.5, 0.0]"])
    simulate_dataset(config, out, progress=False)
    files = _files(out)
    assert len(files) == 2
    stamps = {p: p.stat().st_mtime_ns for p in files}
    files[0].unlink()
    (out / "train" / "stale.h5.tmp").write_bytes(b"half")
    simulate_dataset(config, out, progress=False)
    assert files[0].exists() and files[1].stat().st_mtime_ns == stamps[files[1]]
    assert not list(out.rglob("*.tmp"))
    changed = load_config(CONFIGS / "tiny.yaml", ["dataset.subjects=2", "dataset.split_fractions=[0.5, 0.5, 0.0]",
                                                  "sequence.b0_t=1.5"])
    with pytest.raises(ValueError, match="other parameters"):
        simulate_dataset(changed, out, progress=False)


def test_failed_write_leaves_nothing_behind(tmp_path, tiny_config, monkeypatch):
    data = simulate_subject(0, tiny_config)
    path = tmp_path / "sub-0000.h5"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(layout.h5py, "File", broken)
    with pytest.raises(OSError, match="disk full"):
        write_subject(data, path, tiny_config, "train")
    assert not path.exists() and not list(tmp_path.iterdir())


def test_clean_mode_no_implant_restores_anatomy(tiny_config):
    from masc_gadget.config import build_config

    sections = tiny_config.to_dict()
    sections["implant"]["clean_mode"] = "no_implant"
    config = build_config(sections)
    void = simulate_subject(1, tiny_config)
    restored = simulate_subject(1, config)
    np.testing.assert_array_equal(void.kspace_metal, restored.kspace_metal)
    inside = void.implant_mask.astype(bool)
    assert restored.images_clean[inside].mean() > void.images_clean[inside].mean()


@pytest.mark.gpu
def test_cuda_simulation_matches_cpu(tiny_config):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from masc_gadget.config import build_config

    sections = tiny_config.to_dict()
    sections["physics"]["device"] = "cuda"
    gpu = simulate_subject(0, build_config(sections))
    cpu = simulate_subject(0, tiny_config)
    scale = np.abs(cpu.kspace_metal).max()
    np.testing.assert_allclose(gpu.kspace_metal, cpu.kspace_metal, atol=1e-4 * scale)
    np.testing.assert_allclose(gpu.kspace_clean, cpu.kspace_clean, atol=1e-4 * scale)


def test_noise_at_configured_snr(tiny_config):
    from masc_gadget.config import build_config

    sections = tiny_config.to_dict()
    sections["physics"]["snr"] = 20.0
    noisy = simulate_subject(2, build_config(sections))
    clean = simulate_subject(2, tiny_config)
    np.testing.assert_array_equal(noisy.kspace_clean, clean.kspace_clean)  # ground truth stays noiseless
    noise = noisy.kspace_metal - clean.kspace_metal
    ref = clean.images_clean
    sigma = ref[ref > 0.1 * ref.max()].mean() / 20.0
    assert np.sqrt(np.mean(np.abs(noise) ** 2)) == pytest.approx(sigma, rel=0.1)
    sections["physics"]["noise_in_clean"] = True
    both = simulate_subject(2, build_config(sections))
    np.testing.assert_allclose(both.kspace_clean - clean.kspace_clean, noise, atol=1e-6)
