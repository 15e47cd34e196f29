"""``masc bench``: the command line of the throughput benchmarks.

``masc bench unet``: forward latency and throughput of the MAR network
(:func:`training.bench.unet.bench_unet`), printed as a table and optionally written as JSON.

``masc bench serve``: decision latency of ``masc serve`` under concurrent closed-loop scans
(:func:`training.bench.serve.bench_serve`).

``masc bench env``: acquisition-environment steps per second, batched against one slice at a
time, and with ``--sb3`` end-to-end PPO training throughput against sb3-contrib's MaskablePPO
(:func:`training.bench.env.bench_env`, :func:`training.bench.env.bench_ppo`).
"""

from __future__ import annotations

import argparse
import logging
import json
import os
import shlex
import sys
from pathlib import Path

from training.bench.names import SB3_HINT, SB3_POLICIES, VARIANTS

log = logging.getLogger(__name__)


def _write_json(path: str | None, payload: object) -> None:
    """``--out``: the results as JSON (folders made as needed); nothing when no path is given."""
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"results written to {out}")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size_list(text: str) -> list[int | tuple[int, int]]:
    """``64,200`` or ``200x180,64``."""
    out: list[int | tuple[int, int]] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            out.append(tuple(int(p) for p in item.lower().split("x")) if "x" in item.lower() else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 64,200 or 200x180, got {text!r}") from None
        if isinstance(out[-1], tuple) and len(out[-1]) != 2:
            raise argparse.ArgumentTypeError(f"expected sizes like 64,200 or 200x180, got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one size, got {text!r}")
    return out


def _variant_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in VARIANTS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown variant {bad[0] if bad else text!r}; known: {', '.join(VARIANTS)}")
    return values


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    bench = subparsers.add_parser("bench", help="benchmark networks on this machine",
                                  description="Latency and throughput benchmarks.")
    actions = bench.add_subparsers(dest="action", metavar="ACTION", required=True)
    unet = actions.add_parser(
        "unet", parents=[common], help="MAR U-Net forward latency and throughput",
        description="Forward latency (median, p90) and throughput of the MAR network in eval mode "
        "at the paper width (64) and the small width (16); on CUDA also bf16 autocast, "
        "NCHW layout (against the default channels-last) and torch.compile, each with its max |difference| from float32. "
        "Depth and scale quantile come from the mar_model config section.",
    )
    unet.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    unet.add_argument("--sizes", type=_size_list, default=[64, 200], metavar="N[,HxW...]",
                      help="image sizes (default 64,200)")
    unet.add_argument("--widths", type=_int_list, default=[64, 16], metavar="W[,W...]",
                      help="network widths (default 64,16)")
    unet.add_argument("--batch-sizes", type=_int_list, default=[1, 8], metavar="B[,B...]",
                      help="batch sizes (default 1,8)")
    unet.add_argument("--repeats", type=int, default=5, metavar="N", help="timed calls (default 5)")
    unet.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls (default 1)")
    unet.add_argument("--variants", type=_variant_list, default=None, metavar="V[,V...]",
                      help=f"subset of {','.join(VARIANTS)} (default: fp32 on CPU, all on CUDA)")
    unet.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    unet.add_argument("--seed", type=int, default=0)
    unet.add_argument("--checkpoint", metavar="FILE.pt",
                      help="benchmark this trained MAR checkpoint (its width) instead of random weights")
    unet.add_argument("--out", metavar="FILE.json", help="also write the rows as JSON")
    unet.set_defaults(func=cmd_unet)

    env = actions.add_parser(
        "env", parents=[common], help="acquisition environment and PPO training throughput",
        description="Environment steps per second of the batched acquisition environment "
        "(--n-envs slices stepping together, random valid actions) against one slice at a time "
        "(a one-env batched env and the Gymnasium env), same number of steps, same MAR network. "
        "With --sb3 also end-to-end PPO training throughput: ours (batched env, PolicyNet) "
        "against sb3-contrib MaskablePPO on the Gymnasium env, same rollout size, minibatch, "
        "epochs and number of steps. The episode comes from the acquisition section, the reward "
        "from env, PPO settings from ppo, the policy from policy_net, the MAR depth from mar_model.",
    )
    env.add_argument("--data", required=True, metavar="DIR", help="a MASC data set folder")
    env.add_argument("--split", default="train", choices=["train", "val", "test"],
                     help="split whose slices the episodes use (default train)")
    env.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    env.add_argument("--n-envs", type=int, default=64, metavar="B",
                     help="slices stepped together by the batched env (default 64)")
    env.add_argument("--steps", type=int, default=20, metavar="N",
                     help="timed steps of each batched env; the one-env loops make n-envs x N "
                     "(default 20)")
    env.add_argument("--mar-width", type=int, default=None, metavar="W",
                     help="MAR network width, 0 = none (default: mar_model.width)")
    env.add_argument("--sb3", action="store_true",
                     help=f"also compare PPO training with sb3-contrib MaskablePPO ({SB3_HINT})")
    env.add_argument("--sb3-policy", choices=SB3_POLICIES, default="mlp",
                     help="MaskablePPO's network: mlp (its default MultiInputPolicy MLP) or ours "
                     "(our PolicyNet as its features extractor: the same network on both sides)")
    env.add_argument("--ppo-steps", type=int, default=2048, metavar="N",
                     help="environment steps of each PPO training run, rounded up to a multiple "
                     "of ppo.rollout_steps (default 2048)")
    env.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    env.add_argument("--seed", type=int, default=0)
    env.add_argument("--out", metavar="FILE.json", help="also write the results as JSON")
    env.set_defaults(func=cmd_env)

    fallback = actions.add_parser(
        "fallback", parents=[common], help="what the OOD rule's safety net costs per slice",
        description="Per-slice latency (batch 1) of the early switch (score of the initial lines' images, "
        "threshold, centre-out's next line, the zero-filled image served) and of the end-of-scan rule, for "
        "each OOD score, beside the zero-filled reconstruction and MAR pass the decision runs anyway. "
        "Target: at most 20 ms per 128 x 128 slice on one core.")
    fallback.add_argument("--mar", metavar="CKPT", default="shipped:masc_small",
                          help="the MAR network (a checkpoint or shipped:NAME; default shipped:masc_small)")
    fallback.add_argument("--size", type=int, default=128, metavar="N", help="image size N x N (default 128)")
    fallback.add_argument("--initial", type=int, default=2, metavar="N", help="initial centre lines (default 2)")
    fallback.add_argument("--repeats", type=int, default=50, metavar="N", help="timed calls per row (default 50)")
    fallback.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads (default 1)")
    fallback.add_argument("--out", metavar="FILE.json", help="also write the rows as JSON")
    fallback.set_defaults(func=cmd_fallback)

    _register_serve(actions, common)
    _register_gpu_check(actions, common)


def cmd_fallback(args: argparse.Namespace) -> int:
    import torch

    from masc_gadget.models.checkpoint import load_mar
    from masc_gadget.models.shipped import resolve
    from training.bench.common import environment
    from training.bench.fallback import bench_fallback, format_table

    if args.threads < 1 or args.size < 8 or args.repeats < 1 or not 1 <= args.initial < args.size:
        raise ValueError("--threads and --repeats must be >= 1, --size >= 8, --initial in [1, size)")
    torch.set_num_threads(args.threads)
    mar, _ = load_mar(resolve(args.mar), "cpu")
    rows = bench_fallback(mar, args.size, args.initial, args.repeats)
    env = environment("cpu")
    print(f"OOD safety net per slice ({args.mar}, {args.size} x {args.size}, {args.initial} initial lines), "
          f"{env['cpu_threads']} CPU thread(s), torch {env['torch']}")
    print(format_table(rows))
    _write_json(args.out, {"environment": env, "rows": rows})
    return 0


def _register_gpu_check(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from training.bench.gpucheck import STEPS

    check = actions.add_parser(
        "gpu-check", parents=[common], help="every GPU measurement in one run (make gpu-check)",
        description="Runs, each as its own process with its own time limit: the gpu-marked tests, "
        "the MAR U-Net at paper width and 256x200 (bf16, channels-last, torch.compile), the batched "
        "environment against the one-slice loop and PPO against MaskablePPO, masc serve under 1 "
        "and 16 concurrent scans, and one paper-scale subject simulated on CUDA. Writes "
        "gpu_check.json and gpu_check.md (and one log per step) in --out. Without CUDA the "
        "CPU-safe parts run and the CUDA-only ones are reported as skipped.",
    )
    check.add_argument("--out", default="runs/gpu-check", metavar="DIR",
                       help="output folder (default runs/gpu-check)")
    check.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    check.add_argument("--steps", default=",".join(STEPS), metavar="S[,S...]",
                       help=f"steps to run (default all: {','.join(STEPS)})")
    check.add_argument("--quick", action="store_true",
                       help="tiny sizes everywhere: checks that the steps run, gives no figures")
    check.add_argument("--budget-s", type=float, default=480.0, metavar="S",
                       help="stop starting steps after S seconds (default 480, 8 minutes)")
    check.add_argument("--config-small", default="configs/small.yaml", metavar="FILE")
    check.add_argument("--config-paper", default="configs/paper.yaml", metavar="FILE")
    check.set_defaults(func=cmd_gpu_check)


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from training.bench.gpucheck import gpu_check

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    report = gpu_check(args.out, device=args.device, quick=args.quick, steps=steps,
                       config_small=args.config_small, config_paper=args.config_paper,
                       budget_s=args.budget_s)
    print((Path(args.out) / "gpu_check.md").read_text())
    failed = [r["step"] for r in report["steps"] if r["status"] in ("failed", "timeout")]
    if failed:
        print(f"gpu-check: {', '.join(failed)} did not finish; see their logs in {args.out}")
    return 1 if failed else 0


def _register_serve(actions: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    serve = actions.add_parser(
        "serve", parents=[common], help="masc serve under concurrent closed-loop scans",
        description="Starts masc serve (its own process, this --config plus --server-set "
        "overrides) and runs N simulated scanners against it at once for each N of --scans: "
        "decisions in deadline, scanner-side latency p50 / p90 / p99, the slowest first decision, "
        "server memory. The scanner section sets feedback, deadline and fallback; the "
        "acquisition section the episode and policy.",
    )
    serve.add_argument("--data", required=True, metavar="DIR", help="a MASC data set folder")
    serve.add_argument("--split", default="test", choices=["train", "val", "test"])
    serve.add_argument("--scans", type=_int_list, default=[1, 16, 64], metavar="N[,N...]",
                       help="concurrent scans per level (default 1,16,64)")
    serve.add_argument("--max-slices", type=int, default=4, metavar="N",
                       help="slices scanned per subject (default 4; 0 = all)")
    serve.add_argument("--server-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override for the started server only (repeatable)")
    serve.add_argument("--server", default="", metavar="HOST:PORT",
                       help="benchmark a server that is already running instead")
    serve.add_argument("--pace", action="store_true",
                       help="scanners send each line at its time in the sequence (scanner.pace), not "
                       "as fast as decisions come")
    serve.add_argument("--line-period-ms", type=float, default=None, metavar="MS",
                       help="with --pace: ms between lines (default: the sequence's, from the data)")
    serve.add_argument("--stagger-s", type=float, default=0.0, metavar="S",
                       help="spread the scans' starts evenly over S seconds (scan i starts i*S/N s "
                       "after the first; default 0: all at once)")
    serve.add_argument("--capacity", action="store_true",
                       help="instead of --scans: find the most concurrent scans that get every "
                       "decision in time (1, 2, 4, ... then bisection; use with --pace)")
    serve.add_argument("--max-scans", type=int, default=64, metavar="N",
                       help="with --capacity: the largest level tried (default 64)")
    serve.add_argument("--bare", action="store_true",
                       help="also time the bare batched decision pass (recon, MAR, policy; no "
                       "transport) at the largest level's batch, with the server's torch threads, "
                       "and report each level's decisions per second against it")
    serve.add_argument("--out", metavar="FILE.json", help="also write the rows as JSON")
    serve.set_defaults(func=cmd_serve)


def cmd_unet(args: argparse.Namespace) -> int:
    import torch

    from masc_gadget.cli import config_from_args
    from masc_gadget.models.unet import MarModelConfig
    from training.bench.common import environment
    from training.bench.unet import bench_unet, format_table

    mar_cfg = config_from_args(args).sections.get("mar_model", MarModelConfig())
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = bench_unet(device=args.device, widths=args.widths, sizes=args.sizes,
                      batch_sizes=args.batch_sizes, repeats=args.repeats, warmup=args.warmup,
                      depth=mar_cfg.depth, scale_quantile=mar_cfg.scale_quantile,
                      variants=args.variants, seed=args.seed, checkpoint=args.checkpoint)
    env = environment(args.device)
    weights = args.checkpoint or "seeded random weights"
    print(f"MAR U-Net forward ({weights}), eval mode, no_grad; {env['device']}"
          f"{' (' + env['device_name'] + ')' if 'device_name' in env else ''}, torch {env['torch']}, "
          f"{env['cpu_threads']} CPU threads; latency per call (whole batch)")
    print(format_table(rows))
    _write_json(args.out, {"environment": env, "rows": rows})
    return 0


def _load(values: list[float] | None) -> str:
    return "n/a" if not values else " ".join(f"{x:.2f}" for x in values)


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from masc_gadget.acquisition.episode import AcquisitionConfig
    from masc_gadget.cli import CommandError, config_from_args
    from masc_gadget.device import resolve_device
    from masc_gadget.models.policy_net import PolicyNetConfig
    from masc_gadget.models.unet import MarModelConfig
    from training.bench.common import environment
    from training.bench.env import bench_env, bench_ppo, format_env_table, seeded_mar
    from training.bench.sb3 import sb3_available
    from training.data import load_split
    from training.rl.env import EnvConfig
    from training.rl.ppo import PPOConfig

    config = config_from_args(args)
    sections = config.sections
    acq = sections.get("acquisition", AcquisitionConfig())
    env_cfg = sections.get("env", EnvConfig())
    mar_cfg = sections.get("mar_model", MarModelConfig())
    ppo_cfg = sections.get("ppo", PPOConfig())
    policy_cfg = sections.get("policy_net", PolicyNetConfig())
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    for name in ("n_envs", "steps", "ppo_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    width = mar_cfg.width if args.mar_width is None else args.mar_width
    device = resolve_device(args.device)
    data = load_split(args.data, args.split)
    acq.check(data.n_pe)
    mar = seeded_mar(width, mar_cfg, seed=args.seed, device=device)
    info = environment(device)  # load average before the runs; the one after is added below

    result = bench_env(data, acq.initial, acq.budget, n_envs=args.n_envs, steps=args.steps,
                       mar=mar, device=device, env_cfg=env_cfg, seed=args.seed)
    ppo_result = None
    if args.sb3:
        if ppo_cfg.rollout_steps % args.n_envs:
            raise CommandError(f"ppo.rollout_steps ({ppo_cfg.rollout_steps}) must be a multiple of "
                               f"--n-envs ({args.n_envs}); change one with --set ppo.rollout_steps=N")
        sb3 = sb3_available()
        if not sb3:
            print(f"sb3-contrib is not installed, MaskablePPO comparison skipped: {SB3_HINT}")
        ppo_result = bench_ppo(data, acq.initial, acq.budget, n_envs=args.n_envs,
                               total_steps=args.ppo_steps, mar=mar, device=device, env_cfg=env_cfg,
                               ppo_cfg=ppo_cfg, policy_cfg=policy_cfg, sb3=sb3, seed=args.seed,
                               sb3_policy=args.sb3_policy)
        if not sb3:
            ppo_result["sb3_status"] = f"skipped: sb3-contrib not installed ({SB3_HINT})"

    info["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    h, w = result["image_shape"]
    print(f"acquisition env, {h}x{w}, {acq.initial} initial + {acq.budget} chosen lines, "
          f"MAR width {width or 'none'}, random valid actions; {info['device']}"
          f"{' (' + info['device_name'] + ')' if 'device_name' in info else ''}, torch {info['torch']}, "
          f"{info['cpu_threads']} CPU threads, load average {_load(info['load_average'])} before, "
          f"{_load(info['load_average_end'])} after")
    print(format_env_table(result, ppo_result))
    _write_json(args.out, {"command": command, "environment": info, "env": result, "ppo": ppo_result})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from masc_gadget.cli import config_from_args
    from sim_scanner.scanner.config import ScannerConfig
    from training.bench.common import environment
    from training.bench.serve import bench_serve, format_serve_table

    config = config_from_args(args)
    if args.max_slices < 0:
        raise ValueError(f"--max-slices must be >= 0 (0 = all), got {args.max_slices}")
    scanner = dataclasses.replace(config.sections.get("scanner", ScannerConfig()),
                                  max_slices=args.max_slices)
    if args.pace:
        scanner = dataclasses.replace(scanner, pace=True)
    if args.line_period_ms is not None:
        scanner = dataclasses.replace(scanner, line_period_ms=args.line_period_ms)
    if args.max_scans < 1:
        raise ValueError(f"--max-scans must be >= 1, got {args.max_scans}")
    if args.capacity and not scanner.pace:
        log.warning("--capacity without --pace: scans as fast as decisions come measure throughput, "
                    "not how many paced scans keep up")
    server_overrides = [*args.overrides, *args.server_set]
    result = bench_serve(config, args.data, args.split, args.scans, scanner, args.config,
                         server_overrides, args.server, capacity=args.capacity, max_scans=args.max_scans,
                         stagger_s=args.stagger_s)
    if args.bare:
        from masc_gadget.serving.host import ServerConfig
        from sim_scanner.dataset.layout import read_manifest
        from training.bench.serve import bare_decisions_per_s

        n_pe, n_readout = read_manifest(args.data)["config"]["sequence"]["matrix"]
        threads = config.sections.get("server", ServerConfig()).threads
        batch = max(r["scans"] for r in result["rows"])
        result["bare"] = bare_decisions_per_s(config, n_pe, n_readout, batch, threads)
        for row in result["rows"]:
            if row.get("decisions_per_s"):
                row["of_bare"] = row["decisions_per_s"] / result["bare"]["decisions_per_s"]
    result["command"] = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    result["environment"] = environment("cpu")
    acq = config["acquisition"]
    print(f"masc serve at {result['server']}: policy {acq.policy}, {acq.initial} + {acq.budget} lines, "
          f"feedback {scanner.feedback}, deadline {scanner.deadline_ms:g} ms, "
          f"{'paced, ' if scanner.pace else ''}"
          f"{args.max_slices or 'all'} slices per scan, {os.cpu_count()} CPUs")
    print(format_serve_table(result))
    if "bare" in result:
        bare = result["bare"]
        print(f"bare batched decision pass, batch {bare['batch']}, {bare['threads']} thread(s): "
              f"{bare['decisions_per_s']:.1f} decisions/s ({bare['pass_ms']:.1f} ms a pass); served: "
              + ", ".join(f"{r['scans']} scans {100 * r['of_bare']:.0f} %" for r in result["rows"] if "of_bare" in r))
    _write_json(args.out, result)
    return 0
