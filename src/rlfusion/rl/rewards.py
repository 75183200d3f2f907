"""Reward sources: the task's verifier, any Python callable named `module:function`, or a
reward model behind the `RewardModel` protocol.

A reward function takes `(response_text, problem)` and returns a float; a reward model scores a
whole batch of trajectories at once (so it can run batched on its own device).
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

from rlfusion.rl.problem import Problem

RewardFn = Callable[[str, Problem], float]


class RewardModel(Protocol):
    def score(self, prompts: list[str], responses: list[str]) -> list[float]: ...


def load_reward_fn(spec: str) -> RewardFn:
    """Import `module:function`; errors name the spec and what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward={spec!r} must be 'task' or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward={spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward={spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn
