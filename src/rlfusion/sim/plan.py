"""The parallel layout of a training job: `ParallelPlan`, `TrainJob` and layer placement.

Layout conventions (Megatron-style, with MoE "parallel folding"):
- Attention and dense MLPs use TP x PP x DP = world, with sequence parallelism inside TP.
- Routed experts use expert-TP 1 and EP ranks carved from the TP x DP ranks of a stage, so
  expert-data-parallel size EDP = TP * DP / EP. Each rank holds `num_experts / EP` experts.
- Rank order: TP fastest, then DP, then PP; EP groups are contiguous ranks, so an EP group
  spans `min(EP, chips_per_domain)` chips per fast domain.
- Layers (and the LM head) are split into PP * VPP contiguous chunks that balance compute
  (`rlfusion.partition`, the split training uses, fed simulated seconds here); chunk c runs on
  stage c % PP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlfusion.model.config import ModelConfig

RECOMPUTE_CHOICES = ("none", "selective", "full", "planned")


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    micro_batch: int  # sequences per micro-batch
    recompute: str = "none"  # "none" | "selective" | "full" | "planned" (memory planner)
    swap: bool = False  # swap MoE expert activations to host memory (planned: may swap)
    distributed_optimizer: bool = True  # shard optimizer states over (E)DP
    hierarchical_a2a: bool = True
    ep_overlap: bool = True  # hide EP all-to-all behind computation (step.py: the measured mechanism)

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "vpp", "ep", "dp", "micro_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"plan.{key}={getattr(self, key)} must be >= 1")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"plan.recompute={self.recompute!r}; allowed: "
                             f"{', '.join(RECOMPUTE_CHOICES)}")

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // self.ep

    def label(self) -> str:
        if self.recompute == "planned":
            extra = "planned" if self.swap else "planned-noswap"
        else:
            extra = f"{self.recompute[:3]}" + ("+swap" if self.swap else "")
        return (f"TP{self.tp} PP{self.pp} VPP{self.vpp} EP{self.ep} DP{self.dp} "
                f"mb{self.micro_batch} {extra}")


@dataclass(frozen=True)
class TrainJob:
    model: ModelConfig
    seq_len: int  # tokens per sequence
    global_batch: int  # sequences per optimizer step
    expert_load_cv: float = 0.2  # std/mean of per-expert token load after balancing (assumed)

    def expert_imbalance(self, ep: int) -> float:
        """Busiest EP rank's expert load / mean load.

        A rank holds `E/ep` experts, so its load has relative std `cv / sqrt(E/ep)`; the
        maximum of `ep` roughly normal loads sits `sqrt(2 ln ep)` std above the mean.
        """
        if ep <= 1 or not self.model.num_moe_layers:
            return 1.0
        per_rank = max(self.model.num_experts // ep, 1)
        return 1.0 + self.expert_load_cv / math.sqrt(per_rank) * math.sqrt(2 * math.log(ep))


def in_flight(plan: ParallelPlan, stage: int, num_micro: int) -> float:
    """Micro-batches (in whole-stage units) whose activations stage `stage` holds at peak."""
    p, v = plan.pp, plan.vpp
    if v == 1:
        return min(num_micro, p - stage)
    chunk_mbs = (v - 1) * p + 2 * (p - 1 - stage) + 1  # Megatron interleaved warm-up + 1
    return min(num_micro * v, chunk_mbs) / v
