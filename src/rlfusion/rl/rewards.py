"""Reward sources: the task's verifier, any Python callable named `module:function`, or a
reward model behind the `RewardModel` protocol.

A reward function takes `(response_text, problem)` and returns a float; a reward model scores a
whole batch of trajectories at once (so it can run batched on its own device).

User reward code is untrusted in the sense that matters to a run: it may raise, return something
that is not a number, or hang. `finite_score` and `DaemonCaller` let the reward stage turn each
of these into one `RewardError` that names the `reward=` spec and the sample.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, Protocol, TypeVar

from rlfusion.rl.plugins import import_named
from rlfusion.rl.problem import Problem

T = TypeVar("T")

RewardFn = Callable[[str, Problem], float]


class RewardModel(Protocol):
    def score(self, prompts: list[str], responses: list[str]) -> list[float]: ...


def load_reward_fn(spec: str) -> RewardFn | RewardModel:
    """Import `module:name`: a function `(response, problem) -> float`, or a class whose
    instances have `score(prompts, responses)` (a reward model; built with no arguments).
    Errors name the spec and what is wrong."""
    fn = import_reward(spec)
    if isinstance(fn, type):
        try:
            model = fn()
        except Exception as e:
            raise ValueError(f"reward={spec!r}: building {spec.partition(':')[2]}() raised "
                             f"{type(e).__name__}: {e}") from e
        if not callable(getattr(model, "score", None)):
            raise ValueError(f"reward={spec!r}: class {spec.partition(':')[2]!r} has no score(prompts, responses) method")
        return model
    return fn


def import_reward(spec: str) -> Any:
    """The function or reward-model class `module:name` names, imported but not built: the
    check a driver makes before it starts the devices that will build it."""
    module_name, attr, fn = import_named("reward", spec, "'task' or 'module:function'")
    if not callable(fn):
        raise ValueError(f"reward={spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def describe_reward(reward: Any) -> str:
    """`module:name` of a reward function or of a reward model's class (for messages when the
    stage was not told the spec)."""
    target = reward if callable(reward) and not hasattr(reward, "score") else type(reward)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}:{getattr(target, '__qualname__', type(target).__name__)}"


def finite_score(value: Any) -> float | None:
    """`value` as a float when it is one finite number (a float, int, bool, NumPy scalar or a
    one-element tensor), else None. Strings are refused even when they spell a number."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return None
    try:
        score = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # e.g. a tensor with several elements
        return None
    return score if math.isfinite(score) else None


def snippet(text: str, limit: int = 40) -> str:
    """A short repr of a prompt or response for error messages."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


class CallTimeout(Exception):
    """`DaemonCaller.call` stopped waiting; the call itself may still be running."""


class DaemonCaller:
    """Runs calls on one reusable daemon thread, so the caller can stop waiting after a timeout.

    A fast call costs a queue hand-off and an event, not a thread start. A Python thread cannot
    be killed: after a timeout the worker thread is abandoned, still inside the user's code, and
    the next call starts a fresh one. The caller raises, the run stops, and because the thread
    is a daemon it does not keep the process from exiting. (This is why it is not a
    `concurrent.futures.ThreadPoolExecutor`: its threads are joined at interpreter exit, so a
    hung reward function would hang the exit too.)
    """

    def __init__(self, name: str = "reward") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn()` on the worker thread; its exception is re-raised here; `CallTimeout` when it
        has not returned after `timeout_s` seconds."""
        if self._thread is None or not self._thread.is_alive():  # first call, after a timeout or a fork
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True)
            self._thread.start()
        done, box = threading.Event(), {}
        self._jobs.put((fn, box, done))
        if not done.wait(min(timeout_s, threading.TIMEOUT_MAX)):
            self._jobs.put(None)  # if the call ever returns, the abandoned thread exits
            self._jobs = self._thread = None
            raise CallTimeout(f"no result after {timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def __getstate__(self) -> dict:  # a thread cannot be pickled; a copy starts its own
        return {"name": self.name, "_jobs": None, "_thread": None}


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, box, done = job
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the waiting caller, which re-raises it
            box["error"] = e
        finally:
            del fn, job  # drop references to the batch before waiting for the next one
            done.set()
