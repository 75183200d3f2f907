"""The generator's stage, `RolloutStage`: `group_size` sampled responses per prompt from the
policy its engine holds — a synchronous rollout (`generate`) or StaleSync's partial rollout of
prompt groups (`run_groups`: the stop rule, summed over the rollout devices, ends it; the rest
is aborted and resumes later). It does not know where its samples go or how it is placed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.problem import Problem
from rlfusion.rl.replay import replay_length
from rlfusion.rl.trajectory import Trajectory, has_routes
from rlfusion.engine.episodes import EpisodeRunner
from rlfusion.rl.env import EnvConfig
from rlfusion.runtime.train_config import RolloutConfig
from rlfusion.stalesync.rules import STOP_SYNC_EVERY, rollout_stops



class RolloutStage:
    """`group_size` sampled responses per prompt from the policy the engine currently holds."""

    def __init__(self, model: MoETransformer, tokenizer: Tokenizer, cfg: RolloutConfig, seed: int,
                 hf_path: str | None = None, compute_dtype: torch.dtype | None = None,
                 record_routes: bool = False, env: EnvConfig = EnvConfig(), env_failure_limit: float = 0.5,
                 deterministic: bool = False):
        """`model` is the policy; with `rollout.backend=vllm` the engine serves a copy of it
        (from `hf_path`, the run's base when that is an HF folder, else an export of `model`).
        `compute_dtype`: the precision of the native engine's passes (`deploy.precision`; None =
        fp32); vLLM computes in bf16, its kernels' dtype, whatever the setting. `record_routes`:
        each sample carries its tokens' routed experts (`Trajectory.routes`; native engine).
        `env` (`env.name` set): every sample is a multi-turn episode (`episodes.EpisodeRunner`);
        more than `env_failure_limit` of recent episodes failing stops the run; `deterministic`
        (`deterministic=true`): the episodes take each answer at a fixed step (`EpisodeRunner`)."""
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        if cfg.backend == "vllm":
            from rlfusion.engine.vllm_backend import VLLMEngine

            self.engine: Any = VLLMEngine.from_model(model, hf_path, seed=seed, max_num_seqs=cfg.max_num_seqs,
                                                     gpu_memory_utilization=cfg.gpu_memory_utilization)
        else:
            self.engine = LLMEngine(model, EngineConfig(max_num_seqs=cfg.max_num_seqs, seed=seed,
                                                        min_prefill_batch=cfg.min_prefill_batch,
                                                        compute_dtype=compute_dtype, record_routes=record_routes))
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                     max_new_tokens=cfg.max_new_tokens, stop_ids=(tokenizer.eos_id,))
        # what steps the rollouts: the engine, or the episodes on it
        self.episodes: EpisodeRunner | None = None
        self.driver: Any = self.engine
        if env.name:
            self.episodes = EpisodeRunner.build(self.engine, tokenizer, env, env_failure_limit, deterministic)
            self.driver = self.episodes
            self.params = dataclasses.replace(self.params, max_new_tokens=env.max_episode_tokens or cfg.max_new_tokens,
                                              stop_ids=(tokenizer.eos_id, *self.episodes.stop_ids))

    def _add(self, request: Request, problem: Problem, paused: Trajectory | None = None) -> None:
        """Queue one sample (an episode of `problem`, with an environment; `paused`: the sample
        it resumes)."""
        if self.episodes is None:
            self.driver.add_request(request)
        else:
            self.episodes.add_request(request, problem, paused.env_reward if paused is not None else 0.0)

    def _sample(self, c: Any, group_id: int, problem: Problem, sample: int) -> Trajectory:
        """A completion as its group's sample `sample` (with its episode's fields)."""
        t = Trajectory.of_completion(c, group_id, problem, self._finish_reason(c))
        t.sample = sample
        if self.episodes is not None:
            for k, v in self.episodes.episode_fields(c.request_id, c.finish_reason != "aborted").items():
                setattr(t, k, v)
        return t

    def params_for(self, group_id: int, sample: int) -> SamplingParams:
        """The sampling parameters of one request: the run's, or with `rollout.lengths=replay`
        a forced length drawn for (group, sample) and no stop token (`rl/replay.py`)."""
        if self.cfg.lengths != "replay":
            return self.params
        c = self.cfg
        length = replay_length(group_id, sample, c.replay_median, c.replay_sigma, c.replay_between, c.max_new_tokens)
        return dataclasses.replace(self.params, max_new_tokens=length, stop_ids=())

    def _finish_reason(self, completion: Any) -> str:
        """A replayed response that reached its drawn length below the cap ended: "stop"."""
        if (self.cfg.lengths == "replay" and completion.finish_reason == "length"
                and len(completion.output_ids) < self.cfg.max_new_tokens):
            return "stop"
        return completion.finish_reason

    def generate(self, problems: list[Problem], group_ids: list[int], version: int | None = None,
                 on_finish: Any = None) -> list[Trajectory]:
        """`group_ids[g]` is problem g's group; tokens are stamped with policy `version`.
        `on_finish(trajectory)`, if given, sees each sample the moment it finishes (the same
        engine steps run either way, so the samples do not depend on it). Returns the samples in
        request order (group by group); `sample` is each one's index in its group."""
        if version is not None:
            self.engine.policy_version = version
        model = self.model
        was_training = model.training
        model.eval()
        G = self.cfg.group_size
        if len(group_ids) != len(problems):
            raise ValueError(f"{len(problems)} problems need as many group ids, got {len(group_ids)}")
        requests = [Request(f"{group_ids[g]}/{i}", encode_prompt(self.tokenizer, p.prompt), self.params_for(group_ids[g], i))
                    for g, p in enumerate(problems) for i in range(G)]
        index = {r.request_id: k for k, r in enumerate(requests)}
        done: dict[int, Trajectory] = {}
        try:
            for k, r in enumerate(requests):
                self._add(r, problems[k // G])
            while self.driver.has_unfinished():
                for c in self.driver.step():
                    k = index[c.request_id]
                    t = self._sample(c, group_ids[k // G], problems[k // G], k % G)
                    done[k] = t
                    if on_finish is not None:
                        on_finish(t)
        finally:
            model.train(was_training)
            self.driver.abort({r.request_id for r in requests} - {requests[k].request_id for k in done})
        return [done[k] for k in range(len(requests))]

    def run_groups(self, groups: list[tuple[int, Problem, list[Trajectory]]], version: int, quota: int,
                   must_finish: set[int], drop_overdue: bool = False, sync: Any = None,
                   keep_cache: bool = False) -> dict[str, Any]:
        """Partial rollout over prompt groups `(group_id, problem, open samples)`: a group with no
        open samples starts `group_size` new ones, else its open (aborted) samples resume with
        the current weights. Steps the engine until every request is done, or until `quota` of
        these groups have finished and every group in `must_finish` has (with `drop_overdue`
        the unfinished `must_finish` groups are given up instead). The rest is aborted.

        With several rollout devices, `sync(finished, due unfinished, busy, failed)` sums those counts
        over the devices (every `STOP_SYNC_EVERY` engine steps, and while this device has nothing
        left to run) and the stop rule applies to the sums: `quota` is then the devices' total,
        and a device that runs out of work waits for the others instead of ending the rollout.
        `sync` is a `stop_sums.StopSums`: called with `wait=not busy`; a polled one may answer None
        (the sums are not in yet, `sync.pending`) and is asked again every step until they are,
        the device decoding on meanwhile.

        `keep_cache` (`stalesync.resume_kv=keep`): the aborted requests' cache rows stay with the
        engine, and those this device resumes in its next rollout decode on from them instead of
        prefilling prompt and partial output again with the newer weights.

        Returns finished and unfinished (aborted, partial) samples in request order, the ids of
        the groups it gave up, and how many tokens it generated."""
        self.engine.policy_version = version
        model = self.model
        was_training = model.training
        model.eval()
        run = _GroupRun(self.driver, self._add, self._sample)
        steps, error, peer_failed = 0, None, False
        # an engine in lock-step with its expert-parallel group (`deploy.infer_ep`) steps whenever
        # any rollout device is busy, so the sums are taken every step and every device waits for them
        lockstep = getattr(self.engine, "lockstep", None) is not None
        try:
            run.add(groups, lambda problem: encode_prompt(self.tokenizer, problem.prompt), self.params_for,
                    self.cfg.group_size)
        except Exception as e:  # noqa: BLE001 — re-raised below, after the peers were told
            error = e
        while True:
            busy = error is None and (self.driver.has_work() if lockstep else self.driver.has_unfinished())
            if sync is None or not busy or lockstep or steps % STOP_SYNC_EVERY == 0 or sync.pending:
                counts = (len(run.finished_groups), len(must_finish - run.finished_groups), int(busy),
                          int(error is not None))
                # a failing device keeps joining the sums with its error flag, so no peer is left
                # waiting in a collective; everyone stops on the same call
                if sync is not None:
                    counts = sync(*counts, wait=not busy or lockstep)
                if counts is not None and rollout_stops(*counts, quota=quota, drop_overdue=drop_overdue):
                    peer_failed = bool(counts[3]) and error is None
                    break
                if not busy and not lockstep:
                    continue
            steps += 1
            try:
                run.record(self.driver.step())
            except Exception as e:  # noqa: BLE001
                error = e
        aborted = {c.request_id: c for c in self.driver.abort(set(run.owner) - set(run.done),
                                                               keep_cache=keep_cache and error is None)}
        run.record([c for c in aborted.values() if c.finish_reason != "aborted"])  # (ended while paused)
        model.train(was_training)
        if error is not None:
            raise error
        if peer_failed:
            raise RuntimeError("another rollout device failed during this partial rollout (its error is reported "
                               "by its own worker)")
        dropped = sorted(must_finish - run.finished_groups) if drop_overdue else []
        return {**run.results(aborted), "dropped": dropped, "engine_steps": self.engine.num_steps}

    def rng_state(self) -> torch.Tensor:
        return self.engine.rng_state()

    def saved_rows(self) -> dict:
        """The engine's cache rows of paused requests (`run_groups(keep_cache=True)`)."""
        return self.engine.saved_rows()

    def load_saved_rows(self, rows: dict) -> None:
        self.engine.load_saved_rows(rows)

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.engine.set_rng_state(state)


class _GroupRun:
    """Bookkeeping of one `RolloutStage.run_groups`: which request is which group's sample, how
    many of each group are still open, and what finished. `driver`: the engine, or the episodes
    on it; `add(request, problem, paused sample)` queues a sample on it; `sample(completion,
    group, problem, index)` makes a completion the group's sample."""

    def __init__(self, driver: Any, add: Any, sample: Any):
        self.driver, self.add_one, self.sample = driver, add, sample
        self.owner: dict[str, tuple[int, Problem, int]] = {}  # request id -> (group, problem, sample)
        self.open_count: dict[int, int] = {}
        self.order: list[str] = []  # request order
        self.done: dict[str, Any] = {}  # finished completions
        self.finished_groups: set[int] = set()
        self.resumed_tokens = 0  # tokens the resumed samples brought along

    def add(self, groups: list[tuple[int, Problem, list[Trajectory]]], encode, params_for,
            group_size: int) -> None:
        """A group with open samples resumes them; a group without starts `group_size` new ones.
        `params_for(group, sample)`: each request's sampling parameters (a resumed one gets the
        same, so a forced length stays what it was)."""
        for gid, problem, partial in groups:
            if partial:
                requests = [Request(f"{gid}/{t.sample}", list(t.prompt_ids), params_for(gid, t.sample),
                                    list(t.response_ids), list(t.behaviour_logprobs), list(t.versions),
                                    _routes(t), None if t.response_mask is None else list(t.response_mask))
                            for t in partial]
                self.resumed_tokens += sum(sum(t.sampled) for t in partial)
            else:
                prompt = encode(problem)
                requests = [Request(f"{gid}/{i}", prompt, params_for(gid, i)) for i in range(group_size)]
            for k, r in enumerate(requests):
                self.owner[r.request_id] = (gid, problem, int(r.request_id.split("/")[1]))
                self.order.append(r.request_id)
                self.add_one(r, problem, partial[k] if partial else None)
            self.open_count[gid] = len(requests)
        self.driver.drop_saved()  # rows of paused requests that resume on another device, or never

    def record(self, completions) -> None:
        for c in completions:
            self.done[c.request_id] = c
            gid = self.owner[c.request_id][0]
            self.open_count[gid] -= 1
            if self.open_count[gid] == 0:
                self.finished_groups.add(gid)

    def results(self, aborted: dict[str, Any]) -> dict[str, Any]:
        """Finished and unfinished (aborted, partial) samples in request order, and the tokens
        generated in this run."""
        finished, unfinished, generated = [], [], -self.resumed_tokens
        for rid in self.order:
            c = self.done.get(rid) or aborted[rid]
            gid, problem, i = self.owner[rid]
            t = self.sample(c, gid, problem, i)
            generated += len(c.output_ids) if c.output_mask is None else sum(c.output_mask)
            (finished if rid in self.done else unfinished).append(t)
        return {"finished": finished, "unfinished": unfinished, "generated_tokens": generated}


def _routes(t: Trajectory) -> torch.Tensor | None:
    """A paused sample's routes as its resumed request carries them (`[positions, L * K]`; one
    handed over through the queue arrives flat)."""
    if not has_routes(t):
        return None
    return torch.as_tensor(t.routes).reshape(len(t.prompt_ids) + len(t.response_ids) - 1, -1)
