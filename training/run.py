"""One training run's skeleton, shared by every trainer (MAR pre-training, co-adaptive MASC,
DQN / SS-DDQN, the learned mask, the fixed order and the MAR fine-tuning recipe): its files, its
resume, its best and last checkpoints, its CSV log and its seeded initialisation.

Every trainer ends each of its periods (an epoch, a validated rollout, a number of transitions)
with one call, :meth:`TrainingRun.record`: keep the validation metrics if they are the best,
save the best and the last checkpoints, wait for every rank, append the CSV row. Trainers keep
only what makes them different: what they train and how they validate.

Files of a run whose best checkpoint is ``OUT.pt``:

* ``OUT.pt``: the best checkpoint by the run's validation metric (what is served and evaluated);
* ``OUT.last.pt``: the latest state, with the optimizers' and generators' states (``--resume``);
* ``OUT.csv``: one row per epoch / rollout / validation, appended (a crash keeps every row; a
  resumed run appends to it; a fresh run starts it anew).

Under ``torchrun`` only rank 0 writes (``main``); every rank keeps the same best metrics.
"""

from __future__ import annotations

import logging
import math
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from masc_gadget.core.seeding import isolated_rng
from masc_gadget.models.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from training.csvlog import append_row
from training.distributed import Dist

__all__ = ["TrainingRun", "git_commit", "seeded"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
