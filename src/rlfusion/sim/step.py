"""Training step time, MFU and peak memory of one parallel plan (the cost model proper).

Owns `StepEstimate` and `estimate_step()`; the layout conventions are in `plan.py`, the
memory formulas in `memory.py`, collective formulas in `comm.py`. Step time:

    step = (m + (PP - 1) / VPP) * t_stage  +  exposed DP communication  +  optimizer step

with `m` micro-batches and `t_stage` the slowest stage's fwd+bwd time per micro-batch
(compute, recompute, TP collectives, exposed EP all-to-all, PP send/recv, exposed swap).
This is the 1F1B bubble `(PP-1) t_stage`, divided by VPP for the interleaved schedule.
Overlap rules: with `ep_overlap`, EP all-to-all hides behind computation as far as the
mechanism `ep_overlap.json` beside this file names was measured to hide it (`python
bench/ep_overlap.py --record` writes it): "overlap_fb" (Adaptive Pipe, `parallel/overlap.py`:
the forward of one micro-batch paired with the backward of another, so a layer's transfers
hide behind the other pass's whole layers, attention included) covers them with the layer's
whole fwd+bwd compute; "chunked" (`layout.a2a_chunks`) with the same layer's MoE block only
(router, shared and routed experts). exposed = a2a - efficiency * min(a2a, cover); the DP gradient
reduce-scatter hides behind the last micro-batch's backward and the parameter all-gather
behind the first micro-batch's forward; TP collectives and PP sends are fully exposed.

`recompute="planned"`: per stage, `memory_plan.plan_memory` (the planner training uses) picks
keep / recompute / swap per layer module from these cost terms, per micro-batch: saved bytes
from `costs.module_activations` x tokens per rank, recompute seconds = the module's forward
time as `_layer_time` counts it, swap seconds = 2 x bytes / host link bandwidth; budget =
(device memory - weights, grads, optimizer, buffers, reserve) / micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from rlfusion.memory_plan import MemoryPlan, ModuleProfile, plan_memory
from rlfusion.model.flops import attention_matmul_params
from rlfusion.partition import partition
from rlfusion.sim import comm
from rlfusion.sim.costs import BF16, LayerCost, model_flops_per_token, model_layers, module_activations
from rlfusion.sim.hardware import ClusterSpec
from rlfusion.sim.memory import FRAGMENTATION, GRAD_BYTES, MemoryEstimate, stage_memory
from rlfusion.sim.plan import ParallelPlan, TrainJob, in_flight

OPTIMIZER_STEP_BYTES = 32  # bytes touched per locally-updated parameter by fused Adam
EP_OVERLAP_FILE = Path(__file__).with_name("ep_overlap.json")


@functools.cache
def ep_overlap_measurement() -> dict:
    """The measured overlap of the expert all-to-all (`bench/ep_overlap.py --record`): its
    `efficiency` is the share of the all-to-all that computation hid where there was compute
    enough to cover it (1 - exposed overlapped / exposed blocking), its `mechanism` ("overlap_fb"
    or "chunked") and how it was measured."""
    return json.loads(EP_OVERLAP_FILE.read_text())


def ep_exposed_s(a2a_s: float, compute_s: float, overlap: bool) -> float:
    """Seconds of a layer's expert all-to-all no computation covers (`compute_s`: the work
    that can cover it)."""
    if not overlap:
        return a2a_s
    return a2a_s - ep_overlap_measurement()["efficiency"] * min(a2a_s, compute_s)


@dataclass(frozen=True)
class StageTime:
    """Per micro-batch (fwd + bwd) seconds on one pipeline stage."""

    compute_s: float
    recompute_s: float
    tp_comm_s: float
    ep_comm_s: float  # total all-to-all time
    ep_exposed_s: float  # part not hidden behind compute
    pp_comm_s: float
    swap_exposed_s: float
    fwd_s: float  # forward share (windows for DP overlap)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.tp_comm_s + self.ep_exposed_s
                + self.pp_comm_s + self.swap_exposed_s)


@dataclass(frozen=True)
class StepEstimate:
    plan: ParallelPlan
    num_microbatches: int
    step_s: float
    compute_s: float  # useful compute on the slowest stage, whole step
    recompute_s: float
    bubble_s: float
    tp_comm_s: float
    ep_comm_exposed_s: float
    ep_comm_total_s: float
    pp_comm_s: float
    dp_comm_exposed_s: float
    swap_exposed_s: float
    optimizer_s: float
    mfu: float
    memory: MemoryEstimate
    fits: bool
    memory_plans: tuple[MemoryPlan, ...] = ()  # per stage, for recompute="planned"
    link_busy_s: float = 0.0  # seconds the busiest link of a chip carries traffic in the step
    link_wait_s: float = 0.0  # what that adds to the step beyond everything else (contention)

    @property
    def comm_share(self) -> float:
        """Exposed communication as a fraction of the step."""
        exposed = (self.tp_comm_s + self.ep_comm_exposed_s + self.pp_comm_s
                   + self.dp_comm_exposed_s)
        return exposed / self.step_s


def _efficiency(cluster: ClusterSpec, rows: float) -> float:
    chip = cluster.chip
    return chip.matmul_efficiency * rows / (rows + chip.half_efficiency_rows)


def _layer_time(layer: LayerCost, job: TrainJob, plan: ParallelPlan, cluster: ClusterSpec
                ) -> tuple[float, float, float, float, float]:
    """(fwd+bwd compute, recompute, tp comm, ep comm, cover) seconds of one layer, one
    micro-batch; `cover`: the work the overlapped all-to-all hides behind — the layer's whole
    fwd+bwd compute with Adaptive Pipe (the paired pass's), else its MoE block's (router,
    shared and routed experts; attention is not)."""
    model, peak = job.model, cluster.chip.peak_tflops * 1e12
    tokens = plan.micro_batch * job.seq_len
    local = tokens / plan.tp  # tokens per rank (sequence parallel)
    dense_rate = peak * _efficiency(cluster, tokens)
    expert_rows = local * model.top_k * plan.ep / max(model.num_experts, 1)
    fwd = (layer.matmul_flops * local / dense_rate
           + layer.attn_core_flops * local / (peak * cluster.chip.attention_efficiency))
    attn_bwd = 1.5 * layer.attn_core_flops * local / (peak * cluster.chip.attention_efficiency)
    imbalance = job.expert_imbalance(plan.ep)
    cover = 0.0
    if layer.expert_flops:
        routed = layer.expert_flops * local * imbalance / (peak * _efficiency(cluster, expert_rows))
        fwd += routed
        moe_matmuls = layer.matmul_flops - 2.0 * attention_matmul_params(model)
        cover = 3.0 * (routed + max(0.0, moe_matmuls) * local / dense_rate)
    compute = 3.0 * fwd + attn_bwd
    if layer.expert_flops and ep_overlap_measurement().get("mechanism") == "overlap_fb":
        cover = compute
    recompute = {"none": 0.0, "full": fwd, "planned": 0.0,  # planned: added per stage later
                 "selective": layer.recompute_flops * local / dense_rate}[plan.recompute]
    tp_comm = 0.0
    if plan.tp > 1 and layer.kind != "head":
        link = cluster.link_for(plan.tp)
        collectives = 2 if layer.kind == "dense" else 1  # AG + RS pairs per block on TP
        buf = tokens * model.d_model * BF16
        tp_comm = 2 * collectives * (comm.ring_time("all_gather", buf, plan.tp, link)
                                     + comm.ring_time("reduce_scatter", buf, plan.tp, link))
    ep_comm = 0.0
    if layer.kind == "moe" and plan.ep > 1:
        local_ranks = min(plan.ep, cluster.chips_per_domain)
        vol = comm.all_to_all_volume(local, model.d_model, model.top_k, plan.ep, local_ranks,
                                     plan.hierarchical_a2a)
        ep_comm = 4 * imbalance * comm.all_to_all_time(vol, cluster, plan.ep, local_ranks,
                                           plan.hierarchical_a2a)
    return compute, recompute, tp_comm, ep_comm, cover


def _module_profiles(index: int, layer: LayerCost, job: TrainJob, plan: ParallelPlan,
                     cluster: ClusterSpec) -> dict[str, ModuleProfile]:
    """Per micro-batch profiles of `layers.{index}` and its modules (planner naming): bytes
    from `costs.module_activations` x tokens per rank, forward seconds as `_layer_time` counts
    them (attention: projections + core; MLP/MoE: the rest of the matmuls + routed experts;
    norms: read + write of the residual stream at device memory bandwidth)."""
    model, chip = job.model, cluster.chip
    peak = chip.peak_tflops * 1e12
    tokens = plan.micro_batch * job.seq_len
    local = tokens / plan.tp
    dense_rate = peak * _efficiency(cluster, tokens)
    attn_mm = 2.0 * attention_matmul_params(model)
    attn_s = (attn_mm * local / dense_rate
              + layer.attn_core_flops * local / (peak * chip.attention_efficiency))
    mlp_s = (layer.matmul_flops - attn_mm) * local / dense_rate
    if layer.expert_flops:
        expert_rows = local * model.top_k * plan.ep / max(model.num_experts, 1)
        mlp_s += (layer.expert_flops * local * job.expert_imbalance(plan.ep)
                  / (peak * _efficiency(cluster, expert_rows)))
    norm_s = 2 * model.d_model * BF16 * local / (chip.memory_bandwidth_GBps * 1e9)
    seconds = {"attn_norm": norm_s, "attn": attn_s, "mlp_norm": norm_s, "mlp": mlp_s}
    name = f"layers.{index}"
    out = {}
    for child, (saved, inp) in module_activations(model, layer,
                                                  job.expert_imbalance(plan.ep)).items():
        out[f"{name}.{child}"] = ModuleProfile(saved * local, inp * local, seconds[child])
    out[name] = ModuleProfile(sum(p.saved_bytes for p in out.values()),
                              model.d_model * BF16 * local, sum(seconds.values()))
    return out


def _plan_stage(indexed: list[tuple[int, LayerCost]], job: TrainJob, plan: ParallelPlan,
                cluster: ClusterSpec, stage: int, num_micro: int
                ) -> tuple[MemoryPlan, tuple[float, float, bool], float, float]:
    """Run the memory planner on one stage: (plan, (activation bytes, bytes swapped to host,
    staging buffer needed) per device, recompute and swap seconds added per micro-batch).
    The budget reserves the staging buffer (one layer being recomputed / swapped in)."""
    layers = [x for _, x in indexed]
    local = plan.micro_batch * job.seq_len / plan.tp
    profiles: dict[str, ModuleProfile] = {}
    for i, layer in indexed:
        if layer.kind != "head":
            profiles.update(_module_profiles(i, layer, job, plan, cluster))
    total = (sum(p.saved_bytes for n, p in profiles.items() if n.count(".") == 1)
             + sum(x.activation.total * local for x in layers if x.kind == "head"))
    flight = in_flight(plan, stage, num_micro)
    static, _ = stage_memory(layers, job, plan, stage, num_micro, planned=(0.0, 0.0, True))
    # what is left for activations, which the allocator's fragmentation share grows too
    budget = (cluster.chip.memory_GB - static.total_GB) * 1e9 / (1 + FRAGMENTATION) / flight * (1 - 1e-9)
    bandwidth = cluster.host.bandwidth_GBps * 1e9
    if budget < 0:  # weights and optimizer alone do not fit
        return MemoryPlan(fits=False), (total * flight, 0.0, False), 0.0, 0.0
    mp = plan_memory(profiles, total, budget, bandwidth, allow_swap=plan.swap)
    swapped = sum(profiles[n].saved_bytes for n in mp.swap)
    recompute_s = sum(profiles[n].forward_s for n in mp.recompute)
    staged = bool(mp.recompute or mp.swap)
    return (mp, ((total - mp.predicted_saved_bytes) * flight, swapped * flight, staged),
            recompute_s, 2 * swapped / bandwidth)


def _stage_time(layers: list[LayerCost], job: TrainJob, plan: ParallelPlan,
                cluster: ClusterSpec, chunks_on_stage: int) -> StageTime:
    compute = recompute = tp_comm = ep_comm = ep_exposed = swap_exposed = fwd = 0.0
    host_rate = cluster.host.bandwidth_GBps * 1e9
    local = plan.micro_batch * job.seq_len / plan.tp
    for layer in layers:
        c, r, t, e, cover = _layer_time(layer, job, plan, cluster)
        compute, recompute, tp_comm, ep_comm = compute + c, recompute + r, tp_comm + t, ep_comm + e
        fwd += c / 3.0
        ep_exposed += ep_exposed_s(e, cover, plan.ep_overlap)
        if (plan.swap and plan.recompute not in ("full", "planned")  # planned: added later
                and layer.activation.swappable):
            moved = layer.activation.swappable * local / host_rate  # each way
            swap_exposed += 2 * max(0.0, moved - c / 3.0)
    pp_comm = 0.0
    if plan.pp > 1:
        link = cluster.link_for(2, stride=plan.tp * plan.dp)
        act = plan.micro_batch * job.seq_len * job.model.d_model * BF16 / plan.tp
        pp_comm = 2 * chunks_on_stage * comm.p2p_time(act, link)
    return StageTime(compute, recompute, tp_comm, ep_comm, ep_exposed, pp_comm, swap_exposed,
                     fwd)




def plan_problem(job: TrainJob, plan: ParallelPlan, cluster: ClusterSpec) -> str | None:
    """Why `plan` cannot run `job` on `cluster` (None when it can)."""
    model = job.model
    if plan.num_devices != cluster.num_chips:
        return f"TP*PP*DP={plan.num_devices} != {cluster.num_chips} chips"
    if (plan.tp * plan.dp) % plan.ep or (model.num_experts and model.num_experts % plan.ep):
        return f"EP{plan.ep} must divide TP*DP={plan.tp * plan.dp} and num_experts"
    if model.num_heads % plan.tp:
        return f"TP{plan.tp} must divide num_heads={model.num_heads}"
    if plan.pp * plan.vpp > model.num_layers + 1:
        return f"PP*VPP={plan.pp * plan.vpp} exceeds the {model.num_layers + 1} layers+head"
    if job.global_batch % (plan.micro_batch * plan.dp):
        return f"global batch {job.global_batch} not divisible by mb*DP"
    num_micro = job.global_batch // (plan.micro_batch * plan.dp)
    if plan.vpp > 1 and num_micro % plan.pp:
        return f"interleaving needs micro-batches ({num_micro}) divisible by PP{plan.pp}"
    return None


def _stages(job: TrainJob, plan: ParallelPlan, cluster: ClusterSpec) -> list[list[LayerCost]]:
    return [[x for _, x in stage] for stage in _indexed_stages(job, plan, cluster)]


def _indexed_stages(job: TrainJob, plan: ParallelPlan, cluster: ClusterSpec
                    ) -> list[list[tuple[int, LayerCost]]]:
    """Per pipeline stage, its (layer index, layer) pairs; the head comes last."""
    layers = model_layers(job.model, job.seq_len)
    times: dict[int, float] = {}
    for layer in layers:  # only three distinct layer kinds: time each once
        if id(layer) not in times:
            c, r, t, e, cover = _layer_time(layer, job, plan, cluster)
            times[id(layer)] = c + r + t + ep_exposed_s(e, cover, plan.ep_overlap)
    owner = partition([times[id(x)] for x in layers], plan.pp * plan.vpp)
    stages: list[list[tuple[int, LayerCost]]] = [[] for _ in range(plan.pp)]
    for i, (layer, chunk) in enumerate(zip(layers, owner)):
        stages[chunk % plan.pp].append((i, layer))
    return stages


def _dp_exposed(layers: list[LayerCost], plan: ParallelPlan, cluster: ClusterSpec,
                stage: StageTime) -> tuple[float, float]:
    """(exposed, total) seconds of the data-parallel gradient and parameter collectives: the
    gradients' hide behind backward, the parameters' behind forward, each where it fits."""
    dense = sum(x.dense_params for x in layers) / plan.tp
    expert = sum(x.expert_params for x in layers) / plan.ep
    dense_link = cluster.link_for(plan.dp, stride=plan.tp)
    expert_link = cluster.link_for(plan.edp, stride=plan.ep)
    if plan.distributed_optimizer:
        grads = (comm.ring_time("reduce_scatter", dense * GRAD_BYTES, plan.dp, dense_link)
                 + comm.ring_time("reduce_scatter", expert * GRAD_BYTES, plan.edp, expert_link))
        params = (comm.ring_time("all_gather", dense * BF16, plan.dp, dense_link)
                  + comm.ring_time("all_gather", expert * BF16, plan.edp, expert_link))
    else:
        grads = (comm.ring_time("all_reduce", dense * GRAD_BYTES, plan.dp, dense_link)
                 + comm.ring_time("all_reduce", expert * GRAD_BYTES, plan.edp, expert_link))
        params = 0.0
    backward = stage.total_s - stage.fwd_s
    return max(0.0, grads - backward) + max(0.0, params - stage.fwd_s), grads + params


def _optimizer_s(layers: list[LayerCost], plan: ParallelPlan, cluster: ClusterSpec) -> float:
    dense = sum(x.dense_params for x in layers) / plan.tp
    expert = sum(x.expert_params for x in layers) / plan.ep
    if plan.distributed_optimizer:
        dense, expert = dense / plan.dp, expert / plan.edp
    return (dense + expert) * OPTIMIZER_STEP_BYTES / (cluster.chip.memory_bandwidth_GBps * 1e9)


def estimate_step(job: TrainJob, plan: ParallelPlan, cluster: ClusterSpec) -> StepEstimate:
    problem = plan_problem(job, plan, cluster)
    if problem:
        raise ValueError(f"plan {plan.label()} is invalid: {problem}")
    num_micro = job.global_batch // (plan.micro_batch * plan.dp)
    indexed = _indexed_stages(job, plan, cluster)
    stages = [[x for _, x in stage] for stage in indexed]
    times = [_stage_time(layers, job, plan, cluster, plan.vpp) for layers in stages]
    planned = [None] * plan.pp
    memory_plans: tuple[MemoryPlan, ...] = ()
    if plan.recompute == "planned":
        results = [_plan_stage(indexed[s], job, plan, cluster, s, num_micro)
                   for s in range(plan.pp)]
        memory_plans = tuple(r[0] for r in results)
        planned = [r[1] for r in results]
        times = [dataclasses.replace(t, recompute_s=t.recompute_s + r[2],
                                     swap_exposed_s=t.swap_exposed_s + r[3])
                 for t, r in zip(times, results)]
    slow = max(range(plan.pp), key=lambda s: times[s].total_s)
    st = times[slow]
    bubble = (plan.pp - 1) / plan.vpp * st.total_s
    dp = [_dp_exposed(stages[s], plan, cluster, times[s]) for s in range(plan.pp)]
    dp_exposed, dp_total = max(e for e, _ in dp), max(t for _, t in dp)
    optimizer = max(_optimizer_s(layers, plan, cluster) for layers in stages)
    step = num_micro * st.total_s + bubble + dp_exposed + optimizer
    busy = link_busy_s(plan, cluster, num_micro * st.tp_comm_s, num_micro * st.ep_comm_s,
                       num_micro * st.pp_comm_s, dp_total)
    link_wait = max(0.0, max(busy.values()) - step)  # one link cannot carry more than the step
    step += link_wait
    memories = [stage_memory(stages[s], job, plan, s, num_micro, planned[s])
                for s in range(plan.pp)]
    memory, swapped = max(memories, key=lambda m: m[0].total_GB)
    fits = (memory.total_GB <= cluster.chip.memory_GB
            and swapped <= cluster.host_memory_GB_per_chip
            and all(mp.fits and m[1] <= cluster.host_memory_GB_per_chip
                    for mp, m in zip(memory_plans, memories)))
    model_flops = model_flops_per_token(job.model, job.seq_len) * job.seq_len * job.global_batch
    mfu = model_flops / (step * cluster.num_chips * cluster.chip.peak_tflops * 1e12)
    return StepEstimate(
        plan=plan, num_microbatches=num_micro, step_s=step,
        compute_s=num_micro * st.compute_s, recompute_s=num_micro * st.recompute_s,
        bubble_s=bubble, tp_comm_s=num_micro * st.tp_comm_s,
        ep_comm_exposed_s=num_micro * st.ep_exposed_s, ep_comm_total_s=num_micro * st.ep_comm_s,
        pp_comm_s=num_micro * st.pp_comm_s, dp_comm_exposed_s=dp_exposed,
        swap_exposed_s=num_micro * st.swap_exposed_s, optimizer_s=optimizer, mfu=mfu,
        memory=memory, fits=fits, memory_plans=memory_plans,
        link_busy_s=max(busy.values()), link_wait_s=link_wait,
    )


def link_busy_s(plan: ParallelPlan, cluster: ClusterSpec, tp_s: float, ep_s: float, pp_s: float,
                dp_s: float) -> dict[str, float]:
    """Seconds each link of a chip carries traffic in one step: the scale-up fabric inside a
    fast domain ("intra") and the scale-out network ("inter"). A collective travels on the
    link its group spans (hierarchical expert all-to-all: the scale-out link once the EP
    group leaves the domain). Hidden or exposed, traffic on one link shares it, so a step is
    never shorter than its busiest link."""
    domain = cluster.chips_per_domain
    busy = {"intra": 0.0, "inter": 0.0}
    busy["intra" if plan.tp <= domain else "inter"] += tp_s
    busy["intra" if plan.ep <= domain else "inter"] += ep_s
    busy["intra" if plan.tp * plan.dp * 2 <= domain else "inter"] += pp_s
    busy["intra" if plan.tp * plan.dp <= domain else "inter"] += dp_s
    return busy
