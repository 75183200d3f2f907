"""External validation: verl's fully asynchronous trainer ablation, reproduced by the simulator.

The publication (verl, `docs/advance/fully_async.md`, "Asynchronous Training on 7B Model", first
version with every figure: commit 6f0b21c5, 2025-10-21): Qwen2.5-Math-7B trained with DAPO on
dapo-math-17k, 512 prompts x 16 samples per step, responses up to 28K tokens, vLLM + FSDP2 on
H20 GPUs, 400 steps. Synchronous co-located training ("colocate sync": vLLM sleeps while FSDP2
trains on the same GPUs, old logprobs recomputed by a forward pass) against the fully
asynchronous trainer on half the GPUs each for rollout and training (staleness_threshold 0.5,
partial rollout, the rollout's logprobs used as old logprobs). Its run scripts add: generation
TP 4, gpu_memory_utilization 0.8, prompts up to 2,048 tokens.

Taken from the publication: the model, the hardware (`sim/hardware.H20`), prompts and samples
per step, the response cap, the GPU counts and splits, the engine TP and memory share, what
each mode computes (old-logprob pass or not). Assumed, because the publication does not give
them: the response-length distribution (log-normal, median 1,200 tokens, p99/median 10, so that
a few of each step's 8,192 responses reach the cap, as DAPO's overlong penalty suggests), the
prompt length (256 tokens), and everything the cost model assumes for any cluster (matmul
efficiency, per-step host work of the engine). verl's fractional staleness bound 0.5 is run as
the simulator's s = 1 with partial rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.model.config import get_preset
from rlfusion.sim.cluster_calibration import EngineAssumptions, calibration_from_hardware, engine_slots, train_plan
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate

SOURCE = "verl docs/advance/fully_async.md (commit 6f0b21c5), table 'Asynchronous Training on 7B Model'"


@dataclass(frozen=True)
class Published:
    gpus: int  # colocate sync on `gpus`; fully async on gpus/2 : gpus/2
    sync_step_s: float  # colocate sync: mean step
    sync_gen_s: float
    sync_old_log_prob_s: float
    sync_update_s: float
    async_step_s: float  # fully async: mean step
    speedup_400: float  # total time of 400 steps, sync / async


PUBLISHED = (
    Published(32, 790.10, 357.41, 107.71, 313.81, 294.77, 2.66),
    Published(64, 365.28, 150.72, 70.26, 133.41, 189.26, 1.92),
    Published(128, 356.30, 177.85, 53.92, 113.81, 150.63, 2.35),
)

ENGINE = EngineAssumptions(devices_per_engine=4, tp=4, context_len=256, slot_context=8192,
                           memory_utilization=0.8, train_seq_len=8192, train_global_batch=2048)


def workload(gpus: int, asynchronous: bool) -> RLSimConfig:
    return RLSimConfig(
        mode="separated" if asynchronous else "colocated", devices_per_supernode=gpus, rollout_fraction=0.5,
        prompts_per_step=512, group_size=16, num_steps=3, prompt_len=256, response_median=1200.0,
        response_p99_over_median=10.0, max_new_tokens=28_672, max_num_seqs=256,
        max_staleness=1 if asynchronous else 0, partial_rollout=asynchronous,
        reference=not asynchronous)  # sync recomputes the old logprobs (a forward); async uses the rollout's


@dataclass(frozen=True)
class Reproduced:
    published: Published
    sync_step_s: float
    sync_phases: dict[str, float]  # role -> mean seconds per step on the busiest engine lane
    async_step_s: float

    @property
    def sync_error(self) -> float:
        return self.sync_step_s / self.published.sync_step_s - 1.0

    @property
    def speedup(self) -> float:
        return self.sync_step_s / self.async_step_s


def _step(result) -> float:
    ends = result.update_end_s
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def reproduce(gpus_list: tuple[int, ...] = (32, 64, 128)) -> list[Reproduced]:
    model = get_preset("qwen2.5-7b")
    out = []
    for pub in (p for p in PUBLISHED if p.gpus in gpus_list):
        cluster = get_cluster("h20", pub.gpus)
        plan = train_plan(model, cluster, ENGINE)
        cal = calibration_from_hardware(model, cluster, ENGINE, plan)
        slots = engine_slots(model, cluster, ENGINE)
        sync = simulate(workload(pub.gpus, False).replace(max_num_seqs=min(slots, 1024)), cal)
        asyn = simulate(workload(pub.gpus, True).replace(max_num_seqs=min(slots, 1024)), cal)
        steps = len(sync.update_end_s)
        phases: dict[str, float] = {}
        for ev in sync.timeline:
            if ev.device == "engine0":
                phases[ev.role] = phases.get(ev.role, 0.0) + (ev.end - ev.start) / steps
        out.append(Reproduced(pub, _step(sync), phases, _step(asyn)))
    return out
