"""The runtime's StaleSync, simulated as implemented (`RLSimConfig.stalesync_model = "runtime"`).

The schedule is the runtime's own code: the trainer's step `rlfusion.stalesync.schedule.
StaleSyncSchedule` drives this module as it drives the runtime's devices (it implements the
schedule's `ScheduleDevices`: start a rollout, wait for it, update, sync weights), with the
book `rlfusion.stalesync.book.StalenessBook` (admission, deadlines, quota, the choice of each
update's groups, the staleness check), the stop rule `rollout_stops` and the device split; each
rollout engine is the engine's scheduler (`rlfusion.engine.scheduler.Scheduler`, continuous
batching). What this module adds is time, from the costs of a measured `Calibration` (nothing
fitted):

- **Book.** Prompt groups of G samples are admitted (weights version `a`) while the groups in
  flight plus a batch reserved for the next update (separated overlap) number fewer than
  (s+1)*B, B = prompts per step; a group admitted at `a` is due at update `a + s`. Overdue
  groups are waited for (`overdue = "wait"`; the simulator has no other policy).
- **Rollout.** Every unfinished group runs, split over the rollout devices as the schedule splits it.
  Each device's scheduler (`max_num_seqs` slots, admission once `min_prefill_batch`
  slots are free, a packed prefill budget of `max_num_batched_tokens` tokens per step) plans the
  steps (the rows longest first, as the engine keeps them); a step costs the decode pass over
  the running rows (each run of similar-length rows read up to its own longest) plus the
  prefill pass over the admitted ones, and gives every scheduled row one token. One
  device applies `rollout_stops` to its own counts before each step. With several rollout
  devices the rule applies to the sums of their counts every `stop_sync_every` engine steps (a
  collective, so they meet there; each sum costs the measured `Calibration.stop_sync_s`), and a
  device out of work waits in it. Unfinished samples are aborted and resume next rollout:
  a paused group goes back to the device that holds its samples; with `resume_kv = "keep"` (the
  runtime's default) a sample that was running decodes on from its saved cache row (the scheduler's
  restore: no prefill; the row copies are not charged), else it re-prefills prompt + partial
  output. Each device then scores the samples of the groups that finished
  (reference forward, measured rate + fixed cost per pass) — unless, separated,
  `scorers = "train"` (the runtime's `deploy.scorers`, "train" by default with the overlap):
  then the train devices run the reference pass of the update's batch before the update.
- **Update k** trains the groups the book hands out for it.
- **Co-located**: rollout on every device, reference, switch, data-parallel update, switch back.
  **Separated, s >= 1**: the first step fills the pipeline with one rollout; then the rollout
  for update k+1 (weights v_k, `reserved` = the groups of the batch taken for update k) runs
  on the rollout devices while the train devices run update k; the weight broadcast starts once
  both are done (the rollout worker is busy until then), and the engines load the weights
  (`switch_s`) before their next rollout. Separated with s = 0 runs rollout, then update.
  **Hybrid, s >= 1** (`deploy.mode=hybrid`): as separated, but every device has an engine;
  the train devices' (the second half) score and update k, switch, then join the rollout for
  k+1 with weights v_{k+1} and the schedule's share of its new groups (sized from the step
  before, as the trainer sizes it); they hand their paused samples over to the early devices. Their stop-rule sums are
  polled, so no device waits for another while it has work (`_polled`); the broadcast follows
  the rollout.

Lengths: a problem is its samples' prompt lengths, `cfg.prompt_lengths[(p * G + i) % len]` for
the p-th problem drawn (empty: `cfg.prompt_len`); sample i of group `group_id` generates
`cfg.response_lengths[(group_id * G + i) % len]` tokens (groups are numbered in admission order,
as the runtime numbers them), so a real run's lengths replay exactly; empty = the log-normal of
the config, drawn when the group first runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfusion.engine.scheduler import Scheduler, SchedulerConfig
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.stalesync.book import GroupReport, StalenessBook
from rlfusion.stalesync.rules import RolloutPlan, StaleSyncConfig, overlaps, rollout_stops, staleness
from rlfusion.stalesync.schedule import RolloutOutcome, StaleSyncSchedule, UpdateOutcome
from rlfusion.sim.rl_state import SimState, TimelineEvent, squared_lengths

# a step's busiest rollout engine, named as RLTrainer's metrics name them (SimResult.rollout_stats)
ROLLOUT_STATS = ("engine_decode_passes", "engine_decode_rows_mean", "time_decode_s", "time_prefill_s",
                 "time_stop_sync_s")


@dataclass
class SimSample:
    """One sample: its engine request (the tokens generated so far, each with the policy version
    that produced it) and the response length it ends at. Carries what `StalenessBook` reads of
    a sample (`group_id`, `versions`, `response_ids`) and what the simulator's costs read
    (`prompt_len`, `length`)."""

    group_id: int
    prompt_len: int
    length: int
    request: Request
    paused_on: int = -1  # the engine (index) that aborted it
    done: bool = False  # finished
    kept: bool = False  # it was running then: that engine saved its cache row (resume_kv=keep)

    @property
    def versions(self) -> list[int]:
        return self.request.versions

    @property
    def response_ids(self) -> list[int]:
        return self.request.output_ids


@dataclass
class _Device:
    """One rollout engine while a partial rollout runs on it."""

    name: str
    clock: float
    scheduler: Scheduler
    samples: dict[str, SimSample] = field(default_factory=dict)  # request id -> sample, request order
    steps: int = 0
    open_count: dict[int, int] = field(default_factory=dict)
    finished_groups: set[int] = field(default_factory=set)
    due: frozenset[int] = frozenset()
    finished: dict[str, SimSample] = field(default_factory=dict)
    decode_s: float = 0.0  # this rollout's engine passes, as the runtime's engine stats count them
    prefill_s: float = 0.0
    decode_passes: int = 0
    decode_rows: int = 0  # rows of those passes
    stop_sync_s: float = 0.0  # in the stop-rule sums, waiting for the other devices included
    version: int = 0  # the weights it generates with

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished()

    def stops(self, plan: RolloutPlan) -> bool:
        """`rollout_stops` on this device's own counts (one rollout device)."""
        return rollout_stops(len(self.finished_groups), len(self.due - self.finished_groups), int(self.busy), 0,
                             quota=plan.quota, drop_overdue=plan.drop)

    def pause(self, index: int, keep_rows: bool) -> int:
        """The rollout stops on device `index`: what has not finished is aborted (a running
        sample's cache row kept where `keep_rows`); returns the tokens its samples hold."""
        running = {s.request_id for s in self.scheduler.running}
        self.scheduler.abort(set(self.samples) - set(self.finished))
        for rid, smp in self.samples.items():
            if rid not in self.finished:
                smp.paused_on = index
                smp.kept = keep_rows and rid in running
        return sum(len(smp.response_ids) for smp in self.samples.values())

    def reports(self, index: int, held: dict[int, list[SimSample]], hands_over: bool) -> list[GroupReport]:
        """What device `index` reports (`partial_rollout.PartialRollout`): a finished group's
        samples go into the queue, scored there; a hybrid train device (`hands_over`) hands its
        paused samples over (an early one resumes them), the others keep theirs."""
        reports = []
        for gid in dict.fromkeys(smp.group_id for smp in self.samples.values()):
            tokens = sum(len(smp.response_ids) for smp in held[gid])
            if gid in self.finished_groups:
                versions = [min(smp.versions) for smp in held[gid] if smp.versions]
                reports.append(GroupReport.finished_group(gid, tokens, (), versions))
            else:
                reports.append(GroupReport(gid, False, tokens, held_by=-1 if hands_over else index))
        return reports


class RuntimeStaleSync:
    """The runtime's `StalenessBook` and the trainer's step, on top of `SimState`'s costs and timeline."""

    def __init__(self, sim: SimState) -> None:
        self.sim, cfg = sim, sim.cfg
        self.s = cfg.max_staleness
        self.B = cfg.prompts_per_step * cfg.num_supernodes
        self.G = cfg.group_size
        self.book = StalenessBook(StaleSyncConfig(enabled=True, max_staleness=self.s,
                                                  rollout_finish_threshold=cfg.rollout_finish_threshold,
                                                  resume_kv=cfg.resume_kv),
                                  self.B, self.G)
        prompts = cfg.prompt_lengths or (cfg.prompt_len,)
        self.scheduler_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                             max(prompts) + cfg.max_new_tokens + 1, cfg.min_prefill_batch)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
        self.held: dict[int, list[SimSample]] = {}  # group id -> its samples, held by its engine
        self._prompt_ids: dict[int, list[int]] = {}  # one token list per prompt length, shared
        self.hybrid = cfg.mode == "hybrid"
        # hybrid: the engines of the train devices (the second half), which join each overlapped
        # rollout after their update, with their share of its new groups (`assign_hybrid`)
        first_late = (len(sim.engines) + 1) // 2
        self.late_names = {e.name for e in sim.engines[first_late:]} if self.hybrid else set()
        if self.hybrid and not self.late_names:
            raise ValueError(f"simulate.mode='hybrid' needs >= 2 engines (devices / devices_per_engine), got "
                             f"{len(sim.engines)}: some devices only generate, the others also train")
        # `ScheduleDevices`: the schedule drives this model as it drives the runtime's devices
        self.rollout_devices = len(sim.engines)
        self.late = tuple(range(first_late, len(sim.engines))) if self.hybrid else ()
        self.schedule = StaleSyncSchedule(self.book, self, overlaps(cfg.mode, self.book.cfg), self.hybrid)
        self.now = 0.0  # the step's clock: where the next rollout and update start
        self.version = 0  # the update this step trains
        self._sync_after: float | None = None  # separated overlap: the broadcast follows the rollout and the update
        self._updated = False  # this step's update ran (a rollout waited for after it ran beside it)
        self.generated: list[int] = []  # tokens generated in each update's step
        self.rollout_stats: list[dict[str, float]] = []  # per update step: its busiest engine's passes
        self._step_stats: list[_Device] = []  # the current update step's rollout devices
        self.staleness_seen: list[int] = []  # per trained sample
        self.in_flight_max = 0  # most groups in flight (incl. a reserved batch) at any admission
        self._last_rollout: dict[str, int] = {}

    # ---- the book ----
    def _new_samples(self, group_id: int, problem: tuple[int, ...]) -> list[SimSample]:
        """A new group's G samples, as `run_groups` starts them."""
        sim, cfg = self.sim, self.sim.cfg
        out = []
        for i, prompt_len in enumerate(problem):
            length = sim._new_sample().length  # the config's length source, in first-run order
            if cfg.response_lengths:
                n = cfg.response_lengths[(group_id * self.G + i) % len(cfg.response_lengths)]
                length = min(max(n, 1), cfg.max_new_tokens)
            if prompt_len not in self._prompt_ids:
                self._prompt_ids[prompt_len] = [0] * prompt_len
            prompt = self._prompt_ids[prompt_len]
            out.append(SimSample(group_id, prompt_len, length, Request(f"{group_id}/{i}", prompt, self.params)))
        return out

    # ---- `ScheduleDevices` ----

    def start_rollout(self, plan: RolloutPlan, parts: list[list], defer_late: bool) -> dict[str, Any]:
        """The rollout runs (in simulated time) when waited for: by then a deferred one knows
        when its late devices joined (`update(join=...)`)."""
        self.in_flight_max = max(self.in_flight_max, self.schedule.in_flight())
        return {"plan": plan, "parts": parts, "start": self.now, "late_start": None, "defer": defer_late}

    def wait(self, running: dict[str, Any]) -> RolloutOutcome:
        late_start = running["late_start"] if running["defer"] else None
        end, reports, dropped, generated = self.rollout(running["plan"], running["parts"], running["start"], late_start)
        if not self._updated:  # nothing ran beside it: the step goes on from its end
            self.now = end
        if self._sync_after is not None:  # separated overlap: the broadcast once both are done
            self._broadcast(max(self._sync_after, end), "train")
            self._sync_after = None
        return RolloutOutcome(reports, dropped, generated, end - running["start"])

    def update(self, groups: list, join: dict[str, Any] | None = None) -> UpdateOutcome:
        """Update `self.version` -> +1 on the train devices from the step's clock."""
        sim, cal, k = self.sim, self.sim.cal, self.version
        batch = [smp for g in groups for smp in self.held.pop(g.group_id)]
        for smp in batch:
            st = staleness(k, smp.versions)
            self.staleness_seen.append(st)
            sim.staleness_max = max(sim.staleness_max, st)
        sim.trained_tokens += sum(smp.length for smp in batch)
        train_end = self.learn(batch, self.now, k)
        busy, self._updated = train_end - self.now, True
        if join is not None:  # hybrid: the train devices switch, then join the rollout with the new weights
            for lane in sorted(self.late_names):
                sim.record(lane, "switch", train_end, train_end + cal.switch_s, k + 1)
            join["late_start"] = train_end + cal.switch_s
        elif self.schedule.overlap:
            self._sync_after = train_end
        elif sim.cfg.mode == "separated":
            sim.record("train", "weight_sync", train_end, train_end + sim.weight_sync_s(), k + 1)
            self.now = train_end + sim.weight_sync_s()
            self._load_weights(self.now, k + 1)
        else:  # co-located: back to the rollout layout
            for eng in sim.engines:
                sim.record(eng.name, "switch", train_end, train_end + cal.switch_s, k + 1)
                eng.clock = train_end + cal.switch_s
            self.now = train_end + cal.switch_s
        return UpdateOutcome({"trained": 1.0}, busy)

    def sync_weights(self) -> None:
        """Hybrid: the broadcast once the rollout and the update are done; the train devices
        generated with the new weights already."""
        lane = sorted(self.late_names)[0]
        self._broadcast(max([self.now] + [e.clock for e in self.sim.engines]), lane, skip=self.late_names)

    def _broadcast(self, start: float, lane: str, skip: set[str] = frozenset()) -> None:
        sim = self.sim
        sim.record(lane, "weight_sync", start, start + sim.weight_sync_s(), self.version + 1)
        self.now = start + sim.weight_sync_s()
        self._load_weights(self.now, self.version + 1, skip=skip)

    # ---- one partial rollout (RolloutStage.run_groups on every rollout device) ----
    def rollout(self, plan: RolloutPlan, parts: list[list], start: float,
                late_start: float | None = None) -> tuple[float, list[GroupReport], list[int], int]:
        """Run `plan` (`parts[i]` on engine i) from `start` on all rollout devices; returns when
        the devices are done (scoring included), their reports, the groups given up and the
        tokens generated. Hybrid, overlapped (`late_start`): the train devices' engines join at
        `late_start`, with the next weights."""
        devs, resumed = self._load_parts(plan, parts, start, late_start)
        end = self._run_until_stop(devs, plan)
        self._step_stats.extend(devs)
        reports, dropped, generated = self._stop_devices(devs, plan, end, late_start)
        return max(e.clock for e in self.sim.engines), reports, dropped, generated - resumed

    def _load_parts(self, plan: RolloutPlan, parts: list[list], start: float,
                    late_start: float | None) -> tuple[list[_Device], int]:
        """A device per rollout engine with its part's samples queued (a resumed sample on the
        engine that saved its row starts from it); and the tokens the resumed samples held."""
        version, devs, resumed = plan.version, [], 0
        for index, (eng, part) in enumerate(zip(self.sim.engines, parts)):
            late = late_start is not None and eng.name in self.late_names
            dev = _Device(eng.name, max(late_start if late else start, eng.clock), Scheduler(self.scheduler_cfg),
                          version=version + 1 if late else version)
            for it in part:
                gid = it.group_id
                if it.resume:
                    samples = [smp for smp in self.held[gid] if not smp.done]
                    resumed += sum(len(smp.response_ids) for smp in samples)
                else:
                    samples = self.held[gid] = self._new_samples(gid, problem_prompts(self.sim.cfg, self.G, it.problem_id))
                for smp in samples:
                    kept = smp.kept and smp.paused_on == index  # its saved row is on this engine
                    dev.scheduler.add(smp.request, cached=smp.prompt_len + len(smp.response_ids) - 1 if kept else 0)
                    dev.samples[smp.request.request_id] = smp
                dev.open_count[gid] = len(samples)
            dev.due = plan.due & {it.group_id for it in part}
            devs.append(dev)
        return devs, resumed

    def _run_until_stop(self, devs: list[_Device], plan: RolloutPlan) -> float:
        """Engine steps until the stop rule holds (one device alone; hybrid's polled sums; else
        the sums every device meets for every `stop_sync_every` steps or when idle); returns when."""
        if len(devs) == 1:
            dev = devs[0]
            while not dev.stops(plan):
                self._engine_step(dev, dev.version)
            return dev.clock
        if self.hybrid:
            return self._polled(devs, plan)
        every = self.sim.cfg.stop_sync_every
        t = self._meet(devs)
        while not rollout_stops(sum(len(d.finished_groups) for d in devs),
                                sum(len(d.due - d.finished_groups) for d in devs),
                                sum(d.busy for d in devs), 0, quota=plan.quota, drop_overdue=plan.drop):
            for d in devs:
                d.clock = t
                if d.busy:
                    self._engine_step(d, d.version)
                    while d.busy and d.steps % every:
                        self._engine_step(d, d.version)
            t = self._meet(devs)
        return t

    def _stop_devices(self, devs: list[_Device], plan: RolloutPlan, end: float,
                      late_start: float | None) -> tuple[list[GroupReport], list[int], int]:
        """Each device at `end`: its unfinished samples paused (their rows kept where
        `resume_kv="keep"`), its reports, its overdue groups given up (`overdue="drop"`) and, where
        the rollout devices score, its finished groups' reference pass; returns the reports, the
        groups dropped and every token the samples hold."""
        sim = self.sim
        # separated with scorers "train", and hybrid: the train devices score, in `learn`
        scorers_on_train = sim.cfg.mode == "hybrid" or (sim.cfg.mode == "separated" and sim.cfg.scorers == "train")
        dropped, generated, reports = [], 0, []
        for index, dev in enumerate(devs):
            generated += dev.pause(index, keep_rows=sim.cfg.resume_kv == "keep")
            dropped += sorted(dev.due - dev.finished_groups) if plan.drop else []
            reports += dev.reports(index, self.held, hands_over=late_start is not None and dev.name in self.late_names)
            dev.clock = end
            finished = [smp for gid in dev.finished_groups for smp in self.held[gid]]
            tokens = sum(smp.prompt_len + smp.length for smp in finished)
            eng = next(e for e in sim.engines if e.name == dev.name)
            eng.clock = end
            if tokens and not scorers_on_train:  # the device scores its finished groups (reward is free; reference forward)
                for role, seconds in sim.reference_phases(tokens, squared_lengths(finished)):
                    sim.record(eng.name, role, eng.clock, eng.clock + seconds, plan.version)
                    eng.clock += seconds
        for gid in dropped:
            del self.held[gid]
        return reports, dropped, generated

    def _polled(self, devs: list[_Device], plan: RolloutPlan) -> float:
        """Hybrid's stop-rule sums (`stop_sums.StopSums`, polled): no device waits for another while it
        has work; once every device has joined, the rule applies to the sums of their counts
        before each engine step (the poll costs nothing beside a step), stepping the device that
        is furthest behind in time. Returns when the last device stops."""
        joined = max(d.clock for d in devs)
        while True:
            busy = [d for d in devs if d.busy]
            now = min((d.clock for d in busy), default=joined)
            if now >= joined and rollout_stops(sum(len(d.finished_groups) for d in devs),
                                               sum(len(d.due - d.finished_groups) for d in devs), len(busy), 0,
                                               quota=plan.quota, drop_overdue=plan.drop):
                return max([now] + [d.clock for d in devs])
            dev = min(busy, key=lambda d: d.clock)
            self._engine_step(dev, dev.version)

    def _meet(self, devs: list[_Device]) -> float:
        """A stop-rule sum: every device waits for the last to arrive, then the collective runs;
        returns when it ends (each device's wait and sum counted in its `stop_sync_s`)."""
        t = max(d.clock for d in devs) + self.sim.cal.stop_sync_s
        for d in devs:
            d.stop_sync_s += t - d.clock
        return t

    def _engine_step(self, dev: _Device, version: int) -> None:
        """One `LLMEngine.step()`: the scheduler's plan, its decode + prefill passes, a token for
        every scheduled row; the rows at their length finish."""
        sim = self.sim
        step = dev.scheduler.schedule()
        decode_s = prefill_s = 0.0
        busy = sim.engine_cal  # with the other devices busy
        if step.decode:
            decode_s = busy.decode_pass_s([seq.num_tokens for seq in step.decode])
            dev.decode_passes += 1
            dev.decode_rows += len(step.decode)
        if step.prefill:
            prefill_s = busy.prefill_s(sum(seq.num_tokens for seq in step.prefill))
        dev.decode_s += decode_s
        dev.prefill_s += prefill_s
        seconds = decode_s + prefill_s
        record_rollout(self.sim.timeline, self._last_rollout, dev.name, dev.clock, dev.clock + seconds, version)
        dev.clock += seconds
        dev.steps += 1
        for seq in step.decode + step.prefill:
            req = seq.request
            req.output_ids.append(0)
            req.logprobs.append(0.0)
            req.versions.append(version)
            smp = dev.samples[req.request_id]
            if len(req.output_ids) >= smp.length:
                dev.scheduler.finish(seq)
                dev.finished[req.request_id] = smp
                smp.done = True
                dev.open_count[smp.group_id] -= 1
                if dev.open_count[smp.group_id] == 0:
                    dev.finished_groups.add(smp.group_id)

    # ---- the trainer's step ----
    def learn(self, batch: list[SimSample], start: float, version: int) -> float:
        """Update `version` -> `version + 1` on the train devices from `start`; returns its end."""
        sim, t = self.sim, start
        colocated = sim.cfg.mode not in ("separated", "hybrid")
        lanes = (sorted(self.late_names) if self.hybrid else [e.name for e in sim.engines] if colocated else ["train"])
        if self.hybrid:  # after its last rollout, training state back in (the co-located switch)
            t = max([t] + [e.clock for e in sim.engines if e.name in self.late_names])
        phases = ([("switch", sim.cal.switch_s)] if colocated or self.hybrid else []) + sim.train_phases(batch)
        for role, seconds in phases:
            for lane in lanes:
                sim.record(lane, role, t, t + seconds, version)
            t += seconds
        return t

    def run(self) -> float:
        """Every update's step, as `StaleSyncSchedule.step` orders it."""
        sim = self.sim
        for k in range(sim.cfg.num_steps):
            self._step_stats, self.version, self._updated = [], k, False
            out = self.schedule.step(k)
            sim.update_end.append(self.now)
            self.generated.append(out.generated_tokens)
            self.rollout_stats.append(busiest_engine(self._step_stats))
            sim.version = k + 1
        return max([self.now] + [e.clock for e in sim.engines])

    def _load_weights(self, now: float, version: int, skip: set[str] = frozenset()) -> None:
        """The engines take the broadcast weights in (`skip`: hybrid's train devices, which
        generated with them already)."""
        for eng in self.sim.engines:
            if eng.name in skip:
                continue
            start = max(eng.clock, now)
            self.sim.record(eng.name, "switch", start, start + self.sim.cal.switch_s, version)
            eng.clock = start + self.sim.cal.switch_s


def problem_prompts(cfg: Any, group_size: int, p: int) -> tuple[int, ...]:
    """Problem `p` (`Group.problem_id`): its samples' prompt lengths."""
    if not cfg.prompt_lengths:
        return (cfg.prompt_len,) * group_size
    return tuple(cfg.prompt_lengths[(p * group_size + i) % len(cfg.prompt_lengths)] for i in range(group_size))


def record_rollout(timeline: list, last: dict[str, int], lane: str, start: float, end: float, version: int) -> None:
    """Engine steps back to back on a lane extend one timeline event (`last`: each lane's last
    rollout event)."""
    i = last.get(lane)
    if i is not None and i < len(timeline):
        ev = timeline[i]
        if ev.version == version and abs(ev.end - start) < 1e-12:
            timeline[i] = TimelineEvent(lane, "rollout", ev.start, end, version)
            return
    if end > start:
        last[lane] = len(timeline)
        timeline.append(TimelineEvent(lane, "rollout", start, end, version))


def busiest_engine(devs: list[_Device]) -> dict[str, float]:
    """The step's rollout passes of the engine that spent the most time in them (the runtime's
    `_engine_metrics`), summed over the step's rollouts."""
    per: dict[str, dict[str, float]] = {}
    rows: dict[str, int] = {}
    for d in devs:
        acc = per.setdefault(d.name, dict.fromkeys(ROLLOUT_STATS, 0.0))
        acc["time_decode_s"] += d.decode_s
        acc["time_prefill_s"] += d.prefill_s
        acc["engine_decode_passes"] += d.decode_passes
        acc["time_stop_sync_s"] += d.stop_sync_s
        rows[d.name] = rows.get(d.name, 0) + d.decode_rows
    if not per:
        return {}
    name = max(per, key=lambda n: per[n]["time_decode_s"] + per[n]["time_prefill_s"])
    busiest = per[name]
    busiest["engine_decode_rows_mean"] = rows[name] / busiest["engine_decode_passes"] if busiest["engine_decode_passes"] else 0.0
    return busiest


def run_runtime_stalesync(sim: SimState) -> tuple[float, RuntimeStaleSync]:
    model = RuntimeStaleSync(sim)
    return model.run(), model
