"""The acquisition MDP as a standard single-episode Gymnasium environment.

``ActiveAcquisitionEnv`` is a one-env view of :class:`training.rl.env.BatchedAcquisitionEnv` (same
reconstruction, MAR correction and reward), for Gymnasium tooling: the env checker, wrappers,
``gymnasium.make("masc/ActiveAcquisition-v0", data_dir=..., split=..., config=...)`` and
masked-action libraries (``action_masks()``, as sb3-contrib's MaskablePPO expects). MASC's own
PPO steps the batched env directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import gymnasium
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import (
    Config,
    build_config,
    config_sections,
    from_dict,
    load_config,
)
from training.data import SliceSet, load_split
from training.rl.env import BatchedAcquisitionEnv, EnvConfig, Observation

__all__ = ["ENV_ID", "ActiveAcquisitionEnv", "FreeLineSpace", "episode_config", "register_env"]

ENV_ID = "masc/ActiveAcquisition-v0"
"""Gymnasium id of :class:`ActiveAcquisitionEnv`."""


def register_env() -> None:
    """Register :data:`ENV_ID` with Gymnasium (idempotent)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="training.rl.gym_env:ActiveAcquisitionEnv")


class FreeLineSpace(spaces.Discrete):
    """``Discrete(PE)`` whose unmasked :meth:`sample` draws only lines not yet acquired.

    The env keeps ``allowed`` ((PE,) int8, 1 = not acquired) up to date, so a random agent, a
    vector env's random actions and Gymnasium's env checker only take valid actions. Any line
    index is still *contained* in the space; choosing an acquired one is a ValueError in
    :meth:`ActiveAcquisitionEnv.step`. An explicit ``mask`` or ``probability`` is used as given.
    """

    def __init__(self, n: int, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(n, seed=seed)
        self.allowed = np.ones(n, dtype=np.int8)

    def sample(self, mask: np.ndarray | None = None, probability: np.ndarray | None = None) -> np.int64:
        if mask is None and probability is None:
            mask = self.allowed.copy()
        return super().sample(mask=mask, probability=probability)


def _zero_filled_bound(data: SliceSet, cfg: EnvConfig) -> float:
    """An upper bound of every zero-filled image of ``data``, whatever the mask.

    With the orthonormal IFFT, ``|I(y, x)| <= sum |K| / sqrt(PE * RO)`` (triangle inequality),
    and leaving lines out only removes terms. A 0.1% margin covers float32 rounding.
    """
    kspace = data.kspace_metal if cfg.kspace == "metal" else data.kspace_clean
    n = kspace.shape[-2] * kspace.shape[-1]
    total = kspace.abs().double().sum(dim=(-2, -1)).max()
    return float(total) / float(np.sqrt(n)) * 1.001 + 1e-30


def _sections() -> dict[str, type]:
    """Registered config sections, plus ``env`` even where the package metadata lacks it."""
    sections = dict(config_sections())
    sections.setdefault("env", EnvConfig)
    sections.setdefault("acquisition", AcquisitionConfig)
    return sections


def episode_config(config: str | Path | Mapping[str, Any] | Config | None
                   ) -> tuple[AcquisitionConfig, EnvConfig]:
    """The ``acquisition`` and ``env`` sections of ``config``.

    ``config``: a YAML path (read with :func:`masc_gadget.config.load_config`), a
    :class:`~masc_gadget.config.Config`, a mapping of section name to either plain data or the
    section's dataclass, or None (defaults).
    """
    if config is None:
        return AcquisitionConfig(), EnvConfig()
    if isinstance(config, (str, Path)):
        config = load_config(config, sections=_sections())
    if isinstance(config, Config):
        sections = config.sections
        acq = sections.get("acquisition", AcquisitionConfig())
        env = sections.get("env", EnvConfig())
        return acq, env
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a YAML path, a Config or a mapping of sections, got "
                        f"{type(config).__name__}")
    known = _sections()
    raw = {k: v for k, v in config.items() if not dataclasses.is_dataclass(v)}
    built = build_config(raw, sections=known).sections
    out = []
    for name, cls in (("acquisition", AcquisitionConfig), ("env", EnvConfig)):
        value = config.get(name)
        if dataclasses.is_dataclass(value):
            if not isinstance(value, cls):
                raise TypeError(f"config section {name!r} must be a {cls.__name__}, got "
                                f"{type(value).__name__}")
            out.append(value)
        else:
            out.append(built[name] if name in built else from_dict(cls, value, name))
    return out[0], out[1]


class ActiveAcquisitionEnv(gymnasium.Env):
    """One acquisition episode of one slice at a time (DESIGN.md "Acquisition episode").

    Spaces (PE lines, (H, W) images, ``budget`` choices per episode):

    * observation: ``Dict(image=Box((H, W), float32), mask=MultiBinary(PE) int8,
      steps_left=Box(0, budget, (1,), int64))``. ``image`` is ``g(I)`` when a MAR network is set
      and ``observe_mar`` (bounds -inf..inf: the residual network's output is unbounded and may
      go below zero; Gymnasium's checker warns about infinite bounds), else the zero-filled
      magnitude ``I`` (bounds 0..``sum |K| / sqrt(PE * RO)`` of the data set's largest slice,
      which no mask can exceed).
    * action: :class:`FreeLineSpace` = ``Discrete(PE)``, the line to acquire next. An already
      acquired line is a ValueError (use :meth:`action_masks`; MaskablePPO never samples a
      masked action, and the space's own ``sample()`` draws only free lines).

    ``reset(seed=, options={"index": i})`` starts an episode on slice ``i`` (default: a slice
    drawn with ``self.np_random``), with the ``initial`` centre lines acquired. After ``budget``
    steps the episode terminates (never truncates). Rewards ``alpha * (Q_{t+1} - Q_t)`` sum to
    ``alpha * (Q_final - Q_initial)``; ``info`` has ``slice_index`` and ``quality`` (current Q),
    and at termination ``final_quality`` and ``episode_return``.

    Args:
        data_dir: a MASC data set folder; ``split`` of it is loaded (give this or ``data``).
        split: train, val or test.
        config: YAML path, Config or mapping; its ``acquisition`` section gives ``initial`` and
            ``budget``, its ``env`` section the rest (``n_envs`` is ignored: one episode).
        data: the slices, instead of ``data_dir``.
        mar: the MAR network (on ``device``), or None.
        render_mode: None or ``"rgb_array"`` (the observed image as (H, W, 3) uint8).
        device: where reconstruction and MAR run.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, data_dir: str | Path | None = None, split: str = "train",
                 config: str | Path | Mapping[str, Any] | Config | None = None,
                 data: SliceSet | None = None, mar: nn.Module | None = None,
                 render_mode: str | None = None, device: str | torch.device = "cpu") -> None:
        if (data_dir is None) == (data is None):
            raise ValueError("give exactly one of data_dir (a data set folder) and data (a SliceSet)")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}, "
                             f"got {render_mode!r}")
        if data is None:
            data = load_split(data_dir, split)
        acq, env_cfg = episode_config(config)
        if env_cfg.corruption.enabled:
            raise ValueError("the Gymnasium view acquires each line once (its action space is the free lines): "
                             "env.corruption needs the batched environment (training.rl.env)")
        self.acquisition = acq
        self.env_config = dataclasses.replace(env_cfg, n_envs=1)
        self.render_mode = render_mode
        self._env = BatchedAcquisitionEnv(data, self.env_config, acq.initial, acq.budget, mar=mar,
                                          device=device, autoreset=False)
        n_pe, (h, w) = self._env.n_pe, self._env.image_shape
        if mar is not None and env_cfg.observe_mar:
            low, high = -np.inf, np.inf  # a residual network's output has no bound
        else:
            low, high = 0.0, _zero_filled_bound(data, env_cfg)
        self.observation_space = spaces.Dict({
            "image": spaces.Box(low, high, (h, w), np.float32),
            "mask": spaces.MultiBinary(n_pe),
            "steps_left": spaces.Box(0, acq.budget, (1,), np.int64),
        })
        self.action_space = FreeLineSpace(n_pe)
        self._obs: Observation | None = None
        self._slice = -1

    @property
    def batched(self) -> BatchedAcquisitionEnv:
        """The underlying one-env :class:`BatchedAcquisitionEnv`."""
        return self._env

    @property
    def n_slices(self) -> int:
        return self._env.n_slices

    def set_mar(self, mar: nn.Module | None) -> None:
        """Use another (or an updated) MAR network; the current observation is recomputed."""
        self._env.set_mar(mar)
        if self._obs is not None:
            self._obs = self._env.observation

    def _numpy_obs(self, obs: Observation) -> dict[str, np.ndarray]:
        # fresh arrays on every call: Gymnasium users keep what they are given
        return {
            "image": np.array(obs.image[0].cpu().numpy(), dtype=np.float32, copy=True),
            "mask": np.array(obs.mask[0].cpu().numpy(), dtype=np.int8, copy=True),
            "steps_left": np.array([int(obs.steps_left[0])], dtype=np.int64),
        }

    def _info(self) -> dict[str, Any]:
        return {"slice_index": self._slice, "quality": float(self._env.current_quality[0])}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Start an episode; ``options={"index": i}`` picks slice ``i``."""
        super().reset(seed=seed)
        options = options or {}
        unknown = sorted(set(options) - {"index"})
        if unknown:
            raise ValueError(f"unknown reset option {unknown[0]!r}; allowed: index")
        if "index" in options:
            index = options["index"]
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise ValueError(f"options['index'] must be an integer slice index, got {index!r}")
            if not 0 <= index < self.n_slices:
                raise ValueError(f"options['index'] must be in [0, {self.n_slices}), got {index}")
            index = int(index)
        else:
            index = int(self.np_random.integers(self.n_slices))
        self._slice = index
        self._obs = self._env.reset(indices=[index])
        self.action_space.allowed[:] = self.action_masks()
        return self._numpy_obs(self._obs), self._info()

    def step(self, action: int | np.integer) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        """Acquire line ``action``.

        Raises:
            TypeError: ``action`` is not an integer.
            ValueError: ``action`` is out of range or already acquired, or the episode is over.
            RuntimeError: called before :meth:`reset`.
        """
        if self._obs is None:
            raise RuntimeError("call reset() before step()")
        if isinstance(action, np.ndarray) and action.shape == ():
            action = action.item()
        if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)):
            raise TypeError(f"action must be an integer PE line index, got {action!r}")
        action = int(action)
        n_pe = self._env.n_pe
        if not 0 <= action < n_pe:
            raise ValueError(f"action (PE line) must be in [0, {n_pe}), got {action}")
        if int(self._obs.steps_left[0]) <= 0:
            raise ValueError("the episode has terminated; call reset() before step()")
        if bool(self._obs.mask[0, action]):
            raise ValueError(f"line {action} is already acquired; allowed actions are those where "
                             "action_masks() is True")
        obs, rewards, terminated, info = self._env.step(torch.tensor([action]))
        self._obs = obs
        reward = float(rewards[0])
        done = bool(terminated[0])
        out_info = self._info()
        if done:
            out_info["final_quality"] = float(info["final_quality"][0])
            out_info["episode_return"] = float(info["episode_return"][0])
        self.action_space.allowed[:] = self.action_masks()
        return self._numpy_obs(obs), reward, done, False, out_info

    def action_masks(self) -> np.ndarray:
        """(PE,) bool, True for the lines that may be chosen (not yet acquired)."""
        if self._obs is None:
            raise RuntimeError("call reset() before action_masks()")
        allowed = ~self._obs.mask[0].cpu().numpy()
        if int(self._obs.steps_left[0]) <= 0:
            allowed[:] = False
        return allowed

    def render(self) -> np.ndarray | None:
        """``rgb_array``: the observed image, scaled to its maximum, as (H, W, 3) uint8."""
        if self.render_mode is None or self._obs is None:
            return None
        image = self._obs.image[0].clamp_min(0).cpu().numpy()
        peak = float(image.max())
        gray = (255.0 * image / peak if peak > 0 else image).round().clip(0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)


register_env()
