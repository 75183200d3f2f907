"""Per-layer, per-token costs of a `ModelConfig`: FLOPs, parameters, activation bytes.

Owns the model side of the cost model; knows nothing about devices or parallel plans (those
divide these numbers in `step.py`). Parameter totals come from `ModelConfig`'s own counting
methods and forward FLOPs from the model's own formulas (`rlfusion.model.flops`, whose
conventions hold here: a multiply-add is 2 FLOPs, causal attention counts half the `s x s`
scores), so the simulator and the real model agree by construction.

Conventions of the cost model on top of those:
- Backward costs 2x the forward for matmuls; the attention core costs 2.5x (flash attention
  recomputes the scores). Model FLOPs for MFU use 3x forward (no recompute, no flash extra).
- Activations are bf16 (2 bytes) except router logits and softmax statistics (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.model.config import ModelConfig
from rlfusion.model.flops import (attention_dims, attn_core_flops, dense_layer_matmul_flops,
                                  head_matmul_flops, moe_layer_matmul_flops, routed_expert_flops)

BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes per token saved for backward by one layer, split by what can be given up."""

    kept: float  # needed by backward, not cheap to recompute
    recomputable: float  # dropped by selective recompute (norms, SwiGLU, MLA up-projections)
    swappable: float  # MoE expert inputs/outputs that swap can move to host memory

    @property
    def total(self) -> float:
        return self.kept + self.recomputable + self.swappable


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer (or the LM head), per token, whole layer (not yet sharded)."""

    kind: str  # "dense", "moe" or "head"
    matmul_flops: float  # forward FLOPs of TP-sharded matmuls (attention proj, dense/shared MLP)
    attn_core_flops: float  # forward FLOPs of the causal attention core
    expert_flops: float  # forward FLOPs of the routed experts (top_k of them), EP-sharded
    recompute_flops: float  # extra forward FLOPs of selective recompute
    dense_params: int  # TP-sharded parameters (attention, dense/shared MLP, router, norms)
    expert_params: int  # routed-expert parameters (EP-sharded)
    activation: ActivationBytes

    @property
    def forward_flops(self) -> float:
        return self.matmul_flops + self.attn_core_flops + self.expert_flops


def _attention_activation(model: ModelConfig) -> ActivationBytes:
    d, h = model.d_model, model.num_heads
    d_qk, d_v = attention_dims(model)
    stats = h * FP32  # flash-attention log-sum-exp
    if model.attention == "mla":
        m = model.mla
        latent = m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim  # q_a out, c_kv, k_rope
        kept = (d + latent + h * d_qk + h * d_v) * BF16 + stats  # x, latents, q, attn out
        recomputable = (d + h * (d_qk + d_v)) * BF16  # norm out, k and v re-expanded
        return ActivationBytes(kept, recomputable, 0.0)
    kv = model.num_kv_heads * model.head_dim
    kept = (d + h * d_qk + 2 * kv + h * d_v) * BF16 + stats  # x, q, k, v, attn out
    return ActivationBytes(kept, d * BF16, 0.0)


def _mla_recompute_flops(model: ModelConfig) -> float:
    if model.attention != "mla":
        return 0.0
    m = model.mla
    return 2.0 * m.kv_lora_rank * model.num_heads * (m.qk_nope_head_dim + m.v_head_dim)


def dense_layer(model: ModelConfig, seq_len: int) -> LayerCost:
    d, f = model.d_model, model.dense_ffn_dim
    attn = _attention_activation(model)
    mlp = ActivationBytes(kept=(d + 2 * f) * BF16, recomputable=(d + f) * BF16, swappable=0.0)
    return LayerCost(
        kind="dense",
        matmul_flops=dense_layer_matmul_flops(model),
        attn_core_flops=attn_core_flops(model, seq_len),
        expert_flops=0.0,
        recompute_flops=_mla_recompute_flops(model),
        dense_params=model.attention_params() + model.swiglu_params(f) + 2 * d,
        expert_params=0,
        activation=_sum(attn, mlp),
    )


def moe_layer(model: ModelConfig, seq_len: int) -> LayerCost:
    d, fe, k = model.d_model, model.expert_ffn_dim, model.top_k
    shared = model.num_shared_experts
    attn = _attention_activation(model)
    moe = ActivationBytes(
        kept=d * BF16 + model.num_experts * FP32 + shared * 2 * fe * BF16,  # x, logits, shared
        recomputable=(d + shared * fe) * BF16 + k * fe * BF16,  # norm out, SwiGLU outputs
        swappable=k * (2 * d + 2 * fe) * BF16,  # dispatched inputs, gate/up, expert outputs
    )
    expert = model.swiglu_params(fe)
    return LayerCost(
        kind="moe",
        matmul_flops=moe_layer_matmul_flops(model),
        attn_core_flops=attn_core_flops(model, seq_len),
        expert_flops=routed_expert_flops(model),
        recompute_flops=_mla_recompute_flops(model),
        dense_params=(model.attention_params() + shared * expert + model.router_params()
                      + 2 * d),
        expert_params=model.num_experts * expert,
        activation=_sum(attn, moe),
    )


def head_layer(model: ModelConfig) -> LayerCost:
    """Final norm + LM head (+ the loss). Its fp32 logits are counted as a transient buffer."""
    d, v = model.d_model, model.vocab_size
    return LayerCost(kind="head", matmul_flops=head_matmul_flops(model), attn_core_flops=0.0,
                     expert_flops=0.0, recompute_flops=0.0,
                     dense_params=(0 if model.tie_embeddings else d * v) + d,
                     expert_params=0, activation=ActivationBytes(d * BF16, 0.0, 0.0))


def module_activations(model: ModelConfig, layer: LayerCost, expert_imbalance: float = 1.0
                       ) -> dict[str, tuple[float, float]]:
    """Per-token (saved bytes, input bytes) of a layer's modules in the memory planner's naming
    (`memory_plan.CHILDREN`), the `ActivationBytes` inventory split by module: each norm saves
    its input (the residual stream, `d` bf16); attention and the MLP / MoE block save their
    input (the norm output) and everything else of their part; the `swappable` expert bytes
    belong to the MoE block, scaled by the busiest EP rank's `expert_imbalance`."""
    x = model.d_model * BF16
    attn = _attention_activation(model).total
    mlp = layer.activation.total - attn + (expert_imbalance - 1.0) * layer.activation.swappable
    return {"attn_norm": (x, x), "attn": (attn - x, x), "mlp_norm": (x, x), "mlp": (mlp - x, x)}


def model_layers(model: ModelConfig, seq_len: int) -> list[LayerCost]:
    """All layers in order, then the head. The embedding (a lookup) is added by the planner."""
    dense, moe = dense_layer(model, seq_len), moe_layer(model, seq_len)
    layers = [dense] * model.num_dense_layers + [moe] * model.num_moe_layers
    return layers + [head_layer(model)]


def model_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token used for MFU: 3x forward, no recompute."""
    return 3.0 * sum(layer.forward_flops for layer in model_layers(model, seq_len))


def check_param_total(model: ModelConfig, seq_len: int) -> int:
    """Total parameters as the per-layer costs see them (embedding included)."""
    layers = model_layers(model, seq_len)
    return sum(x.dense_params + x.expert_params for x in layers) + model.vocab_size * model.d_model


def _sum(a: ActivationBytes, b: ActivationBytes) -> ActivationBytes:
    return ActivationBytes(a.kept + b.kept, a.recomputable + b.recomputable,
                           a.swappable + b.swappable)
