"""``masc eval``: sampling methods with and without MAR on a split, and its modes (combine, suite, retest)."""

from __future__ import annotations

import argparse
from pathlib import Path


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
