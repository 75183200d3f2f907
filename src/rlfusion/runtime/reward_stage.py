"""The scorer's reward stage, `RewardStage`, and its fault policy: user reward code that raises,
hangs or returns something unusable fails those samples (reward 0, marked), not the run —
until most recent samples failed. The task's own verifier is trusted and runs inline.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from rlfusion.errors import RewardError
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.rl.dapo import overlong_penalty
from rlfusion.rl.rewards import (CallTimeout, DaemonCaller, RewardFn, RewardModel, describe_reward,
                                finite_score, snippet)
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime.train_config import AlgoConfig

# What user reward code may raise that stops the run as a reward fault: sys.exit() and the
# like too (on the scoring thread they would otherwise end only that thread, or the worker)
USER_CODE_ERRORS = (Exception, SystemExit, GeneratorExit)


def _clip(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


class RewardStage:
    """Rule reward per sample (`RewardFn`) or a batched reward model (`RewardModel.score`).

    `name` is the `reward=` spec, for messages ("task": the task's verifier). User reward code
    that raises, returns anything but a finite number in `reward_range`, or (with `timeout_s`)
    does not return within `timeout_s` seconds for one `score` call fails those samples, not
    the run: each failed sample gets reward 0 and its `reward_failed` mark (the advantage stage
    counts them and, with `reward_on_failure=drop`, leaves their groups out of the update).
    When more than `failure_limit` of the last `FAILURE_WINDOW` samples this stage scored
    failed (all so far, early in a run), the run stops with a `RewardError` that names the spec,
    the share and the first failure of the batch. The task's verifier is trusted code: it runs
    inline and its errors propagate. User code runs on a reusable daemon thread
    (`DaemonCaller`) that the stage stops waiting for after the timeout (a thread cannot be
    killed; it is abandoned, and the next call starts a fresh one).
    """

    FAILURE_WINDOW = 64

    def __init__(self, reward: RewardFn | RewardModel, tokenizer: Tokenizer, algo: AlgoConfig,
                 max_new_tokens: int, *, name: str = "", timeout_s: float | None = None,
                 reward_range: tuple[float, float] = (-math.inf, math.inf), failure_limit: float = 0.5):
        self.reward, self.tokenizer, self.algo = reward, tokenizer, algo
        self.max_new_tokens = max_new_tokens
        self.name = name or describe_reward(reward)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"reward timeout_s={timeout_s} must be > 0")
        self.timeout_s = timeout_s if name != "task" else None
        self.caller = DaemonCaller(f"reward {self.name}") if self.timeout_s is not None else None
        self.reward_range, self.failure_limit = reward_range, failure_limit
        self.recent: collections.deque[bool] = collections.deque(maxlen=self.FAILURE_WINDOW)  # failed?

    def _answer_ids(self, ids: list[int]) -> list[int]:
        """The response up to its first end token: what is scored (a replayed response,
        `rollout.lengths=replay`, decodes on past it to its forced length)."""
        eos = self.tokenizer.eos_id
        return ids[:ids.index(eos)] if eos in ids else ids

    def score(self, trajs: list[Trajectory]) -> None:
        texts = [self.tokenizer.decode(self._answer_ids(t.response_ids)) for t in trajs]
        if self.caller is None:
            scores, failures = self._scores(trajs, texts)
        else:
            grad, device = torch.is_grad_enabled(), _cuda_device()
            at = [0]  # the sample the reward function is on (for the timeout message)

            def job() -> tuple[list[float | None], list[tuple[str, BaseException | None]]]:  # grad mode and the CUDA device are per thread
                torch.set_grad_enabled(grad)
                if device is not None:
                    torch.cuda.set_device(device)
                return self._scores(trajs, texts, at)

            try:
                scores, failures = self.caller.call(job, self.timeout_s)
            except CallTimeout:
                where = (f"a reward model scoring {len(trajs)} samples" if hasattr(self.reward, "score")
                         else f"{len(trajs)} samples; stuck on sample {at[0]}: {self._sample(trajs, texts, at[0])}")
                scores = [None] * len(trajs)
                failures = [(f"reward={self.name!r} did not return within {self.timeout_s:g} s ({where}); "
                             f"raise reward_timeout_s= or fix the function", None)]
        for t, score in zip(trajs, scores):
            t.reward_failed = score is None
            t.correct = t.reward = 0.0 if score is None else score
        self._check_failures(scores, failures)
        for t in trajs:  # an episode's environment: its step rewards add up; a failed one scores 0
            if t.env_failed:
                t.reward_failed, t.correct, t.reward = True, 0.0, 0.0
            else:
                t.reward += t.env_reward
        if self.algo.overlong_buffer:
            lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
            penalty = overlong_penalty(lengths, self.max_new_tokens, self.algo.overlong_buffer,
                                       self.algo.overlong_factor)
            for t, p in zip(trajs, penalty.tolist()):
                t.reward += p

    def _check_failures(self, scores: list[float | None], failures: list[tuple[str, BaseException | None]]) -> None:
        """Count the batch's failures; stop the run when most recent samples failed."""
        self.recent.extend(score is None for score in scores)
        failed = sum(self.recent)
        if failures and failed > self.failure_limit * len(self.recent):
            message, cause = failures[0]
            raise RewardError(f"{message} — {failed} of the last {len(self.recent)} samples' rewards failed "
                              f"(more than reward_failure_limit={self.failure_limit:g})") from cause

    def _scores(self, trajs: list[Trajectory], texts: list[str], at: list[int] | None = None
                ) -> tuple[list[float | None], list[tuple[str, BaseException | None]]]:
        """One finite float per sample, None where the reward failed, and each failure's
        description (naming the spec and the sample) with the exception it raised, if any. The
        task's verifier is trusted: it raises."""
        trusted = self.name == "task"
        lo, hi = self.reward_range
        failures: list[tuple[str, BaseException | None]] = []
        if hasattr(self.reward, "score"):
            try:
                raw = self.reward.score([t.problem.prompt for t in trajs], texts)
            except USER_CODE_ERRORS as e:
                return [None] * len(trajs), [(f"reward={self.name!r}: score() raised {type(e).__name__}: "
                                              f"{_clip(e)} (scoring {len(trajs)} samples)", e)]
            try:
                raw = list(raw)
            except TypeError:
                return [None] * len(trajs), [(f"reward={self.name!r}: score() returned {_shown(raw)}; it must "
                                              f"return one finite number per sample", None)]
            if len(raw) != len(trajs):
                return [None] * len(trajs), [(f"reward={self.name!r}: reward model returned {len(raw)} scores "
                                              f"for {len(trajs)} samples", None)]
            what = "a reward model's score() must return finite numbers"
        else:
            raw = []
            for i, (text, t) in enumerate(zip(texts, trajs)):
                if at is not None:
                    at[0] = i
                try:
                    raw.append(self.reward(text, t.problem))
                except USER_CODE_ERRORS as e:
                    message = (f"reward={self.name!r} raised {type(e).__name__}: {_clip(e)} on sample {i} "
                               f"of {len(trajs)} ({self._sample(trajs, texts, i)})")
                    if trusted:
                        raise RewardError(message) from e
                    raw.append(_FAILED)
                    failures.append((message, e))
            what = "a reward function must return a finite number"
        scores: list[float | None] = []
        for i, v in enumerate(raw):
            score = None if v is _FAILED else finite_score(v)
            if v is not _FAILED and score is None:
                message = (f"reward={self.name!r} returned {_shown(v)} for sample {i} of {len(trajs)} "
                           f"({self._sample(trajs, texts, i)}); {what}")
                if trusted:
                    raise RewardError(message)
                failures.append((message, None))
            elif score is not None and not lo <= score <= hi:
                failures.append((f"reward={self.name!r} returned {score:g} for sample {i} of {len(trajs)} "
                                 f"({self._sample(trajs, texts, i)}), outside reward_min={lo:g} .. reward_max={hi:g}",
                                 None))
                score = None
            scores.append(score)
        return scores, failures

    @staticmethod
    def _sample(trajs: list[Trajectory], texts: list[str], i: int) -> str:
        return f"prompt {snippet(str(getattr(trajs[i].problem, 'prompt', '?')))}, response {snippet(texts[i])}"


_FAILED = object()  # a sample whose reward function raised


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _cuda_device() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None
