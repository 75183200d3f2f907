"""The controller's one interface to the device workers: `Devices`. The controller calls it
explicitly — rollout, score, update, weight sync, evaluate, state, per-step reports — and it
sends each command to the devices whose roles run it, with group ids and row counts, never samples:
the samples move between the devices through the DistQueue.

    LocalDevices   one `DeviceWorker` in the controller's process (`deploy.backend=local`),
                   the in-process queue; the same commands, switch and memory ledger
    RayDevices     one Ray actor per device (`ray_devices.py`), the Ray queue (metadata in a
                   controller actor, each row's data in the device worker that made it)

The two differ only in how a command reaches a worker (`_start` / `_wait`).
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
import time
from typing import Any

import torch

from rlfusion.model import lora
from rlfusion.model.files import load_weights_into
from rlfusion.obs.metrics import NumberUnpacker
from rlfusion.obs.timeline import unpack_spans
from rlfusion.queue import DistQueue
from rlfusion.queue.controller import row_runs
from rlfusion.runtime.dataflow import queue_config
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.stalesync.book import unpack_reports
from rlfusion.stalesync.rules import contiguous_parts as split, pack_items
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.device_binding import local_device
from rlfusion.runtime.workers import DeviceWorker


class Devices(ABC):
    """Commands to the device workers of `plan`. `version` is the policy version (updates so
    far): the one counter of the run (each command that changes it carries it to the devices).
    `driver_bytes` counts what the step's commands and their answers carried across the
    controller (Ray backend; 0 in process)."""

    def __init__(self, cfg: TrainConfig, plan: DeploymentPlan, queue: Any):
        self.cfg, self.plan, self.queue = cfg, plan, queue
        self.version = 0
        self.score_here = all(dev in plan.reward and dev in plan.reference for dev in plan.rollout)
        self.peer_scored = 0  # last rollout: samples scored by a device that did not generate them
        self.weight_sync_bytes = 0
        self.last_sync_s = 0.0  # separated: the broadcast, including waiting for a running rollout
        self.count_bytes = False
        self.driver_bytes = 0  # this step's commands and answers (see `take_driver_bytes`)
        self._unpackers: dict[tuple[int, str], NumberUnpacker] = {}  # the devices' packed answers

    # ---- how a command reaches a worker (the backends differ only here) ----

    @abstractmethod
    def _start(self, device: int, method: str, *args: Any) -> Any:
        """Begin `method(*args)` on `device`; a handle `_wait` resolves."""

    @abstractmethod
    def _wait(self, handles: list[Any]) -> list[Any]:
        """The answers of started commands, in order."""

    def _run(self, calls: list[tuple[int, str, tuple]], kind: str = "step") -> list[Any]:
        """Run `calls` (device, method, args) on their devices at once; their answers in order."""
        return self._counted(self._wait([self._start(d, m, *self._counted(a, kind)) for d, m, a in calls]), kind)

    def _counted(self, obj: Any, kind: str) -> Any:
        """`obj`, its pickled size added to `driver_bytes` when it is a step's command or answer
        (state and setup calls are not counted: sizing a checkpoint would pickle it twice)."""
        if self.count_bytes and kind == "step":
            self.driver_bytes += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return obj

    def take_driver_bytes(self) -> int:
        """Bytes the controller sent and received since the last call: commands and answers,
        plus its own queue traffic (none: the devices read and write every row)."""
        out = self.driver_bytes + self.queue.wire_bytes + getattr(self.queue, "meta_bytes", 0)
        self.driver_bytes = 0
        self.queue.wire_bytes = 0
        if hasattr(self.queue, "meta_bytes"):
            self.queue.meta_bytes = 0
        return out

    # ---- the step ----

    def rollout(self, group_ids: list[int], version: int) -> int:
        """Generate `group_size` samples per group on the rollout devices (contiguous parts of
        the groups), scored on the way where reward and reference live there, else by the
        scoring devices (`score`); every row ends up in the queue with its reward (and reference
        logprobs). With `deploy.share_scoring` and several rollout devices that score, the rows
        go in as they finish and any of those devices scores them (`Scorer.score_shared`), so one
        device's long tail overlaps the scoring of its finished samples on another. Returns the
        tokens generated."""
        plan = self.plan
        share = self.score_here and self.cfg.deploy.share_scoring and len(plan.rollout) > 1
        step = row_runs(group_ids) if share else ()  # the step's groups, as runs of consecutive ids
        calls = [(dev, "generate", (part, version, self.score_here, step))
                 for dev, part in zip(plan.rollout, split(group_ids, len(plan.rollout)))
                 if part or plan.train_layout or plan.infer_ep > 1 or share]
        # a layout's switch is collective, and a lock-step engine steps with its group: every device joins
        outs = self._run(calls)
        self.peer_scored = sum(o["peer_rows"] for o in outs)
        if not self.score_here:
            self.score(len(group_ids) * self.cfg.rollout.group_size)
        return sum(o["generated_tokens"] for o in outs)

    def score(self, rows: int | list[int]) -> None:
        """Reward and reference for rows that are (or are about to be) in the queue, on the
        scoring devices — `rows`: a count (a synchronous step's, the first that many) or the row
        ids (StaleSync's batch): the first reward device scores all, the reference devices split
        the rows. Each waits for its rows to be ready."""
        plan = self.plan
        reference = list(plan.reference) if self.cfg.algo.kl_coef else []
        ids = list(range(rows)) if isinstance(rows, int) else rows
        # no KL term: no reference pass, the reward device alone
        parts = dict(zip(reference, split(ids, len(reference)))) if reference else {}
        if isinstance(rows, int):
            parts = {d: len(p) for d, p in parts.items()}
        else:  # row ids cross as runs of consecutive ids
            rows, parts = row_runs(rows), {d: row_runs(p) for d, p in parts.items()}
        devices = sorted({plan.reward[0], *reference})
        self._run([(d, "score", (rows if d == plan.reward[0] else 0, parts.get(d, 0))) for d in devices])

    def start_groups(self, parts: list[list], version: int, quota: int, due: set[int], drop_overdue: bool,
                     defer: tuple[int, ...] = ()) -> "GroupRollout":
        """StaleSync's partial rollout of `parts[i]` (`stalesync.GroupItem`s) on rollout device i
        (non-blocking), stopping
        once `quota` groups finished over all devices and the `due` ones are done. The devices in
        `defer` (hybrid placement's train devices, busy with the update) are not started: the
        returned `GroupRollout` starts them with `launch`, and its `wait` merges the results."""
        rollout = GroupRollout(self, quota, drop_overdue)
        coordinated = len(self.plan.rollout) > 1  # every rollout device joins the stop-rule sums
        for dev, part in zip(self.plan.rollout, parts):
            if part or coordinated:
                mine = due & {it.group_id for it in part}
                rollout.calls[dev] = (part, mine)
        rollout.launch([d for d in rollout.calls if d not in defer], version)
        return rollout

    def start_update(self, rows: int | list[int]) -> Any:
        """`update` without the wait or the weight sync: starts the update on the train devices and
        returns the function that waits for it, moves the version on and returns its metrics."""
        wire = rows if isinstance(rows, int) else row_runs(rows)  # row ids cross as runs of consecutive ids
        handles = [self._start(dev, "update", *self._counted((wire, self.version), "step")) for dev in self.plan.train]

        def wait() -> dict[str, float]:
            metrics = self._unpack(self.plan.train[0], "update", self._counted(self._wait(handles), "step")[0])
            self.version += 1
            return metrics
        return wait

    def update(self, rows: int | list[int]) -> dict[str, float]:
        """One synchronous update on the train devices from scored rows in the queue — a count
        (the first that many) or the row ids (StaleSync's batch) — (`DeviceWorker.update`: the advantage stage and the data-parallel split run on
        the first train device); the policy version moves on whether or not a row was kept. In
        separated mode new weights then go to the rollout devices. Returns the first train
        device's answer: the batch's aggregates and the update's metrics."""
        metrics = self.start_update(rows)()
        if metrics["trained"]:
            self.sync_rollout_weights()
        return metrics

    def sync_rollout_weights(self) -> None:
        """The new weights to the rollout devices that do not train (bucketed broadcast)."""
        if not self.plan.colocated_actor:
            start = time.perf_counter()
            # separated: every train device sends its shards' pieces; hybrid: the first broadcasts
            group = sorted({*(self.plan.train if self.plan.separated else self.plan.train[:1]), *self.plan.rollout})
            self.weight_sync_bytes = self._run([(dev, "sync_weights", ()) for dev in group])[0]
            self.last_sync_s = time.perf_counter() - start

    def evaluate(self, indices: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        """Greedy (reward, response length) per held-out problem, data-parallel over the rollout
        devices."""
        parts = split(indices, len(self.plan.rollout))
        calls = [(dev, "evaluate", (part, max_new_tokens)) for dev, part in zip(self.plan.rollout, parts)
                 if part or self.plan.train_layout or self.plan.infer_ep > 1]
        return [r for out in self._run(calls) for r in out]

    def reports(self) -> dict[int, dict[str, Any]]:
        """Each device's report since the last call (`DeviceWorker.report`): `spans` (phase,
        wall start, wall end), `engine` (the rollout engine's counts; empty without one),
        `memory` (`peaks` per phase, on CUDA `allocator_peaks` too, `zero_redundancy`, `offloads`,
        `restores`, `engine_loads`) and `queue_bytes`."""
        out = {}
        for d, (spans, numbers) in enumerate(self._run([(d, "report", ()) for d in range(self.plan.num_devices)])):
            report: dict[str, Any] = {"spans": unpack_spans(spans), "engine": {}, "memory": {"peaks": {}}}
            for name, value in self._unpack(d, "report", numbers).items():
                *path, key = name.split("/")
                node = report
                for part in path:
                    node = node.setdefault(part, {})
                node[key] = value
            out[d] = report
        return out

    def _unpack(self, device: int, channel: str, packed: Any) -> dict[str, float]:
        """A device's packed numbers (`NumberPacker`) on one of its channels."""
        unpacker = self._unpackers.setdefault((device, channel), NumberUnpacker())
        return unpacker.unpack(packed)

    # ---- state ----

    def pull_weights(self, model: torch.nn.Module) -> None:
        """The trained state into `model`: every weight, or with LoRA its adapters."""
        load_weights_into(model, self.on_train_devices("weights"), "the train devices' weights",
                          part=lora.trained_part(model))

    def on_train_devices(self, method: str) -> Any:
        """The first train device's answer to `weights` or `state`, whole tensors that every train
        device could give. In a training layout gathering them is collective, so every train
        device joins, but only the first keeps and returns the whole tensors (`keep=False`
        elsewhere: one gathered tensor at a time, never the whole state on every device)."""
        first, *others = self.plan.train if self.plan.train_layout else self.plan.train[:1]
        return self._run([(first, method, ())] + [(d, method, (False,)) for d in others], kind="state")[0]

    def state(self) -> dict[str, Any]:
        """Policy weights, optimizer state and version, whole."""
        return self.on_train_devices("state")

    def load_state(self, state: dict[str, Any]) -> None:
        self._run([(d, "load_state", (state,)) for d in range(self.plan.num_devices)], kind="state")
        self.version = state["version"]

    def critic_state(self) -> dict[str, Any]:
        return self._run([(self.plan.train[0], "critic_state", ())], kind="state")[0]

    def load_critic_state(self, state: dict[str, Any]) -> None:
        self._run([(d, "load_critic_state", (state,)) for d in self.plan.train], kind="state")

    def rng_state(self) -> list[torch.Tensor]:
        return self._run([(d, "rng_state", ()) for d in self.plan.rollout], kind="state")

    def paused(self) -> list[dict]:
        """Each rollout device's paused StaleSync requests: the samples it holds and their cache
        rows (`resume_kv=keep`)."""
        return self._run([(d, "paused", ()) for d in self.plan.rollout], kind="state")

    def load_paused(self, states: list[dict]) -> None:
        if len(states) != len(self.plan.rollout):
            raise ValueError(f"paused requests of {len(states)} rollout devices, the run has {len(self.plan.rollout)}")
        self._run([(d, "load_paused", (st,)) for d, st in zip(self.plan.rollout, states)], kind="state")

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.plan.rollout):
            raise ValueError(f"engine RNG states of {len(states)} rollout devices, this run has {len(self.plan.rollout)}")
        self._run([(d, "set_rng_state", (s,)) for d, s in zip(self.plan.rollout, states)], kind="state")

    def shutdown(self) -> None:
        pass


class GroupRollout:
    """One partial rollout over the rollout devices (`Devices.start_groups`): the calls of the
    devices started so far, `launch` for the deferred ones, `wait` for the merged result."""

    def __init__(self, devices: Devices, quota: int, drop_overdue: bool):
        self.devices, self.quota, self.drop_overdue = devices, quota, drop_overdue
        self.calls: dict[int, tuple[list, set[int]]] = {}  # device: (its groups, its due ones)
        self.handles: list[Any] = []
        self.launched: list[int] = []  # the device of each handle

    def launch(self, devices: list[int], version: int) -> None:
        """Start the rollout on `devices`, generating with weights `version` (a train device
        that joins after its update generates with the new ones)."""
        d = self.devices
        for dev in devices:
            part, mine = self.calls[dev]
            args = d._counted((pack_items(part), version, self.quota, mine, self.drop_overdue, d.score_here), "step")
            self.handles.append(d._start(dev, "rollout_groups", *args))
            self.launched.append(dev)

    def wait(self) -> dict[str, Any]:
        """The devices' answers merged: the groups' reports (`stalesync.GroupReport`), the groups
        given up and the tokens generated."""
        outs = self.devices._counted(self.devices._wait(self.handles), "step")
        return {"reports": [r for o in outs for r in unpack_reports(o["reports"])],
                "dropped": [g for o in outs for g in o["dropped"]],
                "generated_tokens": sum(o["generated_tokens"] for o in outs)}


class LocalDevices(Devices):
    """One device in the controller's process: the same worker, commands, switch and ledger as
    a Ray device, called directly."""

    def __init__(self, cfg: TrainConfig, plan: DeploymentPlan, base_path: str):
        queue = DistQueue(queue_config(cfg.rollout.group_size))
        plan = plan.on(local_device(cfg.deploy.device))
        super().__init__(cfg, plan, queue)
        self.workers = [DeviceWorker(0, plan, cfg, str(base_path), queue=queue)]
        self.workers[0].connect(None)

    def _start(self, device: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[device], method)(*args)

    def _wait(self, handles: list[Any]) -> list[Any]:
        return handles
