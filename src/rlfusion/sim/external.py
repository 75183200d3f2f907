"""External validation: verl's fully asynchronous trainer ablation, reproduced by the simulator.

The publication (verl, `docs/advance/fully_async.md`, "Asynchronous Training on 7B Model", first
version with every figure: commit 6f0b21c5, 2025-10-21): Qwen2.5-Math-7B trained with DAPO on
dapo-math-17k, 512 prompts x 16 samples per step, responses up to 28K tokens, vLLM + FSDP2 on
H20 GPUs, 400 steps. Synchronous co-located training ("colocate sync": vLLM sleeps while FSDP2
trains on the same GPUs, old logprobs recomputed by a forward pass) against the fully
asynchronous trainer on half the GPUs each for rollout and training (staleness_threshold 0.5,
partial rollout, the rollout's logprobs used as old logprobs).

Inputs, by source:

- from the publication / its scripts: the model, the hardware (`sim/hardware.H20`), prompts and
  samples per step, the response cap (max_response_length 28,672), the GPU counts and splits,
  generation TP 4 (gen_tp) and gpu_memory_utilization 0.8, what each mode computes (old-logprob
  pass or not: use_rollout_log_probs), ppo_mini_batch_size 32 (16 optimizer steps per 512
  prompts in both modes; the asynchronous trainer's require_batches 4 x
  trigger_parameter_sync_step 4 x 32 prompts = 512 prompts per parameter sync, so one weight
  sync per simulated update). The trainers (`TrainerConfig`): the co-located run script
  (recipe/fully_async_policy/exp/qwen2-7B-math_{32,64,128}/fsdp2_colocate/run.sh, verl commit
  94d681dc) sets param_offload and optimizer_offload True, fsdp_size 2, ulysses sp 4,
  enable_gradient_checkpointing True; the asynchronous scripts
  (recipe/fully_async_policy/shell/dapo_7b_math_fsdp2_{16-16,32_32,64_64}.sh at 6f0b21c5) set
  actor offload False, fsdp_size 8, ulysses sp 4 and leave gradient checkpointing at verl's
  default (True). Both: ppo_max_token_len_per_gpu 61,440. verl's FSDP worker keeps the actor's
  parameters in fp32 (bf16 compute) and loads / offloads them once per phase.
- from an independent source: the engine's per-step floor at small batch, from vLLM's measured
  time per output token of Mistral-7B at TP 4 on 4 x H100 SXM with 10 concurrent requests (3.65
  ms median, vLLM 0.5.4; LambdaLabsML/vllm-benchmark,
  results/prompt_10/4xH100-80GB-SXM/Mistral-7B-Instruct-v0.3_tp4_len2048.json): the cost
  model's own step for that model and GPU (weight reads, TP all-reduces) subtracted, the rest is
  the host / launch floor of a step (`measured_step_floor_ms`), applied on H20 as it is.
- assumed: the response-length distribution (log-normal, median 1,200 tokens, p99/median 10, so
  that a few of each step's 8,192 responses reach the cap, as DAPO's overlong penalty
  suggests), the prompt length (256 tokens), the cost model's matmul efficiency, and the host
  link of the H20 preset (55 GB/s per GPU) for offload traffic. verl's fractional staleness
  bound 0.5 is run as the simulator's s = 1 with partial rollout.

What each trainer costs, from its own settings: the training rate of the cost model's
data-parallel plan on the trainer's own GPUs with full recompute when gradient checkpointing is
on (one extra forward); the old-logprob forward at a quarter of a recomputing train token
(forward + recompute + backward = 4 forwards); offload traffic over the host link each phase
(fp32 parameter shard in and out for the old-logprob pass and the update, Adam state in and out
for the update); the FSDP collectives of each micro-batch (bf16 all-gathers in the shard group,
fp32 reduce-scatter, fp32 all-reduce across replica groups), counted only where they exceed the
backward they overlap with.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlfusion.model.config import ModelConfig, get_preset
from rlfusion.sim.calibration import Calibration
from rlfusion.sim.cluster_calibration import (EngineAssumptions, calibration_from_hardware, decode_step_s,
                                              engine_slots, train_plan)
from rlfusion.sim.costs import BF16
from rlfusion.sim.hardware import ClusterSpec, get_cluster
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate
from rlfusion.sim.step import estimate_step

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

# The independent small-batch measurement (see the module docstring): vLLM 0.5.4, Mistral-7B-Instruct-v0.3
# at TP 4 on 4 x H100 SXM, 10 concurrent requests of <= 487 prompt tokens, median time per output token.
MEASURED_ITL_MS = 3.65
MEASURED_ITL_BATCH = 10  # concurrent requests (most of the run has fewer: the upper end of the table)
MEASURED_ITL_CONTEXT = 1024  # prompt + output tokens of the benchmark's requests, at most ~1.4K


def mistral_7b(base: ModelConfig) -> ModelConfig:
    """Mistral-7B-v0.3's shape (32 layers, d 4096, 32 heads, 8 KV heads, FFN 14,336, vocab 32,768)."""
    return dataclasses.replace(base, vocab_size=32768, d_model=4096, num_layers=32, num_heads=32,
                               num_kv_heads=8, head_dim=128, num_dense_layers=32, dense_ffn_dim=14336,
                               qkv_bias=False)


def measured_step_floor_ms(measured_ms: float = MEASURED_ITL_MS) -> float:
    """The host / launch floor of one decode step: the measured small-batch step less what the cost
    model has for the same step (weight reads of the TP shard, TP all-reduces, KV reads) with no
    host work, for the measured model on the measured GPUs."""
    model = mistral_7b(get_preset("qwen2.5-7b"))
    a = EngineAssumptions(devices_per_engine=4, tp=4, context_len=MEASURED_ITL_CONTEXT, step_overhead_ms=0.0)
    return measured_ms - decode_step_s(model, get_cluster("h100", 8), MEASURED_ITL_BATCH, a) * 1e3


ENGINE = EngineAssumptions(devices_per_engine=4, tp=4, context_len=256, slot_context=8192,
                           memory_utilization=0.8, train_seq_len=8192, train_global_batch=2048,
                           step_overhead_ms=round(measured_step_floor_ms(), 2))


@dataclass(frozen=True)
class TrainerConfig:
    """One trainer's settings, from its run script."""

    fsdp_size: int  # GPUs one parameter shard group spans (FSDP2 hybrid sharding: replicas across groups)
    param_offload: bool  # fp32 parameter shard to host memory between phases
    optimizer_offload: bool  # Adam state to host memory between updates
    gradient_checkpointing: bool  # recompute every layer's forward in the backward
    ulysses_sp: int = 4  # sequence parallel group: a micro-batch's token budget is per GPU x sp
    max_token_len_per_gpu: int = 61_440  # ppo_max_token_len_per_gpu ((2,048 + 28,672) x 2)
    mini_batch_prompts: int = 32  # ppo_mini_batch_size: one optimizer step per 32 prompts

    def forward_fraction(self) -> float:
        """A forward over a token relative to training on it: 1/3 (forward + backward = 3 forwards),
        1/4 with full recompute."""
        return 0.25 if self.gradient_checkpointing else 1.0 / 3.0


SYNC_TRAINER = TrainerConfig(fsdp_size=2, param_offload=True, optimizer_offload=True, gradient_checkpointing=True)
ASYNC_TRAINER = TrainerConfig(fsdp_size=8, param_offload=False, optimizer_offload=False, gradient_checkpointing=True)
PARAM_BYTES = 4  # fp32 parameters held by verl's FSDP actor
ADAM_BYTES = 8  # two fp32 moments per parameter
GRAD_BYTES = 4  # fp32 gradient reduction


def train_rate(model: ModelConfig, cluster: ClusterSpec, trainer: TrainerConfig, a: EngineAssumptions) -> float:
    """Tokens/s per GPU of the cost model's data-parallel plan on `cluster`, with full recompute when
    the trainer checkpoints gradients (else selective)."""
    job = TrainJob(model, a.train_seq_len, a.train_global_batch)
    plan = ParallelPlan(tp=1, pp=1, vpp=1, ep=1, dp=cluster.num_chips, micro_batch=1,
                        recompute="full" if trainer.gradient_checkpointing else "selective")
    est = estimate_step(job, plan, cluster)
    return a.train_seq_len * a.train_global_batch / est.step_s / cluster.num_chips


def offload_s(params: float, trainer: TrainerConfig, host_GBps: float) -> tuple[float, float]:
    """(old-logprob pass, update) seconds of offload traffic on each GPU: its fp32 parameter shard
    in and out around each pass, its Adam state in and out around the update."""
    shard = params / trainer.fsdp_size
    weights = 2 * shard * PARAM_BYTES / (host_GBps * 1e9) if trainer.param_offload else 0.0
    adam = 2 * shard * ADAM_BYTES / (host_GBps * 1e9) if trainer.optimizer_offload else 0.0
    return weights, weights + adam


def micro_batches(tokens_per_step: float, gpus: int, trainer: TrainerConfig, prompts_per_step: int = 512) -> int:
    """Micro-batches each sequence-parallel group runs per step: each of the step's mini-batches
    is split to the group's token budget (per GPU x sp)."""
    groups = gpus // trainer.ulysses_sp
    mini = prompts_per_step // trainer.mini_batch_prompts
    per_group = tokens_per_step / mini / groups
    return mini * max(1, math.ceil(per_group / (trainer.max_token_len_per_gpu * trainer.ulysses_sp)))


def fsdp_comm_s(params: float, gpus: int, trainer: TrainerConfig, cluster: ClusterSpec) -> float:
    """One micro-batch's FSDP collectives on each GPU: two bf16 all-gathers of the parameters in the
    shard group (forward, and backward with its recompute), an fp32 reduce-scatter of the gradients
    there, and an fp32 ring all-reduce of the GPU's gradient shard across the replica groups."""
    f = trainer.fsdp_size
    group = cluster.link_for(f)
    s = (2 * (f - 1) / f * params * BF16 + (f - 1) / f * params * GRAD_BYTES) / (group.bandwidth_GBps * 1e9)
    replicas = gpus // f
    if replicas > 1:
        across = cluster.link_for(gpus)
        s += 2 * (replicas - 1) / replicas * params / f * GRAD_BYTES / (across.bandwidth_GBps * 1e9)
    return s


def trainer_calibration(base: Calibration, model: ModelConfig, cluster: ClusterSpec, trainer: TrainerConfig,
                        a: EngineAssumptions, tokens_per_step: float) -> Calibration:
    """`base` with the training costs of `trainer` on the `cluster` it trains on."""
    params = model.param_counts()["total"]
    rate = train_rate(model, cluster, trainer, a)
    ref_offload, update_offload = offload_s(params, trainer, cluster.host.bandwidth_GBps)
    n_micro = micro_batches(tokens_per_step, cluster.num_chips, trainer)
    comm = n_micro * fsdp_comm_s(params, cluster.num_chips, trainer, cluster)
    backward = tokens_per_step / (rate * cluster.num_chips) * (1 - trainer.forward_fraction())
    exposed = max(0.0, comm - backward)  # FSDP2 overlaps the collectives with the backward
    forward_rate = rate / trainer.forward_fraction()
    return base.replace(
        train_tokens_per_s_per_device=rate, train_step_overhead_s=update_offload + exposed,
        forward_fraction=trainer.forward_fraction(), reference_tokens_per_s_per_device=forward_rate,
        reference_overhead_s=ref_offload,
        source_notes=base.source_notes + (
            f"trainer on {cluster.num_chips} GPUs: FSDP group {trainer.fsdp_size}, offload params "
            f"{trainer.param_offload} / optimizer {trainer.optimizer_offload}, gradient checkpointing "
            f"{trainer.gradient_checkpointing}: {rate:,.0f} tokens/s per GPU, forward {forward_rate:,.0f}; "
            f"offload {ref_offload:.2f} s per old-logprob pass, {update_offload:.2f} s per update; "
            f"{n_micro} micro-batches x {comm / n_micro:.2f} s of FSDP collectives = {comm:.1f} s against "
            f"{backward:.0f} s of backward, {exposed:.1f} s exposed",),
    )


def expected_tokens_per_step(cfg: RLSimConfig) -> float:
    """Prompt + response tokens of one step under the workload's log-normal: its mean response,
    at most the cap (the cap's clipping of the tail itself is left out)."""
    mean = min(cfg.response_median * math.exp(cfg.length_sigma ** 2 / 2), cfg.max_new_tokens)
    return cfg.samples_per_step * (cfg.prompt_len + mean)


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
        sync_cfg = workload(pub.gpus, False).replace(max_num_seqs=min(slots, 1024))
        async_cfg = workload(pub.gpus, True).replace(max_num_seqs=min(slots, 1024))
        tokens = expected_tokens_per_step(sync_cfg)
        sync_cal = trainer_calibration(cal, model, cluster, SYNC_TRAINER, ENGINE, tokens)
        async_cal = trainer_calibration(cal, model, get_cluster("h20", pub.gpus // 2), ASYNC_TRAINER, ENGINE, tokens)
        sync = simulate(sync_cfg, sync_cal)
        asyn = simulate(async_cfg, async_cal)
        steps = len(sync.update_end_s)
        phases: dict[str, float] = {}
        for ev in sync.timeline:
            if ev.device == "engine0":
                phases[ev.role] = phases.get(ev.role, 0.0) + (ev.end - ev.start) / steps
        out.append(Reproduced(pub, _step(sync), phases, _step(asyn)))
    return out
