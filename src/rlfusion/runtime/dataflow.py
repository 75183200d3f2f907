"""The RL dataflow as DistQueue traffic: one queue row per sampled response, one column per field
a stage adds, and which columns each stage reads and writes.

    rollout    (device)  ─put─► problem prompt_ids response_ids behaviour_logprobs versions
                                finish_reason sample num_tokens response_len truncated
    reward     (device)  get(problem, response_ids)                 ─put─► reward correct
    reference  (device)  get(prompt_ids, response_ids, behaviour_logprobs) ─put─► ref_logprobs kl
    advantage  (first train device)  get(reward correct kl sample num_tokens response_len
                                         truncated) ─put─► advantage shaped_reward train
    actor      (device)  get_rows(prompt_ids response_ids behaviour_logprobs advantage|shaped_reward
                                  [ref_logprobs]) ─► update; the first train device then retires
                                  the rows

The controller reads and writes no row: every stage runs on the devices. A stage reads only the
columns it needs and writes only the ones it produces.
`Trajectory` is the stages' working form of a row: `to_trajectories` and `trajectory_columns`
translate.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
    ColumnSpec("advantage", "float64"),
    ColumnSpec("shaped_reward", "float64"),  # the reward after KL shaping (what GAE uses)
    ColumnSpec("train", "int8"),  # 1 = kept for the update (dynamic sampling may drop a group)
)


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
ADVANTAGE = Stage("advantage", ("reward", "correct", "reward_failed", "sample", "num_tokens", "response_len",
                                "truncated"),
                  ("advantage", "shaped_reward", "train"))


def advantage_reads(cfg: Any) -> tuple[str, ...]:
    """What the advantage stage reads: with KL reward shaping also each row's KL."""
    return ADVANTAGE.reads + (("kl",) if cfg.algo.kl_coef and cfg.algo.kl_mode == "reward" else ())


def actor_reads(cfg: Any) -> list[str]:
    """The columns an update reads: GAE (PPO with a critic) needs the reward, not an advantage."""
    cols = ["prompt_ids", "response_ids", "behaviour_logprobs"]
    cols.append("shaped_reward" if cfg.algo.advantage == "gae" else "advantage")
    if cfg.algo.kl_coef and cfg.algo.kl_mode == "loss":
        cols.append("ref_logprobs")
    return cols


def queue_config(group_size: int, capacity: int | None = None) -> QueueConfig:
    return QueueConfig(TRAJECTORY_COLUMNS, capacity=capacity, group_size=group_size)


def group_problem(task: Any, seed: int, group_id: int) -> Problem:
    """The problem of prompt group `group_id`: a pure function of the run's seed and the id, so
    whichever device (or the controller) samples it gets the same one, and a resumed run too."""
    return task.sample(random.Random(f"{seed}/{group_id}"))


@dataclass
class RowNumbers:
    """What the advantage stage knows of a sample: its numbers, never its tokens. It sets
    `reward` (KL-shaped, when shaping is on), `advantage` and `train`."""

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


_GETTERS: dict[str, Callable[[Any], Any]] = {
    "train": lambda t: int(t.train),
    "shaped_reward": lambda t: t.reward,
    "response_len": lambda t: len(t.response_ids),
    "truncated": lambda t: int(t.finish_reason == "length"),
    "reward_failed": lambda t: int(t.reward_failed),
}


def trajectory_columns(trajs: Sequence[Any], names: Sequence[str]) -> dict[str, list[Any]]:
    """The named fields of each trajectory (or `RowNumbers`), as queue columns."""
    return {n: [_GETTERS[n](t) if n in _GETTERS else getattr(t, n) for t in trajs] for n in names}


def to_trajectories(batch: Batch) -> list[Trajectory]:
    """`Trajectory` objects holding whatever columns `batch` carries (others keep their
    defaults, empty for the rollout fields), in batch order. A `shaped_reward` column becomes
    the reward (what the update's loss sees)."""
    cols = batch.columns
    fields = {f.name for f in dataclasses.fields(Trajectory)}
    out = []
    for i, group in enumerate(batch.group_ids):
        kw: dict[str, Any] = {n: v[i] for n, v in cols.items() if n in fields}
        t = Trajectory(group_id=group, problem=kw.pop("problem", None), prompt_ids=kw.pop("prompt_ids", []),
                       response_ids=kw.pop("response_ids", []), behaviour_logprobs=kw.pop("behaviour_logprobs", []),
                       versions=kw.pop("versions", []), finish_reason=kw.pop("finish_reason", ""), **kw)
        if "shaped_reward" in cols:
            t.reward = cols["shaped_reward"][i]
        t.train = bool(t.train)
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
