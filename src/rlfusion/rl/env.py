"""Environments of multi-turn episodes: the contract a user's `env="module:Class"` meets, and the
checks that turn what an environment returns into one `EnvStep` or a failure message.

An episode starts from a problem (`reset`); the policy writes a turn, which ends on one of the
environment's `stop` texts (a tool call's closing text), on the end token or at the token
budget. A turn that ends on a stop text is the action `step` answers with an observation (text
the policy reads next, appended to the same sequence), a reward contribution and whether the
episode is done. A turn that ends on the end token ends the episode: the run's reward scores the
whole response, plus the rewards the steps returned.

Environments run in worker processes (`rl/env_pool.py`), so one that hangs, crashes or kills
its process fails that episode, not the run. A worker rebuilds an episode it does not hold (a
resumed episode, a restarted worker) by `reset` and the episode's earlier actions replayed in
order: an environment must answer the same actions the same way (deterministic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfusion.config import check_fields
from rlfusion.rl.plugins import import_named
from rlfusion.rl.problem import Problem

MAX_OBSERVATION_CHARS = 65_536  # a longer observation fails its episode (what a context could hold, many times over)


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one action. `info`: numbers the run averages per step into
    metrics (`env_info_NAME`), e.g. whether a tool call was well formed."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """What `env="module:Class"` names: a class built with no arguments, one instance per episode."""

    stop: tuple[str, ...]  # the texts (one token each) that end a turn and hand it to `step`

    def reset(self, problem: Problem) -> None: ...

    def step(self, action: str) -> EnvStep: ...


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes (`engine/episodes.py`): `env = "module:Class"` (or `env.name`) names the
    environment (`rl/env.Environment`) that answers each turn ending on one of its stop texts;
    "" = single-turn rollouts."""

    name: str = ""
    max_turns: int = 4  # turns the policy writes per episode (the environment answers all but the last)
    # response tokens per episode, observations included; 0 = rollout.max_new_tokens
    max_episode_tokens: int = 0
    timeout_s: float = 10.0  # one step() call; past it the worker is killed and the episode fails
    workers: int = 4  # environment processes per rollout device

    def __post_init__(self) -> None:
        check_fields("env", {
            "name": (self.name == "" or ":" in self.name, "allowed: '' (single-turn) or 'module:Class'"),
            "max_turns": (self.max_turns >= 1, "must be >= 1"),
            "max_episode_tokens": (self.max_episode_tokens >= 0, "must be >= 0 (0 = rollout.max_new_tokens)"),
            "timeout_s": (self.timeout_s > 0, "must be > 0"),
            "workers": (self.workers >= 1, "must be >= 1"),
        }, self)


# `env = "module:Class"` sets env.name (a section given a plain value sets this field)
EnvConfig.SHORTHAND = "name"


def import_env(spec: str) -> type:
    """The class `module:Class` names, checked for `stop`, `reset` and `step`; one-line errors."""
    module_name, attr, cls = import_named("env", spec, "'module:Class' (a class with stop, reset and step)")
    if not isinstance(cls, type):
        raise ValueError(f"env={spec!r}: module {module_name!r} has no class {attr!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"env={spec!r}: class {attr!r} has no {' or '.join(missing)} method")
    stop = getattr(cls, "stop", None)
    if not (isinstance(stop, tuple) and stop and all(isinstance(s, str) and s for s in stop)):
        raise ValueError(f"env={spec!r}: {attr}.stop must be a non-empty tuple of non-empty strings (the texts "
                         f"that end a turn), got {stop!r}")
    return cls


def stop_ids(cls: type, tokenizer: Any, spec: str) -> tuple[int, ...]:
    """The token ids of the environment's stop texts; each must be exactly one token."""
    ids = []
    for text in cls.stop:
        try:
            encoded = tokenizer.encode(text)
        except ValueError as e:
            raise ValueError(f"env={spec!r}: stop text {text!r} cannot be encoded by the run's tokenizer ({e})") from None
        if len(encoded) != 1:
            raise ValueError(f"env={spec!r}: stop text {text!r} is {len(encoded)} tokens for the run's tokenizer; "
                             "each must be exactly one")
        ids.append(encoded[0])
    return tuple(ids)


def checked_step(value: Any) -> EnvStep:
    """What `step` returned as an `EnvStep` — an `EnvStep`, a string (an observation) or an
    `(observation, reward, done)` tuple; `ValueError` naming what is wrong otherwise."""
    if isinstance(value, str):
        value = EnvStep(value)
    elif isinstance(value, tuple) and len(value) == 3:
        value = EnvStep(*value)
    if not isinstance(value, EnvStep):
        raise ValueError(f"step() returned {_shown(value)}; allowed: an EnvStep, a str or (observation, reward, done)")
    if not isinstance(value.observation, str):
        raise ValueError(f"step() returned an observation of type {type(value.observation).__name__}; it must be a str")
    if len(value.observation) > MAX_OBSERVATION_CHARS:
        raise ValueError(f"step() returned an observation of {len(value.observation)} characters (limit "
                         f"{MAX_OBSERVATION_CHARS})")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise ValueError(f"step() returned reward {_shown(value.reward)}; it must be a finite number")
    if not isinstance(value.done, bool):
        raise ValueError(f"step() returned done={_shown(value.done)}; it must be a bool")
    info = value.info if isinstance(value.info, dict) else None
    if info is None or not all(isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v)
                               for k, v in info.items()):
        raise ValueError("step() returned info that is not a dict of names to finite numbers")
    return EnvStep(value.observation, float(value.reward), value.done, {k: float(v) for k, v in info.items()})


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"
