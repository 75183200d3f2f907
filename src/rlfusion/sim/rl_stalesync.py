"""The runtime's StaleSync, simulated as implemented (`RLSimConfig.stalesync_model = "runtime"`).

Mirrors `rlfusion.runtime.stalesync.StalenessBook`, `RLTrainer._stalesync_step` /
`_start_rollout` / `_balanced_parts`, `RolloutStage.run_groups` and the engine's scheduler,
with the costs of a measured `Calibration` (nothing fitted):

- **Book.** Prompt groups of G samples are admitted (weights version `a`) while the groups in
  flight plus a batch reserved for the next update (separated overlap) number fewer than
  (s+1)*B, B = prompts per step; a group admitted at `a` is due at update `a + s`. Quota =
  `min(B, ceil(threshold * B))` (or the count when threshold > 1) finished groups, counting
  finished ones not yet trained.
- **Rollout.** Every unfinished group runs, oldest first per device: new groups in contiguous
  parts over the rollout devices, resumed groups one at a time to the part with the fewest
  groups. Each device steps its engine (continuous batching, `max_batch_per_engine` slots,
  admission once `min_prefill_batch` slots are free, a (packed) prefill budget of
  `max_batched_tokens` tokens per step; a step costs the decode pass over the running rows plus the
  prefill pass over the admitted ones, whose first token comes from the prefill) until the
  finished groups reach the quota and all due groups are done (overdue = wait). With several
  rollout devices the stop rule is global: the devices sum their counts every
  `stop_sync_every` engine steps (a collective, so they meet there; each sum costs the measured
  `Calibration.stop_sync_s`), and a device out of work waits in it. Unfinished samples are
  aborted and resume next rollout (re-prefilling prompt + partial output). Each device then scores its finished samples (reference forward, measured
  rate + fixed cost per pass) — unless, separated, `reference_placement = "train"`: then the
  train devices run the reference pass of the update's batch before the update (the runtime's
  `deploy.scorers = "train"`, its default with the overlap).
- **Update k** trains every due finished group, then the oldest finished ones, up to B groups;
  every sample's staleness (k - version of its first token) is checked against s.
- **Co-located**: rollout on every device, reference, switch, data-parallel update, switch back.
  **Separated, s >= 1**: the first step fills the pipeline with one rollout; then the rollout
  for update k+1 (weights v_k, `reserved` = the groups of the batch taken for update k) runs
  on the rollout devices while the train devices run update k; the weight broadcast starts once
  both are done (the rollout worker is busy until then), and the engines load the weights
  (`switch_s`) before their next rollout. Separated with s = 0 runs rollout, then update.

Response lengths: `cfg.response_lengths[(group_id * G + i) % len]` is sample i of group
`group_id` (groups are numbered in admission order, as the runtime numbers them), so a real
run's lengths replay exactly; empty = the log-normal of the config. `cfg.prompt_lengths` are
indexed the same way (empty: `cfg.prompt_len` for every sample). `overdue = "drop"` is not modelled.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from rlfusion.sim.rl_sim import Sample, TimelineEvent, _Sim

# a step's busiest rollout engine, named as RLTrainer's metrics name them (SimResult.rollout_stats)
ROLLOUT_STATS = ("engine_decode_passes", "time_decode_s", "time_prefill_s", "time_stop_sync_s")


@dataclass
class _Group:
    gid: int
    admitted: int  # weights version at admission; due at update admitted + s
    samples: list[Sample]
    done: list[Sample] = field(default_factory=list)
    open: list[Sample] = field(default_factory=list)
    started: bool = False

    @property
    def finished(self) -> bool:
        return self.started and not self.open


@dataclass
class _Device:
    """One rollout engine while a partial rollout runs on it."""

    name: str
    clock: float
    waiting: deque = field(default_factory=deque)
    running: list[Sample] = field(default_factory=list)
    steps: int = 0
    open_count: dict[int, int] = field(default_factory=dict)
    finished_groups: set[int] = field(default_factory=set)
    due: set[int] = field(default_factory=set)
    finished: list[Sample] = field(default_factory=list)
    decode_s: float = 0.0  # this rollout's engine passes, as the runtime's engine stats count them
    prefill_s: float = 0.0
    decode_passes: int = 0
    stop_sync_s: float = 0.0  # in the stop-rule sums, waiting for the other devices included

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


class RuntimeStaleSync:
    """The book and the trainer's step, on top of `_Sim`'s costs and timeline."""

    def __init__(self, sim: _Sim) -> None:
        self.sim, cfg = sim, sim.cfg
        self.s = cfg.staleness
        self.B = cfg.prompts_per_step * cfg.num_supernodes
        self.G = cfg.samples_per_prompt
        t = cfg.rollout_finish_threshold
        self.quota = min(self.B, math.ceil(t * self.B - 1e-9) if t <= 1 else int(t))
        self.groups: dict[int, _Group] = {}
        self.next_gid = 0
        self.overlap = cfg.mode == "separated" and self.s >= 1
        self.generated: list[int] = []  # tokens generated in each update's step
        self.rollout_stats: list[dict[str, float]] = []  # per update step: its busiest engine's passes
        self._step_stats: list[_Device] = []  # the current update step's rollout devices
        self.staleness_seen: list[int] = []  # per trained sample
        self.in_flight_max = 0  # most groups in flight (incl. a reserved batch) at any admission
        self._last_rollout: dict[str, int] = {}

    # ---- the book ----
    def admit(self, version: int, reserved: int) -> None:
        while len(self.groups) + reserved < (self.s + 1) * self.B:
            gid = self.next_gid
            self.next_gid += 1
            self.groups[gid] = _Group(gid, version, [self._sample(gid, i) for i in range(self.G)])
        self.in_flight_max = max(self.in_flight_max, len(self.groups) + reserved)

    def _sample(self, gid: int, i: int) -> Sample:
        sim, cfg = self.sim, self.sim.cfg
        sample = sim._new_sample()  # the config's length source, in admission order
        if cfg.response_lengths:
            n = cfg.response_lengths[(gid * self.G + i) % len(cfg.response_lengths)]
            sample.length = min(max(n, 1), cfg.max_response_len)
        if cfg.prompt_lengths:
            sample.prompt_len = cfg.prompt_lengths[(gid * self.G + i) % len(cfg.prompt_lengths)]
        sample.batch = gid  # the group it belongs to
        return sample

    def plan(self, version: int, update_version: int, reserved: int = 0):
        self.admit(version, reserved)
        items = [g for g in self.groups.values() if not g.finished]
        due = {g.gid for g in items if g.admitted + self.s <= update_version}
        quota = max(0, self.quota - sum(g.finished for g in self.groups.values()))
        return items, due, quota

    def take_batch(self, update_version: int) -> list[Sample]:
        finished = [g for g in self.groups.values() if g.finished]
        due = [g for g in finished if g.admitted + self.s <= update_version]
        overdue = {g.gid for g in self.groups.values() if g.admitted + self.s <= update_version
                   and not g.finished}
        assert not overdue, f"groups {sorted(overdue)} due at {update_version} but unfinished"
        others = [g for g in finished if g.admitted + self.s > update_version]
        take = sorted(due + others[:max(0, self.B - len(due))], key=lambda g: g.gid)
        batch = []
        for g in take:
            del self.groups[g.gid]
            batch.extend(g.done)
        for smp in batch:
            st = update_version - smp.min_version
            assert st <= self.s, f"staleness {st} > {self.s}"
            self.staleness_seen.append(st)
            self.sim.max_staleness = max(self.sim.max_staleness, st)
        self.sim.trained_tokens += sum(smp.length for smp in batch)
        return batch

    # ---- one partial rollout (RolloutStage.run_groups on every rollout device) ----
    def rollout(self, items: list[_Group], due: set[int], quota: int, version: int,
                start: float) -> tuple[float, int]:
        """Run the planned groups from `start` (all rollout devices); returns when the devices
        are done (scoring included) and the tokens generated."""
        sim = self.sim
        parts = _balanced_parts(items, len(sim.engines))
        devs = []
        for eng, part in zip(sim.engines, parts):
            dev = _Device(eng.name, max(start, eng.clock))
            for g in part:
                reqs = g.open if g.started else g.samples
                for smp in reqs:
                    smp.needs_prefill = True
                dev.waiting.extend(reqs)
                dev.open_count[g.gid] = len(reqs)
                g.started, g.open = True, []
            dev.due = due & {g.gid for g in part}
            devs.append(dev)
        before = sum(smp.generated for dev in devs for smp in dev.waiting)
        if len(devs) == 1:
            dev = devs[0]
            while dev.busy and not (len(dev.finished_groups) >= quota and dev.due <= dev.finished_groups):
                self._engine_step(dev, version)
            end = dev.clock
        else:  # the stop-rule sums: every device calls every `stop_sync_every` steps (or idle)
            every = sim.cfg.stop_sync_every
            t = self._meet(devs)
            while True:
                done = sum(len(d.finished_groups) for d in devs)
                due_left = sum(len(d.due - d.finished_groups) for d in devs)
                if not any(d.busy for d in devs) or (done >= quota and not due_left):
                    break
                for d in devs:
                    d.clock = t
                    if d.busy:
                        self._engine_step(d, version)
                        while d.busy and d.steps % every:
                            self._engine_step(d, version)
                t = self._meet(devs)
            end = t
        generated = -before
        self._step_stats.extend(devs)
        # separated with reference_placement "train": the train devices score, in `learn`
        scorers_on_train = sim.cfg.mode == "separated" and sim.cfg.reference_placement == "train"
        for dev, part in zip(devs, parts):
            aborted = list(dev.waiting) + dev.running
            # run_groups returns samples in request order: a group's open samples resume in
            # sample order (by induction the order they were requested in)
            for smp in sorted(aborted, key=lambda x: x.idx):
                self.groups[smp.batch].open.append(smp)
            for smp in sorted(dev.finished, key=lambda x: x.idx):
                self.groups[smp.batch].done.append(smp)
            generated += sum(smp.generated for smp in aborted + dev.finished)
            dev.clock = end
            tokens = sum(smp.prompt_len + smp.length for smp in dev.finished)
            eng = next(e for e in sim.engines if e.name == dev.name)
            eng.clock = end
            if tokens and not scorers_on_train:  # the device scores what finished (reward is free; reference forward)
                for role, seconds in sim.reference_phases(tokens):
                    sim.record(eng.name, role, eng.clock, eng.clock + seconds, version)
                    eng.clock += seconds
        return max(e.clock for e in sim.engines), generated

    def _meet(self, devs: list[_Device]) -> float:
        """A stop-rule sum: every device waits for the last to arrive, then the collective runs;
        returns when it ends (each device's wait and sum counted in its `stop_sync_s`)."""
        t = max(d.clock for d in devs) + self.sim.cal.stop_sync_s
        for d in devs:
            d.stop_sync_s += t - d.clock
        return t

    def _engine_step(self, dev: _Device, version: int) -> None:
        """One `LLMEngine.step()`: the scheduler's admission, then decode + prefill passes."""
        sim, cfg, cal = self.sim, self.sim.cfg, self.sim.cal
        decode = list(dev.running)
        prefill: list[Sample] = []
        prefill_tokens = 0
        free = cfg.max_batch_per_engine - len(dev.running)
        if not (dev.running and free < min(len(dev.waiting), cfg.min_prefill_batch)):
            budget = cfg.max_batched_tokens - len(decode)
            while dev.waiting and len(dev.running) + len(prefill) < cfg.max_batch_per_engine:
                smp = dev.waiting[0]
                n = smp.prompt_len + smp.generated
                if prefill_tokens + n > budget:
                    break
                dev.waiting.popleft()
                prefill_tokens += n
                prefill.append(smp)
        decode_s = prefill_s = 0.0
        if decode:
            decode_s = cal.decode_step_s(len(decode), max(smp.prompt_len + smp.generated for smp in decode))
            dev.decode_passes += 1
        if prefill:
            prefill_s = cal.prefill_s(prefill_tokens)
        dev.decode_s += decode_s * sim.engine_slow
        dev.prefill_s += prefill_s * sim.engine_slow
        seconds = (decode_s + prefill_s) * sim.engine_slow
        self._record_rollout(dev.name, dev.clock, dev.clock + seconds, version)
        dev.clock += seconds
        dev.steps += 1
        dev.running = decode + prefill
        still = []
        for smp in dev.running:
            if smp.min_version < 0:
                smp.min_version = version
            smp.needs_prefill = False
            smp.generated += 1
            if smp.generated >= smp.length:
                dev.finished.append(smp)
                dev.open_count[smp.batch] -= 1
                if dev.open_count[smp.batch] == 0:
                    dev.finished_groups.add(smp.batch)
            else:
                still.append(smp)
        dev.running = still

    def _record_rollout(self, lane: str, start: float, end: float, version: int) -> None:
        """Engine steps back to back on a lane extend one timeline event."""
        timeline = self.sim.timeline
        i = self._last_rollout.get(lane)
        if i is not None and i < len(timeline):
            ev = timeline[i]
            if ev.version == version and abs(ev.end - start) < 1e-12:
                timeline[i] = TimelineEvent(lane, "rollout", ev.start, end, version)
                return
        if end > start:
            self._last_rollout[lane] = len(timeline)
            timeline.append(TimelineEvent(lane, "rollout", start, end, version))

    # ---- the trainer's step ----
    def learn(self, batch: list[Sample], start: float, version: int) -> float:
        """Update `version` -> `version + 1` on the train devices from `start`; returns its end."""
        sim, t = self.sim, start
        colocated = sim.cfg.mode != "separated"
        lanes = [e.name for e in sim.engines] if colocated else ["train"]
        phases = ([("switch", sim.cal.switch_s)] if colocated else []) + sim.train_phases(batch)
        for role, seconds in phases:
            for lane in lanes:
                sim.record(lane, role, t, t + seconds, version)
            t += seconds
        return t

    def run(self) -> float:
        sim, cfg, cal = self.sim, self.sim.cfg, self.sim.cal
        now, pending = 0.0, None
        for k in range(cfg.num_steps):
            generated = 0
            self._step_stats = []
            if self.overlap:
                if pending is None:  # pipeline fill
                    items, due, quota = self.plan(k, k)
                    now, gen = self.rollout(items, due, quota, k, now)
                    generated += gen
                    pending = self.take_batch(k)
                batch, reserved = pending, len({smp.batch for smp in pending})
                items, due, quota = self.plan(k, k + 1, reserved)
                rollout_end, gen = self.rollout(items, due, quota, k, now)
                generated += gen
                train_end = self.learn(batch, now, k)
                sim.record("train", "weight_sync", max(train_end, rollout_end),
                           max(train_end, rollout_end) + sim.weight_sync_s(), k + 1)
                now = max(train_end, rollout_end) + sim.weight_sync_s()
                self._load_weights(now, k + 1)
                pending = self.take_batch(k + 1)
            else:
                items, due, quota = self.plan(k, k)
                now, gen = self.rollout(items, due, quota, k, now)
                generated += gen
                batch = self.take_batch(k)
                now = self.learn(batch, now, k)
                if cfg.mode == "separated":
                    sim.record("train", "weight_sync", now, now + sim.weight_sync_s(), k + 1)
                    now += sim.weight_sync_s()
                    self._load_weights(now, k + 1)
            sim.update_end.append(now)
            self.generated.append(generated)
            self.rollout_stats.append(self._busiest(self._step_stats))
            if cfg.mode != "separated":  # back to the rollout layout
                for eng in sim.engines:
                    sim.record(eng.name, "switch", now, now + cal.switch_s, k + 1)
                    eng.clock = now + cal.switch_s
                now += cal.switch_s
            sim.version = k + 1
        return max([now] + [e.clock for e in sim.engines])

    @staticmethod
    def _busiest(devs: list[_Device]) -> dict[str, float]:
        """The step's rollout passes of the engine that spent the most time in them (the runtime's
        `_engine_metrics`), summed over the step's rollouts."""
        per: dict[str, dict[str, float]] = {}
        for d in devs:
            acc = per.setdefault(d.name, dict.fromkeys(ROLLOUT_STATS, 0.0))
            acc["time_decode_s"] += d.decode_s
            acc["time_prefill_s"] += d.prefill_s
            acc["engine_decode_passes"] += d.decode_passes
            acc["time_stop_sync_s"] += d.stop_sync_s
        if not per:
            return {}
        return max(per.values(), key=lambda e: e["time_decode_s"] + e["time_prefill_s"])

    def _load_weights(self, now: float, version: int) -> None:
        for eng in self.sim.engines:
            start = max(eng.clock, now)
            self.sim.record(eng.name, "switch", start, start + self.sim.cal.switch_s, version)
            eng.clock = start + self.sim.cal.switch_s


def _balanced_parts(items: list[_Group], num_parts: int) -> list[list[_Group]]:
    """trainer._balanced_parts: new groups in contiguous parts, resumed ones to the part with the
    fewest groups, each part oldest first."""
    fresh = [g for g in items if not g.started]
    k, r = divmod(len(fresh), num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        end = start + k + (i < r)
        parts.append(fresh[start:end])
        start = end
    for g in (g for g in items if g.started):
        min(parts, key=len).append(g)
    for part in parts:
        part.sort(key=lambda g: g.gid)
    return parts


def run_runtime_stalesync(sim: _Sim) -> tuple[float, RuntimeStaleSync]:
    model = RuntimeStaleSync(sim)
    return model.run(), model
