"""The decoder-only MoE transformer, readable top to bottom.

Layers `[0, num_dense_layers)` have a dense SwiGLU MLP, the rest a Mixture-of-Experts MLP;
attention is GQA or MLA. The model knows nothing about parallelism or RL: parallel layouts are
applied to it from outside, and the rollout engine drives it through a `CacheBatch`.

Legend: B batch rows, T tokens, D model dim, V vocab.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlfusion.model.attention import build_attention
from rlfusion.model.config import ModelConfig
from rlfusion.model.kv_cache import AttnContext, CacheBatch, KVCache, PackedSeqs
from rlfusion.model.layers import RMSNorm, Rotary, SwiGLU
from rlfusion.model.routes import Routes
from rlfusion.model.moe import MoE, Router


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = build_attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_idx >= cfg.num_dense_layers
        self.moe_index = layer_idx - cfg.num_dense_layers  # among the MoE layers (what `Routes` index)
        self.mlp = MoE(cfg) if self.is_moe else SwiGLU(cfg.d_model, cfg.dense_ffn_dim)

    def forward(self, x_BTD: torch.Tensor, ctx: AttnContext, routes: Routes | None = None) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), ctx)
        if self.is_moe:
            return x_BTD + self.mlp(self.mlp_norm(x_BTD), routes, self.moe_index)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def forward(self, tokens_BT: torch.Tensor, batch: CacheBatch | None = None,
                packed: PackedSeqs | None = None, routes: Routes | None = None) -> torch.Tensor:
        """Logits `[B, T, V]`.

        Default: causal attention over each row of `tokens_BT`. With `batch`: rows continue
        sequences in the KV cache. With `packed`: `tokens_BT` is `[1, N]`, several sequences
        concatenated without padding, each attending only to itself. `routes`: the MoE routes
        to replay or record over the `B * T` tokens in row order (`model.routes`).
        """
        ctx = AttnContext.build(tokens_BT.shape[0], tokens_BT.shape[1], batch, tokens_BT.device,
                                packed)
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, ctx, routes)
        x_BTD = self.norm(x_BTD)
        if self.lm_head is None:
            return x_BTD @ self.embed.weight.T
        return self.lm_head(x_BTD)

    # ---- MoE router bookkeeping -------------------------------------------------------------

    def routers(self) -> list[Router]:
        return [layer.mlp.router for layer in self.layers if layer.is_moe]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the load-balancing losses of the last forward pass (0 when disabled)."""
        losses = [layer.mlp.aux_loss for layer in self.layers if layer.is_moe]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def update_router_bias(self) -> None:
        for router in self.routers():
            router.update_bias(self.config.bias_update_rate)

    # ---- cache and init ---------------------------------------------------------------------

    def new_kv_cache(self, num_slots: int, max_len: int | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        max_len = max_len or self.config.max_seq_len
        dtype = dtype or self.embed.weight.dtype
        device = self.embed.weight.device
        buffers = [tuple(torch.zeros(num_slots, heads, max_len, width, dtype=dtype, device=device)
                         for heads, width in layer.attn.cache_shapes()) for layer in self.layers]
        return KVCache(buffers, num_slots, max_len)

    @classmethod
    def meta(cls, cfg: ModelConfig) -> MoETransformer:
        """The model with every tensor on the meta device: its shapes and no memory. It becomes a
        real model by taking tensors as its own (`load_state_dict(assign=True)`), then
        `derive_buffers`; nothing is allocated or initialised twice."""
        with torch.device("meta"):
            return cls(cfg)

    @classmethod
    def of_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> MoETransformer:
        """The model holding `state`'s tensors (not copies; built on the meta device)."""
        model = cls.meta(cfg)
        model.load_state_dict(state, assign=True)
        model.derive_buffers()
        return model

    def derive_buffers(self) -> None:
        """Compute the buffers checkpoints do not hold (RoPE tables, routing counts) on the
        weights' device: what a `meta()` model needs once it has taken its weights."""
        device = self.embed.weight.device
        for module in self.modules():
            if isinstance(module, Rotary):
                module.build_tables(device)
        for router in self.routers():
            router.tokens_per_expert = torch.zeros_like(router.expert_bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.num_layers)  # residual branches (GPT-2 style)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)  # q/k/v biases (qkv_bias)
            elif p.dim() == 1:
                nn.init.ones_(p)  # norm weights
            elif name.endswith(("wo.weight", "down.weight", "w_down_EFD")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)
        for router in self.routers():
            router.expert_bias.zero_()
