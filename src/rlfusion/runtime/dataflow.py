"""The RL dataflow as DistQueue traffic: one queue row per sampled response, one column per field
a stage adds, and the step that moves rows from stage to stage.

    rollout ─put─► [problem prompt_ids response_ids behaviour_logprobs versions finish_reason]
    reward     get(problem, response_ids)            ─put─► reward, correct
    reference  get(prompt_ids, response_ids)         ─put─► ref_logprobs           (with a KL term)
    critic     get(prompt_ids, response_ids)         ─put─► values                 (PPO)
    advantage  get(reward, ..., policy="group")      ─put─► advantage | token_advantages + returns, train
    actor      get(everything the update needs)      ─► update; rows retired once the actor has them

A stage reads only the columns it needs and writes only the ones it produces, so the stages can
live in other processes (the Ray backend) or run concurrently (StaleSync) without change. The
stage objects in `stages.py` still work on `Trajectory` lists; `to_trajectories` and
`trajectory_columns` translate. Nothing here knows how the stages are placed or scheduled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlfusion.queue import Batch, ColumnSpec, QueueConfig
from rlfusion.rl.trajectory import Trajectory

TRAJECTORY_COLUMNS: tuple[ColumnSpec, ...] = (
    ColumnSpec("problem", "object"),
    ColumnSpec("prompt_ids", "int32", variable_length=True),
    ColumnSpec("response_ids", "int32", variable_length=True),
    ColumnSpec("behaviour_logprobs", "float32", variable_length=True),
    ColumnSpec("versions", "int64", variable_length=True),  # policy version of each response token
    ColumnSpec("finish_reason", "object"),
    ColumnSpec("reward", "float64"),
    ColumnSpec("correct", "float64"),  # the task score, before any shaping
    ColumnSpec("ref_logprobs", "float32", variable_length=True),
    ColumnSpec("values", "float32", variable_length=True),
    ColumnSpec("advantage", "float64"),
    ColumnSpec("token_advantages", "float32", variable_length=True),
    ColumnSpec("returns", "float32", variable_length=True),
    ColumnSpec("train", "int8"),  # 1 = kept for the update (dynamic sampling may drop a group)
)
ROLLOUT_COLUMNS = ("problem", "prompt_ids", "response_ids", "behaviour_logprobs", "versions", "finish_reason")


def queue_config(group_size: int, capacity: int | None = None) -> QueueConfig:
    return QueueConfig(TRAJECTORY_COLUMNS, capacity=capacity, group_size=group_size)


def trajectory_columns(trajs: Sequence[Trajectory], names: Sequence[str]) -> dict[str, list[Any]]:
    """The named fields of each trajectory, as queue columns."""
    getters: dict[str, Callable[[Trajectory], Any]] = {
        "correct": lambda t: t.metrics["correct"], "train": lambda t: int(t.metrics.get("train", 1))}
    return {n: [getters[n](t) if n in getters else getattr(t, n) for t in trajs] for n in names}


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
        for extra in ("correct", "train"):
            if extra in cols:
                t.metrics[extra] = cols[extra][i]
        out.append(t)
    return out


class QueueDataflow:
    """The synchronous loop's side of the queue: puts rollouts, runs one stage at a time over
    the rows, retires finished rows, and keeps the seconds spent on queue traffic (gets, puts
    and the row <-> trajectory translation, not the stages' own work) in `overhead_s`."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.overhead_s = 0.0

    def put_rollouts(self, trajs: Sequence[Trajectory]) -> list[int]:
        """New rows, one per trajectory; a row's version is the oldest policy version among its tokens."""
        t0 = time.perf_counter()
        ids = self.queue.put(trajectory_columns(trajs, ROLLOUT_COLUMNS), group_ids=[t.group_id for t in trajs],
                             versions=[min(t.versions, default=0) for t in trajs])
        self.overhead_s += time.perf_counter() - t0
        return ids

    def run_stage(self, consumer: str, needs: Sequence[str], produces: Sequence[str], count: int,
                  work: Callable[[list[Trajectory]], Any], policy: str = "fifo") -> tuple[list[Trajectory], Any]:
        """Take `count` rows with `needs` ready, run `work` on them as trajectories, write back
        `produces`. Returns the trajectories and what `work` returned."""
        t0 = time.perf_counter()
        batch = self.queue.get(consumer, needs, count, policy)
        if len(batch) != count:
            raise RuntimeError(f"stage {consumer!r} expected {count} ready rows, the queue had {len(batch)}")
        trajs = to_trajectories(batch)
        t1 = time.perf_counter()
        result = work(trajs)
        t2 = time.perf_counter()
        if produces:
            self.queue.put(trajectory_columns(trajs, produces), row_ids=batch.row_ids)
        self.overhead_s += (t1 - t0) + (time.perf_counter() - t2)
        return trajs, result

    def retire_done(self, last_consumer: str) -> int:
        t0 = time.perf_counter()
        done = self.queue.clear_consumed([last_consumer])
        self.overhead_s += time.perf_counter() - t0
        return len(done)
