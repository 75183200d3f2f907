"""The scorer role of a device: the reward (`RewardStage`) and, with a KL term, the reference
logprobs and KL (`ReferenceStage`) of samples.

    score(rows)               rows in the queue (separated placement, StaleSync's scorers on the
                              train devices): read them as they become ready, write the columns
    score_and_reference       samples of this device's own rollout, before they go into the queue
    score_shared(groups)      shared scoring of a synchronous rollout (`deploy.share_scoring`):
                              the rollout devices put samples unscored as they finish, and each
                              device, once its own decoding is done, takes rows of the step
                              waiting in the queue a chunk at a time, scores and writes them

The scorer does not generate or train; it writes only the columns a later stage of this run
reads (`dataflow.REWARD.writes`, `dataflow.reference_writes`).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from rlfusion.queue.controller import runs_rows
from rlfusion.engine.runner import autocast
from rlfusion.errors import RunError
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.rewards import load_reward_fn
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.model import lora
from rlfusion.runtime.reference_stage import ReferenceStage, add_summed_kl
from rlfusion.runtime.reward_stage import RewardStage
from rlfusion.runtime.deployment import lora_reference_shares_policy
from rlfusion.runtime.role_context import RoleContext

# shared scoring: a device takes the step's rows in chunks of about 1/SHARE_TAKES of them (each
# take and its write cost the controller three round trips), of at least SHARE_CHUNK_ROWS rows
SHARE_TAKES, SHARE_CHUNK_ROWS = 4, 8
SHARE_WAIT_S = 1.0  # one wait for rows of the step (it ends early when a row arrives or all are taken)


class Scorer:
    """The reward and reference of one device (either may be None: a device without that role,
    or no KL term). The reference weights are the switch's to move (fully shared: on host
    between passes)."""

    def __init__(self, ctx: RoleContext, reward: RewardStage | None, reference: ReferenceStage | None):
        self.ctx, self.reward, self.reference = ctx, reward, reference
        if reference is not None and not reference.shares_policy:  # (a shared base moves with the policy)
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
            budget = cfg.env.max_episode_tokens or cfg.rollout.max_new_tokens  # (an episode's, observations in)
            reward = RewardStage(reward_fn, tokenizer, cfg.algo, budget, name=cfg.reward,
                                 timeout_s=cfg.reward_timeout_s, reward_range=(cfg.reward_min, cfg.reward_max),
                                 failure_limit=cfg.reward_failure_limit)
        reference = None
        if "reference" in roles and cfg.algo.kl_coef:
            shared = lora.spec_of(model) is not None and lora_reference_shares_policy(ctx.plan, ctx.device,
                                                                                      ctx.switch.merge_adapters)
            reference = ReferenceStage(model if shared else copy.deepcopy(model), cfg.rollout.temperature,
                                       cfg.optim.microbatch_tokens, replay=cfg.algo.routing_replay_reference,
                                       shares_policy=shared)
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
        reference = (dataflow.REFERENCE.name, dataflow.reference_reads(ctx.cfg), reference_rows,
                     dataflow.reference_writes(ctx.cfg), self._reference)
        for name, reads, rows, writes, run in ((dataflow.REWARD.name, dataflow.reward_reads(ctx.cfg), reward_rows,
                                                dataflow.REWARD.writes, self._reward), reference):
            if not rows:
                continue
            timeout = ctx.cfg.deploy.queue_timeout_s
            rows = rows if isinstance(rows, int) else runs_rows(rows)  # ids cross as runs (`row_runs`)
            count = rows if isinstance(rows, int) else len(rows)
            with ctx.spans.span("queue"):
                batch = dataflow.read_rows(ctx.queue, name, reads, rows, timeout)
            if len(batch) != count:
                raise RunError(f"stage {name!r} on device {ctx.device} waited {timeout:g} s for "
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
        return self.ctx.put_new(trajs, dataflow.rollout_writes(self.ctx.cfg, True) + self.writes)

    # ---- shared scoring of a synchronous rollout ----

    def score_shared(self, groups: list[int], mine: set[int]) -> tuple[int, int]:
        """Shared scoring of a synchronous rollout (`deploy.share_scoring`): score rows of the
        step's `groups` waiting in the queue — any rollout device's, put unscored as they finish
        — a chunk at a time as one reader of them all (the reward stage's consumer: each row is
        taken once; its own rows first), until every row of the step is taken. A device calls it
        once its own decoding is done, so an idle one scores a busy one's finished samples and the
        two finish together. Returns the rows scored here and how many of them are not of `mine`
        (this device's groups)."""
        ctx, cfg = self.ctx, self.ctx.cfg
        reads = tuple(dict.fromkeys(dataflow.reward_reads(cfg) + (dataflow.reference_reads(cfg) if self.reference else ())))
        total = len(groups) * cfg.rollout.group_size
        chunk = max(SHARE_CHUNK_ROWS, -(-total // SHARE_TAKES))
        own = sorted(mine)
        scored = peer = 0
        taken, since = -1, time.monotonic()  # rows of the step taken by any device, and since when
        while True:
            # its own rows first (they live in this process), then any of the step's, waiting
            # (no span: idle) until one is ready or every row is taken; the read of a chunk (a few
            # KB) is counted with that wait
            batch = ctx.queue.get(dataflow.REWARD.name, reads, chunk, groups=own) if own else ()
            if not len(batch):
                own = []  # all its own rows are in (its decoding is done) and taken: none come back
                batch = ctx.queue.get(dataflow.REWARD.name, reads, chunk, block=True, timeout=SHARE_WAIT_S,
                                      groups=groups, min_count=1)
            if len(batch):
                trajs = self.score_and_reference(dataflow.to_trajectories(batch))
                with ctx.spans.span("queue"):
                    ctx.queue.put(dataflow.trajectory_columns(trajs, self.writes), row_ids=batch.row_ids)
                scored += len(trajs)
                peer += sum(g not in mine for g in batch.group_ids)
                continue
            with ctx.spans.span("queue"):
                now_taken = ctx.queue.count_consumed(dataflow.REWARD.name, groups)
            if now_taken >= total:
                return scored, peer
            if now_taken != taken:
                taken, since = now_taken, time.monotonic()
            elif time.monotonic() - since > cfg.deploy.queue_timeout_s:
                raise RunError(f"shared scoring on device {ctx.device} saw no row of the step taken for "
                               f"{cfg.deploy.queue_timeout_s:g} s ({taken} of {total}; deploy.queue_timeout_s)")

    def _reward(self, trajs: list[Trajectory]) -> None:
        with self.ctx.spans.span("reward"):
            self.reward.score(trajs)

    def _reference(self, trajs: list[Trajectory]) -> None:
        ctx = self.ctx
        with ctx.switch.reference_pass(), autocast(ctx.where, ctx.compute_dtype):
            self.reference.logprobs(trajs)
        if ctx.cfg.algo.kl_mode == "reward":  # the summed estimate reward shaping subtracts (metadata-sized)
            add_summed_kl(trajs, ctx.cfg.algo.kl_kind)
