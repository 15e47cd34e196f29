"""``masc check {mar,headroom,diversity,sim-params}``: the checks of networks and data sets."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from training.cli.evaluate import register_diversity


def register_check(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc check {mar,headroom,diversity}``: the checks of networks and data sets."""
    check = subparsers.add_parser("check", help="check networks and data: mar (do no harm), headroom (the gate), "
                                  "diversity, sim-params", description="Checks before and after training: does a MAR "
                                  "network do no harm (mar), can an adaptive policy pay on this protocol (headroom: the "
                                  "gate), how predictable a data set is (diversity), how the simulation's parameters "
                                  "move the artifact and the methods (sim-params).")
    actions = check.add_subparsers(dest="action", metavar="WHAT", required=True)
    register_mar_check(actions, common, "mar")
    register_headroom(actions, common, "headroom")
    register_diversity(actions, common, "diversity")
    register_sim_params(actions, common)



def register_mar_check(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser,
                       name: str = "mar-check") -> None:
    mc = subparsers.add_parser(name, parents=[common], help="does a MAR network do no harm; its OOD score's ROC",
                               description="Check MAR networks on a split of each data folder: the output for fully "
                               "sampled clean images (should not change), the correction of a fixed policy's "
                               "zero-filled images against them (tests over subjects), and how well each OOD score "
                               "flags the slices the network harms (ROC). --calibrate picks the score and threshold "
                               "(use it on the validation split only).")
    mc.add_argument("--mar", required=True, metavar="NAME=CKPT[,...]", help="MAR checkpoints (or shipped:NAME), "
                    "each named for the report")
    mc.add_argument("--data", required=True, metavar="DIR[,DIR...]", help="dataset folder(s), each reported apart")
    mc.add_argument("--split", default="val", choices=["train", "val", "test"])
    mc.add_argument("--policy", default="center-out", help="the fixed policy whose lines are corrected "
                    "(default center-out); its budget is the config's acquisition section")
    mc.add_argument("--reference", metavar="NAME", help="the network the others are compared with")
    mc.add_argument("--calibrate", action="store_true", help="choose each network's OOD score and threshold on "
                    "this split (pooled over the folders, and for a MASC checkpoint over its fixed policy's "
                    "lines and the lines its own policy plays) and write OUT/ood.json")
    mc.add_argument("--cross-validate", type=int, default=0, metavar="K",
                    help="also serve each folder's slices under an OOD rule calibrated on the other subjects "
                    "(K folds by subject; a real volume is one subject): per subject and over subjects, against "
                    "doing nothing (centre-out's zero-filled image); a network that carries a policy is judged "
                    "on its own lines")
    mc.add_argument("--early-lines", type=int, default=None, metavar="N",
                    help="a later early switch: the early rule scores the image of each slice's first N own "
                         "lines (N > the initial lines) and a flagged slice continues with centre-out's lines; "
                         "the calibration records after_lines, which the gadget and masc eval play")
    mc.add_argument("--objective", default="served", choices=["served", "no-harm"],
                    help="how --calibrate picks the threshold: the largest mean served SSIM (served, default), or "
                         "the largest among those that keep the do-no-harm target on the calibration subjects "
                         "(no-harm; docs/mar-safety.md)")
    mc.add_argument("--calibrate-on", metavar="FOLDER[,FOLDER...]",
                    help="the data folders (by name) whose slices calibrate the rule (default: every one); the "
                         "others are held-out domains, served under the rule as calibrated")
    mc.add_argument("--early-scores", metavar="SCORE[,SCORE...]",
                    help="the scores the early rule may be calibrated with (default: every one; the best ROC "
                         "area on the calibration slices wins): consistency, residual, flip, and with --early-lines "
                         "beyond the initial lines holdout, halves")
    mc.add_argument("--out", required=True, metavar="DIR", help="results.json, report.md, roc.png")
    mc.set_defaults(func=cmd_mar_check)



OWN_LINES = ("masc", "fixed-order", "loupe")
"""Checkpoint kinds whose network serves the lines of its own policy: ``mar-check --calibrate``
pools those lines with the fixed policy's."""



def cmd_mar_check(args: argparse.Namespace) -> int:
    import torch

    from masc_gadget.cli import CommandError, config_from_args
    from masc_gadget.models.checkpoint import load_mar
    from training.evaluation.marcheck import mar_check

    config = config_from_args(args)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from masc_gadget.acquisition.learned import load_learned
    from masc_gadget.models.checkpoint import load_checkpoint

    mars, policies = {}, {}
    for item in args.mar.split(","):
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        mars[name] = load_mar(path, "cpu")[0]
        stored_early = getattr(mars[name], "ood_early", None) is not None
        if ((args.calibrate or args.cross_validate > 1 or stored_early)
                and load_checkpoint(path, map_location="cpu").metadata.get("kind") in OWN_LINES):
            policies[name] = load_learned(path, "cpu")[0]  # its own lines join the calibration
    if args.reference and args.reference not in mars:
        raise CommandError(f"--reference {args.reference!r} names none of the networks: {', '.join(mars)}")
    if args.calibrate and args.split != "val":
        raise CommandError("--calibrate chooses thresholds: use it on the validation split (--split val)")
    ood = {n: {"score": m.ood.score, "threshold": m.ood.threshold} for n, m in mars.items()
           if getattr(m, "ood", None) is not None}
    for n, m in mars.items():  # the stored early switch: its slices are served as the gadget serves them
        early = getattr(m, "ood_early", None)
        if early is not None and n in policies:
            ood.setdefault(n, {})["early"] = {"score": early.score, "threshold": early.threshold,
                                              "after_lines": early.after_lines}
    stored = {e["early"]["after_lines"] for e in ood.values() if "early" in e}
    if args.early_lines is None and len(stored) == 1 and not args.calibrate:
        args.early_lines = stored.pop()  # scored where the stored rule scores
    elif len(stored) > 1 and not args.calibrate and args.early_lines is None:
        raise CommandError("the networks' stored early rules switch after different line counts: check them apart "
                           "or give --early-lines")
    acq = config["acquisition"]
    snr = tuple(config["variation"].snr) if tuple(config["variation"].snr) != (0.0, 0.0) else (config["physics"].snr,) * 2
    mar_check(mars, args.data, args.split, acq.initial, acq.budget, args.out, policy=args.policy,
              snr=snr if snr[0] > 0 else None,
              reference=args.reference, ood=ood, do_calibrate=args.calibrate, policies=policies,
              folds=args.cross_validate, early_lines=args.early_lines, objective=args.objective,
              calibrate_on=[f.strip() for f in args.calibrate_on.split(",") if f.strip()] if args.calibrate_on else None,
              early_scores=[s.strip() for s in args.early_scores.split(",")] if args.early_scores else None)
    print((Path(args.out) / "report.md").read_text())
    return 0



def register_headroom(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser,
                      name: str = "headroom") -> None:
    hr = subparsers.add_parser(name, parents=[common], help="can an adaptive policy pay here: oracle vs a "
                               "cross-fitted fixed order",
                               description="The gate before training an adaptive policy: on a split, the oracle's "
                               "lead over the population order fitted on other subjects (cross-fitted over subject "
                               "folds) and centre-out, under each MAR network, with tests over subjects. Section "
                               "headroom: region (image | implant), margin, beam, folds, slices_per_subject, gate; "
                               "the lines are the acquisition section's initial + budget.")
    hr.add_argument("--data", metavar="DIR", help="dataset folder (required unless --combine)")
    hr.add_argument("--combine", metavar="DIR,DIR[,...]", help="instead of measuring: one table of earlier "
                    "headroom outputs (their headroom.json), written to OUT/candidates.md")
    hr.add_argument("--mar", metavar="CKPT[,CKPT...]", help="MAR network(s), e.g. three training seeds: each is "
                    "measured apart, the report gives the mean and spread (required, except with headroom.recon=sense, "
                    "which is scored without one)")
    hr.add_argument("--policy", metavar="CKPT[,CKPT...]", help="learned policies to score beside the oracle and the "
                    "fixed order, one per --mar network in the same order (the network each was trained under, "
                    "e.g. masc train masc --set masc_train.mar_mode=frozen): the report gives the share of the "
                    "oracle's lead each captures")
    hr.add_argument("--from", dest="from_dir", metavar="DIR", help="with --policy: score the policies against an "
                    "earlier measurement (DIR/headroom.json: its data, slices and MAR networks) instead of measuring "
                    "the oracle and the fixed order again")
    hr.add_argument("--split", default="val", choices=["train", "val", "test"],
                    help="the split measured (default val: the gate decides what to train)")
    hr.add_argument("--out", required=True, metavar="DIR", help="where headroom.json and headroom.md go")
    hr.set_defaults(func=cmd_headroom)



def _read_headroom(folder: str):
    from masc_gadget.cli import CommandError
    from training.evaluation.headroom import read_headroom

    try:
        return read_headroom(folder)
    except (FileNotFoundError, ValueError) as err:
        raise CommandError(str(err)) from None


def cmd_headroom(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError, config_from_args
    from training.evaluation.headroom import add_policies, headroom, render_candidates, render_headroom, write_headroom

    if args.from_dir:
        if not args.policy:
            raise CommandError("--from scores learned policies against an earlier measurement: give --policy CKPT,...")
        report = add_policies(config_from_args(args), _read_headroom(args.from_dir),
                              [p.strip() for p in args.policy.split(",") if p.strip()])
        paths = write_headroom(report, args.out)
        print(render_headroom(report), end="")
        print("written: " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.combine:
        reports = {}
        for folder in (f.strip() for f in args.combine.split(",") if f.strip()):
            reports[Path(folder).name] = _read_headroom(folder)
        text = render_candidates(reports)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "candidates.md").write_text(text)
        print(text, end="")
        print(f"written: {Path(args.out) / 'candidates.md'}")
        return 0
    if not args.data:
        raise CommandError("masc check headroom needs --data DIR (or --combine DIR,DIR,...)")

    mars = [m.strip() for m in (args.mar or "").split(",") if m.strip()]
    policies = [p.strip() for p in (args.policy or "").split(",") if p.strip()]
    report = headroom(config_from_args(args), args.data, args.split, mars, policy_paths=policies)
    paths = write_headroom(report, args.out)
    print(render_headroom(report), end="")
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0



def register_sim_params(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc check sim-params`` (formerly ``masc check sim-params``)."""
    sp = actions.add_parser("sim-params", parents=[common], help="field strength, bandwidth, implant material",
                            description="For each setting (0.55 / 1.5 / 3 / 7 T; 0.5x / 1x / 2x readout bandwidth; "
                            "CoCr / titanium), simulate a test set of the same subjects and report the artifact "
                            "severity (metal vs clean NMSE, SSIM) and, with --checkpoint, MASC against the best "
                            "baseline. Writes study.json and study.md; reruns keep finished datasets.")
    sp.add_argument("--out", required=True, metavar="DIR", help="where study.json and study.md go")
    sp.add_argument("--data-dir", metavar="DIR", help="where the simulated test sets go (default OUT/datasets)")
    sp.add_argument("--subjects", type=int, default=4, metavar="N", help="test subjects per setting (default 4)")
    sp.add_argument("--studies", metavar="LIST", help="comma-separated subset of: field strength, readout bandwidth, "
                    "implant material (default all)")
    sp.add_argument("--checkpoint", metavar="CKPT", help="a MASC checkpoint, evaluated on every set with its MAR")
    sp.add_argument("--population-data", metavar="DIR", help="with --checkpoint: also the population order, learned "
                    "on this dataset's training split")
    sp.set_defaults(func=cmd_study_sim_params)



def cmd_study_sim_params(args: argparse.Namespace) -> int:
    from training.evaluation.simstudy import render_study, run_study

    studies = [s.strip() for s in args.studies.split(",") if s.strip()] if args.studies else None
    report = run_study(args.config, list(args.overrides), args.out, args.subjects, studies, args.checkpoint,
                       args.population_data, data_dir=args.data_dir)
    print(render_study(report))
    print(f"written: {Path(args.out) / 'study.json'}, {Path(args.out) / 'study.md'}")
    return 0
