"""The scorer role of a device: the reward (`RewardStage`) and, with a KL term, the reference
logprobs and KL (`ReferenceStage`) of samples.

    score(rows)               rows in the queue (separated placement, StaleSync's scorers on the
                              train devices): read them as they become ready, write the columns
    score_and_reference       samples of this device's own rollout, before they go into the queue
    shared / take_finished /  shared scoring of a synchronous rollout (`deploy.share_scoring`):
      score_from              the generating device offers each finished sample to a pool
                              (`finished_pool.FinishedPool`, served on its own thread); an idle
                              peer takes them a chunk at a time, scores and puts them

The scorer does not generate or train; it writes only the columns a later stage of this run
reads (`dataflow.REWARD.writes`, `dataflow.reference_writes`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from rlfusion.queue.controller import runs_rows
from rlfusion.engine.runner import autocast
from rlfusion.errors import RunError
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.rewards import load_reward_fn
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.finished_pool import FinishedPool
from rlfusion.runtime.reference_stage import ReferenceStage, add_summed_kl
from rlfusion.runtime.reward_stage import RewardStage
from rlfusion.runtime.role_context import RoleContext

SCORE_CHUNK_TOKENS = 1024  # a device scores its pool this many tokens at a time (a peer may take the rest)


class Scorer:
    """The reward and reference of one device (either may be None: a device without that role,
    or no KL term). The reference weights are the switch's to move (fully shared: on host
    between passes)."""

    def __init__(self, ctx: RoleContext, reward: RewardStage | None, reference: ReferenceStage | None):
        self.ctx, self.reward, self.reference = ctx, reward, reference
        self.pool = FinishedPool()  # finished samples of a running shared rollout
        if reference is not None:
            ctx.switch.attach(reference=reference.model)

    @classmethod
    def build(cls, ctx: RoleContext, roles: tuple[str, ...], model: MoETransformer, tokenizer: Tokenizer,
              task: Any) -> "Scorer":
        """The stages of the scoring roles in `roles`: the reward (the task's verifier, or the
        user's `reward=` spec) and, with `algo.kl_coef`, the reference (a frozen copy of `model`)."""
        cfg = ctx.cfg
        reward = None
        if "reward" in roles:
            reward_fn = task.reward if cfg.reward == "task" else load_reward_fn(cfg.reward)
            reward = RewardStage(reward_fn, tokenizer, cfg.algo, cfg.rollout.max_new_tokens, name=cfg.reward,
                                 timeout_s=cfg.reward_timeout_s, reward_range=(cfg.reward_min, cfg.reward_max),
                                 failure_limit=cfg.reward_failure_limit)
        reference = (ReferenceStage(copy.deepcopy(model), cfg.rollout.temperature, cfg.optim.microbatch_tokens)
                     if "reference" in roles and cfg.algo.kl_coef else None)
        return cls(ctx, reward, reference)

    @property
    def writes(self) -> tuple[str, ...]:
        """The columns this device's scoring adds to a row."""
        return dataflow.REWARD.writes + (dataflow.reference_writes(self.ctx.cfg) if self.reference is not None else ())

    # ---- rows in the queue ----

    def score(self, reward_rows: int | tuple[int, ...], reference_rows: int | tuple[int, ...]) -> None:
        """Read rows as they become ready — `reward_rows` for the reward, `reference_rows` for
        the reference: a count (the first that many, a synchronous step's) or the row ids as runs
        (StaleSync's batch) — and write those columns back. Each role reads as its own
        consumer, so a row is scored by exactly one device per role."""
        ctx = self.ctx
        reference = (dataflow.REFERENCE, reference_rows, dataflow.reference_writes(ctx.cfg), self._reference)
        for stage, rows, writes, run in ((dataflow.REWARD, reward_rows, dataflow.REWARD.writes, self._reward),
                                         reference):
            if not rows:
                continue
            timeout = ctx.cfg.deploy.queue_timeout_s
            rows = rows if isinstance(rows, int) else runs_rows(rows)  # ids cross as runs (`row_runs`)
            count = rows if isinstance(rows, int) else len(rows)
            with ctx.spans.span("queue"):
                batch = dataflow.read_rows(ctx.queue, stage.name, stage.reads, rows, timeout)
            if len(batch) != count:
                raise RunError(f"stage {stage.name!r} on device {ctx.device} waited {timeout:g} s for "
                               f"{count} rows and got {len(batch)} (deploy.queue_timeout_s)")
            trajs = dataflow.to_trajectories(batch)
            run(trajs)
            with ctx.spans.span("queue"):
                ctx.queue.put(dataflow.trajectory_columns(trajs, writes), row_ids=batch.row_ids)

    # ---- samples that are not in the queue yet ----

    def score_and_reference(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Reward and (if this device holds one) reference logprobs, written into `trajs`."""
        if trajs:
            self._reward(trajs)
            if self.reference is not None:
                self._reference(trajs)
        return trajs

    def put_scored(self, trajs: list[Trajectory]) -> list[int]:
        """Samples scored here as new queue rows (the rollout's columns and this device's
        scoring columns); their row ids."""
        return self.ctx.put_new(trajs, dataflow.rollout_writes(scored=True) + self.writes)

    def shared(self, generate: Callable[[Callable[[Trajectory], None]], list[Trajectory]]
               ) -> tuple[list[Trajectory], int]:
        """A synchronous rollout with shared scoring, on the generating device: `generate(on_finish)`
        runs it, offering each finished sample to the pool that `take_finished` hands out to an
        idle peer's `score_from`; this device then scores the rest, `SCORE_CHUNK_TOKENS` at a
        time, so a peer that runs out of work shares that too and the two finish together. Its
        rows go in one write at the end (a put costs a few queue round trips, and no stage reads
        them before the rollout ends). Returns the rollout's samples and how many this device
        scored and put."""
        self.pool.open()
        try:
            trajs = generate(self.pool.offer)
            self.pool.decoding_done()
            scored: list[Trajectory] = []
            while chunk := self.pool.take(SCORE_CHUNK_TOKENS):
                scored += self.score_and_reference(chunk)
            self.put_scored(scored)
        finally:
            self.pool.close()
        return trajs, len(scored)

    def take_finished(self, min_count: int = 1, max_tokens: int = SCORE_CHUNK_TOKENS,
                      wait_s: float = 0.0) -> tuple[list[Trajectory], bool]:
        """Finished, not yet scored samples of the running `shared` rollout, up to `max_tokens`
        tokens, which are the caller's to score and put from now on, and whether its pool is
        still open (more may come). While this device still decodes, none unless `min_count`
        wait (more will come); once it scores its own, any that wait. With `wait_s`, an open
        pool with too few samples is waited on for up to that long: the answer comes as soon as
        enough are offered or the pool closes."""
        return self.pool.take_waiting(min_count, max_tokens, wait_s)

    def score_from(self, peer: Any, wait_s: float, min_count: int) -> int:
        """Score `peer`'s finished samples (another device's worker, inside a shared rollout) a
        chunk at a time until its pool closes, then put them; returns how many. While it has
        fewer than `min_count` waiting, the peer holds each request up to `wait_s` and answers
        as soon as that changes, so this call ends the moment the pool closes."""
        import ray

        scored: list[Trajectory] = []  # put once at the end, as the peer puts its own
        while True:
            taken, open_ = ray.get(peer.take_finished.options(concurrency_group="pool").remote(
                min_count, SCORE_CHUNK_TOKENS, wait_s))
            if taken:
                scored += self.score_and_reference(taken)
            elif not open_:
                self.put_scored(scored)
                return len(scored)

    def _reward(self, trajs: list[Trajectory]) -> None:
        with self.ctx.spans.span("reward"):
            self.reward.score(trajs)

    def _reference(self, trajs: list[Trajectory]) -> None:
        ctx = self.ctx
        with ctx.switch.reference_pass(), autocast(ctx.where, ctx.compute_dtype):
            self.reference.logprobs(trajs)
        if ctx.cfg.algo.kl_mode == "reward":  # the summed estimate reward shaping subtracts (metadata-sized)
            add_summed_kl(trajs, ctx.cfg.algo.kl_kind)
