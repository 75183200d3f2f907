"""What the roles of one device (generator, scorer, learner; `workers.DeviceWorker` hosts them)
share: `RoleContext` — the device, its plan and run config, its torch device and compute
precision, its one `DeviceSwitch`, its one queue client — and `SpanLog`, its timeline of work
since the last report. Neither knows which roles exist.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime.dataflow import trajectory_columns
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.train_config import TrainConfig

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # `deploy.precision` → autocast dtype (None: off)


class SpanLog:
    """(phase, wall start, wall end) per span of the device's work, until `take` hands them over."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.spans.append((phase, start, time.time()))

    def add(self, phase: str, start: float, end: float) -> None:
        self.spans.append((phase, start, end))

    def take(self) -> list[tuple[str, float, float]]:
        spans, self.spans = self.spans, []
        return spans


@dataclass
class RoleContext:
    """One device as its roles see it. `queue`: the run's DistQueue client (the in-process
    queue with the local backend, the Ray one's client in a Ray worker); `compute_dtype`: every
    role's passes run under autocast to it (`deploy.precision`; None = fp32)."""

    device: int
    plan: DeploymentPlan
    cfg: TrainConfig
    where: torch.device
    compute_dtype: torch.dtype | None
    switch: DeviceSwitch
    queue: Any
    spans: SpanLog
    queue_moved: dict[str, int] = field(default_factory=dict)  # the client's byte counters at the last report

    def take_queue_bytes(self) -> dict[str, float]:
        """The bytes this device's queue client moved since the last call: to and from storage
        ("queue_bytes") and the part that crossed a process boundary ("queue_remote_bytes"; a
        device's own rows move in process)."""
        out = {}
        for name, attr in (("queue_bytes", "wire_bytes"), ("queue_remote_bytes", "remote_bytes")):
            moved = getattr(self.queue, attr, 0)
            out[name], self.queue_moved[name] = moved - self.queue_moved.get(name, 0), moved
        return out

    def put_new(self, trajs: list[Trajectory], columns: tuple[str, ...]) -> list[int]:
        """`trajs` as new queue rows holding `columns` (`dataflow.trajectory_columns`), each with
        its group id and its oldest token's policy version; their row ids."""
        if not trajs:
            return []
        with self.spans.span("queue"):
            return self.queue.put(trajectory_columns(trajs, columns), group_ids=[t.group_id for t in trajs],
                                  versions=[min(t.versions, default=0) for t in trajs])
