"""``masc simulate``: datasets, previews and single-object physics checks."""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

log = logging.getLogger("masc.simulate")


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    sim = subparsers.add_parser(
        "simulate", help="simulate paired metal / clean datasets and physics checks",
        description="Physics simulation of paired metal / clean MRI data.",
    )
    actions = sim.add_subparsers(dest="action", metavar="ACTION", required=True)

    ds = actions.add_parser("dataset", parents=[common], help="simulate a paired dataset folder",
                            description="Simulate a paired metal / clean dataset (resumable).")
    ds.add_argument("--out", required=True, metavar="DIR", help="dataset folder to write")
    ds.add_argument("--subjects", type=int, metavar="N", help="override dataset.subjects")
    ds.add_argument("--workers", type=int, metavar="N", help="override dataset.workers")
    ds.set_defaults(func=cmd_dataset)

    ex = actions.add_parser("external", parents=[common], help="paired dataset from real images (cross-dataset test)",
                            description="Import real MR images (fastMRI single-coil or ISMRMRD HDF5, DICOM) and add "
                            "a simplified implant's artifacts with the 2D model (section artifact2d): a held-out test "
                            "set in the project's layout. 'builtin' uses the real MR images shipped inside installed "
                            "packages (nothing is downloaded).")
    ex.add_argument("--source", required=True, metavar="PATH|builtin[:PKG,...]",
                    help="a file, a folder, or builtin (the real MR images inside installed packages: pydicom, "
                    "scikit-image, nilearn, dipy; builtin:pydicom,dipy picks some)")
    ex.add_argument("--train", metavar="NAMES", help="volumes (names or name prefixes, comma-separated) for the "
                    "train split; a volume is one subject, never divided (default: every volume in test)")
    ex.add_argument("--val", metavar="NAMES", help="volumes for the validation split (as --train)")
    ex.add_argument("--train-draws", type=int, metavar="N", help="implant poses per slice of a training volume "
                    "(default --draws)")
    ex.add_argument("--augment", action="store_true", help="each training draw in a random orientation (90-degree "
                    "rotations and mirroring)")
    ex.add_argument("--out", required=True, metavar="DIR", help="dataset folder to write")
    ex.add_argument("--draws", type=int, default=1, metavar="N",
                    help="implant poses drawn per imported slice (default 1)")
    ex.set_defaults(func=cmd_external)

    st = actions.add_parser("stream", parents=[common], help="a subject's scan as a scanner records it (ISMRMRD file)",
                            description="Rewrite one subject's ISMRMRD group the way a scanner would have recorded "
                            "it (readout oversampling, a receive array with correlated noise, a line order, "
                            "asymmetric echo, partial Fourier, channel-mask style) and write it as an ISMRMRD file "
                            "that gadgetron_ismrmrd_client or python-ismrmrd-server's client.py can send.")
    st.add_argument("subject", metavar="SUBJECT.h5", help="a subject file of a dataset folder")
    st.add_argument("--out", required=True, metavar="FILE.h5", help="ISMRMRD file to write (group 'dataset')")
    st.add_argument("--group", default="metal", choices=["metal", "clean"], help="which partner (default metal)")
    st.add_argument("--oversampling", type=int, default=1, choices=[1, 2], help="readout oversampling (default 1)")
    st.add_argument("--coils", type=int, default=0, metavar="N", help="receive coils (default: the subject's own)")
    st.add_argument("--noise", type=float, default=0.0, metavar="SD", help="noise per sample, as a fraction of "
                    "the k-space's largest magnitude (default 0)")
    st.add_argument("--noise-correlation", type=float, default=0.0, metavar="RHO",
                    help="noise correlation of neighbouring channels (default 0)")
    st.add_argument("--order", default="linear", choices=["linear", "reverse", "centric", "interleaved"],
                    help="line order per slice (default linear)")
    st.add_argument("--asymmetric-echo", type=float, default=0.0, metavar="F",
                    help="fraction of readout samples before the echo left out (default 0)")
    st.add_argument("--partial-fourier", type=float, default=1.0, metavar="F",
                    help="fraction of phase-encoding lines acquired (default 1)")
    st.add_argument("--channel-mask", default="set", choices=["set", "none", "first"],
                    help="how channel_mask is written (default set: a bit per channel)")
    st.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    st.set_defaults(func=cmd_stream)

    pv = actions.add_parser("preview", parents=[common], help="PNG preview of one subject",
                            description="Clean, metal, difference, implant mask and field map.")
    pv.add_argument("folder", metavar="DIR", help="dataset folder")
    pv.add_argument("--subject", metavar="ID", help="subject id (default: first test subject)")
    pv.add_argument("--out", required=True, metavar="FILE.png")
    pv.add_argument("--slices", type=int, default=4, metavar="N", help="slices to show (default 4)")
    pv.set_defaults(func=cmd_preview)

    sp = actions.add_parser("sphere", parents=[common], help="field map of a single sphere",
                            description="Field map of a sphere centred in the grid (B0 along z), "
                            "for validation against the analytic dipole solution.")
    sp.add_argument("--radius-mm", type=float, required=True)
    sp.add_argument("--chi-ppm", type=float, required=True,
                    help="susceptibility of the sphere relative to its surroundings (ppm)")
    sp.add_argument("--b0", type=float, default=3.0, help="field strength, tesla (default 3)")
    sp.add_argument("--voxel-mm", type=float, default=1.0)
    sp.add_argument("--size", type=int, metavar="N",
                    help="grid points per axis (default: 8 radii across)")
    sp.add_argument("--out", required=True, metavar="FILE.h5")
    sp.set_defaults(func=cmd_sphere)


def cmd_dataset(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from sim_scanner.dataset.layout import split_counts
    from sim_scanner.dataset.simulate import simulate_dataset

    overrides = list(args.overrides)
    if args.subjects is not None:
        overrides.append(f"dataset.subjects={args.subjects}")
    if args.workers is not None:
        overrides.append(f"dataset.workers={args.workers}")
    args.overrides = overrides
    config = config_from_args(args)
    manifest = simulate_dataset(config, args.out)
    counts = ", ".join(f"{k}: {n}" for k, n in split_counts(manifest).items())
    print(f"dataset written to {args.out} ({counts})")
    return 0


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def cmd_external(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from sim_scanner.dataset.external import (ImportSummary, assign_splits, builtin_volumes, read_volumes,
                                              simulate_external)

    config = config_from_args(args)
    if args.source == "builtin" or args.source.startswith("builtin:"):
        packages = [p for p in args.source.partition(":")[2].split(",") if p]
        volumes = builtin_volumes(packages or None)
    else:
        summary = ImportSummary()
        volumes = read_volumes(args.source, summary)
        print(summary.render())
    splits = assign_splits(volumes, _names(args.train), _names(args.val))
    manifest = simulate_external(config, volumes, args.out, draws=args.draws, splits=splits,
                                 train_draws=args.train_draws, train_augment=args.augment)
    names = ", ".join(f"{v['name']} ({v['slices']} slices, {v['split']})" for v in manifest["external"])
    print(f"external dataset written to {args.out}: {names}; {args.draws} draw(s) per slice")
    return 0


def cmd_stream(args: argparse.Namespace) -> int:
    import numpy as np

    from sim_scanner.dataset.streams import StreamStyle, read_stream, scanner_like, write_stream

    header_xml, acquisitions = read_stream(args.subject, args.group)
    peak = max((float(np.abs(a.data).max()) for a in acquisitions), default=0.0)
    style = StreamStyle(readout_oversampling=args.oversampling, coils=args.coils, noise=args.noise * peak,
                        noise_correlation=args.noise_correlation, order=args.order,
                        asymmetric_echo=args.asymmetric_echo, partial_fourier=args.partial_fourier,
                        channel_mask=args.channel_mask)
    header_xml, stream = scanner_like(header_xml, acquisitions, style, np.random.default_rng(args.seed))
    out = write_stream(args.out, header_xml, stream)
    print(f"{len(stream)} acquisitions of {args.subject} ({args.group}) written to {out} (group 'dataset')")
    return 0


def cmd_preview(args: argparse.Namespace) -> int:
    from sim_scanner.dataset.preview import write_preview

    if args.slices < 1:
        raise ValueError(f"--slices must be >= 1, got {args.slices}")
    out = write_preview(args.folder, args.subject, args.out, args.slices)
    print(f"preview written to {out}")
    return 0


def cmd_sphere(args: argparse.Namespace) -> int:
    import h5py
    import numpy as np

    from masc_gadget.config import ConfigError
    from sim_scanner.physics.grid import Grid
    from sim_scanner.physics.field import (
        dipole_field_hz,
        sphere_field_analytic_hz,
        sphere_susceptibility,
    )

    if args.radius_mm <= 0 or args.voxel_mm <= 0 or args.b0 <= 0:
        raise ValueError("--radius-mm, --voxel-mm and --b0 must be > 0")
    size = args.size or 2 * int(math.ceil(4 * args.radius_mm / args.voxel_mm))
    if size < 8:
        raise ValueError(f"grid of {size} points per axis is too small; raise --size or lower --voxel-mm")
    if size > 512:
        raise ConfigError(f"grid of {size}^3 points is too large (max 512); raise --voxel-mm or set --size")
    grid = Grid((size, size, size), (args.voxel_mm,) * 3)
    chi = sphere_susceptibility(grid, args.radius_mm, args.chi_ppm)
    field = dipole_field_hz(chi, grid.voxel_mm, args.b0, padding=0.5)
    z, y, x = grid.axes_mm()
    analytic = sphere_field_analytic_hz(z, y, x, args.radius_mm, args.chi_ppm, args.b0)
    r = np.sqrt(z**2 + y**2 + x**2)
    shell = (r > 1.5 * args.radius_mm) & (r < 3.5 * args.radius_mm)
    rel = float(np.abs(field - analytic)[shell].max() / max(np.abs(analytic[shell]).max(), 1e-12))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(out, "w") as f:
        d = f.create_dataset("field_hz", data=field.astype(np.float32))
        d.attrs["axes"] = "z, y, x"
        f.create_dataset("analytic_hz", data=analytic)
        for target in (f, d):
            target.attrs["voxel_mm"] = args.voxel_mm
            target.attrs["radius_mm"] = args.radius_mm
            target.attrs["chi_ppm"] = args.chi_ppm
            target.attrs["b0_t"] = args.b0
        f.attrs["max_rel_error_1.5_to_3.5_radii"] = rel
    print(f"sphere field map ({size}^3, peak {np.abs(field).max():.1f} Hz) written to {out}; "
          f"max |numeric - analytic| / peak between 1.5 and 3.5 radii: {rel:.2e}")
    return 0
