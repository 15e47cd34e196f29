"""Data-parallel training under ``torchrun`` (PyTorch DistributedDataParallel).

``torchrun --nproc_per_node N -m masc_gadget.cli train mar ...`` starts N processes with the
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` environment;
:func:`setup` joins them into one process group (NCCL on CUDA, gloo on CPU) and says who this
process is. A plain ``masc train ...`` (no such environment) is a group of one and changes
nothing. Rank 0 alone writes checkpoints and logs; every rank keeps the same model, optimizer
and random streams (DDP all-reduces the gradients), so a checkpoint holds no per-rank state and
a run resumes with any number of ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

__all__ = ["Dist", "setup", "shard"]


@dataclass(frozen=True)
class Dist:
    """This process's place in the group."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process: gradients are all-reduced."""
        return self.world > 1

    def device(self, requested: str) -> str:
        """The device of this rank: ``cuda:LOCAL_RANK`` when ``requested`` is auto / cuda and
        CUDA is present, else ``requested``."""
        if self.active and requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return requested

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def average_gradients(self, module: torch.nn.Module) -> None:
        """All-reduce the gradients of ``module`` to their mean over the ranks (every rank must
        call it after the same backward passes)."""
        if not self.active:
            return
        for p in module.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= self.world

    def mean(self, value: float) -> float:
        """``value`` averaged over the ranks (the same answer on every rank)."""
        if not self.active:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t[0]) / self.world

    def check_in_sync(self, module: torch.nn.Module) -> None:
        """RuntimeError unless every rank holds the same parameters (compares a checksum)."""
        if not self.active:
            return
        with torch.no_grad():
            total = torch.stack([p.detach().double().sum().cpu() for p in module.parameters()]).sum()
        both = torch.stack([total, -total])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        if float(both[0] + both[1]) > 1e-6 * max(1.0, abs(float(total))):
            raise RuntimeError("the ranks' parameters differ: data-parallel training went out of sync")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` under DistributedDataParallel (BatchNorm made SyncBatchNorm on CUDA; on
        CPUs, where there is none, each rank normalises its own part of the batch: use
        ``mar_model.norm: group`` for results equal to one process); itself alone."""
        if not self.active:
            return model
        device = next(model.parameters()).device
        if device.type == "cuda":
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        return torch.nn.parallel.DistributedDataParallel(model)


def setup() -> Dist:
    """Join the ``torchrun`` process group when this process was started by one (idempotent);
    a group of one otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(backend)
        log.info("rank %d of %d joined the %s process group", rank, world, backend)
    return Dist(rank, world, local_rank)


def shard(index: torch.Tensor, dist: Dist) -> torch.Tensor:
    """This rank's part of a global minibatch ``index``: every ``world``-th item from ``rank``."""
    return index[dist.rank::dist.world]
