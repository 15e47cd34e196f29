"""One inference worker for many acquisition engines: the decision passes of every connection
that waits at the same moment run as one batched forward (zero-filled recon -> MAR -> policy).

Each engine serves one connection from its own thread. Without a batcher, 16 concurrent scans
make 16 forward passes of one slice each, competing for the same cores; with one, the passes
that are queued when the worker is free are grouped by model (same policy and MAR network,
same matrix and device) and run together, so the cost per decision falls as the load rises.

The queue is bounded (a full queue is an error for the caller: the scanner then takes its
fallback line), and a request that has waited past its deadline is answered with
:class:`DeadlineExpired` instead of being computed: its answer could no longer be used.
Nothing here does I/O; the worker is a daemon thread that :meth:`DecisionBatcher.close` stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class DeadlineExpired(RuntimeError):
    """The request waited in the queue past its deadline and was not computed."""


class QueueFull(RuntimeError):
    """The batcher's queue is full: too many decisions are waiting."""


@dataclass(eq=False)
class DecisionRequest:
    """The decision pass of one engine: ``run(requests)`` computes a group of them at once."""

    key: Any
    """Requests with equal keys run in one pass (the same models, matrix and device)."""
    payload: Any
    """What ``run`` needs of this request (k-space, masks, states, generators, ...)."""
    size: int
    """Slices in this request (the batch grows by this much)."""
    deadline: float | None = None
    """``time.monotonic()`` after which the answer is useless; None = no deadline."""
    future: Future = field(default_factory=Future)


RunGroup = Callable[[Sequence[DecisionRequest]], Sequence[Any]]
"""Computes the answers of a group of requests with equal keys, one answer per request."""


class DecisionBatcher:
    """A worker thread that runs queued :class:`DecisionRequest` s in batched passes.

    Args:
        run: computes one group (requests with equal ``key``), returns one answer per request.
        max_batch: slices per pass at most (a request larger than this runs alone).
        max_queue: requests waiting at most; :meth:`submit` raises :class:`QueueFull` beyond.
        linger_ms: how long the worker waits for more requests once it has one (0: take what
            is queued now; a few ms trade latency at low load for larger batches at high load).
    """

    def __init__(self, run: RunGroup, max_batch: int = 64, max_queue: int = 1024,
                 linger_ms: float = 0.0, name: str = "masc-decisions") -> None:
        if max_batch < 1 or max_queue < 1 or linger_ms < 0:
            raise ValueError(f"max_batch and max_queue must be >= 1 and linger_ms >= 0, got "
                             f"{max_batch}, {max_queue}, {linger_ms}")
        self._run = run
        self.max_batch = int(max_batch)
        self.linger_s = float(linger_ms) / 1e3
        self._queue: queue.Queue[DecisionRequest | None] = queue.Queue(maxsize=int(max_queue))
        self._pending: list[DecisionRequest] = []
        self._closed = threading.Event()
        self.passes = 0
        """Batched passes run so far."""
        self.batched = 0
        """Requests answered so far (each pass answers one or more)."""
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: DecisionRequest) -> Future:
        """Queue ``request``; its ``future`` gets the answer, or the pass's exception."""
        if self._closed.is_set():
            raise RuntimeError("the decision batcher is closed")
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} decisions are already waiting") from None
        return request.future

    def __call__(self, request: DecisionRequest, timeout: float | None = None) -> Any:
        """Submit and wait for the answer (re-raises the pass's exception)."""
        return self.submit(request).result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker; requests still queued fail with RuntimeError."""
        self._closed.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)

    # --- the worker -------------------------------------------------------------------------------

    def _take(self) -> list[DecisionRequest]:
        """Block for one request, then take what is queued (lingering up to ``linger_s``)."""
        first = self._pending.pop(0) if self._pending else self._queue.get()
        if first is None:
            return []
        taken = [first]
        size = first.size
        end = time.monotonic() + self.linger_s
        while size < self.max_batch:
            try:
                wait = end - time.monotonic()
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._closed.set()
                break
            taken.append(item)
            size += item.size
        return taken

    def _groups(self, taken: list[DecisionRequest]) -> list[list[DecisionRequest]]:
        """Live requests grouped by key, each group within ``max_batch`` slices; the rest wait
        for the next pass (in order)."""
        now = time.monotonic()
        groups: dict[Any, list[DecisionRequest]] = {}
        sizes: dict[Any, int] = {}
        for request in taken:
            if request.deadline is not None and now > request.deadline:
                request.future.set_exception(DeadlineExpired("the decision was not computed: "
                                                             "its deadline passed in the queue"))
                continue
            group = groups.setdefault(request.key, [])
            if group and sizes[request.key] + request.size > self.max_batch:
                self._pending.append(request)
                continue
            group.append(request)
            sizes[request.key] = sizes.get(request.key, 0) + request.size
        return list(groups.values())

    def _work(self) -> None:
        while True:
            taken = self._take()
            if not taken and self._closed.is_set():
                break
            for group in self._groups(taken):
                self._run_group(group)
            if self._closed.is_set() and self._queue.empty() and not self._pending:
                break
        self._fail_waiting()

    def _run_group(self, group: list[DecisionRequest]) -> None:
        try:
            answers = self._run(group)
            if len(answers) != len(group):
                raise RuntimeError(f"a batched pass returned {len(answers)} answers for {len(group)} requests")
        except Exception as err:  # noqa: BLE001 - handed to every waiting caller, never lost
            for request in group:
                request.future.set_exception(err)
            return
        self.passes += 1
        self.batched += len(group)
        for request, answer in zip(group, answers):
            request.future.set_result(answer)

    def _fail_waiting(self) -> None:
        leftover = list(self._pending)
        self._pending.clear()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                leftover.append(item)
        for request in leftover:
            if not request.future.done():
                request.future.set_exception(RuntimeError("the decision batcher is closed"))


def split_rows(array: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """``array`` cut along its first axis into consecutive pieces of ``sizes`` rows."""
    return np.split(array, np.cumsum(sizes)[:-1]) if len(sizes) else []
