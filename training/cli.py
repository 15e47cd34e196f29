"""``masc train`` and ``masc eval``."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

log = logging.getLogger("masc.train")


def register_train(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    train = subparsers.add_parser("train", help="train networks (mar, masc, dqn, ss-ddqn, loupe, fixed-order, finetune)",
                                  description="Training: MAR pre-training (stage 1), MASC (stage 2) and the "
                                  "learned baselines.")
    actions = train.add_subparsers(dest="action", metavar="WHAT", required=True)
    mar = actions.add_parser("mar", parents=[common], help="pre-train the MAR U-Net (stage 1)",
                             description="Pre-train the MAR U-Net on paired metal / clean images "
                             "with L1 + lambda (1 - SSIM); best checkpoint by validation loss.")
    mar.add_argument("--data", required=True, metavar="DIR[,DIR...]", help="dataset folder(s): several are "
                     "trained on together (e.g. the hip simulation and real anatomy, masc simulate external)")
    mar.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); "
                     "<CKPT stem>.last.pt and .csv are written beside it")
    mar.add_argument("--resume", metavar="CKPT", help="continue from a .last.pt checkpoint")
    mar.set_defaults(func=cmd_train_mar)
    masc = actions.add_parser("masc", parents=[common], help="co-adaptive PPO + MAR training (stage 2)",
                              description="Co-adaptive training of the acquisition policy (artifact-aware "
                              "PPO) and the MAR network; ablations via masc_train.mar_mode and env.kspace.")
    masc.add_argument("--data", required=True, metavar="DIR", help="dataset folder")
    masc.add_argument("--mar", metavar="CKPT", help="pre-trained MAR checkpoint (masc train mar)")
    masc.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); "
                      "<CKPT stem>.last.pt and .csv are written beside it")
    masc.add_argument("--resume", metavar="CKPT", help="continue from a .last.pt checkpoint")
    masc.add_argument("--demos", metavar="FILE", help="where the greedy oracle's demonstrations for the "
                      "imitation warm start (imitation.slices > 0) are kept: read when they match, else written")
    masc.set_defaults(func=cmd_train_masc)
    for variant, title in (("dqn", "DQN (Mnih et al. 2015)"),
                           ("ss-ddqn", "SS-DDQN (Pineda et al. 2020): Double DQN on the reconstruction and its k-space")):
        q = actions.add_parser(variant, parents=[common], help=f"value-based baseline: {title}",
                               description=f"Train the {title} line-selection baseline on the acquisition "
                               "environment (sections dqn, q_net, env); replay of masks, not images.")
        q.add_argument("--data", required=True, metavar="DIR", help="dataset folder")
        q.add_argument("--mar", metavar="CKPT", help="frozen MAR checkpoint the agent observes and is rewarded "
                       "through (without it: zero-filled images)")
        q.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); "
                       "<CKPT stem>.last.pt and .csv are written beside it")
        q.add_argument("--resume", metavar="CKPT", help="continue from a .last.pt checkpoint")
        q.set_defaults(func=cmd_train_dqn, variant=variant)
    loupe = actions.add_parser("loupe", parents=[common], help="learned fixed mask (LOUPE-style) + its MAR network",
                               description="Learn one line mask for every slice at the exact budget, jointly with "
                               "the MAR network (section loupe); played as a fixed order by masc eval and the gadget.")
    loupe.add_argument("--data", required=True, metavar="DIR", help="dataset folder")
    loupe.add_argument("--mar", metavar="CKPT", help="pre-trained MAR checkpoint to start the MAR network from "
                       "(without it: trained from scratch)")
    loupe.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); "
                       "<CKPT stem>.last.pt and .csv are written beside it")
    loupe.add_argument("--resume", metavar="CKPT", help="continue from a .last.pt checkpoint")
    loupe.set_defaults(func=cmd_train_loupe)
    fixed = actions.add_parser("fixed-order", parents=[common],
                               help="the population order of a protocol + its MAR network co-adapted to it",
                               description="Learn the population-greedy order of the acquisition section's "
                               "lines on training slices under a pre-trained MAR network, then co-adapt the "
                               "network to those lines (section fixed_order); served like any policy "
                               "(policy fixed-order) and scored by masc eval --methods fixed-order.")
    fixed.add_argument("--data", required=True, metavar="DIR", help="dataset folder")
    fixed.add_argument("--mar", required=True, metavar="CKPT", help="pre-trained MAR checkpoint (masc train mar)")
    fixed.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); .last.pt and .csv beside it")
    fixed.add_argument("--order-from", metavar="CKPT", help="take the order of an earlier fixed-order checkpoint "
                       "learned on the same data under the same --mar (it must have this protocol's lines), and "
                       "only co-adapt the network, e.g. for more epochs")
    fixed.set_defaults(func=cmd_train_fixed_order)
    tune = actions.add_parser("finetune", parents=[common],
                              help="a pre-trained MAR network fine-tuned by one recipe to a policy's lines",
                              description="Play a trained policy (any kind) on the training and validation "
                              "slices, fine-tune the pre-trained MAR network to its masks by the recipe of a "
                              "config section (finetune: the served masks; finetune_joint: the co-adaptive "
                              "loop's pre-action masks and settings), select on validation, and write the "
                              "policy's checkpoint with that network.")
    tune.add_argument("--data", required=True, metavar="DIR", help="dataset folder(s)")
    tune.add_argument("--policy", required=True, metavar="CKPT", help="the trained policy whose lines are learned")
    tune.add_argument("--mar", required=True, metavar="CKPT", help="pre-trained MAR checkpoint (masc train mar)")
    tune.add_argument("--select-on", metavar="DIR[,DIR...]",
                      help="dataset folder(s) whose validation split selects the network (default: --data); "
                           "e.g. the simulation alone, so that real volumes choose nothing they are scored on")
    tune.add_argument("--recipe", default="finetune", choices=("finetune", "finetune_joint"),
                      help="the config section of the recipe (default finetune)")
    tune.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    tune.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); .last.pt and .csv beside it")
    tune.set_defaults(func=cmd_train_finetune)
    register_refit(actions, common, "refit")
    adapt = actions.add_parser("adapt", parents=[common],
                               help="adapt a model to a site's own metal-free images and judge it on held-out volumes",
                               description="Import a site's metal-free volumes (DICOM folders, NIfTI, fastMRI / "
                               "ISMRMRD), simulate implants into them, fine-tune the base model's MAR network to its "
                               "policy's lines by the shared recipe (section finetune), calibrate and check it on the "
                               "validation volumes, export it, and say whether it does no harm on the held-out "
                               "volumes, each against doing nothing and the base model (OUT/report.md).")
    adapt.add_argument("--source", required=True, metavar="DIR|FILE|builtin[:PKG]", help="the site's images")
    adapt.add_argument("--base", default="shipped:fixed_small", metavar="CKPT",
                       help="the model to adapt: a checkpoint with its policy and MAR network (default "
                       "shipped:fixed_small, the recommended one)")
    for split in ("train", "val", "test"):
        adapt.add_argument(f"--{split}", metavar="NAMES", help=f"volumes for {split} (names or prefixes, comma-"
                           "separated); without any: the last volume by name validates, the quarter before it is "
                           "held out, the rest trains")
    adapt.add_argument("--draws", type=int, default=3, metavar="N", help="implant poses per validation / test slice")
    adapt.add_argument("--train-draws", type=int, default=8, metavar="N", help="implant poses per training slice")
    adapt.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    adapt.add_argument("--out", required=True, metavar="DIR", help="folder for the data, the model and report.md")
    adapt.set_defaults(func=cmd_train_adapt)


def register_eval(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    ev = subparsers.add_parser("eval", parents=[common], help="evaluate sampling methods with / without MAR",
                               description="Evaluate sampling methods with and without MAR on a split: "
                               "results.json, table.md, curves.png, examples.png.")
    ev.add_argument("--data", metavar="DIR[,DIR...]", help="dataset folder(s) (required unless --combine): "
                    "several are each evaluated into OUT/NAME, with OUT/summary.md beside them")
    ev.add_argument("--split", default="test", choices=["train", "val", "test"])
    ev.add_argument("--methods", metavar="LIST", help="comma-separated policy names (default: eval.methods)")
    ev.add_argument("--mar", metavar="CKPT", help="MAR network of the baselines and of learned methods without "
                    "their own (without it: those are scored without MAR only); it never replaces the MAR network "
                    "a learned checkpoint carries")
    ev.add_argument("--checkpoint", metavar="CKPT[,CKPT...]", help="trained checkpoints of the learned methods "
                    "(masc, dqn, ss-ddqn, loupe, fixed-order; each file's kind says which); a checkpoint that carries its own "
                    "MAR network (masc, loupe) observes through it and is scored with it, with or without --mar, "
                    "as the gadget serves it")
    ev.add_argument("--reference", metavar="ROW", help="row for the p-values, e.g. random or random+nomar")
    ev.add_argument("--combine", metavar="DIR,DIR[,...]",
                    help="instead of evaluating: combine the outputs of earlier masc eval runs, one per "
                    "training seed, into combined.json / combined.md (mean and spread over seeds, "
                    "paired tests within each seed)")
    ev.add_argument("--suite", choices=["paper"], help="instead of one evaluation: the paper's tables (Table 1 at "
                    "every acceleration, Table 2's ablations, Table 3 on --external, over --seeds) from the models "
                    "in --runs, named mar_sS.pt, masc_sS.pt, dqn_sS.pt, ss-ddqn_sS.pt, loupe_sS.pt, ablation-*_sS.pt")
    ev.add_argument("--runs", metavar="DIR", help="with --suite: the folder of trained models")
    ev.add_argument("--seeds", default="0", metavar="LIST", help="with --suite: training seeds, e.g. 0,1,2 (default 0)")
    ev.add_argument("--external", metavar="DIR", help="with --suite: a held-out set (masc simulate external) for Table 3")
    ev.add_argument("--oracle", action="store_true", help="with --suite: add the greedy oracle to Table 1 (slow)")
    ev.add_argument("--resume", action="store_true", help="with --suite: read back the tables already in --out that "
                    "were evaluated with the same models, data and config (their inputs.json) instead of evaluating them again")
    ev.add_argument("--compare", default="masc", metavar="NAME",
                    help="with --combine: the method compared with every other row (default masc)")
    ev.add_argument("--alpha", type=float, default=0.01,
                    help="with --combine: the level a win needs in both paired tests (default 0.01)")
    ev.add_argument("--retest", metavar="DIR,DIR[,...]",
                    help="instead of evaluating: recompute the paired tests of earlier masc eval outputs over "
                    "subjects (their results.json and table.md are rewritten in place; the scores are not "
                    "recomputed); a --suite folder: every table, Table 2 and the combined reports")
    ev.add_argument("--headroom", action="store_true", help="also measure the oracle's lead over a fixed order "
                    "cross-fitted on each --data folder, under --mar (section headroom; slow: the oracle scores every "
                    "free line); written to OUT[/NAME]/headroom.md")
    ev.add_argument("--scans", metavar="DIR[,DIR...]", help="closed-loop scans (masc scan output folders) of the "
                    "same slices, shown beside the evaluated rows of the policy each was served (table.md, "
                    "results.json closed_loop): the gadget serves what masc eval scores")
    ev.add_argument("--out", metavar="OUTDIR", help="folder to write (required unless --retest)")
    ev.set_defaults(func=cmd_eval)


def register_diversity(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser,
                       name: str = "diversity") -> None:
    div = subparsers.add_parser(name, parents=[common], help="how predictable a dataset is",
                                description="Can line choice matter on this dataset? The SSIM of the nearest "
                                "training image (no scan), of the MAR network from the initial centre lines "
                                "and after a centre-out / random scan with the budget, the train / test gap "
                                "and the fully sampled ceiling.")
    div.add_argument("--data", required=True, metavar="DIR", help="dataset folder")
    div.add_argument("--mar", required=True, metavar="CKPT", help="MAR checkpoint (masc train mar)")
    div.add_argument("--split", default="test", choices=["val", "test"])
    div.add_argument("--out", metavar="FILE.json", help="also write the report as JSON")
    div.set_defaults(func=cmd_diversity)


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


def cmd_headroom(args: argparse.Namespace) -> int:
    import json

    from masc_gadget.cli import CommandError, config_from_args
    from training.evaluation.headroom import add_policies, headroom, render_candidates, render_headroom, write_headroom

    if args.from_dir:
        path = Path(args.from_dir) / "headroom.json"
        if not path.is_file():
            raise CommandError(f"{args.from_dir}: no headroom.json (run masc check headroom --out {args.from_dir} first)")
        if not args.policy:
            raise CommandError("--from scores learned policies against an earlier measurement: give --policy CKPT,...")
        report = add_policies(config_from_args(args), json.loads(path.read_text()),
                              [p.strip() for p in args.policy.split(",") if p.strip()])
        paths = write_headroom(report, args.out)
        print(render_headroom(report), end="")
        print("written: " + ", ".join(str(p) for p in paths.values()))
        return 0
    if args.combine:
        reports = {}
        for folder in (f.strip() for f in args.combine.split(",") if f.strip()):
            path = Path(folder) / "headroom.json"
            if not path.is_file():
                raise CommandError(f"{folder}: no headroom.json (run masc check headroom --out {folder} first)")
            reports[Path(folder).name] = json.loads(path.read_text())
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


def _report_best(what: str, out: str, best: dict, step: str, seconds: bool = True) -> None:
    """The line a training command ends with: the best checkpoint, when and how good, the log."""
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under torchrun: rank 0 reports
    took = f", {best.get('seconds', 0):.0f} s" if seconds else ""
    if "roi_ssim" in best:
        took = f", region SSIM {best['roi_ssim']:.4f}{took}"
    print(f"best {what} checkpoint: {out} ({step} {best.get(step, '?')}, val SSIM {best.get('ssim', float('nan')):.4f}, "
          f"PSNR {best.get('psnr', float('nan')):.2f} dB{took}); log: {Path(out).with_suffix('.csv')}")


def cmd_train_mar(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.mar import train_mar

    config = config_from_args(args)
    best = train_mar(config, args.data, args.out, resume=args.resume)
    _report_best("MAR", args.out, best, "epoch", seconds=False)
    return 0


def cmd_train_masc(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.coadapt import train_masc

    config = config_from_args(args)
    best = train_masc(config, args.data, args.mar, args.out, resume=args.resume, demos=args.demos)
    _report_best("MASC", args.out, best, "rollout")
    return 0


def cmd_train_dqn(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.rl.dqn import train_dqn

    config = config_from_args(args)
    best = train_dqn(config, args.data, args.mar, args.out, variant=args.variant, resume=args.resume)
    _report_best(args.variant, args.out, best, "transitions")
    return 0


def cmd_train_loupe(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.loupe import train_loupe

    config = config_from_args(args)
    best = train_loupe(config, args.data, args.mar, args.out, resume=args.resume)
    _report_best("learned-mask", args.out, best, "epoch")
    return 0


def cmd_train_fixed_order(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.fixed_order import train_fixed_order

    best = train_fixed_order(config_from_args(args), args.data, args.mar, args.out, order_from=args.order_from)
    _report_best("fixed-order", args.out, best, "epoch")
    return 0


def cmd_train_finetune(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.finetune_policy import finetune_policy

    best = finetune_policy(config_from_args(args), args.data, args.policy, args.mar, args.out, args.recipe,
                           args.device, select_on=args.select_on)
    _report_best("fine-tuned", args.out, best, "step")
    return 0


def cmd_train_adapt(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.adapt import adapt

    names = {k: [n.strip() for n in (getattr(args, k) or "").split(",") if n.strip()] for k in ("train", "val", "test")}
    report = adapt(config_from_args(args), args.source, args.base, args.out, names["train"], names["val"],
                   names["test"], args.draws, args.train_draws, args.device)
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["held_out"]["models"]["adapted"]["no_harm"] else 1


def register_refit(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser,
                   name: str = "refit") -> None:
    """``masc train refit``."""
    refit = subparsers.add_parser(name, parents=[common], help="a fixed-order checkpoint refit on another "
                                  "population or protocol",
                                  description="Learn the fixed order again on another data set (or for the "
                                  "acquisition section's protocol) under a checkpoint's MAR network; with "
                                  "--finetune, co-adapt the network to the new order too.")
    refit.add_argument("checkpoint", metavar="CKPT", help="a fixed-order checkpoint (or any with a MAR network)")
    refit.add_argument("--data", required=True, metavar="DIR", help="the new population's dataset folder")
    refit.add_argument("--finetune", action="store_true", help="also co-adapt the MAR network to the new order")
    refit.add_argument("--out", required=True, metavar="CKPT", help="the refit checkpoint (.pt)")
    refit.set_defaults(func=cmd_refit)


def cmd_refit(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from training.fixed_order import refit_fixed_order

    best = refit_fixed_order(config_from_args(args), args.checkpoint, args.data, args.out, finetune=args.finetune)
    _report_best("fixed-order", args.out, best, "epoch")
    return 0


def cmd_eval_combine(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError
    from training.evaluation.seeds import combine_seeds, load_results, render_combined, write_combined

    given = [f"--{n}" for n in ("data", "mar", "checkpoint", "methods", "reference") if getattr(args, n)]
    if given:
        raise CommandError(f"--combine reads finished evaluations; drop {', '.join(given)}")
    if not 0 < args.alpha < 1:
        raise CommandError(f"--alpha must be between 0 and 1, got {args.alpha}")
    folders = [f.strip() for f in args.combine.split(",") if f.strip()]
    report = combine_seeds([load_results(f) for f in folders], [Path(f).name for f in folders],
                           method=args.compare, alpha=args.alpha)
    paths = write_combined(report, args.out)
    print(render_combined(report))
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_eval_retest(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError
    from training.evaluation.evaluate import write_results
    from training.evaluation.seeds import load_results
    from training.evaluation.tables import add_tests

    given = [f"--{n}" for n in ("data", "mar", "checkpoint", "methods", "combine", "suite", "out") if getattr(args, n)]
    if given:
        raise CommandError(f"--retest rewrites the tests of finished evaluations in place; drop {', '.join(given)}")
    for folder in (f.strip() for f in args.retest.split(",") if f.strip()):
        if (Path(folder) / "suite.json").is_file():
            from training.evaluation.suite import render_suite, retest_suite

            print(render_suite(retest_suite(folder)))
            print(f"{folder}: the suite's tables, Table 2 and the combined reports retested over subjects")
            continue
        results = load_results(folder)
        add_tests(results)
        path = Path(folder)
        write_results(results, path if path.is_dir() else path.parent)
        print(f"{path}: tests over {len(set(s.rsplit('/', 1)[0] for s in results['slices']))} subjects written")
    return 0


def cmd_eval_suite(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError, config_from_args
    from training.evaluation.suite import render_suite, run_suite

    if not args.data or not args.runs:
        raise CommandError("masc eval --suite needs --data DIR and --runs DIR")
    given = [f"--{n}" for n in ("mar", "checkpoint", "methods") if getattr(args, n)]
    if given:
        raise CommandError(f"--suite reads its models from --runs; drop {', '.join(given)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise CommandError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    report = run_suite(config_from_args(args), args.data, args.runs, args.out, seeds, args.external, args.oracle,
                       resume=args.resume)
    print(render_suite(report))
    print(f"written: {Path(args.out) / 'suite.md'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError, config_from_args

    if args.retest:
        return cmd_eval_retest(args)
    if not args.out:
        raise CommandError("masc eval needs --out OUTDIR")
    if args.combine:
        return cmd_eval_combine(args)
    if args.suite:
        return cmd_eval_suite(args)
    if args.resume:
        raise CommandError("--resume goes with --suite (one masc eval has nothing to resume)")
    if not args.data:
        raise CommandError("masc eval needs --data DIR (or --combine DIR,DIR,... to combine seeds)")
    if args.headroom and not args.mar:
        raise CommandError("--headroom measures under one MAR network: give --mar CKPT")
    from training.evaluation.evaluate import evaluate, write_outputs
    from training.evaluation.tables import render_table

    overrides = list(args.overrides)
    if args.reference:
        overrides.append(f"eval.reference={args.reference}")
    args.overrides = overrides
    config = config_from_args(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    folders = [d.strip() for d in args.data.split(",") if d.strip()]
    if len(folders) == 1:
        results, figures = evaluate(config, folders[0], args.split, methods, args.mar, checkpoint=args.checkpoint)
        if args.scans:
            from training.evaluation.tables import closed_loop

            results["closed_loop"] = closed_loop(results, [d.strip() for d in args.scans.split(",") if d.strip()])
        paths = write_outputs(results, figures, args.out)
        print(render_table(results))
        paths.update(_eval_headroom(args, config, folders[0], args.out))
        print("written: " + ", ".join(str(p) for p in paths.values()))
        return 0
    from training.evaluation.tables import render_summary

    names = [Path(d).name or d for d in folders]
    if len(set(names)) != len(names):
        raise CommandError(f"--data folders need distinct names (each is written to OUT/NAME), got {', '.join(names)}")
    every = {}
    for name, folder in zip(names, folders):
        results, figures = evaluate(config, folder, args.split, methods, args.mar, checkpoint=args.checkpoint)
        write_outputs(results, figures, Path(args.out) / name)
        print(f"## {name} ({folder})\n\n{render_table(results)}")
        _eval_headroom(args, config, folder, Path(args.out) / name)
        every[name] = results
    Path(args.out, "summary.md").write_text(render_summary(every))
    print(render_summary(every))
    print(f"written: {', '.join(str(Path(args.out) / n) for n in names)}, {Path(args.out) / 'summary.md'}")
    return 0


def _eval_headroom(args: argparse.Namespace, config, folder: str, out: str | Path) -> dict[str, Path]:
    """``masc check headroom``: the gate on the folder just evaluated, under ``--mar``."""
    if not args.headroom:
        return {}
    from training.evaluation.headroom import headroom, render_headroom, write_headroom

    report = headroom(config, folder, args.split, [args.mar])
    print(render_headroom(report), end="")
    return {f"headroom_{k}": v for k, v in write_headroom(report, out).items()}


def cmd_diversity(args: argparse.Namespace) -> int:
    import json

    from masc_gadget.cli import config_from_args
    from training.evaluation.diversity import diversity_report, render_report

    report = diversity_report(config_from_args(args), args.data, args.mar, args.split)
    print(render_report(report), end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.out}")
    return 0


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
        if ((args.calibrate or args.cross_validate > 1)
                and load_checkpoint(path, map_location="cpu").metadata.get("kind") in OWN_LINES):
            policies[name] = load_learned(path, "cpu")[0]  # its own lines join the calibration
    if args.reference and args.reference not in mars:
        raise CommandError(f"--reference {args.reference!r} names none of the networks: {', '.join(mars)}")
    if args.calibrate and args.split != "val":
        raise CommandError("--calibrate chooses thresholds: use it on the validation split (--split val)")
    ood = {n: {"score": m.ood.score, "threshold": m.ood.threshold} for n, m in mars.items()
           if getattr(m, "ood", None) is not None}
    acq = config["acquisition"]
    snr = tuple(config["variation"].snr) if tuple(config["variation"].snr) != (0.0, 0.0) else (config["physics"].snr,) * 2
    mar_check(mars, args.data, args.split, acq.initial, acq.budget, args.out, policy=args.policy,
              snr=snr if snr[0] > 0 else None,
              reference=args.reference, ood=ood, do_calibrate=args.calibrate, policies=policies,
              folds=args.cross_validate)
    print((Path(args.out) / "report.md").read_text())
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
                                   **check_record(json.loads(Path(path).read_text()), name)}}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CommandError(f"--check {args.check}: {err}") from None
        broken = [f"{folder}: {', '.join(k for k, v in (f['promises'] or {}).items() if k != 'all' and not v['kept'])}"
                  for folder, f in notes["mar_check"]["folders"].items() if (f["promises"] or {}).get("all") is not True]
        if broken:
            print(f"MASC warning: {args.checkpoint} does not keep its promises ({'; '.join(broken)}); a network "
                  "that breaks one is not shipped (docs/mar-safety.md)", file=sys.stderr)
    record = export_checkpoint(args.checkpoint, args.out, command=args.trained_with, ood=ood, notes=notes,
                               export_command=shlex.join(["masc", *sys.argv[1:]]))
    print(f"shipped model written to {args.out} ({record['size_bytes']} bytes) with {Path(args.out).with_suffix('.json')}")
    return 0


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
