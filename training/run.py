"""One training run's skeleton, shared by every trainer (MAR pre-training, co-adaptive MASC,
DQN / SS-DDQN, the learned mask, the fixed order and the MAR fine-tuning recipe): its loop, its
files, its resume, its best and last checkpoints, its CSV log and its seeded initialisation.

The trainer loop is written once, :meth:`TrainingRun.loop`. A trainer (:class:`Trainer`) brings
what makes it different: how it trains one period (an epoch, a rollout, the transitions between
two validations, the steps between two validations), how it validates, what its checkpoints
hold and how it reports. The loop does the rest, period after period until the trainer's
``total``::

    row = trainer.train_period(bar)       # the CSV row's training columns; ``done`` advances
    if trainer.due():                     # TrainingRun.validated
        metrics = trainer.validate()
        keep the best (on ``metric``), save OUT.pt (when better) and OUT.last.pt, barrier
        row += trainer.columns(metrics); trainer.report(...)
    row["seconds"]                        # the period's, or since the run started (trainer.clock)
    append the row to OUT.csv             # trainer.fields(row): its columns
    progress bar and its postfix

A resumed run continues in one call, :meth:`TrainingRun.restore`: the last checkpoint's state
dicts go into the trainer's modules, its optimizers', generators' and memories' states into
theirs, and it returns the periods done (the trainer's ``done``), where the loop goes on.
:func:`snapshot` writes those states for the last checkpoint.

Files of a run whose best checkpoint is ``OUT.pt``:

* ``OUT.pt``: the best checkpoint by the run's validation metric (what is served and evaluated);
* ``OUT.last.pt``: the latest state, with the optimizers' and generators' states (``--resume``);
* ``OUT.csv``: one row per epoch / rollout / validation, appended (a crash keeps every row; a
  resumed run appends to it; a fresh run starts it anew).

Under ``torchrun`` only rank 0 writes (``main``) and reports; every rank keeps the same best
metrics.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from masc_gadget.core.seeding import isolated_rng
from masc_gadget.models.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from training.csvlog import append_row
from training.distributed import Dist

__all__ = ["RUN_KEYS", "Checkpoints", "RunSettings", "Trainer", "TrainingRun", "git_commit", "seeded", "snapshot"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RunSettings:
    """What every trainer's section holds alike (its ``run`` entry: ``mar_train.run.seed``, ...)."""

    seed: int = 0
    """Seed of weight init, shuffling, masks and the trainer's own draws."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (a distributed run: each rank's own GPU)."""
    max_train_slices: int = 0
    """Use only the first N training slices (0 = all)."""
    max_val_slices: int = 0
    """Use only the first N validation slices (0 = all)."""

    def __post_init__(self) -> None:
        for name in ("seed", "max_train_slices", "max_val_slices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")


RUN_KEYS = {name: f"run.{name}" for name in ("seed", "device", "max_train_slices", "max_val_slices")}
"""A trainer section's keys from before they were nested under ``run``; the config loader reads
them there, with a note (:func:`masc_gadget.config.from_dict`, ``FLAT_KEYS``)."""


def seeded(seed: int, build: Callable[[], T]) -> T:
    """``build()`` with torch's global generator seeded by ``seed`` for the call only (seeded
    weight initialisation; the caller's global RNG state is left as it was)."""
    with isolated_rng(seed):
        return build()


def git_commit() -> str | None:
    """The commit of the code that runs (None outside a git work tree); a work tree with
    uncommitted changes is marked ``+dirty``."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def command_line() -> str:
    """The command this process runs, as typed (``masc train ...``)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("masc", "cli.py", "__main__.py"):
        argv[0] = "masc"
    return shlex.join(argv)


def snapshot(states: dict[str, Any]) -> dict[str, Any]:
    """The states of optimizers, generators and other stateful objects (a replay memory), by
    name: what a ``.last.pt`` checkpoint keeps beside its modules to resume the run exactly."""
    return {name: obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()
            for name, obj in states.items()}


def _load_state(obj: Any, state: Any) -> None:
    """Put ``state`` (of :func:`snapshot`, or a numpy generator's state as JSON) back into ``obj``."""
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = json.loads(state) if isinstance(state, str) else state
    else:
        obj.load_state_dict(state)


@dataclass(frozen=True)
class Checkpoints:
    """What one validation saves (:meth:`TrainingRun.record`): where in the run it is (e.g.
    ``{"epoch": 3}``), the modules of the best checkpoint and of the last one, their metadata,
    the last one's other states (:func:`snapshot`) and, under ``torchrun``, the module whose
    parameters every rank must hold alike (``sync``)."""

    where: dict[str, Any]
    best: dict[str, Any]
    last: dict[str, Any]
    metadata: dict[str, Any]
    extra_state: dict[str, Any]
    sync: torch.nn.Module | None = None


class Trainer(ABC):
    """One trainer as :meth:`TrainingRun.loop` drives it (module docstring).

    Attributes: ``name`` and ``unit`` (the progress bar's label and what a period counts:
    ``epoch``, ``rollout``, ``transition``, ``step``), ``done`` and ``total`` (units trained so
    far, and to train), ``clock`` (the CSV's ``seconds`` column: each period's own time,
    ``period``; the time since the run started, ``run``; none, None).
    """

    name: str
    unit: str
    done: int
    total: int
    clock: Literal["period", "run"] | None = "period"

    @abstractmethod
    def train_period(self, bar: Any) -> dict[str, Any]:
        """Train one period and advance ``done`` (``bar``: the progress bar, for a trainer that
        shows progress within a period); returns the CSV row's training columns."""

    def due(self) -> bool:
        """Whether the period just trained ends with a validation (default: every one)."""
        return True

    @abstractmethod
    def validate(self) -> dict[str, float]:
        """The validation metrics of the current networks (the run's ``metric`` among them)."""

    @abstractmethod
    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        """What the validation with ``metrics`` saves."""

    def columns(self, metrics: dict[str, float]) -> dict[str, Any]:
        """The CSV row's validation columns (default: ``val_<metric>``)."""
        return {f"val_{key}": value for key, value in metrics.items()}

    def fields(self, row: dict[str, Any]) -> Sequence[str] | None:
        """The CSV's columns, in order (default: the row's keys; a trainer whose periods are not
        all validated names them, since the first row's keys make the header)."""
        return None

    @abstractmethod
    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        """Say what the validation gave (the log line; rank 0 only)."""

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        """The progress bar's figures after a period (default: none)."""
        return {}


class TrainingRun:
    """The bookkeeping of one run (module docstring).

    Args:
        out: the best checkpoint's path; its folder is created.
        metric: the validation metric that selects the best checkpoint (``ssim``, ``loss``).
        higher_is_better: whether a larger ``metric`` is better.
        main: whether this process writes (rank 0, or the only process).
        resume: a ``.last.pt`` checkpoint to continue from, or None (a fresh run: the CSV log is
            started anew).
        kind: the checkpoint kind ``resume`` must be (its metadata ``kind``); None: any.
        map_location: where ``resume``'s tensors are loaded.

    After construction, :attr:`checkpoint` is the resumed checkpoint (None for a fresh run)
    and :attr:`best` the best validation metrics so far (from it).
    """

    def __init__(self, out: str | Path, metric: str, higher_is_better: bool, main: bool = True,
                 resume: str | Path | None = None, kind: str | None = None,
                 map_location: str | torch.device = "cpu") -> None:
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.last = self.out.with_name(self.out.stem + ".last.pt")
        self.csv = self.out.with_suffix(".csv")
        self.metric = metric
        self.higher_is_better = higher_is_better
        self.main = main
        self.best: dict[str, Any] = {metric: -math.inf if higher_is_better else math.inf}
        self.checkpoint: Checkpoint | None = None
        self.provenance: dict[str, Any] = {}
        self.resumed_from = resume
        if resume is not None:
            ck = load_checkpoint(resume, map_location=map_location)
            if kind is not None and ck.metadata.get("kind") != kind:
                raise ValueError(f"{resume} is a {ck.metadata.get('kind')!r} checkpoint, not a {kind!r} one")
            self.checkpoint = ck
            self.best = dict(ck.metadata["best_val"])
        elif main:
            self.csv.unlink(missing_ok=True)

    def describe(self, data_dir: str | Path | list[str | Path], **splits: Any) -> None:
        """Record what touched the data in every checkpoint the run writes (``provenance``): the
        command line, the git commit, each data folder's identity (manifest hash, splits) and
        the subjects of each split used (``splits``: name -> :class:`~training.data.SliceSet`,
        e.g. ``train=`` what it trains on, ``val=`` what selects it)."""
        from training.data import data_dirs, data_identity

        data = []
        for folder in data_dirs(data_dir):
            try:
                data.append({k: v for k, v in data_identity(folder).items() if k != "train_anatomies"})
            except (FileNotFoundError, ValueError):
                data.append({"folder": Path(folder).name})
        self.provenance = {"command": command_line(), "git_commit": git_commit(), "data": data,
                           "subjects": {name: sorted(set(s.subjects)) for name, s in splits.items()}}

    def improved(self, metrics: dict[str, float], **where: Any) -> bool:
        """Whether ``metrics`` beat the best so far on the run's metric; if so they become the
        best, with ``where`` (e.g. ``epoch=3``) in front."""
        value, best = metrics[self.metric], self.best[self.metric]
        better = value > best if self.higher_is_better else value < best
        if better:
            self.best = {**where, **metrics}
        return better

    def save(self, improved: bool, best: dict[str, torch.nn.Module], last: dict[str, torch.nn.Module],
             metadata: dict[str, Any], extra_state: dict[str, Any]) -> None:
        """Write the best checkpoint (when ``improved``: the ``best`` modules) and the last one
        (the ``last`` modules and ``extra_state``, for resuming); rank 0 only."""
        if not self.main:
            return
        if improved:
            save_checkpoint(self.out, best, metadata)
        save_checkpoint(self.last, last, metadata, extra_state=extra_state)

    def log_row(self, row: dict[str, Any], fields: Sequence[str] | None = None) -> None:
        """Append one row to the run's CSV log (rank 0 only)."""
        if self.main:
            append_row(self.csv, row, fields)

    def record(self, metrics: dict[str, float], where: dict[str, Any], best: dict[str, torch.nn.Module],
               last: dict[str, torch.nn.Module], metadata: dict[str, Any], extra_state: dict[str, Any],
               row: dict[str, Any] | None = None, fields: Sequence[str] | None = None, dist: Dist = Dist(),
               sync: torch.nn.Module | None = None) -> bool:
        """The end of one period of training: ``metrics`` (validation) become the best when they
        improve on it (:meth:`improved`, with ``where``, e.g. ``{"epoch": 3}``); under torchrun
        the ranks' ``sync`` module is checked to be the same; the best checkpoint (``best``
        modules, when improved) and the last one (``last`` modules and ``extra_state``) are saved
        with ``metadata`` and the best metrics so far (``best_val``); every rank waits until they
        are on disk; ``row`` is appended to the CSV log (``fields``: its columns). Returns
        whether the metrics improved."""
        improved = self.improved(metrics, **where)
        if sync is not None:
            dist.check_in_sync(sync)
        self.save(improved, best, last, {**metadata, "best_val": self.best,
                                         **({"provenance": self.provenance} if self.provenance else {})}, extra_state)
        dist.barrier()  # the checkpoint is on disk before any rank goes on
        if row is not None:
            self.log_row(row, fields)
        return improved

    def finish(self, best: dict[str, torch.nn.Module], metadata: dict[str, Any]) -> None:
        """A run that saved no best checkpoint (resumed after its last epoch into a new path)
        saves its current modules as the best (rank 0 only)."""
        if self.main and not self.out.exists():
            save_checkpoint(self.out, best, {**metadata, **({"provenance": self.provenance} if self.provenance else {})})

    def restore(self, modules: dict[str, Any], states: dict[str, Any], period: str,
                optional: Collection[str] = ()) -> int:
        """Resume in one call: the resumed checkpoint's state dicts go into ``modules`` and its
        saved states (its extra state, else its metadata: a numpy generator's JSON state) into
        the objects of ``states`` (optimizers, generators, a replay memory), each by name; a
        None object, or an ``optional`` name the checkpoint lacks, is skipped. Returns the
        periods done (metadata ``period``, e.g. ``epoch``); 0 for a fresh run."""
        ck = self.checkpoint
        if ck is None:
            return 0
        for name, module in modules.items():
            if module is not None and not (name in optional and name not in ck.state_dicts):
                module.load_state_dict(ck.state_dicts[name])
        for name, obj in states.items():
            saved = ck.extra if name in ck.extra else ck.metadata
            if obj is not None and not (name in optional and name not in saved):
                _load_state(obj, saved[name])
        done = int(ck.metadata[period])
        log.info("resumed from %s after %s %d (best val %s %.4f)", self.resumed_from, period, done, self.metric,
                 self.best[self.metric])
        return done

    def validated(self, trainer: Trainer, row: dict[str, Any], dist: Dist = Dist()) -> bool:
        """Validate ``trainer`` now and :meth:`record` it (keep the best, save the best and the
        last checkpoints, wait for every rank); the validation's columns join ``row`` and rank 0
        reports. Returns whether the metrics improved."""
        metrics = trainer.validate()
        saved = trainer.checkpoints(metrics)
        improved = self.record(metrics, saved.where, saved.best, saved.last, saved.metadata, saved.extra_state,
                               dist=dist, sync=saved.sync)
        row.update(trainer.columns(metrics))
        if self.main:
            trainer.report(row, metrics, improved)
        return improved

    def end_period(self, trainer: Trainer, row: dict[str, Any], dist: Dist = Dist(),
                   since: float | None = None) -> None:
        """The end of one period: :meth:`validated` when the trainer is due, the ``seconds``
        column (since ``since``, when given), the CSV row (rank 0)."""
        if trainer.due():
            self.validated(trainer, row, dist)
        if since is not None:
            row["seconds"] = time.perf_counter() - since
        self.log_row(row, trainer.fields(row))

    def loop(self, trainer: Trainer, dist: Dist = Dist(), progress: bool = True,
             started: float | None = None) -> float:
        """The trainer loop (module docstring): periods of ``trainer`` from its ``done`` until
        its ``total``, each ended by :meth:`end_period`, under a progress bar (rank 0, with
        ``progress``). ``started``: when the run's clock started (default: now). Returns the
        seconds since then."""
        from tqdm.auto import tqdm

        started = time.perf_counter() if started is None else started
        if trainer.done >= trainer.total:
            log.info("nothing to do: %d of %d %ss already trained", trainer.done, trainer.total, trainer.unit)
        bar = tqdm(desc=trainer.name, unit=trainer.unit, total=trainer.total, initial=trainer.done,
                   disable=not (progress and self.main) or trainer.done >= trainer.total)
        while trainer.done < trainer.total:
            begun = time.perf_counter()
            row = trainer.train_period(bar)
            bar.update(trainer.done - bar.n)
            since = begun if trainer.clock == "period" else started if trainer.clock == "run" else None
            self.end_period(trainer, row, dist, since)
            bar.set_postfix(trainer.postfix(row))
        bar.close()
        return time.perf_counter() - started
