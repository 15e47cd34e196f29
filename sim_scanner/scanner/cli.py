"""``masc scan``: the simulated scanner driving a gadget in closed loop (sim_scanner.scanner.session)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from masc_gadget.config import Config
    from sim_scanner.scanner.config import ScannerConfig

log = logging.getLogger("masc.scan")

_FLAGS = {
    # argparse dest -> ScannerConfig field
    "server": "server",
    "feedback": "feedback",
    "deadline_ms": "deadline_ms",
    "fallback": "fallback",
    "interleave": "interleave",
    "pace": "pace",
    "line_period_ms": "line_period_ms",
    "zmq_address": "zmq_address",
    "config_name": "config_name",
    "config_xml": "config_xml",
    "policy": "policy",
    "max_subjects": "max_subjects",
    "max_slices": "max_slices",
}


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    scan = subparsers.add_parser(
        "scan", parents=[common], help="simulated scanner: closed-loop scan against a gadget",
        description="Replay a paired dataset over the MRD protocol against a running gadget "
        "(masc serve or Gadgetron), obey its next-line decisions under a deadline (fallback order "
        "on a miss), and score the returned images against the clean ground truth. Writes "
        "OUTDIR/report.json and OUTDIR/images.h5. Flags override the config section 'scanner'.",
    )
    scan.add_argument("--data", metavar="DIR", help="dataset folder (manifest.json)")
    scan.add_argument("--mrd", metavar="FILE.h5", help="instead of --data: replay a recorded scan (an ISMRMRD file "
                      "holding every line, e.g. a scanner's converted raw data or masc simulate stream's output) in "
                      "closed loop, scored against its own fully sampled image")
    scan.add_argument("--mrd-group", default="dataset", metavar="GROUP", help="the --mrd file's group (default dataset)")
    scan.add_argument("--split", default="test", choices=["train", "val", "test"],
                      help="split to scan (default: test)")
    scan.add_argument("--out", required=True, metavar="OUTDIR", help="folder for report.json and images.h5")
    scan.add_argument("--server", metavar="HOST:PORT", help="gadget address (default 127.0.0.1:9002)")
    scan.add_argument("--feedback", choices=["inband", "fire", "zmq", "none"],
                      help="decisions in-band, as message 1028 (fire), over ZeroMQ, or none (open "
                      "loop); default inband")
    scan.add_argument("--deadline-ms", type=float, metavar="D",
                      help="wait for each decision at most D ms after the previous line (default 200)")
    scan.add_argument("--fallback", metavar="ORDER",
                      help="deterministic policy used on a miss, e.g. center-out (default), equispaced")
    scan.add_argument("--interleave", action="store_true", default=None,
                      help="interleave slices as a multi-slice TSE")
    scan.add_argument("--pace", action="store_true", default=None,
                      help="send each line at its time in the sequence (TR / echo train length, per "
                      "slice interleaved in a TR), not as fast as decisions come")
    scan.add_argument("--line-period-ms", type=float, metavar="MS",
                      help="with --pace: ms between lines (default: the sequence's, from the data)")
    scan.add_argument("--zmq-address", metavar="ENDPOINT",
                      help="ZeroMQ endpoint the scanner binds for --feedback zmq (tcp://127.0.0.1:9003)")
    scan.add_argument("--config-name", metavar="NAME",
                      help="stream configuration name sent to the gadget (default: default)")
    scan.add_argument("--config-xml", metavar="FILE.xml",
                      help="send this stream configuration (e.g. configs/gadgetron/masc_external.xml) "
                      "as the configuration script instead of a name: Gadgetron runs it as is")
    scan.add_argument("--policy", metavar="NAME",
                      help="ask the server for this sampling policy (default: none, the server serves its "
                      "operator's; it applies a client's only where server.client_overrides allows)")
    scan.add_argument("--max-subjects", type=int, metavar="N", help="scan at most N subjects (0 = all)")
    scan.add_argument("--max-slices", type=int, metavar="N", help="at most N slices per subject (0 = all)")
    scan.add_argument("--no-progress", action="store_true", help="no progress bar")
    scan.set_defaults(func=cmd_scan)


def scanner_config_from_args(args: argparse.Namespace, config: Config) -> ScannerConfig:
    """The ``scanner`` section of ``config`` with the command-line flags applied (validated)."""
    from sim_scanner.scanner.config import ScannerConfig

    base = config.sections["scanner"] if "scanner" in config.sections else ScannerConfig()
    values = {
        field: getattr(args, dest) for dest, field in _FLAGS.items() if getattr(args, dest, None) is not None
    }
    return dataclasses.replace(base, **values)


def cmd_scan(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from masc_gadget.config import Config
    from sim_scanner.scanner.session import run_scan

    from masc_gadget.cli import CommandError

    if bool(args.data) == bool(args.mrd):
        raise CommandError("give --data DIR (a data set) or --mrd FILE.h5 (a recorded scan), one of them")
    config = config_from_args(args)
    scanner = scanner_config_from_args(args, config)
    config = Config({**config.sections, "scanner": scanner}, config.source)
    report = run_scan(config, args.data or args.mrd, args.split, args.out, progress=not args.no_progress,
                      mrd_group=args.mrd_group if args.mrd else None)
    print(report.summary())
    print(f"report written to {args.out}/report.json, images to {args.out}/images.h5")
    warnings = [w for sub in report.subjects for w in sub.gadget_warnings]
    if warnings:
        print(f"masc scan: the gadget did not apply {len(set(warnings))} setting(s) as asked: "
              f"{'; '.join(sorted(set(warnings)))}", file=sys.stderr)
    errors = [e for sub in report.subjects for e in sub.gadget_errors]
    if errors:  # the scan completed on the fallback order, but not as asked: say so and fail
        print(f"masc scan: error: the gadget reported {len(errors)} error(s), the first: {errors[0]} "
              f"(every line was still acquired; see {args.out}/report.json)", file=sys.stderr)
        return 1
    return 0


def register_send(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    send = subparsers.add_parser(
        "send", parents=[common], help="send an MRD file to a server (open loop) and keep what comes back",
        description="Send the acquisitions of an ISMRMRD file (e.g. masc simulate stream's output, or a "
        "scanner's converted raw data) to an MRD server (masc serve, Gadgetron, python-ismrmrd-server) in "
        "their order, as python-ismrmrd-server's client.py does, and write the images it returns to an "
        "ISMRMRD file (group 'out', one image variable per series) for masc view. Exit 1 when the server "
        "reported an error.",
    )
    send.add_argument("file", metavar="FILE.h5", help="ISMRMRD file to send")
    send.add_argument("--group", default="dataset", help="its group (default dataset)")
    send.add_argument("--server", default="127.0.0.1:9002", metavar="HOST:PORT", help="default 127.0.0.1:9002")
    send.add_argument("--out", required=True, metavar="OUT.h5", help="ISMRMRD file for the returned images")
    send.add_argument("--config-name", default="default", metavar="NAME",
                      help="configuration name sent (default: default, the server's own)")
    send.add_argument("--config-xml", metavar="FILE.xml", help="send this configuration script instead of a name "
                      "(e.g. configs/gadgetron/masc_external.xml for Gadgetron)")
    send.add_argument("--params", metavar="JSON", help='JSON parameters sent after the header, e.g. \'{"token": "..."}\'')
    send.add_argument("--timeout-s", type=float, default=120.0, metavar="S",
                      help="give up when the server is silent this long (default 120)")
    send.set_defaults(func=cmd_send)


def cmd_send(args: argparse.Namespace) -> int:
    import json

    from sim_scanner.scanner.send import send_file, write_images

    params = None
    if args.params:
        try:
            params = json.loads(args.params)
        except json.JSONDecodeError as err:
            raise ValueError(f"--params is not valid JSON: {err}") from None
        if not isinstance(params, dict):
            raise ValueError("--params must be a JSON object")
    result = send_file(args.file, args.server, args.group, args.config_name, args.config_xml or "", params,
                       timeout_s=args.timeout_s)
    out = write_images(args.out, result.images, result.header)
    series = ", ".join(f"series {s}: {n}" for s, n in result.by_series().items()) or "none"
    print(f"sent {result.sent} acquisitions of {args.file} to {args.server}; {len(result.images)} images back "
          f"({series}), written to {out} (group 'out'); server closed the stream: {'yes' if result.closed else 'no'}")
    for warning in result.warnings:
        print(f"masc send: {warning}", file=sys.stderr)
    if result.errors:
        print(f"masc send: error: the server reported {len(result.errors)} error(s), the first: {result.errors[0]}",
              file=sys.stderr)
        return 1
    return 0


def register_view(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    view = subparsers.add_parser(
        "view", parents=[common], help="returned images as PNG (and DICOM)",
        description="Turn the images of an ISMRMRD file (masc send's output) into a PNG (a row per series, a "
        "column per slice; the policy, what was served and any OOD fallback in each title, a mm scale bar and "
        "the patient directions) and, with --dicom, into DICOM files carrying the images' geometry.",
    )
    view.add_argument("file", metavar="FILE.h5", help="ISMRMRD file of images")
    view.add_argument("--group", default="out", help="its group (default out, as masc send writes)")
    view.add_argument("--out", required=True, metavar="OUT.png", help="the PNG to write")
    view.add_argument("--dicom", metavar="DIR", help="also write one DICOM file per image into DIR")
    view.set_defaults(func=cmd_view)


def cmd_view(args: argparse.Namespace) -> int:
    from sim_scanner.scanner.view import read_images, write_dicom, write_png

    images = read_images(args.file, args.group)
    fallbacks = sum(im.fallback for im in images)
    png = write_png(images, args.out, title=f"{Path(args.file).name} ({args.group}): {len(images)} images"
                    + (f", {fallbacks} served through the MAR fallback" if fallbacks else ""))
    print(f"{len(images)} images ({fallbacks} MAR fallback) drawn in {png}")
    if args.dicom:
        files = write_dicom(images, args.dicom)
        print(f"{len(files)} DICOM files written to {args.dicom}")
    return 0
