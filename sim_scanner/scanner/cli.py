"""``masc scan``: the simulated scanner driving a gadget in closed loop (sim_scanner.scanner.session)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
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
    scan.add_argument("--data", required=True, metavar="DIR", help="dataset folder (manifest.json)")
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

    config = config_from_args(args)
    scanner = scanner_config_from_args(args, config)
    config = Config({**config.sections, "scanner": scanner}, config.source)
    report = run_scan(config, args.data, args.split, args.out, progress=not args.no_progress)
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
