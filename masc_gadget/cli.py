"""The ``masc`` console command.

Subcommands are plugins (entry-point group ``masc.commands``): each package that owns a
subcommand exposes ``register(subparsers, common)``, adds its parser(s) with
``parents=[common]`` and sets ``func`` to a callable taking the parsed namespace. This module
only dispatches, configures logging and turns bad input into a one-line error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from masc_gadget import __version__
from masc_gadget.config import Config, ConfigError, load_config

COMMANDS_GROUP = "masc.commands"
log = logging.getLogger("masc")


class CommandError(Exception):
    """Bad input to a subcommand: printed as one line, exit status 2."""


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes: --config, --set, --log-level, --debug."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common options")
    group.add_argument("--config", metavar="FILE.yaml[,FILE.yaml]", help="YAML config overriding the defaults; "
                       "A.yaml,B.yaml layers B's keys over A's")
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set sequence.b0_t=1.5",
    )
    group.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    group.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return common


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated config named by ``--config`` with ``--set`` overrides applied."""
    return load_config(getattr(args, "config", None), getattr(args, "overrides", []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masc",
        description="MASC: metal-aware k-space sampling and correction for accelerated MRI.",
    )
    parser.add_argument("--version", action="version", version=f"masc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_options()
    for ep in sorted(metadata.entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as err:  # an optional dependency group is not installed
            _register_unavailable(subparsers, ep.name, err)
            continue
        register(subparsers, common)
    return parser


def missing_extra(err: ImportError) -> str:
    """What to tell a user whose install lacks an optional dependency group."""
    return (f"needs {err.name or err}, which is not installed; install the training and "
            "simulation stack with: pip install 'masc[train]'")


def _register_unavailable(subparsers: argparse._SubParsersAction, name: str,
                          err: ImportError) -> None:
    """A subcommand whose package cannot be imported: listed, and an error saying what to
    install when run (the serving-only install has no training stack)."""
    message = f"masc {name} {missing_extra(err)}"

    def fail(_args: argparse.Namespace) -> int:
        raise CommandError(message)

    p = subparsers.add_parser(name, help=f"(unavailable: {missing_extra(err)})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=fail, log_level="WARNING", debug=False)


RENAMED = {"mar-check": ["check", "mar"], "headroom": ["check", "headroom"], "diversity": ["check", "diversity"],
           "export": ["models", "export"], "refit": ["train", "refit"], "study": ["check"]}
"""Old command names -> the command tree's (CHANGELOG 0.2.0); the old ones work until 0.3."""
MODES = {("eval",): {"run": [], "combine": ["--combine"], "suite": ["--suite", "paper"], "retest": ["--retest"]},
         ("check", "headroom"): {"run": [], "combine": ["--combine"], "from": ["--from"]}}
"""Commands whose modes are subcommands: ``masc eval combine DIR,DIR`` is the mode flag ``--combine DIR,DIR``
of the one parser underneath."""
OLD_FLAGS = {("eval",): {"--combine": "masc eval combine DIR,DIR", "--suite": "masc eval suite",
                         "--retest": "masc eval retest DIR,DIR", "--headroom": "masc check headroom"},
             ("check", "headroom"): {"--combine": "masc check headroom combine DIR,DIR",
                                     "--from": "masc check headroom from DIR"}}
"""Mode flags written the old way, and the spelling that replaces each."""
DEPRECATED_UNTIL = "0.3"


def spelled(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` in the command tree's own spelling, and a note for each old spelling it used (old
    command names, mode flags); the old spellings keep working until version :data:`DEPRECATED_UNTIL`."""
    argv, notes = list(argv), []
    if argv and argv[0] in RENAMED:
        new = RENAMED[argv[0]]
        notes.append(f"'masc {argv[0]}' is now 'masc {' '.join(new)}'")
        argv = [*new, *argv[1:]]
    for prefix, modes in MODES.items():
        n = len(prefix)
        if tuple(argv[:n]) != prefix:
            continue
        if len(argv) > n and argv[n] in modes:
            argv = [*argv[:n], *modes[argv[n]], *argv[n + 1:]]
        else:
            notes += [f"'masc {' '.join(prefix)} {flag}' is now '{new}'" for flag, new in OLD_FLAGS[prefix].items()
                      if flag in argv]
    return argv, notes


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, notes = spelled(sys.argv[1:] if argv is None else argv)
    for note in notes:
        print(f"masc: note: {note}; the old spelling works until version {DEPRECATED_UNTIL}", file=sys.stderr)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    prog = "masc " + " ".join(
        x for x in (getattr(args, "command", None), getattr(args, "action", None)) if x
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ConfigError, FileNotFoundError, FileExistsError, ValueError, OSError) as err:
        if args.debug:
            raise
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a lazily imported optional dependency
        if args.debug:
            raise
        print(f"{prog}: error: {prog} {missing_extra(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
