"""Validation of the RL simulator: predict the measured tokens/s of real runs from microbenchmarks.

1. Calibrate: `rlfusion.measure.calibrate` times the real engine (decode step vs active rows,
   prefill), the actor update and reference forward (tokens/s + fixed cost), the switch, the
   weight broadcast between two gloo processes and how much two busy 1-thread processes slow
   each other here. It never sees an RL step.
2. Measure: the real RLTrainer on 2 Ray devices (1 thread each) in each deployment mode, as
   `bench/fusion.py` runs it: one warm-up step per mode, then rounds of one step per mode in
   turn. Each step's response lengths, prompt lengths and the share of tokens the update
   trained on (DAPO dynamic sampling) are recorded: they are inputs of the prediction, the
   workload, not something fitted. Before every round the contention microbenchmark runs
   again (two Ray actors, a fixed synthetic rollout + long-context decode + update workload,
   each part timed apart, alone vs together):
   this machine is shared and how much two busy processes slow each other changes from
   minute to minute (0.46-1.0 seen), so it is sampled at the same times as the runs; the
   medians of those probes are the calibration's `concurrent_speed` and each kind of work's
   speed (`decode_speed`, `context_speed`, `train_speed`). The probe also runs the two
   in lock-step (a barrier after each part, a data-parallel update), as colocated devices
   work: those medians are the lock-step speeds (`lockstep_speed`, `decode_lockstep_speed`, ...),
   which the colocated and fully shared cases use. The same probes time the
   workload alone on one device; their median over the calibration run's time scales every
   compute cost (`Calibration.at_probe_speed`): other sessions' work slows this machine by a
   varying factor, and the probe measures it with a fixed workload, not with an RL step. The
   unscaled prediction is printed too.
3. Predict: the discrete-event simulator (`rlfusion.sim.rl_sim`) replays each mode's measured
   lengths, in order, with the calibration; each step's predicted tokens/s (its generated
   tokens / its simulated time) is compared with the measured one, as the median over steps
   on both sides (as bench/fusion.py reports: one step disturbed by other work on this shared
   machine does not decide the comparison).

StaleSync (`bench/stalesync.py`'s "stalesync s=1/s=2 colocated", threshold 0.75, "stalesync
s=1 separated", rollout/update overlap, and "stalesync s=2 separated", overlap with threshold
0.75) runs interleaved with the synchronous modes. The
trainer's `StalenessBook.take_batch` is wrapped to record every trained sample's final length
by (group id, sample index); the groups still in flight at the end keep their finished
samples' lengths, and their partial samples get a length drawn from the run's lengths above
their partial one (the only lengths not replayed exactly; the bench prints how many). The
simulator (`stalesync_model = "runtime"`, `rlfusion.sim.rl_stalesync`) then runs the same
book, partial rollouts and overlap from the run's first step with those lengths, and each
measured step's tokens/s (generated tokens / step time) is compared with the simulated step's
own generated tokens / simulated time. A StaleSync step's tokens vary from 0 (the pool already
held the update's finished groups: no rollout) to ~3x a synchronous step's, so a per-step median
says little there; these cases compare tokens/s as `bench/stalesync.py` reports it, the sum of
generated tokens over the sum of step times, measured and simulated alike.

The replay workload (`configs/replay.toml`: forced long-tailed lengths, median 150, cap 1,000,
no KL term, so no reference pass) is a second interleaved measurement: synchronous co-located,
StaleSync s=1 / s=2 / s=4 co-located (threshold 0.75) and s=2 with hybrid placement (threshold 0.75:
device 1 updates, then joins each rollout), predicted the same way. There a decode pass
reads every row's cache up to its context, which the calibration's cost per row and position
(`decode_context_ms`) prices, each run of similar-length rows up to its own longest as the engine
reads them.

A validation entry is a `Case` builder in `VALIDATIONS`.

The run ends with StaleSync's reach on the replay workload: with the calibration the
validation just checked, the simulator runs every configuration a user can pick (s 1-8, the
partial-rollout threshold, 128 or 256 engine slots, co-located / hybrid / separated) on lengths
drawn as the workload draws them, and prints each one's tokens/s against the synchronous
co-located step's and the best (`--reach-only`: the calibration and this, ~4 min).

    python bench/simulator.py            # 6 rounds of each measurement (about 18 min)
    python bench/simulator.py --quick    # 2 rounds, quick calibration
    python bench/simulator.py --only replay   # one validation's cases (task | replay)
    python bench/simulator.py --reach-only    # the calibration and StaleSync's simulated reach
    python bench/simulator.py --smoke    # quick calibration, 1 round of one synchronous and one StaleSync
                                         # case per validation, 2 prompts x 2 samples, one published
                                         # run of the external validation (a test runs it)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlfusion.sim.calibration import Calibration, save_calibration
from rlfusion.measure.calibrate import default_setup
from rlfusion.measure.calibrate_all import measure_calibration
from rlfusion.measure.contention import contention_probe, contention_workers, probe_speeds, speeds_line
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.runtime.dataflow import to_trajectories
from rlfusion.runtime.partial_rollout import PAUSED
from rlfusion.sim.rl_sim import simulate
from rlfusion.stalesync.book import batch_rows
from rlfusion.stalesync.rules import handover_group
from rlfusion.sim.rl_state import SimResult
from rlfusion.sim.rl_stalesync import ROLLOUT_STATS

GOAL = 0.15  # relative error allowed by the issue
# --smoke: one synchronous and one StaleSync case of each validation (every branch of the
# measurement and the report; each case's run starts 2 Ray workers, ~3 s each on 2 cores)
SMOKE_CASES = ("colocated", "stalesync_s1_colocated", "replay_colocated", "replay_stalesync_s1_colocated")


@dataclass(frozen=True)
class MeasuredStep:
    generated_tokens: int
    step_s: float
    response_lengths: tuple[int, ...]  # per sample, in the order the devices got them
    prompt_tokens: int
    trained_tokens: int  # prompt + response tokens of the samples the update kept
    phases: dict[str, float]  # "device/phase" -> seconds in this step
    prompt_lengths: tuple[int, ...] = ()  # per sample, in the order of response_lengths


@dataclass(frozen=True)
class Case:
    """One measured configuration and the simulator config that describes it."""

    name: str
    sim: RLSimConfig  # everything but the replayed lengths (StaleSync: with them, by group id)
    steps: list[MeasuredStep]
    # StaleSync cases: the simulation starts where the real run started (its unmeasured first
    # `warmup` steps included, so the book's state is the real one) and `sim.response_lengths`
    # holds every admitted group's sample lengths by group id
    warmup: int = 0

    @property
    def measured_tokens_per_s(self) -> float:
        """Synchronous: median over steps of generated tokens / step time (as bench/fusion.py
        reports it). StaleSync: sum of generated tokens / sum of step times (as
        bench/stalesync.py reports it)."""
        if self.sim.stalesync_model == "runtime":
            return sum(s.generated_tokens for s in self.steps) / sum(s.step_s for s in self.steps)
        return statistics.median(s.generated_tokens / s.step_s for s in self.steps)


@dataclass(frozen=True)
class Prediction:
    step_s: list[float]  # simulated time of each measured step
    tokens_per_s: float  # as Case.measured_tokens_per_s, from the simulated steps
    result: SimResult


def predict(case: Case, cal: Calibration) -> Prediction:
    return predict_stalesync(case, cal) if case.sim.stalesync_model == "runtime" else predict_sync(case, cal)


def _train_fraction(steps: list[MeasuredStep]) -> float:
    total = sum(s.prompt_tokens + sum(s.response_lengths) for s in steps)
    return max(0.01, min(1.0, sum(s.trained_tokens for s in steps) / total))


def predict_stalesync(case: Case, cal: Calibration) -> Prediction:
    """Simulate the run from its first step with the runtime's StaleSync rules; the measured
    steps are the last `len(case.steps)`. Predicted tokens/s: the simulator's own generated
    tokens of those steps / their simulated time (partial rollouts make both vary per step)."""
    cfg = case.sim.replace(num_steps=case.warmup + len(case.steps), train_fraction=_train_fraction(case.steps))
    result = simulate(cfg, cal)
    ends = (0.0,) + result.update_end_s
    seconds = [ends[i + 1] - ends[i] for i in range(case.warmup, len(ends) - 1)]
    gens = result.generated_per_update[case.warmup:]
    return Prediction(seconds, sum(gens) / sum(seconds), result)


def predict_sync(case: Case, cal: Calibration) -> Prediction:
    """Replay the case's measured steps in the simulator. The first step is replayed twice (a
    warm-up update, as the real runs have) and the time from its end to the last update's end
    is the predicted time of the measured steps."""
    steps = [case.steps[0]] + case.steps
    lengths = tuple(n for s in steps for n in s.response_lengths)
    samples = len(lengths)
    prompt_len = round(sum(s.prompt_tokens for s in steps) / samples)
    fraction = _train_fraction(steps)
    prompts = tuple(n for s in steps for n in s.prompt_lengths)
    cfg = case.sim.replace(num_steps=len(steps), response_lengths=lengths, prompt_len=prompt_len,
                           prompt_lengths=prompts if len(prompts) == samples else (),
                           train_fraction=fraction,
                           max_new_tokens=max(case.sim.max_new_tokens, max(lengths)))
    result = simulate(cfg, cal)
    ends = result.update_end_s
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    tokens_per_s = statistics.median(s.generated_tokens / t for s, t in zip(case.steps, seconds))
    return Prediction(seconds, tokens_per_s, result)


# ---- measuring the real runs -----------------------------------------------------------------

class _RecordingRollout:
    """Reads the per-row numbers (response length, prompt + response tokens) of the rows each
    update takes, in (group, sample) order, as a reader of its own just before the update (a few
    bytes per row; the samples themselves stay on the devices)."""

    def __init__(self, trainer):
        self.last: list = []
        devices = trainer.devices
        inner = devices.update

        def update(count):
            batch = devices.queue.get("bench", ["sample", "num_tokens", "response_len"], count, policy="group",
                                      block=True, timeout=trainer.cfg.deploy.queue_timeout_s)
            c = batch.columns
            self.last = sorted(zip(batch.group_ids, c["sample"], c["num_tokens"], c["response_len"]))
            return inner(count)
        devices.update = update


def _step(trainer, rec: _RecordingRollout) -> MeasuredStep:
    start = len(trainer.timeline.spans)
    m = trainer.train_step()
    spans = trainer.timeline.spans[start:]
    phases: dict[str, float] = {}
    for s in spans:
        key = f"{s.device}/{s.phase}"
        phases[key] = phases.get(key, 0.0) + s.duration_s
    rows = rec.last
    prompts = tuple(tokens - length for _, _, tokens, length in rows)
    return MeasuredStep(int(m["generated_tokens"]), m["time_step_s"],
                        tuple(length for *_, length in rows), sum(prompts),
                        round(m["update_tokens_per_s"] * m["time_update_s"]), phases, prompts)


@dataclass
class Probes:
    """Contention microbenchmark samples taken between the measured rounds."""

    alone: list[dict]  # seconds of the probe workload's parts (`contention_probe`)
    together: list[dict]
    lockstep: list[dict]


# StaleSync variants of bench/stalesync.py validated here: case name -> its VARIANTS name
STALESYNC_CASES = {"stalesync_s1_colocated": "stalesync s=1 colocated",  # threshold 0.75
                   "stalesync_s2_colocated": "stalesync s=2 colocated",  # threshold 0.75
                   "stalesync_s1_separated": "stalesync s=1 separated",  # threshold 1, overlap
                   "stalesync_s2_separated": "stalesync s=2 separated"}  # threshold 0.75, overlap


class _BatchRecorder:
    """Wraps a StaleSync trainer's `StalenessBook.take_batch`: reads the batch's rows from the
    queue (the driver's client, as a reader of its own, before the update retires them) for every
    trained sample's final response length by (group id, sample index), and the last batch's
    (response, prompt) token counts."""

    COLUMNS = ["sample", "response_len", "num_tokens"]

    def __init__(self, trainer):
        self.trainer, self.book = trainer, trainer.stale
        self.lengths: dict[tuple[int, int], int] = {}
        self.prompts: dict[int, int] = {}
        self.taken: list[list[tuple[int, int]]] = []  # batches taken since the caller last reset it
        inner = self.book.take_batch

        def take_batch(update_version):
            groups, stats = inner(update_version)
            self.taken.append(self._read(batch_rows(groups), "bench"))
            return groups, stats
        self.book.take_batch = take_batch

    def _read(self, rows: list[int], reader: str) -> list[tuple[int, int]]:
        if not rows:
            return []
        batch = self.trainer.devices.queue.get_rows(reader, rows, self.COLUMNS, timeout=60)
        c, out = batch.columns, []
        for i, gid in enumerate(batch.group_ids):
            n, prompt = c["response_len"][i], c["num_tokens"][i] - c["response_len"][i]
            self.lengths[(gid, c["sample"][i])] = n
            self.prompts[gid] = prompt
            out.append((n, prompt))
        return out

    def group_lengths(self, group_size: int, seed: int = 0) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        """Every admitted group's sample lengths in group-id order, for the replay. Samples of
        groups still in flight when the measurement ended: finished ones (in the queue, or held
        on a rollout device) keep their length; a partial one (aborted at p tokens) gets a length
        drawn from this run's measured lengths above p (its real final length was never
        produced). Returns (lengths, how many were drawn, every sample's prompt tokens in the
        same order)."""
        import random

        rng = random.Random(seed)
        self._read(batch_rows([g for g in self.book.groups.values() if g.finished]), "bench/in flight")
        known = dict(self.lengths)
        partial: dict[tuple[int, int], int] = {}
        held = [t for state in self.trainer.devices.paused() for s in state["samples"].values() for t in s]
        handed = [r for g in self.book.groups.values() if not g.finished and g.held_by < 0 for r in g.rows]
        if handed:
            batch = self.trainer.devices.queue.get_rows("bench/in flight", handed,
                                                        ["response_ids", "finish_reason", "sample", "prompt_ids"])
            held += to_trajectories(batch)
        for t in held:
            gid = t.group_id if t.group_id >= 0 else handover_group(t.group_id)
            (partial if t.finish_reason == PAUSED else known)[(gid, t.sample)] = len(t.response_ids)
            self.prompts[gid] = len(t.prompt_ids)
        pool = sorted(known.values())
        out, drawn = [], 0
        for gid in range(self.book.next_group_id):
            for i in range(group_size):
                n = known.get((gid, i))
                if n is None:
                    above = [x for x in pool if x > partial.get((gid, i), 0)]
                    n = rng.choice(above) if above else partial.get((gid, i), 0) + 1
                    drawn += 1
                out.append(n)
        mean = round(statistics.mean(self.prompts.values())) if self.prompts else 12
        prompts = tuple(self.prompts.get(gid, mean) for gid in range(self.book.next_group_id) for _ in range(group_size))
        return tuple(out), drawn, prompts


def _stale_step(trainer, rec: _BatchRecorder) -> MeasuredStep:
    start = len(trainer.timeline.spans)
    # the batch this update trains: separated overlap took it in the step before
    before = rec.taken[-1] if trainer.overlap and trainer.schedule.pending else None
    rec.taken = []
    m = trainer.train_step()
    batch = before if before is not None else rec.taken[0]
    phases: dict[str, float] = {}
    for s in trainer.timeline.spans[start:]:
        key = f"{s.device}/{s.phase}"
        phases[key] = phases.get(key, 0.0) + s.duration_s
    for key in ("staleness_mean", "groups_in_update", "groups_in_flight", *ROLLOUT_STATS):
        phases[f"metric/{key}"] = m.get(key, 0.0)
    return MeasuredStep(int(m["generated_tokens"]), m["time_step_s"],
                        tuple(n for n, _ in batch),
                        sum(p for _, p in batch),
                        round(m["update_tokens_per_s"] * m["time_update_s"]), phases,
                        tuple(p for _, p in batch))


# The replay workload (configs/replay.toml: long-tailed forced lengths, median 150, cap 1,000, no
# KL term): case name -> bench/stalesync.py's VARIANTS name
REPLAY_CASES = {"replay_colocated": "sync colocated",
                "replay_stalesync_s1_colocated": "stalesync s=1 colocated",  # threshold 0.75
                "replay_stalesync_s2_colocated": "stalesync s=2 colocated",  # threshold 0.75
                "replay_stalesync_s4_colocated": "stalesync s=4 colocated",  # threshold 0.75
                "replay_stalesync_s2_hybrid": "stalesync s=2 hybrid"}  # threshold 0.75, hybrid placement


def measured_cases(rounds: int, probes: Probes, workload: str = "task", smoke: bool = False) -> list[Case]:
    """Real runs on 2 Ray devices (1 thread each), interleaved: a warm-up step each, then rounds
    of one step per run in turn. `task`: the three synchronous deployment modes of
    `bench/fusion.py` and the StaleSync variants of `bench/stalesync.py` in STALESYNC_CASES (32
    prompts x 8 samples); `replay`: REPLAY_CASES on configs/replay.toml (8 x 8). `smoke`: only
    SMOKE_CASES, at `bench/stalesync.py`'s smoke sizes."""
    import ray
    from fusion import DEPLOY_MODES, make_trainer  # bench/fusion.py, next to this file
    from stalesync import SMOKE_ROLLOUT, VARIANTS, make_trainer as make_stale_trainer  # bench/stalesync.py
    from workload import REPLAY  # bench/workload.py

    sizes = SMOKE_ROLLOUT if smoke else []
    if workload == "task":
        sync = {m: (m, lambda tmp, m=m: make_trainer(m, tmp, sizes)) for m in DEPLOY_MODES}
        stale = STALESYNC_CASES
        config = None
    else:
        sync = {c: (VARIANTS[v][0], lambda tmp, v=v: make_stale_trainer(v, tmp, 10, 1000, seed=0, config=REPLAY,
                                                                        overrides=sizes))
                for c, v in REPLAY_CASES.items() if "stalesync.enabled=true" not in VARIANTS[v][1]}
        stale = {c: v for c, v in REPLAY_CASES.items() if c not in sync}
        config = REPLAY
    if smoke:
        sync = {c: x for c, x in sync.items() if c in SMOKE_CASES}
        stale = {c: v for c, v in stale.items() if c in SMOKE_CASES}
    names = list(sync) + list(stale)
    # logical CPUs: a 2-device placement group per run and the 2 probe actors; one runs at a time
    ray.init(address="local", num_cpus=2 * len(names) + 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    steps: dict[str, list[MeasuredStep]] = {m: [] for m in names}
    stale_lengths = {}
    try:
        workers = contention_workers(default_setup(threads=1))
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {m: make(Path(tmp)) for m, (_, make) in sync.items()}
            trainers.update({c: make_stale_trainer(v, Path(tmp), 10, 1000, seed=0, config=config, overrides=sizes)
                             for c, v in stale.items()})
            recorders = {}
            for m, t in trainers.items():
                recorders[m] = _BatchRecorder(t) if m in stale else _RecordingRollout(t)
                t.train_step()  # warm-up
            for r in range(rounds):
                alone, together, lockstep = contention_probe(workers)
                probes.alone += alone
                probes.together += together
                probes.lockstep += lockstep
                for m in names:
                    step = _stale_step if m in stale else _step
                    steps[m].append(step(trainers[m], recorders[m]))
                print(f"  round {r + 1}: " + ", ".join(
                    f"{m} {steps[m][-1].generated_tokens / steps[m][-1].step_s:,.0f} tok/s"
                    for m in names) + f"; contention probe (independent / lock-step): "
                    f"{speeds_line(probe_speeds(alone, together, lockstep))}", flush=True)
            cfg = trainers[names[0]].cfg
            for c in stale:
                plan = trainers[c].devices.plan
                scorers = "rollout" if plan.reference == plan.rollout else "train"
                stale_lengths[c] = (trainers[c].cfg, recorders[c].group_lengths(cfg.rollout.group_size), scorers)
            for t in trainers.values():
                t.close()
    finally:
        ray.shutdown()
    base = RLSimConfig(devices_per_supernode=2, prompts_per_step=cfg.rollout.prompts_per_step,
                       group_size=cfg.rollout.group_size, max_staleness=0,
                       max_num_seqs=cfg.rollout.max_num_seqs,
                       min_prefill_batch=getattr(cfg.rollout, "min_prefill_batch", 1),
                       max_new_tokens=cfg.rollout.max_new_tokens, reference=bool(cfg.algo.kl_coef))
    cases = [Case(m, base.replace(mode=mode), steps[m]) for m, (mode, _) in sync.items()]
    for c in stale:
        tcfg, (lengths, drawn, prompts), scorers = stale_lengths[c]
        st = tcfg.stalesync
        print(f"  {c}: {len(lengths)} admitted samples replayed by group id, {drawn} of them "
              f"(unfinished when the measurement ended) drawn from the run's lengths above their "
              f"partial length")
        sim = base.replace(mode=tcfg.deploy.mode, max_staleness=st.max_staleness, partial_rollout=True,
                           stalesync_model="runtime", rollout_finish_threshold=st.rollout_finish_threshold,
                           resume_kv=st.resume_kv,
                           scorers=scorers,
                           response_lengths=lengths, prompt_lengths=prompts,
                           prompt_len=round(statistics.mean(prompts)),
                           max_new_tokens=max(base.max_new_tokens, max(lengths)))
        cases.append(Case(c, sim, steps[c], warmup=1))
    return cases


# Each entry measures real runs (taking contention probes between rounds) and returns the cases
# to predict: the synchronous modes and the StaleSync variants are measured interleaved. Called
# as measure(rounds, probes, smoke).
VALIDATIONS: dict[str, tuple[str, Callable[[int, Probes, bool], list[Case]]]] = {
    "task": ("fusion + stalesync", lambda rounds, probes, smoke: measured_cases(rounds, probes, "task", smoke)),
    "replay": ("replay workload: sync + stalesync co-located + hybrid",
               lambda rounds, probes, smoke: measured_cases(rounds, probes, "replay", smoke)),
}


# ---- report -----------------------------------------------------------------------------------

def _phase_line(case: Case, pred: Prediction) -> str:
    """Measured vs predicted seconds per step of each device's main phases."""
    n = len(case.steps)
    window = (pred.result.update_end_s[0], pred.result.update_end_s[-1])
    predicted: dict[str, float] = {}
    for e in pred.result.timeline:
        start, end = max(e.start, window[0]), min(e.end, window[1])
        if end > start:
            key = f"{e.device}/{e.role}"
            predicted[key] = predicted.get(key, 0.0) + (end - start) / n
    measured = {k: statistics.mean(s.phases.get(k, 0.0) for s in case.steps)
                for k in {k for s in case.steps for k in s.phases if not k.startswith("metric/")}}
    lanes = ({"device0": "engine0", "device1": "train"} if case.sim.mode == "separated"
             else {"device0": "engine0", "device1": "engine1"})
    parts = []
    for device, lane in lanes.items():
        for real, role in (("rollout", "rollout"), ("reference", "ref"), ("train", "train")):
            meas = measured.get(f"{device}/{real}", 0.0)
            sim = predicted.get(f"{lane}/{role}", 0.0) + (
                predicted.get(f"{lane}/prefill", 0.0) if role == "rollout" else 0.0)
            if meas or sim:
                parts.append(f"{device} {real} {meas:.2f}/{sim:.2f}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    parser.add_argument("--rounds", type=int, default=0, help="measured steps per mode "
                        "(default 6, --quick 2, --smoke 1)")
    parser.add_argument("--calibration-out", type=Path, default=None,
                        help="also save the measured calibration JSON here")
    parser.add_argument("--only", choices=sorted(VALIDATIONS), default=None,
                        help="measure one validation's cases (default: all)")
    parser.add_argument("--reach-only", action="store_true",
                        help="only the calibration and StaleSync's simulated reach on the replay workload (~1 min)")
    parser.add_argument("--external-only", action="store_true",
                        help="only the external validation (verl's fully async ablation, seconds)")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    if args.external_only:
        external_validation(smoke=args.smoke)
        return
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 6)
    if rounds < 1:
        parser.error(f"--rounds={rounds} must be >= 1")
    t0 = time.perf_counter()
    print("calibration microbenchmarks (rlfusion.measure.calibrate, 1 thread per device):", flush=True)
    cal = measure_calibration(None, threads=1, quick=args.quick or args.smoke, smoke=args.smoke)
    if args.calibration_out:
        save_calibration(cal, args.calibration_out)
        print(f"  saved {args.calibration_out}")
    if args.reach_only:
        schedule_reach(cal, smoke=args.smoke)
        return
    cases: list[Case] = []
    probes = Probes([], [], [])
    for key, (name, measure) in VALIDATIONS.items():
        if args.only and key != args.only:
            continue
        print(f"measuring real runs: {name}, {rounds} rounds", flush=True)
        cases += measure(rounds, probes, args.smoke)
    speeds = probe_speeds(probes.alone, probes.together, probes.lockstep)
    before = {k: getattr(cal, k) for k in speeds}
    print(f"contention speeds (independent / lock-step; lock-step for colocated and fully shared):\n"
          f"  calibration run: {speeds_line(before)}\n"
          f"  median of the {len(probes.alone) // 2} probes between rounds (used): {speeds_line(speeds)}")
    probe_s = speeds.pop("probe_s")
    cal = cal.replace(**speeds)
    print(f"machine speed: probe workload alone {cal.probe_s:.3f} s in the calibration run, "
          f"{probe_s:.3f} s median between rounds (costs scaled by {probe_s / cal.probe_s:.3f})")
    unscaled, cal = cal, cal.at_probe_speed(probe_s)
    print(f"\n## simulator vs real runs ({time.perf_counter() - t0:.0f} s)")
    print("| case | measured tok/s | predicted tok/s | error | "
          "measured step s (median) | predicted step s (median) |")
    print("|---|---|---|---|---|---|")
    errors = {}
    for case in cases:
        pred = predict(case, cal)
        meas = case.measured_tokens_per_s
        errors[case.name] = abs(pred.tokens_per_s / meas - 1.0)
        step = statistics.median(s.step_s for s in case.steps)
        print(f"| {case.name} | {meas:,.0f} | {pred.tokens_per_s:,.0f} | "
              f"{pred.tokens_per_s / meas - 1.0:+.1%} | {step:.2f} | "
              f"{statistics.median(pred.step_s):.2f} |")
    print("\nwithout the machine-speed scaling (calibration-run speed):")
    for case in cases:
        pred = predict(case, unscaled)
        print(f"  {case.name}: predicted {pred.tokens_per_s:,.0f} tok/s, error "
              f"{pred.tokens_per_s / case.measured_tokens_per_s - 1.0:+.1%}")
    print("\nseconds per step, measured/predicted:")
    for case in cases:
        print(f"  {case.name}: {_phase_line(case, predict(case, cal))}")
    stale = [case for case in cases if case.sim.stalesync_model == "runtime"]
    if stale:
        print("\nStaleSync schedule, measured/predicted (mean per measured step):")
    for case in stale:
        r = predict(case, cal).result
        n, per = len(case.steps), case.sim.group_size
        gen = r.generated_per_update[case.warmup:]
        trained = [len(s.response_lengths) / per for s in case.steps]
        st_meas = statistics.mean(s.phases.get("metric/staleness_mean", 0.0) for s in case.steps)
        st_pred = statistics.mean(r.staleness_per_sample) if r.staleness_per_sample else 0.0
        pred = predict(case, cal)
        medians = (statistics.median(s.generated_tokens / s.step_s for s in case.steps),
                   statistics.median(g / t for g, t in zip(gen, pred.step_s)))
        print(f"  {case.name}: median over steps of tok/s {medians[0]:,.0f}/{medians[1]:,.0f} "
              f"({medians[1] / max(medians[0], 1e-9) - 1:+.1%})")
        sim_stats = r.rollout_stats[case.warmup:]
        print(f"  {case.name}: busiest rollout engine per step: " + ", ".join(
            f"{key} {statistics.mean(st.phases.get(f'metric/{key}', 0.0) for st in case.steps):.3f}/"
            f"{statistics.mean(x.get(key, 0.0) for x in sim_stats):.3f}" for key in ROLLOUT_STATS))
        print(f"  {case.name}: generated tokens {statistics.mean(s.generated_tokens for s in case.steps):,.0f}"
              f"/{statistics.mean(gen):,.0f}, groups trained {statistics.mean(trained):.1f}/"
              f"{len(r.staleness_per_sample) / per / len(r.update_end_s):.1f} (sim: whole run), staleness mean {st_meas:.2f}/{st_pred:.2f} (sim: whole run), "
              f"max groups in flight (sim) {r.max_groups_in_flight} <= (s+1)B = "
              f"{(case.sim.max_staleness + 1) * case.sim.prompts_per_step}; measured steps {n}")
    lengths = [n for case in cases for s in case.steps for n in s.response_lengths]
    print(f"\nreplayed response lengths: {len(lengths)} samples, mean "
          f"{statistics.mean(lengths):.1f}, max {max(lengths)}; calibration: concurrent speed "
          f"{cal.concurrent_speed:.2f}, lock-step {cal.lockstep:.2f} (whole probe workload), train "
          f"{cal.train_tokens_per_s_per_device:,.0f} tok/s + {cal.train_context_ns:.1f} ns x length^2, "
          f"decode {cal.decode_step_ms[0]:.2f}-{cal.decode_step_ms[-1]:.2f} ms/step")
    replay_sync = [case for case in cases if case.name == "replay_colocated"]
    schedule_reach(cal, _train_fraction(replay_sync[0].steps) if replay_sync else 1.0,
                   smoke=args.smoke)
    print()
    external_validation(targets=False, smoke=args.smoke)
    for name, err in errors.items():
        print(f"target sim_error_{name}: {err:.2f} (goal <= {GOAL})")
    external_targets()


# The reach of StaleSync's schedule on the replay workload: the simulator, with the calibration
# the validation used, over the knobs a user can turn (s, the partial-rollout threshold, engine
# slots, placement), on lengths drawn as the workload draws them (`rl/replay.py`, by group id).
REACH = {"max_staleness": (1, 2, 4, 8), "threshold": (0.25, 0.5, 0.75, 1.0), "max_num_seqs": (128, 256),
         "mode": ("colocated", "hybrid", "separated")}
REACH_STEPS, REACH_WARMUP, REACH_DRAWS = 40, 5, 3  # updates simulated, left out, length draws (group id offsets)


def schedule_reach(cal: Calibration, train_fraction: float = 1.0, smoke: bool = False) -> dict[str, float]:
    """Simulated tokens/s of every StaleSync configuration in REACH over the synchronous
    co-located step's, on `configs/replay.toml`'s workload (8 prompts x 8 samples, 2 devices,
    lengths drawn by group id, no reference pass): the median over REACH_DRAWS draws of
    generated tokens / time of the updates after the first REACH_WARMUP. Prints each
    configuration's ratio, its seconds, decode seconds and rows per pass per update (the first
    draw), and the best;
    returns {configuration: ratio}."""
    from rlfusion.config import load_config
    from rlfusion.rl.replay import replay_length
    from rlfusion.runtime.train_config import TrainConfig
    from workload import REPLAY  # bench/workload.py

    ro = load_config(TrainConfig, REPLAY).rollout
    B, G = ro.prompts_per_step, ro.group_size
    steps, warmup = (8, 2) if smoke else (REACH_STEPS, REACH_WARMUP)
    grid = {"max_staleness": (1,), "threshold": (0.75,), "max_num_seqs": (ro.max_num_seqs,),
            "mode": ("colocated",)} if smoke else REACH

    @functools.lru_cache(maxsize=None)  # every configuration of a draw replays the same lengths
    def lengths(offset: int, groups: int) -> tuple[int, ...]:
        return tuple(replay_length(offset + g, i, ro.replay_median, ro.replay_sigma, ro.replay_between,
                                   ro.max_new_tokens) for g in range(groups) for i in range(G))

    base = RLSimConfig(devices_per_supernode=2, prompts_per_step=B, group_size=G, num_steps=steps,
                       max_new_tokens=ro.max_new_tokens, max_num_seqs=ro.max_num_seqs, reference=False,
                       prompt_len=23, train_fraction=train_fraction)

    def rate(cfg: RLSimConfig) -> tuple[float, dict[str, float]]:
        r = simulate(cfg, cal)
        ends = r.update_end_s
        if cfg.stalesync_model == "runtime":
            generated = sum(r.generated_per_update[warmup:])
        else:
            generated = sum(cfg.response_lengths[warmup * B * G:steps * B * G])
        stats = r.rollout_stats[warmup:]
        per = {k: statistics.mean(x.get(k, 0.0) for x in stats) for k in ("time_decode_s", "engine_decode_rows_mean")} \
            if stats else {}
        per["step_s"] = (ends[-1] - ends[warmup - 1]) / (steps - warmup)
        return generated / (ends[-1] - ends[warmup - 1]), per

    offsets = [d * 100_000 for d in range(1 if smoke else REACH_DRAWS)]
    sync_runs = {o: rate(base.replace(mode="colocated", response_lengths=lengths(o, B * steps))) for o in offsets}
    sync = {o: r for o, (r, _) in sync_runs.items()}
    ratios: dict[str, float] = {}
    print(f"\n## StaleSync's reach on the replay workload, simulated (calibration above; {steps} updates, "
          f"the first {warmup} left out, median of {len(offsets)} length draws)")
    print(f"synchronous co-located: {statistics.median(sync.values()):,.0f} tok/s (simulated), "
          f"{sync_runs[0][1]['step_s']:.2f} s per update (first draw)")
    print("| placement | s | threshold | slots | tok/s vs sync co-located | s per update | decode s / update "
          "(busiest engine) | rows per pass |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in grid["mode"]:
        for s in grid["max_staleness"]:
            for thr in grid["threshold"]:
                for seqs in grid["max_num_seqs"]:
                    runs = [rate(base.replace(mode=mode, max_staleness=s, partial_rollout=True,
                                              stalesync_model="runtime", rollout_finish_threshold=thr,
                                              max_num_seqs=seqs,
                                              response_lengths=lengths(o, B * (steps + s + 2) * 2)))
                            + (sync[o],) for o in offsets]
                    name = f"{mode} s={s} threshold {thr} slots {seqs}"
                    ratios[name] = statistics.median(r / base_rate for r, _, base_rate in runs)
                    per = runs[0][1]
                    print(f"| {mode} | {s} | {thr} | {seqs} | {ratios[name]:.2f}x | {per['step_s']:.2f} | "
                          f"{per.get('time_decode_s', 0.0):.2f} | {per.get('engine_decode_rows_mean', 0.0):.0f} |")
    best = max(ratios, key=ratios.get)
    print(f"best simulated StaleSync configuration: {best}: {ratios[best]:.2f}x the synchronous co-located step")
    return ratios


EXTERNAL_GOAL = 0.25  # the synchronous step of a published run, within 25%


def external_validation(targets: bool = True, smoke: bool = False) -> None:
    """verl's fully async ablation (`rlfusion.sim.external`): the publication's figures and the
    simulator's side by side, from the hardware, model and workload alone (no run here).
    `smoke`: one of the published runs (each takes ~4 s to simulate here)."""
    from rlfusion.sim.external import SOURCE, reproduce

    rows = reproduce((128,)) if smoke else reproduce()
    print(f"## external validation: {SOURCE}")
    print("| GPUs | sync step s published / simulated (error) | gen | old logprob | update | "
          "async step s published / simulated | async speed-up published (400 steps) / simulated |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p, ph = r.published, r.sync_phases
        print(f"| {p.gpus} | {p.sync_step_s:.0f} / {r.sync_step_s:.0f} ({r.sync_error:+.0%}) | "
              f"{p.sync_gen_s:.0f} / {ph.get('rollout', 0) + ph.get('prefill', 0):.0f} | "
              f"{p.sync_old_log_prob_s:.0f} / {ph.get('ref', 0):.0f} | {p.sync_update_s:.0f} / {ph.get('train', 0):.0f} | "
              f"{p.async_step_s:.0f} / {r.async_step_s:.0f} | {p.speedup_400:.2f} / {r.speedup:.2f} |")
    _external_rows[:] = rows
    if targets:
        external_targets()


_external_rows: list = []


def external_targets() -> None:
    rows = _external_rows
    worst = max(abs(r.sync_error) for r in rows)
    print(f"target sim_error_verl_sync_step_max: {worst:.2f} (goal <= {EXTERNAL_GOAL})")
    for r in rows:
        print(f"target sim_verl_async_speedup_{r.published.gpus}gpus: {r.speedup:.2f} "
              f"(goal >= {r.published.speedup_400 * 0.75:.2f}, published {r.published.speedup_400:.2f})")


if __name__ == "__main__":
    main()
