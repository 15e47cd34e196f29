"""Paired metal / clean datasets: one subject through the whole physics pipeline, and the
simulation of a whole dataset folder (DESIGN.md, "Data").

The folder and subject file format (manifest, splits, HDF5 groups, datasets and attributes) is
owned by :mod:`sim_scanner.dataset.layout`; this module simulates and hands it the data.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from masc_gadget.config import Config, build_config
from masc_gadget.core.kspace import fft2c, ifft2c, magnitude
from sim_scanner.dataset.layout import (
    SIM_SECTIONS,
    SPLITS,
    SubjectData,
    is_dataset,
    prepare_folder,
    read_manifest,
    same_simulation,
    sim_config_dict,
    subject_file,
    subject_id,
    subject_index,
    write_manifest,
    write_subject,
)
from sim_scanner.physics.coils import body_array, correlated_noise, noise_covariance
from sim_scanner.physics.grid import Grid
from sim_scanner.physics.implant import (
    ImplantParams,
    draw_implant,
    implant_chi_ppm,
    postop_labels,
    rasterize_implant,
    turned_implant,
)
from sim_scanner.physics.phantom import (
    Anatomy,
    PhantomConfig,
    draw_anatomy,
    rasterize_anatomy,
    tissue_maps,
    turned_landmarks,
)
from sim_scanner.physics.field import dipole_field_hz, fit_shim
from sim_scanner.physics.forward import (
    FAT_CHEMICAL_SHIFT_PPM,
    object_grid,
    synthesize_kspace,
    tse_signal,
)
from sim_scanner.physics.tissues import Tissue, tissue_properties
from sim_scanner.physics.variation import coil_sensitivity, draw_variation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetConfig:
    """What to simulate and how to split it (config section ``dataset``)."""

    name: str = "masc-hip"
    """Dataset name, written to the manifest."""
    subjects: int = 200
    """Number of subjects (paper: 200)."""
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    """Fractions of subjects in train / val / test (paper: 160 / 20 / 20); splits are by subject."""
    seed: int = 0
    """Master seed; subject i is simulated from SeedSequence([seed, i]) whatever the total count."""
    workers: int = 1
    """Parallel worker processes."""
    compression: Literal["none", "lzf", "gzip"] = "lzf"
    """HDF5 compression of the fast arrays."""

    def __post_init__(self) -> None:
        if self.subjects < 1:
            raise ValueError(f"subjects must be >= 1, got {self.subjects}")
        if len(self.split_fractions) != 3 or min(self.split_fractions) < 0:
            raise ValueError(f"split_fractions must be three fractions >= 0, got {self.split_fractions}")
        if not math.isclose(sum(self.split_fractions), 1.0, abs_tol=1e-6):
            raise ValueError(f"split_fractions must sum to 1, got {list(self.split_fractions)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")


def assign_splits(cfg: DatasetConfig) -> dict[str, list[str]]:
    """Subject ids per split: a seeded permutation, cut by the fractions (each non-empty split
    fraction gets at least one subject when there are enough subjects)."""
    n = cfg.subjects
    counts = [int(round(f * n)) for f in cfg.split_fractions]
    for i, f in enumerate(cfg.split_fractions):
        if f > 0 and counts[i] == 0 and n >= sum(1 for x in cfg.split_fractions if x > 0):
            counts[i] = 1
    while sum(counts) > n:
        counts[int(np.argmax(counts))] -= 1
    while sum(counts) < n:
        counts[0] += 1
    order = np.random.default_rng(np.random.SeedSequence([cfg.seed, 2**31 - 1])).permutation(n)
    splits, start = {}, 0
    for name, count in zip(SPLITS, counts):
        splits[name] = [subject_id(int(i)) for i in sorted(order[start : start + count])]
        start += count
    return splits


def image_of(kspace: np.ndarray) -> np.ndarray:
    """float32 magnitude image of k-space (the DESIGN image convention)."""
    return magnitude(torch.from_numpy(kspace)).numpy().astype(np.float32)


def _to_image_grid(volume: np.ndarray, grid: Grid, s: int, margin_cols: int, planes: list[int], n_pe: int,
                   n_ro: int, reduce: str) -> np.ndarray:
    """Average (or max) s x s blocks of the FOV part of ``volume`` at the given planes."""
    out = []
    for p in planes:
        sl = volume[p][:, margin_cols : margin_cols + n_ro * s].reshape(n_pe, s, n_ro, s)
        out.append(sl.mean(axis=(1, 3)) if reduce == "mean" else sl.max(axis=(1, 3)))
    return np.stack(out).astype(np.float32)


def simulate_subject(index: int, config: Config, progress=None) -> SubjectData:
    """Simulate subject ``index`` of the dataset described by ``config`` (bit-reproducible).

    The anatomy, implant and noise come from the subject's generator ``SeedSequence([seed,
    index])``; how the subject is scanned (section ``variation``: pose, field strength,
    bandwidth, SNR, coil shading, implant materials) from a second one, ``SeedSequence([seed,
    index, 1])``, so varying the scan leaves the anatomy alone. The patient is turned about z,
    the axis of B0, so the dipole field of the turned object is computed on the scanner's grid
    as it stands; the shim and the encoding directions are the scanner's.
    """
    dcfg, pcfg, icfg, seq, phys, vcfg = (config[name] for name in SIM_SECTIONS)
    rng = np.random.default_rng(np.random.SeedSequence([dcfg.seed, index]))
    # a trailing 0 would give the stream of [seed, index] again (SeedSequence ignores it)
    var = draw_variation(vcfg, seq, phys, icfg,
                         np.random.default_rng(np.random.SeedSequence([dcfg.seed, index, 1])))
    seq, phys, icfg = var.sequence(seq), var.physics(phys), var.implant(icfg)
    anatomy = draw_anatomy(pcfg, rng)
    implant = draw_implant(icfg, anatomy, rng)
    head = anatomy.hips[implant.side].head_centre_mm
    fov_centre = var.fov_centre((0.0, float(head[2])) if seq.fov_centre == "hip" else (0.0, 0.0))
    stack_centre = float(head[0]) + seq.slab_offset_mm
    grid = object_grid(seq, phys, fov_centre, stack_centre)
    slice_centres = [stack_centre + off for off in seq.slice_offsets_mm()]

    labels_post, labels_clean, components, maps_post, maps_clean = _rasterise(
        anatomy, implant, grid, pcfg, icfg.clean_mode, seq.b0_t, var.rotation_deg
    )
    chi_metal = maps_post.chi_ppm.copy()
    for comp, chi in implant_chi_ppm(implant).items():
        chi_metal[components == int(comp)] = chi
    chi_air = tissue_properties(seq.b0_t)[Tissue.AIR].chi_ppm
    chi_maps = [maps_post.chi_ppm - chi_air, chi_metal - chi_air]
    if icfg.clean_mode == "no_implant":
        chi_maps.append(maps_clean.chi_ppm - chi_air)
    fields = dipole_field_hz(chi_maps, grid.voxel_mm, seq.b0_t, phys.field_padding, phys.device)
    field_tissue, field_metal = fields[0], fields[1]
    field_clean = fields[2] if len(fields) > 2 else field_tissue.copy()
    signal_clean = tse_signal(maps_clean.pd, maps_clean.t1_ms, maps_clean.t2_ms, seq.tr_ms, seq.te_ms)
    signal_metal = tse_signal(maps_post.pd, maps_post.t1_ms, maps_post.t2_ms, seq.tr_ms, seq.te_ms)
    # the scanner's shim: fitted to the tissue field of the post-operative anatomy (the implant's
    # own field is far beyond what shim coils can correct), applied to both partners
    shim = fit_shim(field_tissue, signal_metal > 0, grid, phys.shim)
    if var.coil.strength > 0:  # receive shading, at each spin's own place, in both partners
        shading = coil_sensitivity(var.coil, signal_metal > 0, grid)
        signal_metal *= shading
        signal_clean *= shading
    del fields, field_tissue, chi_maps
    field_clean -= shim
    field_metal -= shim
    fmap_metal = field_metal.copy()
    if phys.fat_chemical_shift:
        shift = FAT_CHEMICAL_SHIFT_PPM * 1e-6 * seq.larmor_hz
        field_clean[labels_clean == Tissue.FAT] += shift
        field_metal[labels_post == Tissue.FAT] += shift
    del chi_metal, maps_post, maps_clean

    k_metal = synthesize_kspace(signal_metal, field_metal, grid, seq, phys, slice_centres, progress)
    k_clean = synthesize_kspace(signal_clean, field_clean, grid, seq, phys, slice_centres, progress)
    k_coils = None
    if phys.coils > 1:  # the array's k-space, from its own random stream: the single-coil data are unchanged
        k_coils = _coil_kspace(k_metal, k_clean, seq, phys,
                               np.random.default_rng(np.random.SeedSequence([dcfg.seed, index, 2])))
    k_metal, k_clean = _add_noise(k_metal, k_clean, phys, rng)
    fmap, implant_mask = _image_grid_maps(fmap_metal, components, grid, seq, phys, slice_centres)
    return SubjectData(
        subject_id=subject_id(index),
        kspace_metal=k_metal,
        kspace_clean=k_clean,
        images_metal=image_of(k_metal),
        images_clean=image_of(k_clean),
        implant_mask=implant_mask,
        field_map_hz=fmap,
        slice_centres_mm=[float(v) for v in slice_centres],
        fov_centre_mm=fov_centre,
        anatomy=dict(anatomy.params),
        implant=implant.to_dict(),
        scanner=var.to_dict(),
        kspace_metal_coils=k_coils,
    )


def _rasterise(anatomy: Anatomy, implant: ImplantParams, grid: Grid, pcfg: PhantomConfig,
               clean_mode: str, b0_t: float, rotation_deg: float):
    """The patient turned by ``rotation_deg`` about z, with its implant, on ``grid`` (scanner
    coordinates): post-operative and clean labels (uint8 [z, y, x]), implant components, and
    the property maps of both partners (the same object when the clean one keeps the void)."""
    labels_pre = rasterize_anatomy(anatomy, grid, pcfg, rotation_deg)
    placed = turned_implant(implant, rotation_deg)
    components = rasterize_implant(placed, grid)
    landmarks = turned_landmarks(anatomy, rotation_deg)
    labels_post = postop_labels(labels_pre, components, placed, landmarks, grid)
    maps_post = tissue_maps(labels_post, anatomy, grid, b0_t, pcfg, rotation_deg)
    if clean_mode == "no_implant":
        labels_clean = labels_pre
        maps_clean = tissue_maps(labels_pre, anatomy, grid, b0_t, pcfg, rotation_deg)
    else:
        labels_clean, maps_clean = labels_post, maps_post
    return labels_post, labels_clean, components, maps_post, maps_clean


def _noise_sigma(k_clean: np.ndarray, phys: Any) -> float:
    """The k-space noise std of ``phys.snr``: the mean clean tissue signal over the SNR."""
    ref = image_of(k_clean)
    return float(ref[ref > 0.1 * ref.max()].mean()) / phys.snr


def _coil_kspace(k_metal: np.ndarray, k_clean: np.ndarray, seq: Any, phys: Any,
                 rng: np.random.Generator) -> np.ndarray:
    """(slices, coils, PE, RO) complex64: the noiseless metal k-space seen by the body array of
    ``phys.coils`` elements (:mod:`sim_scanner.physics.coils`), with noise of ``phys.snr``
    correlated by ``phys.coil_correlation``."""
    sens = body_array(phys.coils, k_metal.shape[1:], tuple(seq.fov_mm))
    image = ifft2c(torch.from_numpy(np.ascontiguousarray(k_metal)))  # (S, PE, RO) complex
    coils = fft2c(torch.from_numpy(sens)[None] * image[:, None]).numpy()
    if phys.snr > 0:
        coils = coils + correlated_noise(coils.shape, noise_covariance(phys.coils, phys.coil_correlation),
                                         _noise_sigma(k_clean, phys), rng)
    return coils.astype(np.complex64)


def _add_noise(k_metal: np.ndarray, k_clean: np.ndarray, phys: Any,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Complex Gaussian noise at ``phys.snr`` (vs the mean clean tissue signal) on the metal
    partner, and the same noise on the clean one when ``phys.noise_in_clean``."""
    if phys.snr > 0:
        sigma = _noise_sigma(k_clean, phys)
        noise = (rng.standard_normal(k_metal.shape) + 1j * rng.standard_normal(k_metal.shape)) * (
            sigma / math.sqrt(2)
        )
        k_metal = (k_metal + noise).astype(np.complex64)
        if phys.noise_in_clean:
            k_clean = (k_clean + noise).astype(np.complex64)
    return k_metal, k_clean


def _image_grid_maps(fmap_metal: np.ndarray, components: np.ndarray, grid: Grid, seq: Any, phys: Any,
                     slice_centres: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The field map at each slice centre and the implant mask of each slice, on the image grid."""
    s = phys.inplane_oversampling
    margin_cols = (grid.shape[2] - seq.n_readout * s) // 2
    z = grid.axis_mm(0)
    centre_planes = [int(np.argmin(np.abs(z - zc))) for zc in slice_centres]
    fmap = _to_image_grid(fmap_metal, grid, s, margin_cols, centre_planes, seq.n_pe, seq.n_readout, "mean")
    masks = []
    for zc in slice_centres:
        planes = np.nonzero(np.abs(z - zc) < seq.slice_thickness_mm / 2)[0]
        occupied = (components[planes] > 0).any(axis=0)[None].astype(np.uint8)
        masks.append(_to_image_grid(occupied, grid, s, margin_cols, [0], seq.n_pe, seq.n_readout, "max")[0])
    return fmap, np.stack(masks).astype(np.uint8)


def _worker(index: int, config_dict: dict[str, Any], path: str, split: str, threads: int) -> str:
    torch.set_num_threads(threads)
    config = build_config(config_dict)
    data = simulate_subject(index, config)
    write_subject(data, Path(path), config, split)
    return data.subject_id


def launcher_rank() -> tuple[int, int]:
    """(rank, number of ranks) of a process started by ``torchrun`` (``RANK``, ``WORLD_SIZE``);
    (0, 1) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    if not 0 <= rank < world:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}")
    return rank, world


def simulate_dataset(config: Config, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """Simulate every subject of ``config`` into ``out``; finished subjects are skipped, so an
    interrupted run resumes. Returns the manifest.

    Started by ``torchrun`` (``RANK`` / ``WORLD_SIZE``, on one node or several sharing the
    folder), each rank simulates the missing ones of every ``WORLD_SIZE``-th subject, from its
    ``RANK`` (of the whole list, so ranks agree however far the others are). Ranks need not
    talk to each other: every subject file is written atomically and
    belongs to one rank, rank 0 writes the manifest, and a rerun (any number of ranks) skips the
    finished subjects. torchrun is used as the launcher only, so the same command scales from one
    process to many nodes without another engine."""
    from tqdm.auto import tqdm

    out = Path(out)
    dcfg = config["dataset"]
    rank, world = launcher_rank()
    splits = assign_splits(dcfg)
    if is_dataset(out):
        old = read_manifest(out)
        if not same_simulation(old, config, splits):
            raise ValueError(
                f"{out} already holds a dataset simulated with other parameters; "
                "choose another --out or delete it"
            )
    prepare_folder(out, clean=world == 1)
    if rank == 0:
        manifest = write_manifest(out, config, splits)

    # each rank owns every world-th subject of the whole dataset (fixed whatever is already on
    # disk, so ranks that start at different moments agree), and simulates those still missing
    subjects = [(subject_index(sid), subject_file(out, split, sid), split)
                for split, ids in splits.items() for sid in ids]
    todo = [item for item in subjects if not item[1].exists()]
    done = dcfg.subjects - len(todo)
    if done and rank == 0:
        log.info("%d of %d subjects already simulated in %s; skipping them", done, dcfg.subjects, out)
    todo = [item for item in subjects[rank::world] if not item[1].exists()]
    log.info("simulating %d subjects into %s with %d worker(s)%s", len(todo), out, dcfg.workers,
             f" (rank {rank} of {world})" if world > 1 else "")
    bar = tqdm(total=len(todo), unit="subject", desc="simulate", disable=not progress or rank != 0)
    try:
        if dcfg.workers == 1 or len(todo) <= 1:
            for index, path, split in todo:
                data = simulate_subject(index, config)
                write_subject(data, path, config, split)
                bar.update()
        else:
            threads = max(1, (os.cpu_count() or 1) // dcfg.workers)
            sim = sim_config_dict(config)
            with ProcessPoolExecutor(dcfg.workers, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(_worker, i, sim, str(p), s, threads) for i, p, s in todo]
                for future in as_completed(futures):
                    future.result()
                    bar.update()
    finally:
        bar.close()
    if world > 1:
        log.info("rank %d of %d: its %d subjects are written", rank, world, len(todo))
        deadline = time.monotonic() + 60
        while not is_dataset(out) and time.monotonic() < deadline:  # rank 0 writes it first thing
            time.sleep(0.1)
        return read_manifest(out)
    log.info("dataset %s complete: %s", out, ", ".join(f"{k} {len(v)}" for k, v in splits.items()))
    return manifest
