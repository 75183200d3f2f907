"""Parallel-strategy search: enumerate plans, drop what cannot run or fit, rank by step time.

Owns `SearchSpace`, `SearchResult`, `search_plans()` and `explain()`. Every candidate is
scored by the cost model in `step.py`; nothing here is fitted to a target MFU. Recompute /
swap choices: none, selective, full (each with or without swapping MoE expert activations)
and `planned` (the memory planner picks keep / recompute / swap per layer module).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from rlfusion.sim.hardware import ClusterSpec
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.step import StepEstimate, estimate_step, plan_problem


@dataclass(frozen=True)
class SearchSpace:
    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    vpp: tuple[int, ...] = (1, 2, 4)
    ep: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    micro_batch: tuple[int, ...] = (1, 2, 4)
    recompute_swap: tuple[tuple[str, bool], ...] = (
        ("none", False), ("none", True), ("selective", False), ("selective", True),
        ("full", False), ("planned", True),
    )


@dataclass(frozen=True)
class SearchResult:
    ranked: list[StepEstimate]  # plans that fit, fastest first
    num_candidates: int  # plans enumerated
    num_invalid: int  # rejected by divisibility / shape rules
    num_oom: int  # valid but over device (or host) memory
    seconds: float  # wall time of the search
    reasons: list[str]  # why the best plan wins, one line each

    @property
    def best(self) -> StepEstimate:
        if not self.ranked:
            raise ValueError("no parallel plan fits memory; try more chips, a shorter "
                             "--seq or a smaller --global-batch")
        return self.ranked[0]


def candidates(job: TrainJob, cluster: ClusterSpec, space: SearchSpace) -> list[ParallelPlan]:
    plans = []
    n = cluster.num_chips
    axes = itertools.product(space.tp, space.pp, space.vpp, space.ep, space.micro_batch,
                             space.recompute_swap)
    for tp, pp, vpp, ep, mb, (recompute, swap) in axes:
        if tp > cluster.chips_per_domain or n % (tp * pp) or (pp == 1 and vpp > 1):
            continue
        if not job.model.num_moe_layers and ep > 1:
            continue
        plans.append(ParallelPlan(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=n // (tp * pp),
                                  micro_batch=mb, recompute=recompute, swap=swap))
    return plans


def search_plans(job: TrainJob, cluster: ClusterSpec, space: SearchSpace | None = None
                 ) -> SearchResult:
    start = time.perf_counter()
    plans = candidates(job, cluster, space or SearchSpace())
    fitting: list[StepEstimate] = []
    invalid = oom = 0
    for plan in plans:
        if plan_problem(job, plan, cluster):
            invalid += 1
            continue
        est = estimate_step(job, plan, cluster)
        if est.fits:
            fitting.append(est)
        else:
            oom += 1
    fitting.sort(key=lambda e: e.step_s)
    reasons = explain(fitting, oom) if fitting else []
    return SearchResult(fitting, len(plans), invalid, oom, time.perf_counter() - start, reasons)


_COMPONENTS = ("compute_s", "recompute_s", "bubble_s", "tp_comm_s", "ep_comm_exposed_s",
               "pp_comm_s", "dp_comm_exposed_s", "swap_exposed_s")
_AXES = ("tp", "pp", "vpp", "ep", "micro_batch", "recompute", "swap")


def _biggest_difference(best: StepEstimate, other: StepEstimate) -> str:
    deltas = {name: getattr(other, name) - getattr(best, name) for name in _COMPONENTS}
    worst = max(deltas, key=lambda k: deltas[k])
    return f"{worst.removesuffix('_s').replace('_', ' ')} +{deltas[worst]:.2f}s"


def explain(ranked: list[StepEstimate], num_oom: int) -> list[str]:
    """One line per axis: the best fitting plan with a different value, and what it loses."""
    best = ranked[0]
    lines = [f"best: {best.plan.label()}  step {best.step_s:.2f}s  MFU {best.mfu:.1%}  "
             f"peak memory {best.memory.total_GB:.1f} GB; {num_oom} valid plans did not fit"]
    for axis in _AXES:
        value = getattr(best.plan, axis)
        rival = next((e for e in ranked if getattr(e.plan, axis) != value), None)
        if rival is None:
            lines.append(f"{axis}={value}: every other choice runs out of memory or is invalid")
            continue
        slower = rival.step_s / best.step_s - 1.0
        lines.append(f"{axis}={value}: best alternative {axis}={getattr(rival.plan, axis)} "
                     f"({rival.plan.label()}) is {slower:.1%} slower "
                     f"({_biggest_difference(best, rival)})")
    return lines

