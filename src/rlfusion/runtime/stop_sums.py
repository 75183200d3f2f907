"""The partial rollout's stop rule summed over the rollout devices (`StopSums`), which every
rollout device of a StaleSync rollout calls from `RolloutStage.run_groups`."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def no_stop_sync() -> dict[str, float]:
    return {"stop_sync_calls": 0.0, "stop_sync_s": 0.0}


class StopSums:
    """The stop rule's counts summed over the rollout devices (an all-reduce of 4 integers).
    Lock-step (`polled=False`): every call waits for the sums, so the devices meet there.
    Polled: a call posts this device's counts (when no sum is in flight) and returns the sums of
    the one in flight once every device posted, else None — the device decodes on meanwhile;
    `wait` (nothing left to run here) waits for them. Every device gets the same sums from the
    same all-reduce and decides the stop on them alone, so they all stop after the same one and
    none is left in flight. Hybrid placement polls: its train devices join a rollout only after
    their update, while the others have long been decoding."""

    def __init__(self, group: Any, stats: dict[str, float], polled: bool):
        self.group, self.stats, self.polled = group, stats, polled
        self.work: Any = None
        self.counts: torch.Tensor | None = None

    @property
    def pending(self) -> bool:
        return self.work is not None

    def __call__(self, *counts: int, wait: bool = False) -> list[int] | None:
        if self.work is None:
            self.counts = torch.tensor(counts, dtype=torch.int64)
            self.work = dist.all_reduce(self.counts, group=self.group, async_op=True)
            self.stats["stop_sync_calls"] += 1
        if self.polled and not wait and not self.work.is_completed():
            return None
        start = time.perf_counter()
        self.work.wait()
        self.stats["stop_sync_s"] += time.perf_counter() - start  # waiting for the peers included
        self.work = None
        return self.counts.tolist()
