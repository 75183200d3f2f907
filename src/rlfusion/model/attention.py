"""Causal self-attention: grouped-query attention (GQA) and multi-head latent attention (MLA).

Both read and write the preallocated KV cache through an `AttnContext`; without a cache they run
plain causal attention over the given tokens (training and full-sequence scoring).

Legend: B batch rows, T new tokens, L cached positions, H query heads, G kv heads, Dh head dim,
R latent rank, P rope dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rlfusion.model.config import ModelConfig
from rlfusion.model.kv_cache import AttnContext
from rlfusion.model.layers import RMSNorm, Rotary


def _write_rows(buf_SL: torch.Tensor, ctx: AttnContext, new_BT: torch.Tensor) -> torch.Tensor:
    """Store the new tokens' entries in the cache and return the rows' cached prefix `[B, L, ...]`."""
    num_rows = new_BT.shape[0]
    rows_BT = (torch.arange(num_rows, device=new_BT.device) + ctx.slot_start).unsqueeze(1)
    buf_SL[rows_BT.expand_as(ctx.pos_BT), ctx.pos_BT] = new_BT.to(buf_SL.dtype)
    return buf_SL[ctx.slot_start:ctx.slot_start + num_rows, :ctx.kv_len]


def _cache(buf_SL: torch.Tensor, ctx: AttnContext, new_BT: torch.Tensor) -> torch.Tensor:
    """Write the pass's new entries into the cache; returns what attention reads: the rows'
    cached prefix, or in a packed prefill (each token to its sequence's row, `cache_rows_N`)
    the packed entries themselves."""
    if ctx.cache_rows_N is None:
        return _write_rows(buf_SL, ctx, new_BT)
    buf_SL[ctx.cache_rows_N, ctx.pos_BT[0]] = new_BT[0].to(buf_SL.dtype)
    return new_BT


def _attend(q_BHTD, k_BGLD, v_BGLD, ctx: AttnContext, scale: float) -> torch.Tensor:
    gqa = q_BHTD.shape[1] != k_BGLD.shape[1]
    if ctx.unpad_SL is not None:
        return _attend_packed(q_BHTD, k_BGLD, v_BGLD, ctx, scale, gqa)
    if ctx.cache is None:
        return F.scaled_dot_product_attention(q_BHTD, k_BGLD, v_BGLD, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q_BHTD, k_BGLD, v_BGLD, attn_mask=ctx.mask_B1TL,
                                          scale=scale, enable_gqa=gqa)


def _attend_packed(q_1HND, k_1GND, v_1GND, ctx: AttnContext, scale: float, gqa: bool) -> torch.Tensor:
    """Varlen attention: gather each bucket of similar-length sequences into right-padded rows,
    attend causally, repack.

    Right padding plus causal masking means no real query ever sees a padded key.
    """
    outs = []
    for unpad_SL in ctx.unpad_SL:
        unpad = lambda x_1HND: x_1HND[0][:, unpad_SL].transpose(0, 1)  # S H L D
        out_SHLD = F.scaled_dot_product_attention(unpad(q_1HND), unpad(k_1GND), unpad(v_1GND),
                                                  is_causal=True, scale=scale, enable_gqa=gqa)
        S, H, L, D = out_SHLD.shape
        outs.append(out_SHLD.transpose(1, 2).reshape(S * L, H, D))
    out_NHD = (outs[0] if len(outs) == 1 else torch.cat(outs))[ctx.repack_N]
    return out_NHD.transpose(0, 1).unsqueeze(0)  # 1 H N D


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def cache_shapes(self) -> list[tuple[int, ...]]:
        """Per-token cache entries: keys and values `[G, Dh]` each."""
        return [(self.num_kv_heads, self.head_dim)] * 2

    def forward(self, x_BTD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.wq(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k = self.wk(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, ctx.pos_BT, ctx.rope), self.rotary(k, ctx.pos_BT, ctx.rope)
        v = self.wv(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if ctx.cache is not None:
            k_buf, v_buf = ctx.cache.layers[self.layer_idx]
            k, v = _cache(k_buf, ctx, k), _cache(v_buf, ctx, v)
        out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx,
                      1.0 / math.sqrt(self.head_dim))
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class MultiHeadLatentAttention(nn.Module):
    """MLA: keys/values are expanded from a cached low-rank latent plus one shared RoPE key."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if m.q_lora_rank:
            self.wq = nn.Sequential(nn.Linear(cfg.d_model, m.q_lora_rank, bias=False),
                                    RMSNorm(m.q_lora_rank, cfg.norm_eps),
                                    nn.Linear(m.q_lora_rank, cfg.num_heads * qk_dim, bias=False))
        else:
            self.wq = nn.Linear(cfg.d_model, cfg.num_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.d_model, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.num_heads * self.v_dim, cfg.d_model, bias=False)
        self.rotary = Rotary(self.rope_dim, cfg.max_seq_len, cfg.rope_theta)

    def cache_shapes(self) -> list[tuple[int, ...]]:
        """Per-token cache entries: the latent `[R]` and the shared RoPE key `[P]`."""
        return [(self.kv_rank,), (self.rope_dim,)]

    def forward(self, x_BTD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.num_heads
        q = self.wq(x_BTD).view(B, T, H, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_rope, ctx.pos_BT, ctx.rope)], dim=-1)
        latent, k_rope = self.wkv_a(x_BTD).split([self.kv_rank, self.rope_dim], dim=-1)
        latent_BTR = self.kv_norm(latent)
        k_rope_BTP = self.rotary(k_rope.unsqueeze(2), ctx.pos_BT, ctx.rope).squeeze(2)
        if ctx.cache is not None:
            lat_buf, rope_buf = ctx.cache.layers[self.layer_idx]
            latent_BTR, k_rope_BTP = _cache(lat_buf, ctx, latent_BTR), _cache(rope_buf, ctx, k_rope_BTP)
        L = latent_BTR.shape[1]
        k_nope, v = self.wkv_b(latent_BTR).view(B, L, H, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope_BTP.unsqueeze(2).expand(B, L, H, self.rope_dim)], dim=-1)
        out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx,
                      1.0 / math.sqrt(self.nope_dim + self.rope_dim))
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


def build_attention(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if cfg.attention == "mla":
        return MultiHeadLatentAttention(cfg, layer_idx)
    return GroupedQueryAttention(cfg, layer_idx)
