"""Discrete-event simulation of the RL dataflow: rollout engines, trainer, switches, staleness.

    new samples ──► engines (continuous batching, step cost = f(active batch)) ──► ready
                       ▲  admit sample of batch b only if engine version w >= b - s      │
                       │                                                                  ▼
      weights v+1 ◄── update u (consumes N ready samples started at version >= u - s) ◄──┘

Owns `simulate()` and its `SimResult`/`TimelineEvent` outputs. Modes:
- separated: `rollout_fraction` of devices generate, the rest train; both run at once. New
  weights reach the engines after a weight transfer and a load (`switch_s`); in-flight samples
  continue under the new weights (their *oldest* token version is what staleness checks).
- colocated: all devices generate; each engine computes reference logprobs of the samples it
  finished right after its own rollout ends (resident reference weights); then all switch to
  training, train data-parallel, and switch back. With `partial_rollout` (and s >= 1) a
  rollout phase ends once N samples are ready and every in-flight sample that would exceed
  the bound has finished; the rest is aborted and resumed (re-prefilling prompt + generated
  tokens) in the next phase.
- fully_shared: colocated with the reference weights offloaded while unused (each engine
  brings them in and out around its reference pass), plus an optional reward model (one more
  switch and forward pass per step).
Staleness s = 0 therefore reproduces synchronous RL in every mode. Costs come only from a
`Calibration` (measured inputs); nothing is fitted to throughput.

Contention: while more than one device works at once, each compute cost is divided by the
measured speed of its kind of work with the host's devices busy (`Calibration.contended`: decode
passes, the attention's reads beyond the decode table's context, and the update and reference
passes each have their own; < 1 for worker processes sharing a CPU, 1 for accelerators). Devices
work at once in colocated and fully_shared modes with 2+ devices, in separated mode among 2+
engines or 2+ trainers, and between engines and trainers when s >= 1 (they overlap). Colocated
and fully shared devices work in lock-step (the driver's phase barriers, the gradient
all-reduce), and so do 2+ data-parallel train devices in any mode: there the lock-step speeds
apply (measured with the two probe processes meeting as a colocated step does; work that slows
one holds up both). An engine that finishes its share early is still charged the slower rate.
"""

from __future__ import annotations

import math

from rlfusion.sim.calibration import Calibration
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_stalesync import run_runtime_stalesync
from rlfusion.sim.rl_state import SimResult, SimState


def _colocated_phase_done(sim: SimState, update: int, partial: bool) -> bool:
    if not partial:
        return (not sim.resume and all(not e.active for e in sim.engines)
                and sim.next_idx >= (update + 1) * sim.n)
    bound = update - sim.cfg.max_staleness
    if len(sim.ready) < sim.n or sum(1 for s in sim.ready if s.min_version >= bound) < sim.n:
        return False
    active = [s for e in sim.engines for s in e.active] + sim.resume
    return not any(s.min_version <= bound for s in active)


def _run_colocated(sim: SimState) -> float:
    cfg, cal, now = sim.cfg, sim.cal, 0.0
    partial = cfg.partial_rollout and cfg.max_staleness > 0
    for update in range(cfg.num_steps):
        limit = update + cfg.max_staleness if partial else update
        for eng in sim.engines:
            eng.version, eng.clock, eng.finished_tokens, eng.finished_squares = update, now, 0, 0
            sim.admit(eng, limit, now)
        t = now
        while not _colocated_phase_done(sim, update, partial):
            eng = min(sim.engines, key=sim.next_finish)
            t = sim.next_finish(eng)
            assert t < math.inf, "rollout phase cannot finish"
            sim.ready += sim.advance(eng, t)
            sim.admit(eng, limit, t)
        for eng in sim.engines:  # pause: finish the step in progress, abort the rest
            sim.ready += sim.advance(eng, t)
            for s in eng.active:
                s.needs_prefill = True
            sim.resume = sorted(sim.resume + eng.active, key=lambda s: s.idx)
            eng.active = []
            eng.changed()
            eng.clock = max(eng.last_work, now)  # its own rollout's end: it scores right away
            for role, seconds in sim.reference_phases(eng.finished_tokens, eng.finished_squares, eng):
                sim.record(eng.name, role, eng.clock, eng.clock + seconds, update)
                eng.clock += seconds
        now = max([t] + [e.clock for e in sim.engines])
        batch = sim.take_batch(update)
        assert batch is not None
        phases = [("switch", cal.switch_s)] + sim.train_phases(batch)
        for role, seconds in phases:
            for eng in sim.engines:
                sim.record(eng.name, role, now, now + seconds, update)
            now += seconds
        sim.update_end.append(now)
        for eng in sim.engines:  # back to the rollout layout for the next phase
            sim.record(eng.name, "switch", now, now + cal.switch_s, update + 1)
        now += cal.switch_s
        sim.version = update + 1
    return now


def _run_separated(sim: SimState) -> float:
    cfg, cal, now = sim.cfg, sim.cal, 0.0
    training_until = math.inf
    arrivals: list[tuple[float, int]] = []
    for eng in sim.engines:
        sim.admit(eng, cfg.max_staleness, now)
    while sim.version < cfg.num_steps:
        if training_until == math.inf:
            batch = sim.take_batch(sim.version)
            if batch is not None:
                t = max([now] + [s.ready_at for s in batch])
                for role, seconds in sim.train_phases(batch):
                    sim.record("train", role, t, t + seconds, sim.version)
                    t += seconds
                training_until = t
        eng = min(sim.engines, key=sim.next_finish)
        t_engine = sim.next_finish(eng)
        t_weights = arrivals[0][0] if arrivals else math.inf
        now = min(t_engine, training_until, t_weights)
        assert now < math.inf, "separated pipeline deadlocked"
        if now == training_until:
            sim.version, training_until = sim.version + 1, math.inf
            sim.update_end.append(now)
            sync = sim.weight_sync_s()
            sim.record("train", "weight_sync", now, now + sync, sim.version)
            arrivals.append((now + sync, sim.version))
        elif now == t_weights:
            _, version = arrivals.pop(0)
            for e in sim.engines:
                sim.ready += sim.advance(e, now)
                e.clock = max(e.clock, now)
                sim.record(e.name, "switch", e.clock, e.clock + cal.switch_s, version)
                e.clock += cal.switch_s
                e.version = version
                sim.admit(e, version + cfg.max_staleness, e.clock)
        else:
            sim.ready += sim.advance(eng, now)
            sim.admit(eng, eng.version + cfg.max_staleness, now)
    return now


_BUSY = ("rollout", "prefill", "train", "ref", "reward")


def simulate(cfg: RLSimConfig, cal: Calibration) -> SimResult:
    sim = SimState(cfg, cal)
    book = None
    if cfg.stalesync_model == "runtime":
        makespan, book = run_runtime_stalesync(sim)
    elif cfg.mode == "separated":
        makespan = _run_separated(sim)
    else:
        makespan = _run_colocated(sim)
    lanes = {e.name: cal.devices_per_engine for e in sim.engines}
    if cfg.mode == "separated":
        lanes["train"] = sim.train_devices()
    busy = dict.fromkeys(lanes, 0.0)
    for ev in sim.timeline:
        if ev.role in _BUSY:
            busy[ev.device] += max(0.0, min(ev.end, makespan) - ev.start)
    return SimResult(
        tokens_per_s=sim.trained_tokens / makespan,
        all_tokens_per_s=(sim.trained_tokens + sim.trained_prompt_tokens) / makespan,
        samples_per_s=cfg.num_steps * sim.n / makespan,
        makespan_s=makespan,
        utilization={lane: min(1.0, b / makespan) for lane, b in busy.items()},
        lane_devices=lanes, timeline=sim.timeline, dropped_samples=sim.dropped,
        staleness_max=sim.staleness_max, updates=sim.version,
        update_end_s=tuple(sim.update_end),
        generated_per_update=tuple(book.generated) if book else (),
        staleness_per_sample=tuple(book.staleness_seen) if book else (),
        max_groups_in_flight=book.in_flight_max if book else 0,
        rollout_stats=tuple(book.rollout_stats) if book else (),
    )


def device_utilization(result: SimResult) -> float:
    """Device-weighted mean utilization."""
    total = sum(result.lane_devices.values())
    return sum(result.utilization[k] * n for k, n in result.lane_devices.items()) / total
