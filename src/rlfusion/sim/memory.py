"""Peak device memory of a training plan: weights, grads, optimizer, activations, buffers.

Owns `MemoryEstimate` and `stage_memory()`. Formulas (per device, bytes):
- weights: bf16 (2 B) per parameter held: dense params / TP + routed-expert params / EP;
- grads: fp32 main grads (4 B) per parameter held;
- optimizer: fp32 master + Adam m, v (12 B) per parameter held, divided by DP (dense) and
  EDP (experts) with the distributed optimizer, not divided without it;
- activations: per-token bytes of each layer (`costs.ActivationBytes`) x micro-batch tokens
  / TP (sequence parallel) x micro-batches in flight (1F1B: PP - stage; interleaved:
  Megatron's warm-up count). Selective recompute drops the `recomputable` part, full
  recompute keeps only each layer's input, swap moves the `swappable` part to host memory;
  `planned` takes the activation bytes chosen by the memory planner (`step.py` runs
  `memory_plan.plan_memory` on the stage's per-module bytes and passes them in);
- buffers: MoE dispatch send+recv buffers for one layer, fp32 logits of one micro-batch on the
  last stage and their gradient, one layer's full activations when recomputing it, a swap
  staging layer, the collectives' communication buffers (gradient buckets, channel buffers);
- reserved: a fixed framework workspace plus a fragmentation share of everything allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.sim.costs import BF16, FP32, LayerCost
from rlfusion.sim.plan import ParallelPlan, TrainJob, in_flight

RESERVED_GB = 2.0  # framework workspace per device (assumption)
FRAGMENTATION = 0.05  # allocator fragmentation: this share of everything allocated (assumption)
COMM_BUFFER_GB = 0.5  # collective buffers (gradient buckets, channels) when any group is > 1 (assumption)
OPTIMIZER_BYTES = 12  # fp32 master weight + Adam m and v per parameter
GRAD_BYTES = 4  # fp32 main gradient per parameter (grads reduced in fp32)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on the most loaded device, by category, in GB (1e9 bytes)."""

    weights_GB: float
    grads_GB: float
    optimizer_GB: float
    activations_GB: float
    buffers_GB: float  # MoE dispatch buffers, fp32 logits, recompute/swap staging
    reserved_GB: float

    @property
    def total_GB(self) -> float:
        return (self.weights_GB + self.grads_GB + self.optimizer_GB + self.activations_GB
                + self.buffers_GB + self.reserved_GB)


def _kept_bytes(layer: LayerCost, plan: ParallelPlan) -> float:
    """Bytes per token a layer keeps for backward under selective recompute / swap."""
    act = layer.activation
    kept = act.kept + (0.0 if plan.recompute == "selective" else act.recomputable)
    return kept + (0.0 if plan.swap else act.swappable)


def stage_memory(layers: list[LayerCost], job: TrainJob, plan: ParallelPlan, stage: int,
                 num_micro: int, planned: tuple[float, float, bool] | None = None
                 ) -> tuple[MemoryEstimate, float]:
    """Memory of pipeline stage `stage` holding `layers`; also returns GB swapped to host.
    `planned`: (activation bytes, bytes swapped to host, anything recomputed or swapped) of
    a `recompute="planned"` plan."""
    model = job.model
    dense = sum(x.dense_params for x in layers)
    expert = sum(x.expert_params for x in layers)
    if stage == 0:
        dense += model.vocab_size * model.d_model  # input embedding
    dense_local, expert_local = dense / plan.tp, expert / plan.ep
    held = dense_local + expert_local
    dense_shards = plan.dp if plan.distributed_optimizer else 1
    expert_shards = plan.edp if plan.distributed_optimizer else 1
    optimizer = OPTIMIZER_BYTES * (dense_local / dense_shards + expert_local / expert_shards)

    tokens = plan.micro_batch * job.seq_len / plan.tp
    if plan.recompute == "full":
        per_mb = sum(model.d_model * BF16 for x in layers if x.kind != "head")
    else:
        per_mb = sum(_kept_bytes(x, plan) for x in layers)
    flight = in_flight(plan, stage, num_micro)
    per_mb += (job.expert_imbalance(plan.ep) - 1.0) * sum(
        x.activation.swappable for x in layers if not plan.swap and plan.recompute != "full")
    activations = per_mb * tokens * flight
    swapped = (sum(x.activation.swappable for x in layers) * tokens * flight
               if plan.swap and plan.recompute != "full" else 0.0)
    if plan.recompute == "planned":
        if planned is None:
            raise ValueError("a planned recompute needs the planner's activation bytes")
        activations, swapped, staged = planned

    buffers = 0.0
    largest = max(x.activation.total for x in layers)
    if any(x.kind == "moe" for x in layers):
        buffers += 2 * tokens * model.top_k * model.d_model * BF16  # dispatch send + recv
    if any(x.kind == "head" for x in layers):  # fp32 logits and their gradient
        buffers += 2 * plan.micro_batch * job.seq_len * model.vocab_size / plan.tp * FP32
    if (staged if plan.recompute == "planned" else plan.recompute != "none" or plan.swap):
        buffers += largest * tokens  # the layer being recomputed / swapped back in
    if max(plan.tp, plan.dp, plan.ep, plan.pp, plan.edp) > 1:
        buffers += COMM_BUFFER_GB * 1e9
    allocated = held * (BF16 + GRAD_BYTES) + optimizer + activations + buffers
    mem = MemoryEstimate(
        weights_GB=held * BF16 / 1e9, grads_GB=held * GRAD_BYTES / 1e9,
        optimizer_GB=optimizer / 1e9, activations_GB=activations / 1e9,
        buffers_GB=buffers / 1e9, reserved_GB=RESERVED_GB + FRAGMENTATION * allocated / 1e9,
    )
    return mem, swapped / 1e9
