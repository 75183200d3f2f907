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


def load_reward_fn(spec: str) -> RewardFn | RewardModel:
    """Import `module:name`: a function `(response, problem) -> float`, or a class whose
    instances have `score(prompts, responses)` (a reward model; built with no arguments).
    Errors name the spec and what is wrong."""
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
    if isinstance(fn, type):
        model = fn()
        if not callable(getattr(model, "score", None)):
            raise ValueError(f"reward={spec!r}: class {attr!r} has no score(prompts, responses) method")
        return model
    return fn
