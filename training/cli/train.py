"""``masc train ...``: the networks and policies, and ``masc train refit``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import logging

log = logging.getLogger("masc.train")


def register_train(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    train = subparsers.add_parser("train", help="train networks (mar, masc, dqn, ss-ddqn, loupe, fixed-order, finetune)",
                                  description="Training: MAR pre-training (stage 1), MASC (stage 2) and the "
                                  "learned baselines.")
    actions = train.add_subparsers(dest="action", metavar="WHAT", required=True)
    _register_stages(actions, common)
    _register_baselines(actions, common)
    _register_fixed_order(actions, common)
    register_refit(actions, common, "refit")
    _register_adapt(actions, common)


def _register_stages(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc train mar`` (stage 1) and ``masc train masc`` (stage 2)."""
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


def _register_baselines(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """The learned baselines: ``dqn``, ``ss-ddqn`` and ``loupe``."""
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


def _register_fixed_order(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc train fixed-order`` and the shared recipe, ``masc train finetune``."""
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
    tune.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the recipe's run.device, auto)")
    tune.add_argument("--out", required=True, metavar="CKPT", help="best checkpoint (.pt); .last.pt and .csv beside it")
    tune.set_defaults(func=cmd_train_finetune)


def _register_adapt(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """``masc train adapt``: a model adapted to a site's own images."""
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
