"""A `Calibration` for an accelerator cluster, derived from hardware specs and the cost model.

For projections only (the 718B model on CloudMatrix-384-style supernodes): nothing here is
measured, so every assumption is written into `source_notes` and printed with the results.

    train tokens/s/device   the best plan of the parallel-strategy search (`search.py`) for
                            the RL update as a training job on one supernode
    decode step(b)          one engine instance over `devices_per_engine` chips (experts
                            EP-sharded, attention data-parallel): max(HBM reads of the
                            weights the batch touches + its KV cache, matmul FLOPs) + the
                            dispatch / combine all-to-alls of every MoE layer
    prefill / token         matmul FLOPs of the active parameters at matmul efficiency
    switch                  optimizer state (fp32 master + Adam) of a chip to host memory over
                            the host link, plus re-laying out its bf16 weights over the fabric
    weight sync             bf16 weights into each engine chip's shard over the fabric
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.model.config import ModelConfig
from rlfusion.sim.calibration import Calibration
from rlfusion.sim.costs import BF16, model_layers
from rlfusion.sim.hardware import ClusterSpec
from rlfusion.sim.plan import TrainJob
from rlfusion.sim.search import SearchResult, search_plans

DECODE_BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
OPTIMIZER_BYTES = 12  # fp32 master weights + Adam moments per parameter


@dataclass(frozen=True)
class EngineAssumptions:
    devices_per_engine: int = 32  # chips per rollout engine instance (EP32, attention DP32)
    context_len: int = 2560  # mean tokens in context during decode (prompt + half a response)
    train_seq_len: int = 8192  # packed sequence length of the RL update
    train_global_batch: int = 768  # sequences per update in the training-plan search


def decode_step_s(model: ModelConfig, cluster: ClusterSpec, batch: int,
                  a: EngineAssumptions) -> float:
    """One decode step of `batch` sequences on one engine instance (roofline + all-to-all)."""
    chip, n = cluster.chip, a.devices_per_engine
    layers = model_layers(model, a.context_len)
    dense = sum(x.dense_params for x in layers)  # the embedding is a lookup of b rows
    experts = sum(x.expert_params for x in layers)
    touched = 1.0 - (1.0 - model.top_k / model.num_experts) ** batch if model.num_experts else 0
    weight_bytes = (dense + experts * touched) * BF16 / n
    if model.attention == "mla":
        kv_per_token = (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * BF16
    else:
        kv_per_token = 2 * model.num_kv_heads * model.head_dim * BF16
    kv_bytes = batch * a.context_len * kv_per_token * model.num_layers / n
    memory_s = (weight_bytes + kv_bytes) / (chip.memory_bandwidth_GBps * 1e9)
    flops = sum(x.forward_flops for x in layers) * batch / n
    compute_s = flops / (chip.peak_tflops * 1e12 * chip.matmul_efficiency)
    link = cluster.link_for(n)
    a2a_bytes = batch * model.top_k * model.d_model * BF16 / n  # each way, per MoE layer
    a2a_s = model.num_moe_layers * 2 * (link.latency_us * 1e-6
                                        + a2a_bytes / (link.bandwidth_GBps * 1e9))
    return max(memory_s, compute_s) + a2a_s


def train_plan(model: ModelConfig, cluster: ClusterSpec, a: EngineAssumptions) -> SearchResult:
    return search_plans(TrainJob(model, a.train_seq_len, a.train_global_batch), cluster)


def calibration_from_hardware(model: ModelConfig, supernode: ClusterSpec,
                              a: EngineAssumptions = EngineAssumptions(),
                              plan: SearchResult | None = None) -> Calibration:
    """`supernode`: the cluster of one supernode (its chips train the update)."""
    chip, n = supernode.chip, a.devices_per_engine
    plan = plan or train_plan(model, supernode, a)
    best = plan.best
    tokens = a.train_seq_len * a.train_global_batch
    train_rate = tokens / best.step_s / supernode.num_chips
    total = model.param_counts()["total"]
    active = model.param_counts()["active"]
    prefill_ms = 2.0 * active / n / (chip.peak_tflops * 1e12 * chip.matmul_efficiency) * 1e3
    per_chip = total / supernode.num_chips
    switch = (per_chip * OPTIMIZER_BYTES / (supernode.host.bandwidth_GBps * 1e9)
              + per_chip * BF16 / (supernode.intra.bandwidth_GBps * 1e9))
    times = tuple(decode_step_s(model, supernode, b, a) * 1e3 for b in DECODE_BATCHES)
    return Calibration(
        decode_batch_sizes=DECODE_BATCHES, decode_step_ms=times,
        prefill_ms_per_token=prefill_ms, train_tokens_per_s_per_device=train_rate,
        train_step_overhead_s=0.0, switch_s=switch,
        transfer_GBps=supernode.intra.bandwidth_GBps, weight_GB=total * BF16 / 1e9,
        devices_per_engine=n, forward_fraction=1.0 / 3.0,
        source=f"derived from hardware specs ({supernode.kind}, {chip.name}) and the cost "
               "model; NOT measured",
        source_notes=(
            f"train: best plan {best.plan.label()} of the search on {supernode.num_chips} "
            f"chips, seq {a.train_seq_len} x {a.train_global_batch} sequences per update: "
            f"{best.step_s:.2f} s, MFU {best.mfu:.1%} -> {train_rate:,.0f} tokens/s per chip; "
            "the same rate for any number of train chips (separated mode uses fewer)",
            f"reference forward = 1/3 of the train cost per token; no reward model (rule "
            "verifier, free)",
            f"engine: {n} chips per instance, bf16 weights EP-sharded, MLA latent KV cache, mean "
            f"context {a.context_len} tokens for every step (context growth not modelled), "
            f"HBM {chip.memory_bandwidth_GBps:.0f} GB/s, matmul efficiency "
            f"{chip.matmul_efficiency:.2f} (assumed), 2 all-to-alls per MoE layer at "
            f"{supernode.intra.bandwidth_GBps:.0f} GB/s + {supernode.intra.latency_us:.0f} us, "
            "no kernel-launch overhead (graph mode assumed), decode step "
            + ", ".join(f"{b}: {t:.1f} ms" for b, t in zip(DECODE_BATCHES, times)),
            f"switch: optimizer state ({OPTIMIZER_BYTES} B/param / {supernode.num_chips} "
            f"chips) to host at {supernode.host.bandwidth_GBps:.0f} GB/s + bf16 weights "
            f"re-laid out over the fabric: {switch:.2f} s each way",
            f"weight sync (separated): {total * BF16 / 1e9:,.0f} GB of bf16 weights, each "
            f"engine chip receives its 1/{n} at {supernode.intra.bandwidth_GBps:.0f} GB/s",
            "gradient sync across supernodes: fp32 ring all-reduce of each chip's shard over "
            "the per-chip inter-supernode bandwidth, not overlapped with compute",
        ),
    )
