"""Projection of RL post-training throughput at supernode scale (`rlfusion simulate --project`).

Runs the RL simulator with a calibration derived from hardware specs and the cost model
(`cluster_calibration`), for co-located vs separated deployment and synchronous (s = 0) vs
StaleSync (s >= 1 with partial rollout), on 1..N supernodes (weak scaling: prompts per update
grow with the supernodes), under three sets of the assumptions nothing here can measure
(`SCENARIOS`: low, central, high throughput), and prints every assumption next to the numbers.

What grows with the cluster: the longest response an update waits for (the log-normal tail is
capped far beyond it, so more samples per update draw longer ones), stragglers (a spread of
device speeds; a synchronous barrier waits for the slowest), the serial advantage stage on the
first train device (its per-sample cost measured on this machine's CPU), the gradient
all-reduce and the weight sync across supernodes. Nothing here is measured on an accelerator;
`bench/simulator.py` is what validates the simulator on real (CPU) runs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from rlfusion.model.config import get_preset
from rlfusion.sim.cluster_calibration import (EngineAssumptions, calibration_from_hardware, engine_slots,
                                              train_plan)
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.rl_config import RLSimConfig, expected_longest
from rlfusion.sim.rl_sim import device_utilization, simulate

MAX_NEW_TOKENS = 32768  # the response cap: far beyond the longest of any update's draws


@dataclass(frozen=True)
class Scenario:
    """Assumptions the projection cannot measure, at one end of their plausible range."""

    name: str
    a2a_message_us: float  # per-peer cost of an expert all-to-all message
    straggler_sigma: float  # log-sigma of device speeds
    memory_utilization: float  # share of HBM an engine may use (KV slots)
    matmul_efficiency_scale: float  # times the chip's assumed matmul efficiency
    step_overhead_ms: float  # host work of one engine step the device does not hide


SCENARIOS = (
    Scenario("low", a2a_message_us=3.0, straggler_sigma=0.08, memory_utilization=0.80, matmul_efficiency_scale=0.8,
             step_overhead_ms=2.0),
    Scenario("central", a2a_message_us=1.0, straggler_sigma=0.03, memory_utilization=0.90,
             matmul_efficiency_scale=1.0, step_overhead_ms=1.0),
    Scenario("high", a2a_message_us=0.5, straggler_sigma=0.0, memory_utilization=0.95, matmul_efficiency_scale=1.1,
             step_overhead_ms=0.5),
)


@dataclass(frozen=True)
class ProjectionRow:
    mode: str
    variant: str  # "sync" or "stalesync"
    num_supernodes: int
    tokens_per_s: dict[str, float]  # scenario -> response tokens trained per second
    all_tokens_per_s: dict[str, float]  # scenario -> prompt + response tokens trained per second
    linearity: float  # central tokens/s / (supernodes x central tokens/s on one supernode)
    utilization: float  # central
    step_s: float  # central, mean time per update


def workload(mode: str, max_staleness: int, chips_per_supernode: int) -> RLSimConfig:
    """The RL step assumed for the projection (reasoning-style long-tail responses)."""
    return RLSimConfig(mode=mode, devices_per_supernode=chips_per_supernode,
                       prompts_per_step=128, group_size=16, num_steps=4,
                       prompt_len=1024, response_median=1536.0, response_p99_over_median=3.75,
                       max_new_tokens=MAX_NEW_TOKENS, max_num_seqs=256, max_staleness=max_staleness,
                       partial_rollout=max_staleness > 0, inter_supernode_GBps=50.0,
                       rollout_fraction=0.5)


def project(model_name: str = "pangu-ultra-moe-718b", kind: str = "cm384",
            supernodes: tuple[int, ...] = (1, 2, 4), max_staleness: int = 1,
            scenarios: tuple[Scenario, ...] = SCENARIOS, advantage_s_per_sample: float | None = None
            ) -> tuple[list[ProjectionRow], list[str]]:
    """Rows for every (mode, variant, supernodes), each under every scenario, and the assumption
    lines. `advantage_s_per_sample`: the serial per-sample work between rollout and update
    (None: measured here, `measure.calibrate.measure_advantage`)."""
    if max_staleness < 1:
        raise ValueError(f"--max-staleness={max_staleness} must be >= 1 (the StaleSync variant)")
    if not any(s.name == "central" for s in scenarios):
        raise ValueError("the projection needs a 'central' scenario")
    model = get_preset(model_name)
    probe = get_cluster(kind, 1)
    supernode = get_cluster(kind, probe.chips_per_domain)
    if advantage_s_per_sample is None:
        advantage_s_per_sample = _measured_advantage()
    cals, slots = _calibrations(model, supernode, scenarios, advantage_s_per_sample)
    rows = []
    for mode in ("colocated", "separated"):
        for variant, s in (("sync", 0), ("stalesync", max_staleness)):
            first = None
            for n in supernodes:
                tokens, all_tokens, central = {}, {}, None
                for sc in scenarios:
                    cfg = workload(mode, s, supernode.num_chips).replace(num_supernodes=n,
                                                                         straggler_sigma=sc.straggler_sigma)
                    cfg = cfg.replace(max_num_seqs=balanced_slots(cfg, cals[sc.name].devices_per_engine, slots[sc.name]))
                    result = simulate(cfg, cals[sc.name])
                    tokens[sc.name], all_tokens[sc.name] = result.tokens_per_s, result.all_tokens_per_s
                    if sc.name == "central":
                        central = result
                first = first or tokens["central"]
                ends = central.update_end_s
                step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0]
                rows.append(ProjectionRow(mode, variant, n, tokens, all_tokens, tokens["central"] / (n * first),
                                          device_utilization(central), step))
    return rows, _assumptions(model_name, model, supernode, max_staleness, scenarios, cals, slots,
                              advantage_s_per_sample, supernodes)


def balanced_slots(cfg: RLSimConfig, devices_per_engine: int, memory_slots: int) -> int:
    """Slots per engine: what its KV memory holds, at most its even share of the samples that
    may be in flight ((s + 1) updates' worth), as a load balancer over the engines spreads them
    (the simulator's engines otherwise fill in order, the first taking all it can hold)."""
    devices = cfg.num_devices * (cfg.rollout_fraction if cfg.mode == "separated" else 1.0)
    engines = max(1, int(devices) // devices_per_engine)
    return max(1, min(memory_slots, -(-(cfg.max_staleness + 1) * cfg.samples_per_step // engines)))


def _calibrations(model, supernode, scenarios: tuple[Scenario, ...], advantage_s_per_sample: float
                  ) -> tuple[dict[str, Any], dict[str, int]]:
    """Per scenario: the calibration of one supernode from its hardware and the cost model, and an
    engine's slots (the update's layout is searched once: it does not depend on the scenario)."""
    base = EngineAssumptions()
    plan = train_plan(model, supernode, base)
    cals, slots = {}, {}
    for sc in scenarios:
        chip = dataclasses.replace(supernode.chip, matmul_efficiency=supernode.chip.matmul_efficiency
                                   * sc.matmul_efficiency_scale)
        cluster = dataclasses.replace(supernode, chip=chip)
        a = dataclasses.replace(base, a2a_message_us=sc.a2a_message_us, memory_utilization=sc.memory_utilization,
                                step_overhead_ms=sc.step_overhead_ms)
        cal = calibration_from_hardware(model, cluster, a, plan)
        cals[sc.name] = dataclasses.replace(cal, advantage_s_per_sample=advantage_s_per_sample)
        slots[sc.name] = engine_slots(model, cluster, a)
    return cals, slots


def _assumptions(model_name: str, model, supernode, max_staleness: int, scenarios: tuple[Scenario, ...],
                 cals: dict[str, Any], slots: dict[str, int], advantage_s_per_sample: float,
                 supernodes: tuple[int, ...]) -> list[str]:
    """Every assumption the projection rests on, one line each (printed under the table)."""
    w = workload("colocated", max_staleness, supernode.num_chips)
    cal = cals["central"]
    longest = ", ".join(f"{n} supernode(s) {expected_longest(w.samples_per_step * n // w.num_supernodes, w.response_median, w.length_sigma):,.0f}"
                        for n in supernodes)
    return [
        f"model {model_name}: {model.param_counts()['total'] / 1e9:,.0f}B total, "
        f"{model.param_counts()['active'] / 1e9:,.1f}B active parameters",
        f"supernode: {supernode.num_chips} x {supernode.chip.name} "
        f"({supernode.chip.peak_tflops:.0f} TFLOPS bf16, {supernode.chip.memory_GB:.0f} GB HBM at "
        f"{supernode.chip.memory_bandwidth_GBps:.0f} GB/s), fabric {supernode.intra.bandwidth_GBps:.0f}"
        f" GB/s per chip inside, {w.inter_supernode_GBps:.0f} GB/s per chip between supernodes",
        f"workload per supernode and update: {w.prompts_per_step} prompts x "
        f"{w.group_size} samples, prompt {w.prompt_len} tokens, response log-normal "
        f"median {w.response_median:.0f}, p99/median {w.response_p99_over_median}, capped at "
        f"{w.max_new_tokens:,} (beyond any update's longest draw: the expected longest response is "
        f"{longest} tokens); weak scaling (prompts per update x supernodes); {w.num_steps} updates simulated",
        "tokens/s counts the tokens the updates train on: response tokens (the RL convention of the "
        "tables) and, in its own column, prompt + response tokens",
        f"engines: {cal.devices_per_engine} chips each, continuous batching over at most the slots the "
        f"KV memory holds (central: {slots['central']:,} per engine) and at most an even share of the "
        "samples in flight (a load balancer over the engines), prefill of prompts and of resumed "
        "context after a partial-rollout abort",
        f"baseline 'separated': {w.rollout_fraction:.0%} of the chips generate (whole engines of "
        f"{cal.devices_per_engine} chips), the rest train and compute the reference logprobs where the "
        "samples were generated; no separate reference or reward pool; new weights broadcast to every "
        "engine after each update. 'colocated': every chip generates, computes reference logprobs, then "
        "trains (switching layouts)",
        f"StaleSync: staleness bound s = {max_staleness}, partial rollout (colocated: a rollout "
        "phase ends once a batch is ready; unfinished samples resume next phase)",
        f"serial work: the advantage stage on the first train device, "
        f"{advantage_s_per_sample * 1e6:.0f} us per sample (measured on this machine's CPU: each row's "
        "numbers through the queue, advantages, the split)",
        "scenarios (low / central / high throughput): "
        + "; ".join(f"{sc.name}: {sc.a2a_message_us:g} us per all-to-all message, straggler sigma "
                    f"{sc.straggler_sigma:g}, engines use {sc.memory_utilization:.0%} of HBM, matmul "
                    f"efficiency x{sc.matmul_efficiency_scale:g}, {sc.step_overhead_ms:g} ms host work per "
                    "engine step" for sc in scenarios),
        f"calibration (central): {cal.source}",
        *[f"  {note}" for note in cal.source_notes],
        "not modelled: failures and restarts, network congestion beyond one link per chip, load "
        "imbalance between experts, KV-cache preemption, overlap of the weight sync with generation",
    ]


def _measured_advantage() -> float:
    """The advantage stage's seconds per sample on this machine (quick measurement)."""
    from rlfusion.measure.calibrate import measure_advantage
    from rlfusion.model.checkpoint import find_base, load_base

    model, tokenizer, _ = load_base(find_base())
    return measure_advantage(tokenizer, model.config.vocab_size, quick=True)


def format_projection(rows: list[ProjectionRow], lines: list[str], seconds: float) -> str:
    names = list(rows[0].tokens_per_s)
    out = [f"RL projection ({seconds:.1f} s): tokens/s as central [lowest .. highest of the scenarios "
           f"{', '.join(names)}]", "",
           f"{'mode':<11}{'variant':<11}{'supernodes':>10}{'response tokens/s':>30}"
           f"{'prompt+response tokens/s':>32}{'linearity':>10}{'util':>7}{'s/update':>10}"]
    def spread(values: dict[str, float]) -> str:
        return f"{values['central']:,.0f} [{min(values.values()):,.0f} .. {max(values.values()):,.0f}]"

    for r in rows:
        resp, both = spread(r.tokens_per_s), spread(r.all_tokens_per_s)
        out.append(f"{r.mode:<11}{r.variant:<11}{r.num_supernodes:>10}{resp:>30}{both:>32}"
                   f"{r.linearity:>10.1%}{r.utilization:>7.1%}{r.step_s:>10.1f}")
    by = {(r.mode, r.variant, r.num_supernodes): r for r in rows}
    last = max(r.num_supernodes for r in rows)
    out.append("")
    for mode in ("colocated", "separated"):
        sync, stale = by[(mode, "sync", last)], by[(mode, "stalesync", last)]
        ratios = [stale.tokens_per_s[k] / sync.tokens_per_s[k] for k in names]
        out.append(f"{mode}, {last} supernode(s): StaleSync / sync = {ratios[names.index('central')]:.2f}x "
                   f"[{min(ratios):.2f} .. {max(ratios):.2f}]")
    co, sep = by[("colocated", "sync", last)], by[("separated", "sync", last)]
    out.append(f"sync, {last} supernode(s): colocated / separated = "
               f"{co.tokens_per_s['central'] / sep.tokens_per_s['central']:.2f}x")
    out += ["", "assumptions:"] + [f"  {x}" for x in lines]
    return "\n".join(out)


def run_projection(model_name: str, kind: str, max_supernodes: int, max_staleness: int) -> str:
    start = time.perf_counter()
    counts = tuple(sorted({1, max_supernodes} | {n for n in (2, 4) if n < max_supernodes}))
    rows, lines = project(model_name, kind, counts, max_staleness)
    return format_projection(rows, lines, time.perf_counter() - start)
