"""StaleSync's step, written once: what runs in which order, over a small devices protocol
(`ScheduleDevices`). The runtime implements the protocol with its device workers in real time
(`runtime/stalesync_devices.py`), the simulator with simulated clocks over the engine's
scheduler (`sim/rl_stalesync.py`); both run this code.

    co-located (no overlap):   rollout(k, for k) ─ take batch k ─ update k
    separated / hybrid, s ≥ 1: [fill: rollout(k, for k) ─ take batch k]
                               rollout(k, for k+1) ‖ update k ─ (hybrid: the train devices
                               join the rollout after their update) ─ wait ─ (hybrid: weights
                               to the early devices) ─ take batch k+1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfusion.stalesync.book import Group, GroupReport, StalenessBook
from rlfusion.stalesync.rules import JOIN_SHARE, RolloutPlan, assign_groups, assign_hybrid, join_share


@dataclass
class RolloutOutcome:
    """What a rollout's devices answered, and how long it ran from its launch (seconds on the
    devices' clock: wall time in the runtime, simulated time in the simulator)."""

    reports: list[GroupReport]
    dropped: list[int]
    generated_tokens: int
    seconds: float


@dataclass
class UpdateOutcome:
    """An update's metrics (`trained`: whether the weights changed) and how long the train
    devices were busy from the launch of the rollout it overlaps (hybrid's `join_share` reads it)."""

    metrics: dict[str, float]
    busy_s: float = 0.0


class ScheduleDevices(Protocol):
    """What the schedule drives. `late` are the rollout devices (indices) that join an overlapped
    rollout after their update (hybrid placement's train devices); `rollout_devices` how many
    rollout devices there are."""

    rollout_devices: int
    late: tuple[int, ...]

    def start_rollout(self, plan: RolloutPlan, parts: list[list], defer_late: bool) -> Any:
        """Launch `plan` with `parts[i]` on rollout device i (non-blocking); with `defer_late`
        the late devices start once their update is done (`update(join=...)`)."""

    def wait(self, rollout: Any) -> RolloutOutcome:
        """The rollout's merged answer, once every device stopped."""

    def update(self, groups: list[Group], join: Any = None) -> UpdateOutcome:
        """Score (where the rollout devices did not) and train the groups' rows; with `join`, the
        late devices then join that rollout with the new weights."""

    def sync_weights(self) -> None:
        """Hybrid: the new weights to the devices that generated with the old ones."""


@dataclass
class StepOutcome:
    """One update's step: the book's batch statistics, the update, the rollouts it ran (the fill
    included) and what the rollouts generated."""

    stats: dict[str, float]
    update: UpdateOutcome
    rollouts: list[RolloutOutcome] = field(default_factory=list)
    fill: bool = False  # this step ran the pipeline fill first

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.rollouts)

    @property
    def dropped_groups(self) -> int:
        return sum(len(r.dropped) for r in self.rollouts)


class StaleSyncSchedule:
    """The step of StaleSync over `devices` (`ScheduleDevices`): the book's plans, the spread of
    groups over the rollout devices, the pipeline fill and overlap, hybrid placement's join and
    its share of new groups. `overlap`: the next update's rollout runs alongside this update."""

    def __init__(self, book: StalenessBook, devices: ScheduleDevices, overlap: bool, hybrid: bool):
        self.book, self.devices, self.overlap, self.hybrid = book, devices, overlap, hybrid
        self.share = JOIN_SHARE  # hybrid: the late devices' share of an overlapped rollout's new groups
        self.pending: tuple[list[Group], dict[str, float]] | None = None  # the batch the next update trains

    def step(self, version: int) -> StepOutcome:
        """The update from `version` to `version + 1` and the rollouts it needs."""
        book, rollouts, fill = self.book, [], False
        if self.overlap and self.pending is None:  # pipeline fill: nothing to learn from yet
            rollouts.append(self._wait(self._start(version, version)))
            self.pending, fill = book.take_batch(version), True
        if not self.overlap:
            rollouts.append(self._wait(self._start(version, version)))
            batch, stats = book.take_batch(version)
            return StepOutcome(stats, self.devices.update(batch), rollouts, fill)
        batch, stats = self.pending
        running = self._start(version, version + 1, reserved=len(batch), defer_late=self.hybrid)
        update = self.devices.update(batch, join=running if self.hybrid else None)
        rolled = self._wait(running)
        rollouts.append(rolled)
        if self.hybrid:
            if update.metrics.get("trained", 1.0):  # every device generated: now the weights move
                self.devices.sync_weights()
            late = len(self.devices.late)
            self.share = join_share(rolled.seconds, update.busy_s, self.devices.rollout_devices - late, late)
        self.pending = book.take_batch(version + 1)
        return StepOutcome(stats, update, rollouts, fill)

    def in_flight(self) -> int:
        """Groups admitted and not trained, the batch waiting for the next update included."""
        return len(self.book.groups) + (len(self.pending[0]) if self.pending else 0)

    def _wait(self, running: Any) -> RolloutOutcome:
        """The rollout's answer, taken into the book."""
        out = self.devices.wait(running)
        self.book.collect(out.reports, out.dropped)
        return out

    def _start(self, version: int, update_version: int, reserved: int = 0, defer_late: bool = False) -> Any:
        """Launch the partial rollout the book plans (weights `version`, for the update of
        `update_version`); with `defer_late` the late devices get a share of the new groups
        (`assign_hybrid`) and join after their update."""
        plan = self.book.plan(version, update_version, reserved)
        n = self.devices.rollout_devices
        if defer_late:
            parts = assign_hybrid(plan.items, [i in self.devices.late for i in range(n)], self.share)
        else:
            parts = assign_groups(plan.items, n)
        return self.devices.start_rollout(plan, parts, defer_late)

    # ---- checkpoint ----

    def state_dict(self) -> dict[str, Any]:
        return {"book": self.book.state_dict(), "pending": self.pending, "join_share": self.share}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.book.load_state_dict(state["book"])
        self.pending = state["pending"]
        self.share = state.get("join_share", self.share)
