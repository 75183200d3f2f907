"""A `Calibration` for an accelerator cluster, derived from hardware specs and the cost model.

For projections only (the 718B model on CloudMatrix-384-style supernodes): nothing here is
measured, so every assumption is written into `source_notes` and printed with the results.

    train tokens/s/device   the best plan of the parallel-strategy search (`search.py`) for
                            the RL update as a training job on one supernode
    decode step(b)          one engine instance over `devices_per_engine` chips (dense and
                            attention weights TP-sharded over `tp`, attention data-parallel
                            over the rest, experts EP-sharded over all), on its busiest chip:
                            max(HBM reads of its dense shard, the experts the batch touches
                            among its own, its sequences' KV cache; matmul FLOPs) + TP
                            all-reduces + the dispatch / combine all-to-alls of every MoE
                            layer with a per-peer message cost; longer contexts add their KV
                            reads; slots are what the KV memory holds
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
    devices_per_engine: int = 32  # chips per rollout engine instance
    tp: int = 1  # tensor parallel inside an engine: dense and attention weights split over `tp`
    #              chips, attention data parallel over the rest; routed experts EP over all
    context_len: int = 1024  # the context the decode table is computed at (a prompt); the
    #                          simulator adds each longer context's KV reads (`decode_context_ms`)
    slot_context: int = 8192  # the context each sequence's KV cache is sized for: an engine's
    #                           slots are what its KV memory holds at this context
    memory_utilization: float = 0.9  # share of a chip's HBM the engine may use
    a2a_message_us: float = 1.0  # cost of each peer message of an expert all-to-all on top of
    #                              the link latency (assumed; DeepEP-style kernels: ~1 us)
    step_overhead_ms: float = 1.0  # host work of one engine step that the device does not hide
    #                                (scheduling, sampling, graph launch), assumed
    train_seq_len: int = 8192  # packed sequence length of the RL update
    train_global_batch: int = 768  # sequences per update in the training-plan search


def _kv_bytes_per_token(model: ModelConfig) -> float:
    """KV-cache bytes of one token over all layers (MLA: the latent and the RoPE key)."""
    if model.attention == "mla":
        per_layer = (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * BF16
    else:
        per_layer = 2 * model.num_kv_heads * model.head_dim * BF16
    return per_layer * model.num_layers


def _kv_split(model: ModelConfig, tp: int) -> int:
    """Over how many TP chips one sequence's KV cache is split (MLA's latent is replicated)."""
    return 1 if model.attention == "mla" else min(tp, model.num_kv_heads)


def engine_weight_bytes_per_chip(model: ModelConfig, a: EngineAssumptions) -> float:
    """bf16 weights one engine chip holds: the dense part / tp, its 1/n of the routed experts."""
    layers = model_layers(model, a.context_len)
    dense = sum(x.dense_params for x in layers) + model.vocab_size * model.d_model  # + the embedding
    experts = sum(x.expert_params for x in layers)
    return (dense / a.tp + experts / a.devices_per_engine) * BF16


def engine_slots(model: ModelConfig, cluster: ClusterSpec, a: EngineAssumptions) -> int:
    """Sequences one engine holds at once: each attention data-parallel group's KV memory (HBM
    x `memory_utilization`, less the weights) at `slot_context` tokens per sequence."""
    free = cluster.chip.memory_GB * 1e9 * a.memory_utilization - engine_weight_bytes_per_chip(model, a)
    if free <= 0:
        raise ValueError(f"{model.param_counts()['total'] / 1e9:.0f}B weights do not fit an engine of "
                         f"{a.devices_per_engine} x {cluster.chip.name} (tp {a.tp}): "
                         f"{engine_weight_bytes_per_chip(model, a) / 1e9:.1f} GB per chip")
    per_sequence = a.slot_context * _kv_bytes_per_token(model) / _kv_split(model, a.tp)
    return max(1, int(free // per_sequence)) * (a.devices_per_engine // a.tp)


def decode_step_s(model: ModelConfig, cluster: ClusterSpec, batch: int,
                  a: EngineAssumptions) -> float:
    """One decode step of `batch` sequences on one engine instance at `a.context_len` of
    context, on its busiest chip: the slower of its HBM reads (every dense weight of its TP
    shard, the routed experts the step touches among its own, its sequences' KV cache) and its
    matmuls, plus the collectives (TP all-reduces of each layer's two outputs; the expert
    dispatch and combine all-to-alls of each MoE layer, with a per-peer message cost)."""
    chip, n, tp = cluster.chip, a.devices_per_engine, a.tp
    dp = n // tp
    rows = -(-batch // dp)  # sequences on the busiest attention data-parallel group
    layers = model_layers(model, a.context_len)
    dense = sum(x.dense_params for x in layers)  # the embedding is a lookup of `rows` rows
    experts = sum(x.expert_params for x in layers)
    touched = 1.0 - (1.0 - 1.0 / model.num_experts) ** (batch * model.top_k) if model.num_experts else 0.0
    weight_bytes = dense / tp * BF16 + experts / n * touched * BF16
    kv_bytes = rows * a.context_len * _kv_bytes_per_token(model) / _kv_split(model, tp)
    memory_s = (weight_bytes + kv_bytes) / (chip.memory_bandwidth_GBps * 1e9)
    flops = (sum(x.matmul_flops + x.attn_core_flops for x in layers) * rows / tp
             + sum(x.expert_flops for x in layers) * batch / n)
    compute_s = flops / (chip.peak_tflops * 1e12 * chip.matmul_efficiency)
    comm_s = 0.0
    if tp > 1:  # two all-reduces per layer of the rows' hidden states (ring)
        link = cluster.link_for(tp)
        size = rows * model.d_model * BF16
        comm_s += 2 * model.num_layers * (2 * (tp - 1) * link.latency_us * 1e-6
                                          + 2 * (tp - 1) / tp * size / (link.bandwidth_GBps * 1e9))
    if model.num_moe_layers and n > 1:
        link = cluster.link_for(n)
        a2a_bytes = rows * model.top_k * model.d_model * BF16 / tp  # each way, per chip and MoE layer
        peers = min(n - 1, rows * model.top_k)
        comm_s += model.num_moe_layers * 2 * ((link.latency_us + peers * a.a2a_message_us) * 1e-6
                                              + a2a_bytes / (link.bandwidth_GBps * 1e9))
    return max(memory_s, compute_s) + comm_s + a.step_overhead_ms / 1e3


def decode_context_ms(model: ModelConfig, cluster: ClusterSpec, a: EngineAssumptions) -> float:
    """Extra decode-step time per active sequence and per context token beyond `context_len`:
    its KV read, spread over the engine's attention data-parallel groups, ms."""
    dp = a.devices_per_engine // a.tp
    per_token = _kv_bytes_per_token(model) / _kv_split(model, a.tp)
    return per_token / dp / (cluster.chip.memory_bandwidth_GBps * 1e9) * 1e3


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
    slots = engine_slots(model, supernode, a)
    batches = tuple(sorted({b for b in DECODE_BATCHES if b < slots} | {slots}))
    times = tuple(decode_step_s(model, supernode, b, a) * 1e3 for b in batches)
    context_ms = decode_context_ms(model, supernode, a)
    return Calibration(
        decode_batch_sizes=batches, decode_step_ms=times,
        decode_context_ms=context_ms, decode_reference_context=a.context_len,
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
            f"engine: {n} chips per instance, tp {a.tp} (dense and attention weights / tp, read "
            f"whole by every attention data-parallel group each step), routed experts EP over {n}, "
            f"{engine_weight_bytes_per_chip(model, a) / 1e9:.1f} GB of bf16 weights per chip; "
            f"{slots} slots (the KV memory, {a.memory_utilization:.0%} of HBM less the weights, at "
            f"{a.slot_context} tokens each); HBM {chip.memory_bandwidth_GBps:.0f} GB/s, matmul "
            f"efficiency {chip.matmul_efficiency:.2f} (assumed); per MoE layer a dispatch and a combine "
            f"all-to-all at {supernode.link_for(n).bandwidth_GBps:.0f} GB/s + "
            f"{supernode.link_for(n).latency_us:.0f} us + {a.a2a_message_us:g} us per peer message; "
            f"{a.step_overhead_ms:g} ms of host work per step (graph mode); decode step at {a.context_len} tokens of "
            "context " + ", ".join(f"{b}: {t:.1f} ms" for b, t in zip(batches, times))
            + f", each longer context +{context_ms * 1e6:.2f} ns per sequence and token (its KV reads)",
            f"switch: optimizer state ({OPTIMIZER_BYTES} B/param / {supernode.num_chips} "
            f"chips) to host at {supernode.host.bandwidth_GBps:.0f} GB/s + bf16 weights "
            f"re-laid out over the fabric: {switch:.2f} s each way",
            f"weight sync (separated): {total * BF16 / 1e9:,.0f} GB of bf16 weights, each "
            f"engine chip receives its 1/{n} at {supernode.intra.bandwidth_GBps:.0f} GB/s",
            "gradient sync across supernodes: fp32 ring all-reduce of each chip's shard over "
            "the per-chip inter-supernode bandwidth, not overlapped with compute",
        ),
    )
