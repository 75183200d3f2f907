"""Model configuration and presets for the MoE decoder.

Owns `ModelConfig` (every architectural choice of the decoder), the named presets and the
parameter counts derived from a config. Importable without torch: the planner and simulator
(`rlfusion.sim`) read the same presets to size models that are never instantiated here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ATTENTION_KINDS = ("gqa", "mla")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dims (DeepSeek-V2/V3 and Pangu Ultra MoE style).

    The KV cache holds only the compressed latent (`kv_lora_rank`) plus the shared RoPE key
    (`qk_rope_head_dim`) per token; keys and values are re-expanded from the latent.
    """

    q_lora_rank: int = 0  # 0 = queries projected directly from the hidden state
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only MoE transformer.

    Layers `[0, num_dense_layers)` use a dense SwiGLU MLP of width `dense_ffn_dim`; the rest are
    MoE layers with `num_experts` routed SwiGLU experts of width `expert_ffn_dim` (top-`top_k`
    routing) plus `num_shared_experts` always-on experts of the same width.
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_dense_layers: int
    dense_ffn_dim: int
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    num_shared_experts: int = 1
    max_seq_len: int = 256
    attention: str = "gqa"
    mla: MLAConfig = field(default_factory=MLAConfig)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    # Family features of imported checkpoints (model/hf.py); all off for the native presets.
    qkv_bias: bool = False  # GQA: biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # GQA: RMSNorm over each head's q and k before RoPE (Qwen3)
    shared_expert_gate: bool = False  # shared experts scaled by sigmoid(w . x) (Qwen2-MoE)
    # Router
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.0  # switch-style load-balancing loss; 0 disables it
    bias_update_rate: float = 1e-3  # aux-loss-free expert-bias step; 0 disables it
    # Group-limited routing (DeepSeek-V3): experts form `num_expert_groups` equal groups, a group
    # scores the sum of its two best experts, and only the best `topk_groups` groups are eligible.
    num_expert_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, key: str, value, allowed: str) -> None:
            if not ok:
                raise ValueError(f"model.{key}={value!r} is invalid: {allowed}")

        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "max_seq_len"):
            need(getattr(self, key) > 0, key, getattr(self, key), "must be > 0")
        need(0 <= self.num_dense_layers <= self.num_layers, "num_dense_layers",
             self.num_dense_layers, f"must be in [0, num_layers={self.num_layers}]")
        need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
             f"must divide num_heads={self.num_heads}")
        need(self.attention in ATTENTION_KINDS, "attention", self.attention,
             f"allowed: {', '.join(ATTENTION_KINDS)}")
        need(self.score_func in SCORE_FUNCS, "score_func", self.score_func,
             f"allowed: {', '.join(SCORE_FUNCS)}")
        if self.num_moe_layers:
            need(self.num_experts > 0, "num_experts", self.num_experts, "must be > 0 with MoE layers")
            need(0 < self.top_k <= self.num_experts, "top_k", self.top_k,
                 f"must be in [1, num_experts={self.num_experts}]")
            need(self.expert_ffn_dim > 0, "expert_ffn_dim", self.expert_ffn_dim, "must be > 0")
            need(self.num_expert_groups >= 1 and self.num_experts % self.num_expert_groups == 0,
                 "num_expert_groups", self.num_expert_groups,
                 f"must be >= 1 and divide num_experts={self.num_experts}")
            need(1 <= self.topk_groups <= self.num_expert_groups, "topk_groups", self.topk_groups,
                 f"must be in [1, num_expert_groups={self.num_expert_groups}]")
            if self.num_expert_groups > 1:
                per_group = self.num_experts // self.num_expert_groups
                need(per_group >= 2, "num_expert_groups", self.num_expert_groups,
                     "must leave >= 2 experts per group (a group scores its two best)")
                need(self.top_k <= self.topk_groups * per_group, "top_k", self.top_k,
                     f"must be <= topk_groups * experts per group = {self.topk_groups * per_group}")
        if self.num_dense_layers:
            need(self.dense_ffn_dim > 0, "dense_ffn_dim", self.dense_ffn_dim, "must be > 0")
        if self.attention == "mla" and self.mla.qk_rope_head_dim % 2:
            raise ValueError("model.mla.qk_rope_head_dim must be even (RoPE rotates pairs)")
        if self.attention == "gqa" and self.head_dim % 2:
            raise ValueError("model.head_dim must be even (RoPE rotates pairs)")
        for key in ("qkv_bias", "qk_norm"):
            need(not getattr(self, key) or self.attention == "gqa", key, getattr(self, key),
                 "only with attention='gqa'")
        need(not self.shared_expert_gate or self.num_shared_experts > 0, "shared_expert_gate",
             self.shared_expert_gate, "needs num_shared_experts >= 1")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- parameter counts (no torch; must match the instantiated model exactly) ----

    def attention_params(self) -> int:
        d, h = self.d_model, self.num_heads
        if self.attention == "gqa":
            q = d * h * self.head_dim
            kv = 2 * d * self.num_kv_heads * self.head_dim
            bias = (h + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
            qk_norm = 2 * self.head_dim if self.qk_norm else 0
            return q + kv + bias + qk_norm + h * self.head_dim * d
        m = self.mla
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk_head  # + q_a norm
        else:
            q = d * h * qk_head
        kv_a = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # + kv_a norm
        kv_b = m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        out = h * m.v_head_dim * d
        return q + kv_a + kv_b + out

    def swiglu_params(self, ffn_dim: int) -> int:
        return 3 * self.d_model * ffn_dim

    def router_params(self) -> int:
        return self.d_model * self.num_experts

    def param_counts(self) -> dict[str, int]:
        """Total and active (per token) parameters, by component.

        `active` counts what one token touches in a forward pass: every dense weight, the
        router, `top_k` routed experts and the shared experts. The input embedding is a lookup,
        so it is reported separately (`embedding`) and left out of `active_non_embedding`.
        """
        norms_per_layer = 2 * self.d_model
        attn = self.num_layers * (self.attention_params() + norms_per_layer)
        dense_mlp = self.num_dense_layers * self.swiglu_params(self.dense_ffn_dim)
        expert = self.swiglu_params(self.expert_ffn_dim)
        routed = self.num_moe_layers * self.num_experts * expert
        shared = self.num_moe_layers * self.num_shared_experts * expert
        if self.shared_expert_gate:
            shared += self.num_moe_layers * self.d_model
        router = self.num_moe_layers * self.router_params()
        embedding = self.vocab_size * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        final_norm = self.d_model
        total = attn + dense_mlp + routed + shared + router + embedding + head + final_norm
        active_routed = self.num_moe_layers * self.top_k * expert
        active = attn + dense_mlp + active_routed + shared + router + embedding + head + final_norm
        return {
            "total": total,
            "active": active,
            "active_non_embedding": active - embedding,
            "embedding": embedding,
            "lm_head": head,
            "attention": attn,
            "dense_mlp": dense_mlp,
            "routed_experts": routed,
            "shared_experts": shared,
            "router": router,
        }


def _tiny() -> ModelConfig:
    # ~1.7M parameters: pretrains and RL-trains on 2 CPU cores in minutes. The vocab
    # is exactly the arithmetic CharTokenizer's (3 specials + 14 characters).
    return ModelConfig(
        vocab_size=17, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        num_dense_layers=1, dense_ffn_dim=512, num_experts=8, top_k=2, expert_ffn_dim=128,
        num_shared_experts=1, max_seq_len=256, routed_scaling_factor=1.0,
        aux_loss_coef=0.0, bias_update_rate=1e-3,
    )


def _tiny_mla() -> ModelConfig:
    return _tiny().replace(
        attention="mla",
        mla=MLAConfig(q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32),
    )


def _pangu_ultra_moe_718b() -> ModelConfig:
    # Pangu Ultra MoE: 61 layers, hidden 7680, 256 routed + 1 shared expert, top-8, expert FFN 2048,
    # MLA attention, first 3 layers dense, vocab 153,600. Head count, MLA ranks and the dense
    # FFN width follow the published Pangu Ultra MoE / DeepSeek-V3 family conventions.
    return ModelConfig(
        vocab_size=153_600, d_model=7680, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=128, num_dense_layers=3, dense_ffn_dim=18_432, num_experts=256, top_k=8,
        expert_ffn_dim=2048, num_shared_experts=1, max_seq_len=8192, attention="mla",
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        score_func="sigmoid", routed_scaling_factor=2.5, bias_update_rate=1e-3,
    )


def _qwen25_7b() -> ModelConfig:
    # Qwen2.5-7B (and Qwen2.5-Math-7B): dense, 28 layers, hidden 3584, 28 query / 4 KV heads of
    # 128, SwiGLU 18,944, q/k/v biases, vocab 152,064, untied head: 7.62B parameters
    return ModelConfig(
        vocab_size=152_064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        num_dense_layers=28, dense_ffn_dim=18_944, num_experts=0, top_k=0, expert_ffn_dim=0,
        num_shared_experts=0, max_seq_len=32_768, qkv_bias=True, norm_eps=1e-6,
    )


PRESETS = {
    "tiny": _tiny,
    "tiny-mla": _tiny_mla,
    "pangu-ultra-moe-718b": _pangu_ultra_moe_718b,
    "qwen2.5-7b": _qwen25_7b,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name]()


def config_to_dict(cfg: ModelConfig) -> dict:
    """The JSON form of a config (a checkpoint's `model` table)."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
    """A config from its JSON form; unknown keys are refused, naming them."""
    d = dict(d)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown model config keys {unknown}; allowed: {sorted(known)}")
    if isinstance(d.get("mla"), dict):
        d["mla"] = MLAConfig(**d["mla"])
    return ModelConfig(**d)
