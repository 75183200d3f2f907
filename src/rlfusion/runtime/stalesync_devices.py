"""The runtime's side of StaleSync's schedule (`rlfusion.stalesync.schedule`): its devices
protocol over `devices.Devices`, in wall time. Commands carry group ids and row ids; the
samples stay on the devices and in the queue."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlfusion.runtime.devices import Devices, GroupRollout
from rlfusion.stalesync.book import Group, batch_rows
from rlfusion.stalesync.rules import RolloutPlan
from rlfusion.stalesync.schedule import RolloutOutcome, UpdateOutcome


@dataclass
class _Running:
    rollout: GroupRollout
    launched: float  # perf_counter


class RuntimeScheduleDevices:
    """`ScheduleDevices` over the run's device workers. `late`: with hybrid placement, the rollout
    devices that also train (they join an overlapped rollout after their update)."""

    def __init__(self, devices: Devices, hybrid: bool):
        self.devices = devices
        plan = devices.plan
        self.rollout_devices = len(plan.rollout)
        self.late = tuple(i for i, d in enumerate(plan.rollout) if d in plan.train) if hybrid else ()
        self.last_sync_s = 0.0  # the last `sync_weights`

    def start_rollout(self, plan: RolloutPlan, parts: list[list], defer_late: bool) -> _Running:
        defer = tuple(self.devices.plan.rollout[i] for i in self.late) if defer_late else ()
        launched = time.perf_counter()
        return _Running(self.devices.start_groups(parts, plan.version, plan.quota, plan.due, plan.drop, defer=defer),
                        launched)

    def wait(self, running: _Running) -> RolloutOutcome:
        out = running.rollout.wait()
        return RolloutOutcome(out["reports"], out["dropped"], out["generated_tokens"],
                              time.perf_counter() - running.launched)

    def update(self, groups: list[Group], join: _Running | None = None) -> UpdateOutcome:
        """The groups' rows, scored now by the scoring devices where the rollout devices did not
        score them, then the update (`learn`)."""
        rows = batch_rows(groups)
        if not self.devices.score_here:
            self.devices.score(rows)
        metrics, start = learn(self.devices, rows, join.rollout if join is not None else None)
        busy = start + metrics["time_update_s"] - join.launched if join is not None else 0.0
        return UpdateOutcome(metrics, busy)

    def sync_weights(self) -> None:
        start = time.perf_counter()
        self.devices.sync_rollout_weights()
        self.last_sync_s = time.perf_counter() - start


def learn(devices: Devices, rows: int | list[int], join: GroupRollout | None = None) -> tuple[dict[str, float], float]:
    """The update from scored rows in the queue (a count, or StaleSync's row ids): advantages,
    the data-parallel split, the step and the rows' retirement all run on the train devices
    (`Devices.update`); the controller gets the batch's aggregates back. Returns the metrics and
    when the update began (perf_counter). `join`: a running rollout the train devices join once
    the update is done (hybrid placement; the weight sync then waits for that rollout's end)."""
    start = time.perf_counter()
    if join is None:
        metrics = devices.update(rows)
    else:
        finish = devices.start_update(rows)
        join.launch([d for d in devices.plan.train if d in join.calls], devices.version + 1)
        metrics = finish()
    seconds = time.perf_counter() - start
    metrics["update_tokens_per_s"] = metrics.pop("update_tokens") / max(seconds, 1e-9)
    metrics["time_update_s"] = seconds
    if not devices.plan.colocated_actor and join is None:
        metrics["time_weight_sync_s"] = devices.last_sync_s
    return metrics, start

