"""Sampling policies: which phase-encoding line to acquire next.

A policy looks at an :class:`~masc_gadget.acquisition.episode.AcquisitionState` and returns one line that
is not acquired yet. It must work from *any* state, not only from the states its own choices
lead to: online, the scanner is the authority on what was acquired and may acquire lines the
policy did not ask for. The same objects run offline (:func:`run_episode`, evaluation batched
over many slices with :meth:`SamplingPolicy.select_batch`) and online in the streaming gadget.

The four conventional baselines of the paper are here (center-out, random, random-lowbias,
equispaced); learned policies (PPO, DQN) live in other packages and join the registry with
:func:`register_policy` or the ``masc.policies`` entry-point group.

Randomness is explicit: random policies take a ``numpy.random.Generator`` and never touch
numpy's global RNG; :func:`slice_rng` gives each slice its own reproducible stream.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import numpy as np

from masc_gadget.acquisition.episode import (
    AcquisitionState,
    EpisodeBatch,
    check_episode,
    initial_lines,
)

POLICIES_GROUP = "masc.policies"


def slice_rng(seed: int, *key: int) -> np.random.Generator:
    """A reproducible random stream for one slice: ``default_rng(SeedSequence([seed, *key]))``.

    ``key`` identifies the slice, e.g. ``slice_rng(cfg.seed, subject, slice_index)``, so that
    evaluation and the gadget draw the same lines for the same slice whatever the order.
    """
    parts = (seed, *key)
    for part in parts:
        is_int = isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_))
        if not is_int or part < 0:
            raise ValueError(f"seed and key must be non-negative integers, got {list(parts)}")
    return np.random.default_rng(np.random.SeedSequence([int(p) for p in parts]))


def center_out_rank(n_pe: int) -> np.ndarray:
    """(n_pe,) int64 rank of each line in centre-out order c, c+1, c-1, c+2, c-2, ...
    (c = n_pe // 2, the k-space centre); lower ranks are closer to the centre."""
    offset = np.arange(n_pe, dtype=np.int64) - n_pe // 2
    return 2 * np.abs(offset) - (offset > 0)


def farthest_free_line(mask: np.ndarray) -> int:
    """The free line farthest from every acquired line (circular distance: the two k-space edges
    are neighbours on the DFT grid); ties go to the line nearest the centre (centre-out order)."""
    mask = np.asarray(mask, dtype=bool)
    n_pe = mask.size
    free = np.flatnonzero(~mask)
    acquired = np.flatnonzero(mask)
    if free.size == 0:
        raise ValueError(f"no free line left: all {n_pe} PE lines are acquired")
    rank = center_out_rank(n_pe)[free]
    if acquired.size == 0:
        return int(free[np.argmin(rank)])
    dist = np.abs(free[:, None] - acquired[None, :])
    dist = np.minimum(dist, n_pe - dist).min(axis=1)
    return int(free[np.lexsort((rank, -dist))[0]])


def _require_rng(rng: np.random.Generator | None, name: str) -> np.random.Generator:
    if rng is None:
        raise ValueError(
            f"policy {name!r} is random and needs an explicit numpy.random.Generator "
            "(rng=slice_rng(seed, slice_index)); numpy's global RNG is never used"
        )
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"policy {name!r}: rng must be a numpy.random.Generator, got {type(rng).__name__}"
        )
    return rng


class SamplingPolicy(abc.ABC):
    """Chooses the next PE line of an episode from its current state.

    Subclasses implement :meth:`choose`; :meth:`select` checks the state before and the choice
    after. Learned policies set ``needs_image = True`` (they read ``state.image``) and override
    :meth:`select_batch` to decide for many slices in one forward pass.
    """

    name: str = ""
    """Registry name, e.g. "center-out"."""
    needs_image: bool = False
    """Whether :meth:`select` reads ``state.image`` (run_episode then calls ``image_fn``)."""
    observes_mar: bool = True
    """For a policy that reads images: whether the image is the MAR-corrected one when a MAR
    network runs (else the zero-filled one). :meth:`sees_mar` is the one place that decides."""
    deterministic: bool = True
    """False when choices are drawn from ``rng``, which is then required."""

    @abc.abstractmethod
    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        """Return a line not acquired in ``state``; called by :meth:`select` once the state is
        known to have a free line and a step left (and ``rng`` to be a Generator when random)."""

    def check(self, state: AcquisitionState, rng: np.random.Generator | None = None
              ) -> np.random.Generator | None:
        """Raise ValueError unless the policy can choose in ``state``: a free line and a step
        left, a Generator for a random policy, the image for a policy that reads it. Returns
        ``rng`` (checked)."""
        if state.steps_left <= 0:
            raise ValueError(
                f"policy {self.name!r}: no steps left (budget of {state.budget} lines spent)"
            )
        if state.mask.all():
            raise ValueError(
                f"policy {self.name!r}: no free line left, all {state.n_pe} PE lines are acquired"
            )
        if not self.deterministic:
            rng = _require_rng(rng, self.name)
        if self.needs_image and state.image is None:
            raise ValueError(f"policy {self.name!r} needs state.image (the current image)")
        return rng

    def select(self, state: AcquisitionState, rng: np.random.Generator | None = None) -> int:
        """The next line to acquire, one of ``state.free_lines()``.

        Raises ValueError when :meth:`check` fails.
        """
        line = self.choose(state, self.check(state, rng))
        if not 0 <= line < state.n_pe or state.mask[line]:
            raise RuntimeError(
                f"policy {self.name!r} chose line {line}, which is not a free line of {state.n_pe}"
            )
        return int(line)

    def select_batch(
        self,
        states: Sequence[AcquisitionState],
        rngs: Sequence[np.random.Generator | None] | None = None,
    ) -> np.ndarray:
        """One choice per state: (B,) int64. ``rngs``: one Generator per state (random policies).

        This default loops over :meth:`select`; learned policies override it with one forward
        pass over the batch.
        """
        states = list(states)
        if rngs is None:
            rngs = [None] * len(states)
        elif len(rngs) != len(states):
            raise ValueError(
                f"need one rng per state: got {len(rngs)} rngs for {len(states)} states"
            )
        return np.array([self.select(s, r) for s, r in zip(states, rngs)], dtype=np.int64)

    def select_trains(
        self,
        states: Sequence[AcquisitionState],
        rngs: Sequence[np.random.Generator | None] | None,
        k: int,
    ) -> np.ndarray:
        """``k`` distinct lines per state, an echo train: (B, k) int64, -1 beyond a state's
        ``steps_left``. This default makes ``k`` sequential :meth:`select_batch` choices, each
        state's mask updated with its earlier picks (its image is not: no data arrive within a
        train). Learned policies override it with the top ``k`` of one forward pass."""
        states = list(states)
        out = np.full((len(states), k), -1, dtype=np.int64)
        rngs = [None] * len(states) if rngs is None else list(rngs)
        for j in range(k):
            active = [i for i, st in enumerate(states) if st.steps_left > 0 and not st.mask.all()]
            if not active:
                break
            lines = self.select_batch([states[i] for i in active], [rngs[i] for i in active])
            for i, line in zip(active, lines):
                out[i, j] = line
                states[i] = states[i].after(int(line), states[i].image)
        return out

    def sees_mar(self, mar_runs: bool) -> bool:
        """Whether this policy is shown the MAR image: it reads images, it observes MAR, and a
        MAR network runs (``mar_runs``). Otherwise it is shown the zero-filled image (or none)."""
        return mar_runs and self.needs_image and self.observes_mar

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CenterOut(SamplingPolicy):
    """From the k-space centre outward, alternating sides: c, c+1, c-1, c+2, c-2, ...
    (c = n_pe // 2), skipping lines already acquired. Deterministic.

    With initial = 2 on 16 lines (7 and 8 acquired) it chooses 9, 10, 6, 11, 5, ...
    """

    name = "center-out"

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        rank = np.where(state.mask, np.iinfo(np.int64).max, center_out_rank(state.n_pe))
        return int(np.argmin(rank))


class Random(SamplingPolicy):
    """Uniformly at random among the lines not yet acquired. Needs an explicit Generator."""

    name = "random"
    deterministic = False

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        free = state.free_lines()
        return int(free[rng.integers(free.size)])


class RandomLowBias(SamplingPolicy):
    """At random among the lines not yet acquired, line k drawn with probability proportional
    to ``exp(-(k - c)^2 / (2 sigma^2))``, ``sigma = sigma_fraction * n_pe`` (c = n_pe // 2), so
    central (low-frequency) lines are more likely. Needs an explicit Generator.
    """

    name = "random-lowbias"
    deterministic = False

    def __init__(self, sigma_fraction: float = 0.15) -> None:
        if not sigma_fraction > 0:
            raise ValueError(f"sigma_fraction must be > 0 (of n_pe), got {sigma_fraction}")
        self.sigma_fraction = float(sigma_fraction)

    def probabilities(self, state: AcquisitionState) -> np.ndarray:
        """(n_pe,) probability of each line being chosen next; 0 for acquired lines."""
        offset = (np.arange(state.n_pe) - state.n_pe // 2) / (self.sigma_fraction * state.n_pe)
        log_w = np.where(state.mask, -np.inf, -0.5 * offset**2)
        w = np.exp(log_w - log_w.max())  # the best free line has weight 1: no underflow to all 0
        return w / w.sum()

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        p = self.probabilities(state)
        free = np.flatnonzero(p > 0)
        return int(rng.choice(free, p=p[free] / p[free].sum()))

    def __repr__(self) -> str:
        return f"RandomLowBias(sigma_fraction={self.sigma_fraction})"


@functools.lru_cache(maxsize=256)
def _equispaced_targets(n_pe: int, initial: int, budget: int) -> tuple[int, ...]:
    check_episode(n_pe, initial, budget)
    block = initial_lines(n_pe, initial)
    lo, hi = int(block[0]), int(block[-1])
    # The free lines form a ring from hi, past the k-space edge (lines n_pe-1 and 0 are DFT
    # neighbours), back to lo: ``ring`` steps long. ``budget`` points cut it into budget + 1
    # equal gaps; the right half is laid out from hi and mirrored from lo, so the pattern is
    # symmetric about the centre of the initial block whatever the rounding.
    ring = n_pe - initial + 1
    spacing = ring / (budget + 1)  # >= 1 because budget <= n_pe - initial: no two points collide
    d = np.floor(spacing * np.arange(1, budget // 2 + 1) + 0.5).astype(np.int64)
    parts = [hi + d, lo - d]
    if budget % 2:  # the odd point sits opposite the centre, at the k-space edge
        parts.append(np.array([hi + int(np.floor(ring / 2 + 0.5))]))
    lines = np.concatenate(parts) % n_pe
    twice_dist = np.abs(2 * lines - (lo + hi))
    order = np.lexsort((-lines, twice_dist))  # centre-out, the upper side first on ties
    return tuple(int(k) for k in lines[order])


def equispaced_lines(n_pe: int, initial: int, budget: int) -> np.ndarray:
    """The ``budget`` lines of the equispaced pattern: (budget,) int64 in centre-out order.

    The lines outside the ``initial`` centre block, with the two k-space edges joined, are cut
    into ``budget + 1`` gaps as equal as rounding allows (sizes differ by at most 2), symmetric
    about the centre of the initial block. None of them is an initial line, so the pattern always
    adds exactly ``budget`` new lines. 10x on 200 lines (2 + 18): 110, 89, 121, 78, ..., 194, 5.
    """
    return np.array(_equispaced_targets(int(n_pe), int(initial), int(budget)), dtype=np.int64)


class Equispaced(SamplingPolicy):
    """A fixed equispaced pattern (:func:`equispaced_lines`) over the whole PE range, centred
    on the k-space centre, with exactly ``budget`` lines on top of the initial centre ones.
    Deterministic.

    The pattern depends only on (n_pe, number of initial lines, ``step + steps_left``), so it is
    the same set whatever the order the lines arrive in. :meth:`select` returns the next target
    not yet acquired, centre-out. A target the scanner acquired on its own counts as done; if
    every target is acquired while steps are left (the scanner acquired other lines), it returns
    the free line farthest from every acquired line (:func:`farthest_free_line`).
    """

    name = "equispaced"

    def targets(self, state: AcquisitionState) -> np.ndarray:
        """(n_targets,) the pattern of ``state``'s episode, centre-out; n_targets = budget
        unless a scanner's extra lines leave fewer free lines than that."""
        initial = min(state.initial_count, state.n_pe)
        budget = min(state.budget, state.n_pe - initial)
        return equispaced_lines(state.n_pe, initial, budget)

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        targets = self.targets(state)
        pending = targets[~state.mask[targets]]
        if pending.size:
            return int(pending[0])
        return farthest_free_line(state.mask)


class FixedOrder(SamplingPolicy):
    """A fixed, non-adaptive order of lines, e.g. the population-greedy order learned on a
    training split. Deterministic; not in the registry (it needs its ``order``).

    :meth:`select` returns the first line of ``order`` not acquired yet; once every line of the
    order is acquired (the scanner acquired others), the free line farthest from every acquired
    line (:func:`farthest_free_line`).
    """

    name = "fixed-order"

    def __init__(self, order: Sequence[int], name: str = "fixed-order") -> None:
        order = np.asarray(order, dtype=np.int64).reshape(-1)
        if order.size == 0 or order.min() < 0 or np.unique(order).size != order.size:
            raise ValueError(f"order must be distinct non-negative line numbers, got {order.tolist()}")
        self.order, self.name = order, str(name)

    def choose(self, state: AcquisitionState, rng: np.random.Generator | None) -> int:
        order = self.order[self.order < state.n_pe]
        pending = order[~state.mask[order]]
        if pending.size:
            return int(pending[0])
        return farthest_free_line(state.mask)

    def __repr__(self) -> str:
        return f"FixedOrder({self.order.tolist()}, name={self.name!r})"


PolicyFactory = Callable[..., SamplingPolicy]

POLICIES: dict[str, PolicyFactory] = {
    CenterOut.name: CenterOut,
    Random.name: Random,
    RandomLowBias.name: RandomLowBias,
    Equispaced.name: Equispaced,
}
"""Policy name -> class or factory taking keyword options."""

_plugins_loaded = False


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``make_policy(name, **kwargs)`` call ``factory(**kwargs)`` (e.g. a learned policy)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"policy factory for {name!r} must be callable, got {factory!r}")
    if name in POLICIES and POLICIES[name] is not factory and not replace:
        raise ValueError(f"policy {name!r} is already registered; pass replace=True to replace it")
    POLICIES[name] = factory


def _load_plugin_policies() -> None:
    """Register the factories of the ``masc.policies`` entry points not registered yet (once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in metadata.entry_points(group=POLICIES_GROUP):
        if ep.name not in POLICIES:
            POLICIES[ep.name] = ep.load()


def make_policy(name: str, **kwargs) -> SamplingPolicy:
    """Build the policy registered as ``name`` with keyword options, e.g.
    ``make_policy("random-lowbias", sigma_fraction=0.1)``."""
    if name not in POLICIES:
        _load_plugin_policies()
    if name not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; known policies: " + ", ".join(sorted(POLICIES))
        )
    policy = POLICIES[name](**kwargs)
    if not isinstance(policy, SamplingPolicy):
        raise TypeError(
            f"policy factory {name!r} returned {type(policy).__name__}, not a SamplingPolicy"
        )
    return policy


def select_lines(
    policy: SamplingPolicy,
    states: Sequence[AcquisitionState],
    rngs: Sequence[np.random.Generator | None],
) -> np.ndarray:
    """``policy.select_batch(states, rngs)``, checked: (B,) int64, one free line per state.
    A state the early OOD rule switched (``state.switched``) gets centre-out's line instead: the
    policy is not asked.

    RuntimeError when the policy returns the wrong number of choices or a line that is not free:
    a broken policy, never bad input.
    """
    states = list(states)
    if any(state.switched for state in states):
        return _safe_split(policy, states, rngs, 1)[:, 0]
    lines = np.asarray(policy.select_batch(states, rngs))
    name = policy.name or type(policy).__name__
    if lines.shape != (len(states),):
        raise RuntimeError(
            f"policy {name!r} returned {lines.shape} choices for {len(states)} states"
        )
    for state, line in zip(states, lines):
        if not 0 <= line < state.n_pe or state.mask[line]:
            raise RuntimeError(
                f"policy {name!r} chose line {int(line)}, which is not a free line of {state.n_pe}"
            )
    return lines.astype(np.int64, copy=False)


def select_trains(
    policy: SamplingPolicy,
    states: Sequence[AcquisitionState],
    rngs: Sequence[np.random.Generator | None],
    k: int,
) -> np.ndarray:
    """``policy.select_trains(states, rngs, k)`` (k = 1: :func:`select_lines`), checked: (B, k)
    int64, distinct free lines per state, -1 only beyond its ``steps_left``; a switched state
    (``state.switched``) gets centre-out's train. RuntimeError for a broken policy."""
    states = list(states)
    if k == 1:
        return select_lines(policy, states, rngs)[:, None]
    if any(state.switched for state in states):
        return _safe_split(policy, states, rngs, k)
    trains = np.asarray(policy.select_trains(states, rngs, k))
    name = policy.name or type(policy).__name__
    if trains.shape != (len(states), k):
        raise RuntimeError(f"policy {name!r} returned trains of shape {trains.shape} for {len(states)} states, k={k}")
    for state, train in zip(states, trains):
        n = min(k, state.steps_left, int((~state.mask).sum()))
        chosen = train[:n]
        if (train[n:] != -1).any() or len(set(chosen.tolist())) != n or any(
                not 0 <= line < state.n_pe or state.mask[line] for line in chosen):
            raise RuntimeError(f"policy {name!r} chose the train {train.tolist()}, not {n} distinct free lines")
    return trains.astype(np.int64, copy=False)


SAFE_ORDER = CenterOut()
"""The order a slice switched by the early OOD rule continues with: centre-out's, so that its
zero-filled image is doing nothing (:func:`training.scoring.do_nothing`)."""


def _safe_split(policy: SamplingPolicy, states: list[AcquisitionState],
                rngs: Sequence[np.random.Generator | None], k: int) -> np.ndarray:
    """(B, k) trains: :data:`SAFE_ORDER`'s for the switched states, ``policy``'s for the others."""
    switched = np.array([state.switched for state in states])
    out = np.full((len(states), k), -1, dtype=np.int64)
    safe, rest = np.flatnonzero(switched), np.flatnonzero(~switched)
    if safe.size:  # the flag cleared, so that centre-out is asked as any policy is
        out[safe] = select_trains(SAFE_ORDER, [dataclasses.replace(states[i], switched=False) for i in safe],
                                  [rngs[i] for i in safe], k).reshape(safe.size, k)
    if rest.size:
        out[rest] = select_trains(policy, [states[i] for i in rest], [rngs[i] for i in rest], k).reshape(rest.size, k)
    return out


def select_next(policy: SamplingPolicy, episodes: EpisodeBatch, rows: Any = None,
                images: Sequence[np.ndarray] | np.ndarray | None = None) -> np.ndarray:
    """The policy's next line for episodes ``rows`` (all: None) of ``episodes``, one batched
    ``select_batch`` with their own generators, ``images[i]`` the image of ``rows[i]``: (k,)
    int64 (:func:`select_lines`)."""
    index = np.arange(len(episodes)) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    return select_lines(policy, episodes.states(index, images), [episodes.rngs[r] for r in index])


def run_episode(
    policy: SamplingPolicy,
    n_pe: int,
    initial: int,
    budget: int,
    rng: np.random.Generator | None = None,
    image_fn: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Play one episode: (initial + budget,) int64 lines in acquisition order, the initial
    centre lines (ascending) first, then the policy's ``budget`` choices.

    ``image_fn(mask) -> image`` maps the (n_pe,) bool mask to the (H, W) current image; it is
    called before each choice, and only when ``policy.needs_image``.
    """
    return run_episodes(
        policy, n_pe, initial, budget, [rng],
        None if image_fn is None else (lambda masks: image_fn(masks[0])[None]),
    )[0]


def run_episodes(
    policy: SamplingPolicy,
    n_pe: int,
    initial: int,
    budget: int,
    rngs: Sequence[np.random.Generator | None],
    image_fn: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Play ``len(rngs)`` episodes in lockstep with one :meth:`~SamplingPolicy.select_batch` per
    step: (B, initial + budget) int64 lines in acquisition order.

    ``image_fn(masks) -> images`` maps (B, n_pe) bool masks to (B, H, W) images; called before
    each step, only when ``policy.needs_image``. Deterministic policies take ``[None] * B``.
    """
    episodes = EpisodeBatch(n_pe, initial, budget, len(rngs), rngs=rngs)
    if policy.needs_image and image_fn is None:
        raise ValueError(f"policy {policy.name!r} needs the image: pass image_fn")
    for _ in range(budget):
        images = None
        if policy.needs_image and len(episodes):
            images = image_fn(episodes.masks)
        episodes.acquire(select_next(policy, episodes, images=images))
    return episodes.chosen()
