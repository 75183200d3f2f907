"""Projection of RL post-training throughput at supernode scale (`rlfusion simulate --project`).

Runs the RL simulator with a calibration derived from hardware specs and the cost model
(`cluster_calibration`), for co-located vs separated deployment and synchronous (s = 0) vs
StaleSync (s >= 1 with partial rollout), on 1..N supernodes (weak scaling: prompts per step
grow with the supernodes), and prints every assumption next to the numbers. Nothing here is
measured; `bench/simulator.py` is what validates the simulator on real (CPU) runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlfusion.model.config import get_preset
from rlfusion.sim.cluster_calibration import EngineAssumptions, calibration_from_hardware
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import device_utilization, simulate


@dataclass(frozen=True)
class ProjectionRow:
    mode: str
    variant: str  # "sync" or "stalesync"
    num_supernodes: int
    tokens_per_s: float
    linearity: float  # tokens/s / (supernodes * tokens/s on one supernode)
    utilization: float
    step_s: float  # mean time per update


def workload(mode: str, max_staleness: int, chips_per_supernode: int) -> RLSimConfig:
    """The RL step assumed for the projection (reasoning-style long-tail responses)."""
    return RLSimConfig(mode=mode, devices_per_supernode=chips_per_supernode,
                       prompts_per_step=128, group_size=16, num_steps=4,
                       prompt_len=1024, response_median=1536.0, response_p99_over_median=3.75,
                       max_new_tokens=7168, max_num_seqs=256, max_staleness=max_staleness,
                       partial_rollout=max_staleness > 0, inter_supernode_GBps=50.0,
                       rollout_fraction=0.5)


def project(model_name: str = "pangu-ultra-moe-718b", kind: str = "cm384",
            supernodes: tuple[int, ...] = (1, 2, 3, 4), max_staleness: int = 1
            ) -> tuple[list[ProjectionRow], list[str]]:
    """Rows for every (mode, variant, supernodes) and the assumption lines."""
    if max_staleness < 1:
        raise ValueError(f"--max-staleness={max_staleness} must be >= 1 (the StaleSync variant)")
    model = get_preset(model_name)
    probe = get_cluster(kind, 1)
    supernode = get_cluster(kind, probe.chips_per_domain)
    assumptions = EngineAssumptions()
    cal = calibration_from_hardware(model, supernode, assumptions)
    rows = []
    for mode in ("colocated", "separated"):
        for variant, s in (("sync", 0), ("stalesync", max_staleness)):
            first = None
            for n in supernodes:
                cfg = workload(mode, s, supernode.num_chips).replace(num_supernodes=n)
                result = simulate(cfg, cal)
                first = first or result.tokens_per_s
                ends = result.update_end_s
                step = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0]
                rows.append(ProjectionRow(mode, variant, n, result.tokens_per_s,
                                          result.tokens_per_s / (n * first),
                                          device_utilization(result), step))
    w = workload("colocated", max_staleness, supernode.num_chips)
    lines = [
        f"model {model_name}: {model.param_counts()['total'] / 1e9:,.0f}B total, "
        f"{model.param_counts()['active'] / 1e9:,.1f}B active parameters",
        f"supernode: {supernode.num_chips} x {supernode.chip.name} "
        f"({supernode.chip.peak_tflops:.0f} TFLOPS bf16, {supernode.chip.memory_GB:.0f} GB HBM at "
        f"{supernode.chip.memory_bandwidth_GBps:.0f} GB/s), fabric {supernode.intra.bandwidth_GBps:.0f}"
        f" GB/s per chip inside, {w.inter_supernode_GBps:.0f} GB/s per chip between supernodes",
        f"workload per supernode and update: {w.prompts_per_step} prompts x "
        f"{w.group_size} samples, prompt {w.prompt_len} tokens, response log-normal "
        f"median {w.response_median:.0f}, p99/median {w.response_p99_over_median}, capped at "
        f"{w.max_new_tokens}; weak scaling (prompts per update x supernodes); "
        f"{w.num_steps} updates simulated",
        f"engines: {cal.devices_per_engine} chips each, up to {w.max_num_seqs} "
        "sequences in flight (continuous batching), prefill of prompt (and of resumed context "
        "after a partial-rollout abort)",
        f"separated: {w.rollout_fraction:.0%} of the chips generate, the rest train; colocated: "
        "every chip generates, computes reference logprobs, then trains",
        f"StaleSync: staleness bound s = {max_staleness}, partial rollout (colocated: a rollout "
        "phase ends once a batch is ready; unfinished samples resume next phase)",
        f"calibration: {cal.source}",
        *[f"  {note}" for note in cal.source_notes],
        "not modelled: stragglers and failures, network congestion, load imbalance between "
        "engines beyond the length tail, context growth of decode cost, overlap of the weight "
        "sync with generation",
    ]
    return rows, lines


def format_projection(rows: list[ProjectionRow], lines: list[str], seconds: float) -> str:
    out = [f"RL projection ({seconds:.1f} s)", "",
           f"{'mode':<11}{'variant':<11}{'supernodes':>10}{'tokens/s':>13}{'linearity':>10}"
           f"{'util':>7}{'s/update':>10}"]
    out += [f"{r.mode:<11}{r.variant:<11}{r.num_supernodes:>10}{r.tokens_per_s:>13,.0f}"
            f"{r.linearity:>10.1%}{r.utilization:>7.1%}{r.step_s:>10.1f}" for r in rows]
    by = {(r.mode, r.variant, r.num_supernodes): r for r in rows}
    last = max(r.num_supernodes for r in rows)
    out.append("")
    for mode in ("colocated", "separated"):
        sync, stale = by[(mode, "sync", last)], by[(mode, "stalesync", last)]
        out.append(f"{mode}, {last} supernode(s): StaleSync / sync = "
                   f"{stale.tokens_per_s / sync.tokens_per_s:.2f}x")
    out += ["", "assumptions:"] + [f"  {x}" for x in lines]
    return "\n".join(out)


def run_projection(model_name: str, kind: str, max_supernodes: int, max_staleness: int) -> str:
    start = time.perf_counter()
    rows, lines = project(model_name, kind, tuple(range(1, max_supernodes + 1)), max_staleness)
    return format_projection(rows, lines, time.perf_counter() - start)
