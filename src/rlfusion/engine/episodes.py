"""Multi-turn episodes on a rollout engine: the policy writes a turn, an environment answers, the
answer's tokens join the same sequence, the policy writes the next turn (`rl/env.py`).

`EpisodeRunner` steps the engine the way the rollout stage steps a bare engine (`add_request`,
`step`, `has_unfinished`, `abort`), and between its passes hands each finished turn to the
environment's worker pool (`rl/env_pool.EnvPool`): the engine decodes the other rows while a call
is pending. Token in, token out: a turn's row is kept when it stops (`Request.keep_row_after`),
and its continuation is the same token ids plus the observation's, so the engine prefills only
the observation into that row (`StepPlan.extend`) and nothing earlier is ever re-tokenized.
Observation tokens are marked 0 in the request's `output_mask` (no loss, no advantage, no KL);
their logprob slot holds 0 and their version slot the version of the turn that called, so the
oldest version of a sample is always that of a sampled token.

An episode ends on the end token, at its token budget (`params.max_new_tokens` counts every
response token, observations too; an answer that does not fit ends the episode without its
observation, its reward counted: the environment took the step), after `max_turns` turns,
when the environment says done, or when it fails: a step that raised, hung past its timeout,
killed its worker or returned something unusable. A failed episode keeps its tokens and gets
reward 0 (`Trajectory.env_failed`); more than `failure_limit` of the last `FAILURE_WINDOW`
episodes failing stops the run (`EnvError`; judged once `MIN_JUDGED` episodes ended).
`abort` waits for the aborted episodes' pending calls (each bounded by the timeout), so a paused
episode is paused between turns with its observation in place, or inside a turn.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from rlfusion.engine.types import Completion, Request
from rlfusion.errors import RunError
from rlfusion.rl.env import import_env, stop_ids
from rlfusion.rl.env_pool import EnvPool, EnvResult
from rlfusion.rl.problem import Problem

FAILURE_WINDOW = 64
MIN_JUDGED = 16  # episodes ended before the failure share is judged (one early failure is not "most")


class EnvError(RunError):
    """Most recent episodes failed in the environment; the message names `env=` and the first failure."""


@dataclass
class _Episode:
    problem: Problem
    env_reward: float = 0.0
    failed: str = ""
    pending: Completion | None = None  # the turn whose step() is in flight
    judged: bool = True  # counts in the failure window


@dataclass
class EpisodeStats:
    """Counts since the last `take_stats`: episodes ended, their turns and environment calls,
    failures, the seconds the environment computed (`call_s`, summed over calls), and the time a
    call was in flight split into what the engine spent decoding meanwhile (hidden) and waiting
    for an answer with nothing to decode (exposed)."""

    episodes: float = 0.0
    turns: float = 0.0
    calls: float = 0.0
    failures: float = 0.0
    call_s: float = 0.0
    hidden_s: float = 0.0
    exposed_s: float = 0.0
    info: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        return {"env_episodes": self.episodes, "env_turns": self.turns, "env_calls": self.calls,
                "env_failures": self.failures, "env_call_s": self.call_s, "env_hidden_s": self.hidden_s,
                "env_exposed_s": self.exposed_s, **{f"env_info_{k}": v for k, v in self.info.items()}}


def segments(mask: list[int]) -> list[tuple[int, int]]:
    """The runs `[start, end)` of sampled tokens (mask 1): the turns the policy wrote."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class EpisodeRunner:
    """Episodes of the environment `pool` runs on `engine`. `stop_ids`: the tokens that end a turn
    and call the environment (its `stop` texts); `name`: the `env=` spec, for messages."""

    def __init__(self, engine: Any, pool: EnvPool, tokenizer: Any, stop_ids: tuple[int, ...], max_turns: int,
                 failure_limit: float, name: str, deterministic: bool = False):
        """`deterministic`: every answer is taken at the step after its call (each step first
        waits for the calls in flight), so the engine's batches, and with them the samples, do
        not depend on how fast the environment answered (a `deterministic=true` run: its
        resume reproduces it); the engine then decodes nothing while a call is in flight."""
        self.engine, self.pool, self.tokenizer = engine, pool, tokenizer
        self.stop_ids, self.max_turns, self.failure_limit, self.name = stop_ids, max_turns, failure_limit, name
        self.deterministic = deterministic
        self.max_seq_len = engine.runner.max_seq_len
        self.episodes: dict[str, _Episode] = {}
        self.recent: collections.deque[str] = collections.deque(maxlen=FAILURE_WINDOW)  # "" or why it failed
        self.stats = EpisodeStats()
        self._ended: list[Completion] = []  # ended between engine steps (an environment's answer)
        self._error = ""  # why the run stops (too many failed episodes), raised by `has_unfinished`
        self._flight: float | None = None  # wall time since which a call has been in flight
        self.spans: list[tuple[float, float]] = []  # wall intervals with a call in flight (the timeline's "env")

    @classmethod
    def build(cls, engine: Any, tokenizer: Any, cfg: Any, failure_limit: float,
              deterministic: bool = False) -> "EpisodeRunner":
        """The episodes of `cfg.name`'s environment (`EnvConfig`) on `engine`, with its worker pool."""
        pool = EnvPool(cfg.name, cfg.workers, cfg.timeout_s)
        ids = stop_ids(import_env(cfg.name), tokenizer, cfg.name)
        return cls(engine, pool, tokenizer, ids, cfg.max_turns, failure_limit, cfg.name, deterministic)

    # ---- the engine's protocol, as the rollout stage drives it ----

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    @property
    def num_steps(self) -> int:
        return self.engine.num_steps

    def add_request(self, request: Request, problem: Problem | None = None, env_reward: float = 0.0,
                    judged: bool = True) -> None:
        """Start (or resume) an episode: `request` is its prompt with any tokens it has so far
        (`output_mask` marking observations), `problem` what the environment resets to;
        `judged`: its failure counts toward stopping the run (not an evaluation's)."""
        if problem is None:
            raise ValueError(f"episode {request.request_id!r} needs its problem (the environment resets to it)")
        if request.output_mask is None:
            request.output_mask = [1] * len(request.output_ids)
        request.keep_row_after = self.stop_ids
        self.episodes[request.request_id] = _Episode(problem, env_reward, judged=judged)
        last = request.output_ids[-1] if request.output_ids else None
        if last in self.stop_ids and request.output_mask[-1] == 1:
            # a sample whose last turn ended on a call never answered (one made elsewhere)
            self._ended += self._turn_ended(_as_completion(request))
        else:
            self.engine.add_request(request)

    def has_work(self) -> bool:
        """Rows in the engine or calls in flight here (not the group's)."""
        return self.engine.has_work() or self.pool.in_flight > 0

    def has_unfinished(self) -> bool:
        """Episodes left (in lock-step: anywhere in the group, collective). Raises the `EnvError`
        of too many failed episodes here — in lock-step on every member, so none is left
        waiting in a collective."""
        if getattr(self.engine, "lockstep", None) is not None:
            busy, failed = self.engine.group_max([self.has_work(), bool(self._error)])
            if failed:
                raise EnvError(self._error or "another member of this rollout device's expert-parallel group "
                               "stopped: most of its recent episodes failed (its error names the environment)")
            return bool(busy)
        if self._error:
            raise EnvError(self._error)
        return self.has_work() or bool(self._ended)

    def step(self) -> list[Completion]:
        """One engine step (or, with no rows to run, a wait for the environment); returns the
        episodes that ended."""
        ended, self._ended = self._ended, []
        if self.deterministic and self.pool.in_flight:
            t0 = time.perf_counter()
            ended += self._take(self._wait_for({ep for ep, e in self.episodes.items() if e.pending is not None}))
            self.stats.exposed_s += time.perf_counter() - t0
        in_flight = self.pool.in_flight > 0
        t0 = time.perf_counter()
        if self.engine.has_work() or getattr(self.engine, "lockstep", None) is not None:
            for c in self.engine.step():
                ended += self._turn_ended(c)
            results = [] if self.deterministic else self.pool.poll()
            if in_flight:
                self.stats.hidden_s += time.perf_counter() - t0
        else:
            results = self.pool.poll(wait_s=0.05) if in_flight else []
            if in_flight:
                self.stats.exposed_s += time.perf_counter() - t0
        ended += self._take(results)
        self._track_flight()
        return ended

    def _wait_for(self, episodes: set[str]) -> list[EnvResult]:
        """Every answer until those of `episodes` are all in (each call within its timeout)."""
        results: list[EnvResult] = []
        while episodes:
            for r in self.pool.poll(wait_s=0.05):
                results.append(r)
                episodes.discard(r.episode)
        return results

    def _take(self, results: list[EnvResult]) -> list[Completion]:
        """The answers, in episode order (the order they arrived in is the workers' timing)."""
        ended = []
        for r in sorted(results, key=lambda r: r.episode):
            ended += self._answered(r)
        return ended

    def _track_flight(self) -> None:
        if self.pool.in_flight and self._flight is None:
            self._flight = time.time()
        elif not self.pool.in_flight and self._flight is not None:
            self.spans.append((self._flight, time.time()))
            self._flight = None

    def take_spans(self) -> list[tuple[float, float]]:
        """The wall intervals with an environment call in flight since the last call."""
        spans, self.spans = self.spans, []
        return spans

    def abort(self, request_ids, keep_cache: bool = False) -> list[Completion]:
        """Pause the given episodes: their pending calls are answered first (each within the
        timeout), then the engine's rows are aborted. Episodes that ended meanwhile come back
        with their own finish reason."""
        ids = set(request_ids)
        ended = self._ended
        ended += self._take(self._wait_for({i for i in ids if i in self.episodes and self.episodes[i].pending is not None}))
        self._ended = [c for c in ended if c.request_id not in ids]
        self._track_flight()
        paused = self.engine.abort(ids, keep_cache)
        if not keep_cache:  # rows kept at a turn's end: the resumed episodes recompute theirs too
            for i in ids:
                self.engine.drop_row(i)
        return [c for c in ended if c.request_id in ids] + paused

    def drop_saved(self) -> int:
        return self.engine.drop_saved()

    def take_stats(self) -> dict[str, float]:
        out, self.stats = self.stats.as_dict(), EpisodeStats()
        return out

    def close(self) -> None:
        self.pool.close()

    # ---- what the rollout stage adds to a sample ----

    def episode_fields(self, request_id: str, finished: bool) -> dict[str, Any]:
        """The sample's environment fields (`Trajectory.env_reward`, `env_failed`); a finished
        episode's record is dropped, a paused one's kept for its resumption here."""
        ep = self.episodes.pop(request_id) if finished else self.episodes[request_id]
        return {"env_reward": ep.env_reward, "env_failed": bool(ep.failed)}

    # ---- turns and answers ----

    def _turn_ended(self, c: Completion) -> list[Completion]:
        turns = len(segments(c.output_mask))
        if c.finish_reason == "stop" and c.output_ids[-1] in self.stop_ids and turns < self.max_turns:
            self._call(c.request_id, c)
            return []
        return self._end(c)

    def _call(self, request_id: str, c: Completion) -> None:
        ep = self.episodes[request_id]
        ep.pending = c
        actions = [self.tokenizer.decode(c.output_ids[a:b], skip_special=False) for a, b in segments(c.output_mask)]
        self.pool.submit(request_id, ep.problem, actions)
        self._track_flight()

    def _answered(self, r: EnvResult) -> list[Completion]:
        ep = self.episodes.get(r.episode)
        if ep is None or ep.pending is None:
            return []  # (an answer for an episode that ended meanwhile)
        c, ep.pending = ep.pending, None
        self.stats.calls += 1
        self.stats.call_s += r.seconds
        if r.step is None:
            ep.failed = r.error
            return self._end(c)
        ep.env_reward += r.step.reward
        for k, v in r.step.info.items():
            self.stats.info[k] = self.stats.info.get(k, 0.0) + v
        if r.step.done:
            return self._end(c)
        try:
            obs = self.tokenizer.encode(r.step.observation)
        except ValueError as e:
            ep.failed = f"its observation cannot be encoded by the run's tokenizer ({e})"
            return self._end(c)
        if not obs:
            ep.failed = "step() returned an empty observation (a turn needs at least one token back; done=True ends it)"
            return self._end(c)
        room = min(c.params.max_new_tokens - len(c.output_ids),
                   self.max_seq_len - 1 - len(c.prompt_ids) - len(c.output_ids))
        if len(obs) >= room:  # no room to answer after it: the episode ends at its budget, without it
            c.finish_reason = "length"
            return self._end(c)
        n = len(obs)
        grown = Completion(c.request_id, c.prompt_ids, c.output_ids + obs, c.logprobs + [0.0] * n,
                           c.versions + [c.versions[-1]] * n, c.finish_reason, c.params, c.routes,
                           c.output_mask + [0] * n)
        request = Request.resume(grown)
        request.keep_row_after = self.stop_ids
        self.engine.add_request(request)
        return []

    def _end(self, c: Completion) -> list[Completion]:
        ep = self.episodes[c.request_id]
        self.engine.drop_row(c.request_id)
        self.pool.close_episode(c.request_id)
        self.stats.episodes += 1
        self.stats.turns += len(segments(c.output_mask))
        self.stats.failures += bool(ep.failed)
        if not ep.judged:
            return [c]
        self.recent.append(ep.failed and f"episode {c.request_id} ({ep.problem.prompt[:40]!r}): {ep.failed}")
        failed = sum(bool(f) for f in self.recent)
        # judged at every end (not only a failing one), so the verdict does not hang on which
        # episode happened to end last
        if failed and len(self.recent) >= MIN_JUDGED and failed > self.failure_limit * len(self.recent):
            first = next(f for f in self.recent if f)
            self._error = self._error or (f"env={self.name!r}: {failed} of the last {len(self.recent)} episodes failed "
                                          f"(more than reward_failure_limit={self.failure_limit:g}); the first: {first}")
        return [c]


def _as_completion(r: Request) -> Completion:
    return Completion(r.request_id, r.prompt_ids, r.output_ids, r.logprobs, r.versions, "stop", r.params,
                      r.routes, r.output_mask)
