"""The discrete-event simulator's state (`SimState`): its engines, clocks, timeline and the
costs it charges, shared by the RL models (`rl_sim.py`'s and `rl_stalesync.py`'s StaleSync)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from rlfusion.sim.calibration import Calibration
from rlfusion.sim.rl_config import RLSimConfig


@dataclass
class Sample:
    idx: int
    batch: int  # the update it was generated for (idx // samples_per_step)
    prompt_len: int
    length: int  # response tokens it will generate
    generated: int = 0
    min_version: int = -1  # policy version of its first token; -1 until admitted
    needs_prefill: bool = True
    ready_at: float = 0.0  # when it is generated and scored, ready for an update


@dataclass(frozen=True)
class TimelineEvent:
    device: str  # lane name: an engine ("engine3") or the trainer ("train")
    role: str  # rollout | prefill | switch | train | ref | reward | weight_sync
    start: float  # seconds
    end: float
    version: int  # policy version the work used


@dataclass(frozen=True)
class SimResult:
    tokens_per_s: float  # response tokens consumed by updates / makespan
    all_tokens_per_s: float  # prompt + response tokens consumed by updates / makespan
    samples_per_s: float
    makespan_s: float
    utilization: dict[str, float]  # lane -> (rollout + train + ref/reward time) / makespan
    lane_devices: dict[str, int]  # lane -> devices it stands for
    timeline: list[TimelineEvent]
    dropped_samples: int  # finished but too stale to train on
    staleness_max: int  # largest (update version - sample min_version) trained on (the run's metric)
    updates: int
    update_end_s: tuple[float, ...] = ()  # when each update's new weights exist
    # stalesync_model "runtime" only: tokens generated in each update's step (its rollouts),
    # the staleness of every trained sample, the most groups in flight (a reserved batch
    # included) right after any admission
    generated_per_update: tuple[int, ...] = ()
    staleness_per_sample: tuple[int, ...] = ()
    max_groups_in_flight: int = 0
    # ... and per update step, the busiest rollout engine's passes and seconds, as the runtime
    # reports them (`time_decode_s`, `time_prefill_s`, `engine_decode_passes`, `time_stop_sync_s`)
    rollout_stats: tuple[dict[str, float], ...] = ()


@dataclass
class SimEngine:
    name: str
    version: int = 0
    clock: float = 0.0
    active: list[Sample] = field(default_factory=list)
    finished_tokens: int = 0  # prompt + response tokens of samples finished since last reset
    finished_squares: int = 0  # the sum of their squared lengths (prompt + response)
    last_work: float = 0.0  # end of its latest prefill or decode step
    taken: dict[int, int] = field(default_factory=dict)  # new samples admitted, per batch
    min_left: int | None = None  # fewest tokens any active sample still needs (None: unknown)
    max_context: int | None = None  # longest prompt + generated of the active samples (None: unknown)

    def fewest_left(self) -> int:
        if self.min_left is None:  # cached: engines that did not change are asked every event
            self.min_left = min(s.length - s.generated for s in self.active)
        return self.min_left

    def longest_context(self) -> int:
        if self.max_context is None:  # cached like `min_left`
            self.max_context = max(s.prompt_len + s.generated for s in self.active)
        return self.max_context

    def changed(self) -> None:
        """Its active samples changed: forget the cached summaries."""
        self.min_left = self.max_context = None


class SimState:
    def __init__(self, cfg: RLSimConfig, cal: Calibration) -> None:
        self.cfg, self.cal = cfg, cal
        self.rng = random.Random(cfg.seed)
        self.n = cfg.samples_per_step
        self.next_idx = 0
        self.resume: list[Sample] = []
        self.ready: list[Sample] = []
        self.timeline: list[TimelineEvent] = []
        self.version = 0
        self.dropped = 0
        self.staleness_max = 0
        self.trained_tokens = 0
        self.trained_prompt_tokens = 0
        # stragglers: each engine's speed for each policy version it generates with, and each
        # update's slowest train device, drawn from their own stream (the lengths do not change)
        self.straggle_rng = random.Random(cfg.seed + 1)
        self.speeds: dict[tuple[str, int], float] = {}
        engines = self._num_engines()
        self.engines = [SimEngine(f"engine{i}") for i in range(engines)]
        # synchronous runs split each batch's prompt groups evenly over the engines, contiguous
        # parts in engine order, as the runtime does; with a staleness bound engines take
        # whatever sample is next
        groups, extra = divmod(self.n // cfg.group_size, engines)
        self.share = ({e.name: (groups + (i < extra)) * cfg.group_size for i, e in enumerate(self.engines)}
                      if cfg.max_staleness == 0 else None)
        self.update_end: list[float] = []
        # separated and hybrid devices work independently (hybrid's train devices update while
        # the others decode), the other modes in lock-step
        independent = cfg.mode in ("separated", "hybrid")
        overlap = independent and cfg.max_staleness > 0
        # the costs of the engines' and the trainer's work with the host's other devices busy
        self.engine_cal = cal.contended(lockstep=not independent) if (engines > 1 or overlap) else cal
        # data-parallel train devices meet in the gradient all-reduce: lock-step in every mode
        self.train_cal = (cal.contended(lockstep=True) if self.train_devices() > 1
                          else cal.contended(lockstep=False) if overlap else cal)

    # ---- stragglers ---------------------------------------------------------------------
    def slow(self, eng: "SimEngine") -> float:
        """How much longer `eng`'s work takes than `engine_cal` prices it: its straggler factor
        for the policy version it generates with (a log-normal of `straggler_sigma`, drawn once
        per engine and version: a barrier waits for the slowest)."""
        sigma = self.cfg.straggler_sigma
        if not sigma:
            return 1.0
        key = (eng.name, eng.version)
        if key not in self.speeds:
            self.speeds[key] = math.exp(self.straggle_rng.gauss(0.0, sigma))
        return self.speeds[key]

    def slowest(self, devices: int) -> float:
        """The slowest of `devices` data-parallel train devices' straggler factors for one
        update (they meet in the gradient reduction)."""
        sigma = self.cfg.straggler_sigma
        if not sigma:
            return 1.0
        return math.exp(max(self.straggle_rng.gauss(0.0, sigma) for _ in range(devices)))

    # ---- setup ------------------------------------------------------------------------
    def _num_engines(self) -> int:
        per = self.cal.devices_per_engine
        devices = self.cfg.num_devices
        if self.cfg.mode == "separated":
            devices = max(per, round(devices * self.cfg.rollout_fraction))
        return max(1, devices // per)

    def train_devices(self) -> int:
        if self.cfg.mode == "separated":
            return max(1, self.cfg.num_devices - len(self.engines) * self.cal.devices_per_engine)
        if self.cfg.mode == "hybrid":  # the engines of the second half, as deploy.mode=hybrid places them
            return max(1, len(self.engines) // 2 * self.cal.devices_per_engine)
        return self.cfg.num_devices

    def _new_sample(self) -> Sample:
        cfg = self.cfg
        if cfg.response_lengths:
            length = cfg.response_lengths[self.next_idx % len(cfg.response_lengths)]
        else:
            length = round(cfg.response_median * math.exp(self.rng.gauss(0.0, cfg.length_sigma)))
        prompt = (cfg.prompt_lengths[self.next_idx % len(cfg.prompt_lengths)] if cfg.prompt_lengths
                  else cfg.prompt_len)
        sample = Sample(self.next_idx, self.next_idx // self.n, prompt, min(max(length, 1), cfg.max_new_tokens))
        self.next_idx += 1
        return sample

    # ---- engines ----------------------------------------------------------------------
    def admit(self, eng: SimEngine, max_batch_index: int, now: float) -> None:
        """Fill free slots: resumed samples first, then new ones the staleness bound allows
        (a new sample of batch b needs b <= max_batch_index)."""
        if not eng.active:
            eng.clock = max(eng.clock, now)
        free = self.cfg.max_num_seqs - len(eng.active)
        waiting = len(self.resume) + self._new_left(eng, max_batch_index)
        if eng.active and free < min(waiting, self.cfg.min_prefill_batch):
            return  # the scheduler waits for a bigger prefill batch
        added: list[Sample] = []
        while len(eng.active) + len(added) < self.cfg.max_num_seqs:
            if self.resume:
                added.append(self.resume.pop(0))
            elif self._new_left(eng, max_batch_index):
                sample = self._new_sample()
                eng.taken[sample.batch] = eng.taken.get(sample.batch, 0) + 1
                added.append(sample)
            else:
                break
        if not added:
            return
        prefill_tokens = 0
        for s in added:
            if s.min_version < 0:
                s.min_version = eng.version
            if s.needs_prefill:
                prefill_tokens += s.prompt_len + s.generated
                s.needs_prefill = False
        cost = self.engine_cal.prefill_s(prefill_tokens) * self.slow(eng)
        self.record(eng.name, "prefill", eng.clock, eng.clock + cost, eng.version)
        eng.clock += cost
        eng.last_work = eng.clock
        eng.active.extend(added)
        eng.changed()

    def _new_left(self, eng: SimEngine, max_batch_index: int) -> int:
        """New samples `eng` may still admit: those of batches up to `max_batch_index`, or in a
        synchronous run what is left of its share of the current batch."""
        left = max(0, (max_batch_index + 1) * self.n - self.next_idx)
        if self.share is None or not left:
            return left
        return min(left, self.share[eng.name] - eng.taken.get(self.next_idx // self.n, 0))

    def next_finish(self, eng: SimEngine) -> float:
        if not eng.active:
            return math.inf
        return eng.clock + self.engine_cal.decode_steps_s(len(eng.active), self.context(eng), eng.fewest_left()) * self.slow(eng)

    def context(self, eng: SimEngine) -> int:
        """The longest context the engine's next decode step attends over."""
        if not self.cal.decode_context_ms or not eng.active:
            return 0  # context-independent decode cost: no need to look
        return eng.longest_context()

    def decode_step_s(self, eng: SimEngine) -> float:
        return self.engine_cal.decode_step_s(len(eng.active), self.context(eng)) * self.slow(eng)

    def advance(self, eng: SimEngine, until: float) -> list[Sample]:
        """Run decode steps up to `until` (finishing the step in progress); return finished."""
        if not eng.active:
            eng.clock = max(eng.clock, until)
            return []
        if eng.clock >= until:  # already past `until` (finishing a step or a prefill)
            return []
        step = self.decode_step_s(eng)  # the first; later ones attend over one more token each
        steps = min(eng.fewest_left(), math.ceil((until - eng.clock) / step - 1e-9))
        seconds = self.engine_cal.decode_steps_s(len(eng.active), self.context(eng), steps) * self.slow(eng)
        self.record(eng.name, "rollout", eng.clock, eng.clock + seconds, eng.version)
        eng.clock += seconds
        eng.last_work = eng.clock
        for s in eng.active:
            s.generated += steps
        eng.changed()
        done = [s for s in eng.active if s.generated >= s.length]
        eng.active = [s for s in eng.active if s.generated < s.length]
        tokens, squares = sum(s.prompt_len + s.length for s in done), squared_lengths(done)
        eng.finished_tokens += tokens
        eng.finished_squares += squares
        if tokens and self.cfg.reference and self.cfg.mode == "separated" and self.cfg.scorers == "rollout":
            # scored where generated, as they finish (the per-pass fixed cost is not charged)
            ref = self.engine_cal.reference_s(tokens, self.cal.devices_per_engine, squares, fixed=False) * self.slow(eng)
            self.record(eng.name, "ref", eng.clock, eng.clock + ref, eng.version)
            eng.clock += ref
            eng.last_work = eng.clock
        for s in done:
            s.ready_at = eng.clock
        return done

    # ---- training ---------------------------------------------------------------------
    def take_batch(self, update: int) -> list[Sample] | None:
        """The N oldest ready samples within the staleness bound of `update`, or None."""
        if len(self.ready) < self.n:  # cannot fill a batch yet; stale ones are dropped later
            return None
        bound = update - self.cfg.max_staleness
        stale = [s for s in self.ready if s.min_version < bound]
        self.dropped += len(stale)
        self.ready = sorted((s for s in self.ready if s.min_version >= bound),
                            key=lambda s: (s.min_version, s.idx))
        if len(self.ready) < self.n:
            return None
        batch, self.ready = self.ready[:self.n], self.ready[self.n:]
        self.staleness_max = max(self.staleness_max, max(update - s.min_version for s in batch))
        self.trained_tokens += sum(s.length for s in batch)
        self.trained_prompt_tokens += sum(s.prompt_len for s in batch)
        return batch

    def train_phases(self, batch: list[Sample]) -> list[tuple[str, float]]:
        """(role, seconds) of everything between 'batch ready' and 'new weights exist'. In the
        colocated modes the reference pass already ran on the engines (`reference_phases`)."""
        cfg, cal = self.cfg, self.cal
        tokens = sum(s.prompt_len + s.length for s in batch)
        squares = squared_lengths(batch)
        queued = tokens if cfg.padding_free else len(batch) * (max((s.prompt_len for s in batch), default=cfg.prompt_len)
                                                               + cfg.max_new_tokens)
        devices = self.train_devices()
        phases = [("queue", queued * cfg.queue_bytes_per_token / (cal.transfer_GBps * 1e9)
                   + len(batch) * cal.advantage_s_per_sample)]
        if cfg.reference and (cfg.mode == "hybrid" or (cfg.mode == "separated" and cfg.scorers == "train")):
            phases.append(("ref", self.train_cal.reference_s(tokens, devices, squares)))
        if cfg.mode == "fully_shared" and cfg.reward_model:
            phases += [("switch", cal.switch_s),
                       ("reward", self.train_cal.reference_s(tokens, devices, squares))]
        # the trainer's costs with the other devices busy, on the share of tokens it keeps
        train = self.train_cal.train_s(tokens * cfg.train_fraction, devices,
                                       squares * cfg.train_fraction) * self.slowest(devices)
        phases.append(("train", train + self.dp_sync_s(devices) + self.grad_sync_s()))
        return phases

    def reference_phases(self, tokens: int, squares: int, eng: "SimEngine | None" = None) -> list[tuple[str, float]]:
        """One engine's reference pass over the `tokens` it generated, `squares` the sum of their
        squared sequence lengths (colocated modes; with scorers 'train' the pass runs on the
        same devices after the switch)."""
        cal = self.cal
        if not self.cfg.reference:
            return []
        forward = ("ref", self.engine_cal.reference_s(tokens, cal.devices_per_engine, squares)
                   * (self.slow(eng) if eng is not None else 1.0))
        if self.cfg.mode != "fully_shared":
            return [forward]
        return [("switch", cal.reference_switch / 2), forward,
                ("switch", cal.reference_switch / 2)]

    def dp_sync_s(self, devices: int) -> float:
        """Ring all-reduce of each train device's gradients across the train devices."""
        if devices <= 1 or not self.cal.grad_sync_GB:
            return 0.0
        return (2.0 * (devices - 1) / devices * self.cal.grad_sync_GB
                / self.cal.transfer_GBps)

    def grad_sync_s(self) -> float:
        n, bw = self.cfg.num_supernodes, self.cfg.inter_supernode_GBps
        if n <= 1 or bw <= 0:
            return 0.0  # ideal network (or one supernode: inside the measured train rate)
        # weights travel in bf16 (weight_GB); gradients reduce in fp32 (2x), sharded over the
        # devices of a supernode
        per_device = 2.0 * self.cal.weight_GB * 1e9 / self.cfg.devices_per_supernode
        return 2.0 * (n - 1) / n * per_device / (bw * 1e9)

    def weight_sync_s(self) -> float:
        """New weights to the engines: each engine device receives its shard in parallel; with
        several supernodes, engines in other supernodes than the trainer's get theirs over the
        inter-supernode links (`inter_supernode_GBps` per device), the slower path."""
        bandwidth = self.cal.transfer_GBps
        if self.cfg.num_supernodes > 1 and self.cfg.inter_supernode_GBps > 0:
            bandwidth = min(bandwidth, self.cfg.inter_supernode_GBps)
        return self.cal.weight_GB / (bandwidth * self.cal.devices_per_engine)

    def record(self, lane: str, role: str, start: float, end: float, version: int) -> None:
        if end > start:
            self.timeline.append(TimelineEvent(lane, role, start, end, version))


def squared_lengths(samples) -> int:
    """The sum of the samples' squared sequence lengths (prompt + response): what their
    attention costs in an update or a reference pass grows with (`Calibration.train_context_ns`)."""
    return sum((s.prompt_len + s.length) ** 2 for s in samples)


# ---- drivers ------------------------------------------------------------------------------
