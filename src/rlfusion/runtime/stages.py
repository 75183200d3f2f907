"""The RL roles as separate stages with typed inputs and outputs.

    problems ─► RolloutStage ─► trajectories ─► RewardStage ─► ReferenceStage ─► advantages ─► ActorStage
                (engine, policy vN)             (.reward)      (.ref_logprobs)   (.advantage)   (update → vN+1)

Each stage reads and writes `Trajectory` fields only, so later issues can run them in other
processes (and in parallel) without changing what they compute. The stages do not know how
they are placed or scheduled.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from typing import Any

import torch

from rlfusion.errors import RewardError, RunError
from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl import advantages as adv
from rlfusion.rl.dapo import dynamic_sampling_mask, overlong_penalty
from rlfusion.rl.policy_loss import value_loss
from rlfusion.rl.problem import Problem
from rlfusion.rl.replay import replay_length
from rlfusion.rl.rewards import (CallTimeout, DaemonCaller, RewardFn, RewardModel, describe_reward,
                                finite_score, snippet)
from rlfusion.rl.trajectory import (Trajectory, device_of, pack, response_values, split_by_token_budget,
                                   token_logprobs)
from rlfusion.runtime import dataflow
from rlfusion.parallel.data_parallel import group_sum, shard_rows, sum_over_replicas
from rlfusion.parallel.seq_balance import SeqCost
from rlfusion.stalesync.rules import rollout_stops
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig, RolloutConfig


class CollapseError(RunError):
    """Rewards stayed at 0 or responses ran to the length limit for too long."""


SYNC_EVERY = 8  # engine steps between the rollout devices' stop-rule sums (2: -10% tokens/s from lock-step waits)


class RolloutStage:
    """`group_size` sampled responses per prompt from the policy the engine currently holds."""

    def __init__(self, model: MoETransformer, tokenizer: Tokenizer, cfg: RolloutConfig, seed: int,
                 hf_path: str | None = None, compute_dtype: torch.dtype | None = None):
        """`model` is the policy; with `rollout.backend=vllm` the engine serves a copy of it
        (from `hf_path`, the run's base when that is an HF folder, else an export of `model`).
        `compute_dtype`: the precision of the native engine's passes (`deploy.precision`; None =
        fp32); vLLM computes in bf16, its kernels' dtype, whatever the setting."""
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        if cfg.backend == "vllm":
            from rlfusion.engine.vllm_backend import VLLMEngine

            self.engine: Any = VLLMEngine.from_model(model, hf_path, seed=seed, max_num_seqs=cfg.max_num_seqs,
                                                     gpu_memory_utilization=cfg.gpu_memory_utilization)
        else:
            self.engine = LLMEngine(model, EngineConfig(max_num_seqs=cfg.max_num_seqs, seed=seed,
                                                        min_prefill_batch=cfg.min_prefill_batch,
                                                        compute_dtype=compute_dtype))
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                     max_new_tokens=cfg.max_new_tokens, stop_ids=(tokenizer.eos_id,))

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
            for r in requests:
                self.engine.add_request(r)
            while self.engine.has_unfinished():
                for c in self.engine.step():
                    k = index[c.request_id]
                    t = Trajectory(group_ids[k // G], problems[k // G], c.prompt_ids, c.output_ids,
                                   c.logprobs, c.versions, self._finish_reason(c))
                    t.sample = k % G
                    done[k] = t
                    if on_finish is not None:
                        on_finish(t)
        finally:
            model.train(was_training)
            self.engine.abort({r.request_id for r in requests} - {requests[k].request_id for k in done})
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
        over the devices (every `SYNC_EVERY` engine steps, and while this device has nothing
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
        run = _GroupRun(self.engine, self._finish_reason)
        steps, error, peer_failed = 0, None, False
        try:
            run.add(groups, lambda problem: encode_prompt(self.tokenizer, problem.prompt), self.params_for,
                    self.cfg.group_size)
        except Exception as e:  # noqa: BLE001 — re-raised below, after the peers were told
            error = e
        while True:
            busy = error is None and self.engine.has_unfinished()
            if sync is None or not busy or steps % SYNC_EVERY == 0 or sync.pending:
                counts = (len(run.finished_groups), len(must_finish - run.finished_groups), int(busy),
                          int(error is not None))
                # a failing device keeps joining the sums with its error flag, so no peer is left
                # waiting in a collective; everyone stops on the same call
                if sync is not None:
                    counts = sync(*counts, wait=not busy)
                if counts is not None and rollout_stops(*counts, quota=quota, drop_overdue=drop_overdue):
                    peer_failed = bool(counts[3]) and error is None
                    break
                if not busy:
                    continue
            steps += 1
            try:
                run.record(self.engine.step())
            except Exception as e:  # noqa: BLE001
                error = e
        aborted = {c.request_id: c for c in self.engine.abort(set(run.owner) - set(run.done),
                                                               keep_cache=keep_cache and error is None)}
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
    many of each group are still open, and what finished."""

    def __init__(self, engine: LLMEngine, finish_reason: Any = None):
        self.engine = engine
        self.finish_reason = finish_reason or (lambda c: c.finish_reason)  # of a finished completion
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
                                    list(t.response_ids), list(t.behaviour_logprobs), list(t.versions))
                            for t in partial]
                self.resumed_tokens += sum(len(t.response_ids) for t in partial)
            else:
                prompt = encode(problem)
                requests = [Request(f"{gid}/{i}", prompt, params_for(gid, i)) for i in range(group_size)]
            for r in requests:
                self.owner[r.request_id] = (gid, problem, int(r.request_id.split("/")[1]))
                self.order.append(r.request_id)
                self.engine.add_request(r)
            self.open_count[gid] = len(requests)
        self.engine.drop_saved()  # rows of paused requests that resume on another device, or never

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
            t = Trajectory(gid, problem, c.prompt_ids, c.output_ids, c.logprobs, c.versions, self.finish_reason(c))
            t.sample = i
            generated += len(c.output_ids)
            (finished if rid in self.done else unfinished).append(t)
        return {"finished": finished, "unfinished": unfinished, "generated_tokens": generated}


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


class ReferenceStage:
    """Log-probabilities of each response under the frozen reference (base) model."""

    def __init__(self, model: MoETransformer, temperature: float, microbatch_tokens: int):
        self.model = model.eval().requires_grad_(False)
        self.temperature, self.microbatch_tokens = temperature, microbatch_tokens

    @torch.no_grad()
    def logprobs(self, trajs: list[Trajectory]) -> None:
        for micro in split_by_token_budget(trajs, self.microbatch_tokens):
            batch = pack(micro, device_of(self.model))
            logprobs_N, _ = token_logprobs(self.model, batch, self.temperature)
            mask = batch.loss_mask_N.bool()
            per_seq = logprobs_N[mask].split([len(t.response_ids) for t in micro])
            for t, lp in zip(micro, per_seq):
                t.ref_logprobs = lp.tolist()


def apply_kl_reward_penalty(trajs: list[Trajectory], algo: AlgoConfig) -> dict[str, float]:
    """Each sample's reward minus `kl_coef` x its summed KL estimate (`kl`, written by the
    reference stage), as in classic RLHF."""
    kl = [t.kl for t in trajs]
    for t, k in zip(trajs, kl):
        t.reward -= algo.kl_coef * k
    return {"kl_seq_mean": sum(kl) / len(kl) if kl else 0.0}


def compute_advantages(trajs: list[Trajectory], algo: AlgoConfig, group_size: int) -> list[Trajectory]:
    """Set `advantage` on every trajectory from the rewards of its group (GRPO, RLOO) or of the
    batch (REINFORCE++); returns the ones to train on (dynamic sampling may drop groups whose
    rewards are all equal: they carry no group-relative signal). GAE's per-token advantages
    need the critic's values: `gae_advantages` computes them where the critic runs."""
    if algo.advantage == "gae":
        return trajs
    rewards_GS = torch.tensor([t.reward for t in trajs]).view(-1, group_size)
    if algo.advantage == "grpo":
        adv_GS = adv.grpo_advantages(rewards_GS, scale_by_std=algo.scale_by_std)
    elif algo.advantage == "rloo":
        adv_GS = adv.rloo_advantages(rewards_GS)
    else:
        adv_GS = adv.reinforce_pp_advantages(rewards_GS.flatten()).view_as(rewards_GS)
    for t, a in zip(trajs, adv_GS.flatten().tolist()):
        t.advantage = a
    if not algo.dynamic_sampling:
        return trajs
    # Filter on the task score, not the shaped reward: KL or overlong penalties make every
    # reward slightly different, which would keep groups that carry no real signal.
    correct_GS = torch.tensor([t.correct for t in trajs]).view(-1, group_size)
    keep_G = dynamic_sampling_mask(correct_GS).tolist()
    return [t for k, t in enumerate(trajs) if keep_G[k // group_size]]


def advantage_stage(queue: Any, cfg: Any, rows: int | list[int], num_ranks: int, cost: SeqCost | None = None
                    ) -> tuple[list[dataflow.RowNumbers], list[list[int]], dict[str, float]]:
    """The advantage stage of one update, on the first train device: the scored rows' numbers
    from the queue — `rows`: a count (the first that many complete groups, a synchronous step's)
    or the row ids (StaleSync's batch) — (reward, score, lengths, KL; never their tokens), KL
    reward shaping if any, advantages, which rows the update keeps, written back by row id
    (`advantage`, `shaped_reward`, `train`), and the kept rows split over `num_ranks`
    data-parallel ranks by tokens, or with `cost` by its a·tokens + b·tokens²
    (`optim.dp_balance=cost`). Returns the rows (in (group, sample) order), each rank's row ids,
    and the batch's aggregates (what the controller records)."""
    timeout = cfg.deploy.queue_timeout_s
    reads = dataflow.advantage_reads(cfg)
    count = rows if isinstance(rows, int) else len(rows)
    try:
        batch = (queue.get("advantage", reads, rows, policy="group", block=True, timeout=timeout)
                 if isinstance(rows, int) else queue.get_rows("advantage", rows, reads, timeout))
    except TimeoutError:
        batch = ()
    if len(batch) != count:
        raise RunError(f"the advantage stage waited {timeout:g} s for {count} scored rows and the queue had "
                       f"{len(batch)} (deploy.queue_timeout_s)")
    rows = dataflow.to_numbers(batch)
    rows.sort(key=lambda r: (r.group_id, r.sample))
    out: dict[str, float] = {}
    if cfg.algo.kl_coef and cfg.algo.kl_mode == "reward":
        out.update(apply_kl_reward_penalty(rows, cfg.algo))
    failed_groups = {r.group_id for r in rows if r.reward_failed}
    scored = rows if cfg.reward_on_failure == "zero" else [r for r in rows if r.group_id not in failed_groups]
    kept = {id(r) for r in compute_advantages(scored, cfg.algo, cfg.rollout.group_size)} if scored else set()
    for r in rows:
        r.train = id(r) in kept
    queue.put(dataflow.trajectory_columns(rows, dataflow.ADVANTAGE.writes), row_ids=[r.row_id for r in rows])
    train = [r for r in rows if r.train]
    shards = [[train[i].row_id for i in part] for part in shard_rows([r.num_tokens for r in train], num_ranks, cost)]
    out.update({
        "reward_mean": sum(r.reward for r in rows) / count,
        "correct_mean": sum(r.correct for r in rows) / count,
        "kept_fraction": len(train) / count,
        "response_length_mean": sum(r.response_len for r in rows) / count,
        "response_tokens": sum(r.response_len for r in rows),  # the update's samples, generated in any step
        "response_length_max": max(r.response_len for r in rows),
        "truncated_fraction": sum(r.truncated for r in rows) / count,
        "update_tokens": sum(r.num_tokens for r in train),
        "reward_failures": sum(r.reward_failed for r in rows),  # samples whose user reward failed
        "reward_failed_groups": len(failed_groups),
    })
    return rows, shards, out


def gae_advantages(trajs: list[Trajectory], algo: AlgoConfig, group: Any = None) -> None:
    """Per-token GAE with the sequence reward on the last response token, whitened over the
    batch: with a data-parallel `group`, over every rank's tokens (each rank holds a share of
    the samples), so the result does not depend on how the batch was split."""
    R = max((len(t.response_ids) for t in trajs), default=0)
    rewards, values, mask = (torch.zeros(len(trajs), R) for _ in range(3))
    for s, t in enumerate(trajs):
        n = len(t.response_ids)
        rewards[s, n - 1] = t.reward
        values[s, :n] = torch.tensor(t.values)
        mask[s, :n] = 1.0
    adv_SR, ret_SR = adv.gae_advantages(rewards, values, mask, algo.gamma, algo.lam)
    valid = mask.bool()
    # sums in float64, so the whitening is the same for any split of the batch
    sums = torch.tensor([float(valid.sum()), adv_SR[valid].double().sum(), adv_SR[valid].double().pow(2).sum()],
                        dtype=torch.float64)
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    n, total, squares = sums.tolist()
    mean = total / max(n, 1.0)
    std = max(((squares - n * mean * mean) / max(n - 1.0, 1.0)) ** 0.5, 1e-6)
    adv_SR = (adv_SR - mean) / std  # whitened over the batch, as in standard PPO
    for s, t in enumerate(trajs):
        n_s = len(t.response_ids)
        t.token_advantages, t.returns = adv_SR[s, :n_s].tolist(), ret_SR[s, :n_s].tolist()


class CriticStage:
    """The value model for PPO: the base decoder with a one-output head instead of the LM head."""

    def __init__(self, base: MoETransformer, algo: AlgoConfig, optim: OptimConfig, dp_group: Any = None):
        self.model = copy.deepcopy(base).train()
        self.model.lm_head = torch.nn.Linear(base.config.d_model, 1, bias=False, device=device_of(base))
        torch.nn.init.zeros_(self.model.lm_head.weight)  # V = 0 at start: advantages = returns
        self.algo, self.microbatch_tokens = algo, optim.microbatch_tokens
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.critic_lr)
        self.dp_group = dp_group  # replicas on several devices: each its share of the samples

    def _values(self, trajs: list[Trajectory]):
        batch = pack(trajs, device_of(self.model))
        values_N = self.model(batch.tokens_N.unsqueeze(0), packed=batch.packed)[0, :, 0].float()
        return batch, values_N

    @torch.no_grad()
    def values(self, trajs: list[Trajectory]) -> None:
        for micro in split_by_token_budget(trajs, self.microbatch_tokens):
            batch, values_N = self._values(micro)
            for t, v in zip(micro, response_values(batch, values_N, micro)):
                t.values = v.tolist()

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One step on `trajs` (with a `dp_group`, this replica's share: the loss is normalized
        by the group's token count and gradients are summed, so every replica takes the
        full-batch step)."""
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = group_sum([sum(len(t.response_ids) for t in trajs)], self.dp_group)[0]
        if num_tokens == 0:
            return {}
        metrics: dict[str, float] = {}
        for micro in split_by_token_budget(trajs, self.microbatch_tokens) if trajs else []:
            batch, values_N = self._values(micro)
            mask = batch.loss_mask_N.bool()
            old, ret = torch.zeros_like(values_N), torch.zeros_like(values_N)
            old[mask] = torch.tensor([v for t in micro for v in t.values], device=values_N.device)
            ret[mask] = torch.tensor([r for t in micro for r in t.returns], device=values_N.device)
            loss, m = value_loss(values_N, old, ret, batch.loss_mask_N, self.algo.value_clip,
                                 num_tokens=num_tokens)
            loss.backward()
            share = int(mask.sum()) / num_tokens
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v * share
        if self.dp_group is not None:
            metrics = sum_over_replicas(list(self.model.parameters()), metrics, self.dp_group)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return metrics
