"""``masc models {list,info,export}``: the shipped models and how a trained checkpoint becomes one."""

from __future__ import annotations

import argparse
from pathlib import Path


def register_models(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc models {list,info,export}``."""
    models = subparsers.add_parser("models", help="the shipped models: list, info, export",
                                   description="The trained models: list those that ship inside the package, show "
                                   "one's provenance (info), write a trained checkpoint as a shipped one (export).")
    actions = models.add_subparsers(dest="action", metavar="WHAT", required=True)
    listed = actions.add_parser("list", parents=[common], help="the shipped models, the recommended one first")
    listed.set_defaults(func=cmd_models_list)
    info = actions.add_parser("info", parents=[common], help="what a model is and how it was made",
                              description="Kind, protocol, validation, OOD calibration, promises and the commands "
                              "that made it, from its provenance (no weights loaded).")
    info.add_argument("model", metavar="NAME|CKPT", help="shipped:NAME, a shipped NAME, or a checkpoint (.pt)")
    info.set_defaults(func=cmd_models_info)
    register_export(actions, common, "export")



def cmd_models_list(args: argparse.Namespace) -> int:
    from masc_gadget.models.shipped import RECOMMENDED, available, provenance

    names = sorted(available(), key=lambda n: (n != RECOMMENDED, n))
    for name in names:
        record = provenance(name)
        acq = (record.get("config") or {}).get("acquisition") or {}
        val = record.get("validation") or {}
        mark = "  (recommended: served when nothing else is configured)" if name == RECOMMENDED else ""
        print(f"shipped:{name}: {record.get('kind', '?')}, {acq.get('initial', '?')} + {acq.get('budget', '?')} lines, "
              f"validation SSIM {val.get('ssim', float('nan')):.4f}{mark}")
    return 0



def cmd_models_info(args: argparse.Namespace) -> int:
    import json

    from masc_gadget.models.checkpoint import load_checkpoint
    from masc_gadget.models.shipped import PREFIX, available, provenance

    name = args.model[len(PREFIX):] if args.model.startswith(PREFIX) else args.model
    if name in available():
        record = provenance(name)
        shown = {k: record.get(k) for k in ("name", "kind", "seed", "code_version", "git_commit", "command",
                                             "export_command", "validation", "trained_rollouts")}
        shown["protocol"] = (record.get("config") or {}).get("acquisition")
        shown["ood"] = {k: v for k, v in (record.get("ood") or {}).items() if k in ("score", "threshold", "stage", "early",
                                                                                   "calibrated_on")}
        shown["training_data"] = record.get("training_data")
        shown["mar_check"] = record.get("mar_check")
    else:
        meta = load_checkpoint(args.model).metadata
        shown = {k: meta.get(k) for k in ("kind", "n_pe", "epoch", "rollout", "val", "provenance", "training_data")}
        shown["ood"] = meta.get("ood")
    print(json.dumps(shown, indent=1, default=str))
    return 0



def register_export(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser,
                    name: str = "export") -> None:
    ex = subparsers.add_parser(name, parents=[common], help="a trained checkpoint as a shipped model",
                               description="Write a trained checkpoint as a shipped one: float16 weights, no "
                               "optimizer state, a provenance json beside it; --ood stores the OOD calibration "
                               "of masc check mar --calibrate in it.")
    ex.add_argument("checkpoint", metavar="CKPT", help="trained checkpoint (.pt, or shipped:NAME with --lines)")
    ex.add_argument("--out", metavar="PT", help="the shipped checkpoint (.pt; .json beside it)")
    ex.add_argument("--lines", metavar="FILE.txt", help="also (or only) write a fixed order's phase-encoding lines "
                    "as a ky list in acquisition order, for a sequence to play with no round trip to the gadget")
    ex.add_argument("--command", dest="trained_with", default="",
                    help="the commands that trained it, for the provenance record")
    ex.add_argument("--ood", metavar="OOD.json[:NAME]", help="the calibration to store (the entry NAME of "
                    "ood.json; default: its only entry)")
    ex.add_argument("--check", metavar="RESULTS.json[:NAME]", help="the masc check mar run of this network (entry "
                    "NAME of its results.json) whose promises and figures go into the provenance; a warning when "
                    "a promise is broken (such a network is not shipped)")
    ex.add_argument("--promise-on", metavar="FOLDER[,FOLDER...]", default="",
                    help="with --check: the data folders (as the check names them) whose promises the model is "
                         "held to, e.g. the hip simulation; the other folders' figures are recorded as measured "
                         "(default: every folder)")
    ex.set_defaults(func=cmd_export)



def cmd_export(args: argparse.Namespace) -> int:
    import json

    from masc_gadget.cli import CommandError
    from training.export import check_record, export_checkpoint, export_lines

    if not args.out and not args.lines:
        raise CommandError("give --out (the shipped checkpoint), --lines (a fixed order's ky list), or both")
    if args.lines:
        lines = export_lines(args.checkpoint, args.lines)
        print(f"{len(lines)} phase-encoding lines of {args.checkpoint} written to {args.lines}")
        if not args.out:
            return 0
    import shlex
    import sys

    ood = None
    if args.ood:
        path, _, name = args.ood.partition(":")
        entries = json.loads(Path(path).read_text())
        if not name and len(entries) != 1:
            raise CommandError(f"{path} holds {', '.join(entries)}: name one, --ood {path}:NAME")
        ood = entries[name or next(iter(entries))]

    notes = None
    if args.check:
        path, _, name = args.check.partition(":")
        try:
            notes = {"mar_check": {"results": Path(path).name,
                                   **check_record(json.loads(Path(path).read_text()), name,
                                                  tuple(f for f in args.promise_on.split(",") if f))}}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CommandError(f"--check {args.check}: {err}") from None
        broken = [f"{folder}: {', '.join(k for k, v in (f['promises'] or {}).items() if k != 'all' and not v['kept'])}"
                  for folder, f in notes["mar_check"]["folders"].items()
                  if folder in notes["mar_check"]["promised_on"] and (f["promises"] or {}).get("all") is not True]
        if broken:
            print(f"MASC warning: {args.checkpoint} does not keep its promises ({'; '.join(broken)}); a network "
                  "that breaks one is not shipped (docs/mar-safety.md)", file=sys.stderr)
    record = export_checkpoint(args.checkpoint, args.out, command=args.trained_with, ood=ood, notes=notes,
                               export_command=shlex.join(["masc", *sys.argv[1:]]))
    print(f"shipped model written to {args.out} ({record['size_bytes']} bytes) with {Path(args.out).with_suffix('.json')}")
    return 0
