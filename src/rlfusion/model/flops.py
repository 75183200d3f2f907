"""Forward FLOPs of a `ModelConfig`: per layer kind, per token, and of a whole pass.

Owns the FLOP formulas of the model's forward pass, the one definition the simulator's cost
model (`sim/costs.py`), the device workers' achieved-FLOP/s metrics and `bench/engine.py` all
use. Torch-free; knows nothing about devices, parallel plans or backward passes (the cost model
prices those from these numbers).

Conventions:
- A multiply-add is 2 FLOPs. A matmul with a `[k, n]` weight costs `2 k n` FLOPs per token.
- Causal attention: the score (`QK^T`) and value (`PV`) products cost `2 * (s/2) * heads *
  (d_qk + d_v)` FLOPs per token in the forward pass: each token attends to `s/2` keys on
  average, i.e. we count half of the full `s x s` matrix, the work a causal flash kernel does.
"""

from __future__ import annotations

from rlfusion.model.config import ModelConfig


def attention_dims(model: ModelConfig) -> tuple[int, int]:
    """(d_qk, d_v): per-head query/key and value widths."""
    if model.attention == "mla":
        return model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim, model.mla.v_head_dim
    return model.head_dim, model.head_dim


def attention_matmul_params(model: ModelConfig) -> int:
    """Attention parameters that are matmul weights (the MLA latent norms are not)."""
    norms = 0
    if model.attention == "mla":
        norms = model.mla.kv_lora_rank + model.mla.q_lora_rank
    return model.attention_params() - norms


def attn_core_flops(model: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's causal attention core over `seq_len` positions."""
    d_qk, d_v = attention_dims(model)
    return 2.0 * (seq_len / 2.0) * model.num_heads * (d_qk + d_v)


def dense_layer_matmul_flops(model: ModelConfig) -> float:
    """Forward matmul FLOPs per token of a dense layer: attention projections, SwiGLU MLP."""
    return 2.0 * attention_matmul_params(model) + 2.0 * model.swiglu_params(model.dense_ffn_dim)


def moe_layer_matmul_flops(model: ModelConfig) -> float:
    """Forward matmul FLOPs per token of an MoE layer outside the routed experts: attention
    projections, the shared experts and the router."""
    shared = model.num_shared_experts * model.swiglu_params(model.expert_ffn_dim)
    return 2.0 * attention_matmul_params(model) + 2.0 * shared + 2.0 * model.router_params()


def routed_expert_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of an MoE layer's routed experts (the `top_k` a token chose)."""
    return 2.0 * model.top_k * model.swiglu_params(model.expert_ffn_dim)


def layer_matmul_flops(model: ModelConfig, layer: int) -> float:
    """Forward matmul FLOPs per token of layer `layer`: a dense layer below
    `num_dense_layers`, else an MoE layer with the `top_k` routed experts a token chose."""
    if layer < model.num_dense_layers:
        return dense_layer_matmul_flops(model)
    return moe_layer_matmul_flops(model) + routed_expert_flops(model)


def head_matmul_flops(model: ModelConfig) -> float:
    """Forward FLOPs per token of the LM head."""
    return 2.0 * model.d_model * model.vocab_size


def token_matmul_flops(cfg: ModelConfig) -> float:
    """Forward matmul FLOPs per token: every layer's projections and MLP (the routed experts a
    token chose, top_k of them), the router and the LM head."""
    moe = moe_layer_matmul_flops(cfg) + routed_expert_flops(cfg)
    return (cfg.num_dense_layers * dense_layer_matmul_flops(cfg) + cfg.num_moe_layers * moe
            + head_matmul_flops(cfg))


def attention_flops_per_position(cfg: ModelConfig) -> float:
    """Forward attention-core FLOPs of one query attending to one key, summed over layers
    (scores and the value product: 2 x heads x (d_qk + d_v))."""
    d_qk, d_v = attention_dims(cfg)
    return 2.0 * cfg.num_heads * (d_qk + d_v) * cfg.num_layers


def forward_flops(cfg: ModelConfig, tokens: float, attended: float) -> float:
    """Useful FLOPs of a forward pass over `tokens` tokens that attend to `attended` positions in
    all (a decode row at context L attends to L; a causal prefill of n tokens to n(n+1)/2): the
    model's matmuls with the routed experts each token chose, and the attention core. Work a
    kernel does beyond that (a small-batch MoE path that runs every expert, padded attention)
    is not useful and not counted, as MFU does not count it."""
    return tokens * token_matmul_flops(cfg) + attended * attention_flops_per_position(cfg)


def causal_positions(lengths: list[int]) -> int:
    """Positions attended by causal passes over sequences of these lengths."""
    return sum(n * (n + 1) // 2 for n in lengths)
