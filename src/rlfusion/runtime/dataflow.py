"""The RL dataflow as DistQueue traffic: one queue row per sampled response, one column per field
a stage adds, and which columns each stage reads and writes.

    rollout    (device)  ─put─► prompt_ids response_ids behaviour_logprobs versions finish_reason
                                sample num_tokens response_len truncated [problem: rows that go in
                                unscored, for the reward stage]
    reward     (device)  get(problem, response_ids)                 ─put─► reward correct reward_failed
    reference  (device)  get(prompt_ids, response_ids, behaviour_logprobs) ─put─► ref_logprobs
                                (kl_mode=loss: the actor's KL term) | kl (kl_mode=reward)
    advantage  (first train device)  get(reward correct reward_failed sample num_tokens
                                         response_len truncated [kl]) ─► the split (`RankRows`:
                                         row ids, advantages, shaped rewards), broadcast to the
                                         train devices
    actor      (device)  get_rows(prompt_ids response_ids behaviour_logprobs versions [ref_logprobs]
                                  [routes]) of its rank's rows ─► update; the first train device then
                                  retires the rows (`routes`: the rollout's routed experts per MoE
                                  layer, written where it records them, `records_routes`)
    handover   (device)  hybrid placement: a late device's paused samples, put and read back with
                                  the rollout's columns

The controller reads and writes no row: every stage runs on the devices. A stage reads only the
columns it needs, and a column is written only when a stage of this run reads it: what the
advantage stage computes rides the split it broadcasts anyway, not the queue. The exception is
a finished row's `finish_reason`, which the handover reads of paused rows: it stays with every
row as the sample's record (the update reads each token's policy version, `versions`, to split
the mismatch metrics by lag; packed, a byte or two per token).
`Trajectory` is the stages' working form of a row: `to_trajectories` and `trajectory_columns`
translate.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlfusion.queue import Batch, ColumnSpec, QueueConfig
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory

TRAJECTORY_COLUMNS: tuple[ColumnSpec, ...] = (
    ColumnSpec("problem", "object"),
    ColumnSpec("prompt_ids", "int32", variable_length=True),
    ColumnSpec("response_ids", "int32", variable_length=True),
    ColumnSpec("behaviour_logprobs", "float32", variable_length=True),
    ColumnSpec("versions", "int64", variable_length=True),  # policy version of each response token
    ColumnSpec("finish_reason", "object"),
    ColumnSpec("sample", "int32"),  # index of the sample in its group
    ColumnSpec("num_tokens", "int32"),  # prompt + response
    ColumnSpec("response_len", "int32"),
    ColumnSpec("truncated", "int8"),  # stopped at max_new_tokens
    ColumnSpec("reward", "float64"),
    ColumnSpec("correct", "float64"),  # the task score, before any shaping
    ColumnSpec("reward_failed", "int8"),  # 1 = the user's reward failed for it (reward 0)
    ColumnSpec("ref_logprobs", "float32", variable_length=True),
    ColumnSpec("kl", "float64"),  # the sample's summed KL estimate against the reference
    # the rollout's routed experts of each fed token per MoE layer, flat (`Trajectory.routes`;
    # empty when not recorded); on the wire in the narrowest signed int type (int8 while every id is below 128)
    ColumnSpec("routes", "int16", variable_length=True),
    # multi-turn episodes (`env.name`): 1 per sampled response token, 0 per observation token
    ColumnSpec("response_mask", "int8", variable_length=True),
    ColumnSpec("env_reward", "float64"),  # the environment's step rewards, summed
    ColumnSpec("env_failed", "int8"),  # 1 = its environment failed (reward 0, counted)
)
ENV_COLUMNS = ("response_mask", "env_reward", "env_failed")


@dataclass(frozen=True)
class Stage:
    """The columns one stage reads and the ones it writes."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


ROLLOUT = Stage("rollout", (), ("problem", "prompt_ids", "response_ids", "behaviour_logprobs", "versions",
                                "finish_reason", "sample", "num_tokens", "response_len", "truncated"))
REWARD = Stage("reward", ("problem", "response_ids"), ("reward", "correct", "reward_failed"))
REFERENCE = Stage("reference", ("prompt_ids", "response_ids", "behaviour_logprobs"), ("ref_logprobs", "kl"))
# the advantage stage writes no column: its results ride the split (`RankRows`)
ADVANTAGE = Stage("advantage", ("reward", "correct", "reward_failed", "sample", "num_tokens", "response_len",
                                "truncated"), ())


def rollout_writes(cfg: Any, scored: bool) -> tuple[str, ...]:
    """The columns of new rows from a rollout: the problem only when the rows go in unscored
    (the reward stage reads it then; scored here, nothing does); the routes where the rollout
    records them (`records_routes`: the actor reads them then); an episode's mask and
    environment outcome where the samples are episodes (`env.name`; scored here, only the mask)."""
    cols = tuple(c for c in ROLLOUT.writes if c != "problem") if scored else ROLLOUT.writes
    if records_routes(cfg):
        cols += ("routes",)
    if cfg.env.name:
        cols += ("response_mask",) if scored else ENV_COLUMNS
    return cols


def reward_reads(cfg: Any) -> tuple[str, ...]:
    """What the reward stage reads: with episodes also their environment's outcome."""
    return REWARD.reads + (("env_reward", "env_failed") if cfg.env.name else ())


def reference_writes(cfg: Any) -> tuple[str, ...]:
    """What the reference stage writes: the per-token logprobs for the actor's KL loss term
    (`algo.kl_mode=loss`), or the summed KL estimate for reward shaping (`kl_mode=reward`)."""
    return ("ref_logprobs",) if cfg.algo.kl_mode == "loss" else ("kl",)


def reference_reads(cfg: Any) -> tuple[str, ...]:
    """What the reference stage reads: with `algo.routing_replay_reference` also the routes,
    with episodes their masks (the summed KL of reward shaping counts sampled tokens only)."""
    return (REFERENCE.reads + (("routes",) if cfg.algo.routing_replay_reference else ())
            + (("response_mask",) if cfg.env.name else ()))


def advantage_reads(cfg: Any) -> tuple[str, ...]:
    """What the advantage stage reads: with KL reward shaping also each row's KL."""
    return ADVANTAGE.reads + (("kl",) if cfg.algo.kl_coef and cfg.algo.kl_mode == "reward" else ())


def actor_reads(cfg: Any) -> list[str]:
    """The columns an update reads (its rows' advantages and shaped rewards come with the split,
    `RankRows`)."""
    cols = ["prompt_ids", "response_ids", "behaviour_logprobs", "versions"]  # versions: the mismatch by lag
    if cfg.algo.kl_coef and cfg.algo.kl_mode == "loss":
        cols.append("ref_logprobs")
    if records_routes(cfg):
        cols.append("routes")
    if cfg.env.name:
        cols.append("response_mask")  # observation tokens take no loss
    return cols


def records_routes(cfg: Any) -> bool:
    """The rollout records its routes (`rollout.record_routes`, or routing replay or the expert
    balancer's rollout load needs them)."""
    return (cfg.rollout.record_routes or cfg.algo.routing_replay != "none"
            or (cfg.optim.expert_balance and cfg.optim.expert_balance_source == "rollout"))


def queue_config(group_size: int, capacity: int | None = None) -> QueueConfig:
    return QueueConfig(TRAJECTORY_COLUMNS, capacity=capacity, group_size=group_size)


def read_rows(queue: Any, consumer: str, columns: Sequence[str], rows: int | list[int], timeout: float,
              policy: str = "fifo") -> Batch | tuple:
    """A stage's read: `rows` a count (the first that many rows ready for `consumer`, by
    `policy`, a synchronous step's) or the row ids (StaleSync's batch). What arrived within
    `timeout` seconds — fewer rows than asked when it ran out; the caller says which stage
    waited."""
    try:
        if isinstance(rows, int):
            return queue.get(consumer, columns, rows, policy=policy, block=True, timeout=timeout)
        return queue.get_rows(consumer, rows, columns, timeout)
    except TimeoutError:
        return ()


def group_problem(task: Any, seed: int, group_id: int) -> Problem:
    """The problem of prompt group `group_id`: a pure function of the run's seed and the id, so
    whichever device (or the controller) samples it gets the same one, and a resumed run too."""
    return task.sample(random.Random(f"{seed}/{group_id}"))


@dataclass
class RowNumbers:
    """What the advantage stage knows of a sample: its numbers, never its tokens. It sets
    `reward` (KL-shaped, when shaping is on), `advantage` and `train` (kept for the update)."""

    row_id: int
    group_id: int
    sample: int
    reward: float
    correct: float
    num_tokens: int
    response_len: int
    truncated: bool
    reward_failed: bool = False
    kl: float = 0.0
    advantage: float = 0.0
    train: bool = True


@dataclass
class RankRows:
    """One data-parallel rank's share of an update, as the advantage stage's split carries it to
    the train devices: the rows the rank reads from the queue by id, and for each what the stage
    computed that no column holds — its advantage (GRPO, RLOO, REINFORCE++; 0 with GAE, whose
    per-token advantages the critic computes) and its reward after KL shaping (GAE's reward)."""

    row_ids: list[int]
    advantages: list[float]
    rewards: list[float]

    @classmethod
    def of(cls, rows: Sequence[RowNumbers]) -> "RankRows":
        return cls([r.row_id for r in rows], [r.advantage for r in rows], [r.reward for r in rows])

    def fill(self, trajs: Sequence[Trajectory]) -> None:
        """Each trajectory's `advantage` and `reward`, by its row id."""
        at = {r: i for i, r in enumerate(self.row_ids)}
        for t in trajs:
            t.advantage, t.reward = self.advantages[at[t.row_id]], self.rewards[at[t.row_id]]


_GETTERS: dict[str, Callable[[Any], Any]] = {
    "routes": lambda t: [] if t.routes is None else torch.as_tensor(t.routes).reshape(-1),
    "response_mask": lambda t: t.sampled,
    "env_failed": lambda t: int(t.env_failed),
    "response_len": lambda t: len(t.response_ids),
    "truncated": lambda t: int(t.finish_reason == "length"),
    "reward_failed": lambda t: int(t.reward_failed),
}


def trajectory_columns(trajs: Sequence[Any], names: Sequence[str]) -> dict[str, list[Any]]:
    """The named fields of each trajectory (or `RowNumbers`), as queue columns."""
    return {n: [_GETTERS[n](t) if n in _GETTERS else getattr(t, n) for t in trajs] for n in names}


def to_trajectories(batch: Batch) -> list[Trajectory]:
    """`Trajectory` objects holding whatever columns `batch` carries (others keep their
    defaults, empty for the rollout fields), in batch order."""
    cols = batch.columns
    fields = {f.name for f in dataclasses.fields(Trajectory)}
    out = []
    for i, group in enumerate(batch.group_ids):
        kw: dict[str, Any] = {n: v[i] for n, v in cols.items() if n in fields}
        t = Trajectory(group_id=group, problem=kw.pop("problem", None), prompt_ids=kw.pop("prompt_ids", []),
                       response_ids=kw.pop("response_ids", []), behaviour_logprobs=kw.pop("behaviour_logprobs", []),
                       versions=kw.pop("versions", []), finish_reason=kw.pop("finish_reason", ""), **kw)
        t.row_id = batch.row_ids[i]
        out.append(t)
    return out


def to_numbers(batch: Batch) -> list[RowNumbers]:
    """The advantage stage's read (`advantage_reads`) as `RowNumbers`, in batch order."""
    c = batch.columns
    return [RowNumbers(r, g, c["sample"][i], c["reward"][i], c["correct"][i], c["num_tokens"][i],
                       c["response_len"][i], bool(c["truncated"][i]), reward_failed=bool(c["reward_failed"][i]),
                       kl=c["kl"][i] if "kl" in c else 0.0)
            for i, (r, g) in enumerate(zip(batch.row_ids, batch.group_ids))]
