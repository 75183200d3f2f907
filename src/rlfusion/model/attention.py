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


def _cache(buf_SGLX: torch.Tensor, ctx: AttnContext, new_BTGX: torch.Tensor) -> None:
    """Write the pass's new entries into the cache: each row's tokens at their positions, or in a
    packed prefill each packed token into its sequence's row (`cache_rows_N`)."""
    if ctx.cache_rows_N is not None:
        buf_SGLX[ctx.cache_rows_N, :, ctx.pos_BT[0]] = new_BTGX[0].to(buf_SGLX.dtype)
        return
    rows_BT = (torch.arange(new_BTGX.shape[0], device=new_BTGX.device) + ctx.slot_start).unsqueeze(1)
    buf_SGLX[rows_BT.expand_as(ctx.pos_BT), :, ctx.pos_BT] = new_BTGX.to(buf_SGLX.dtype)


def _cached_rows(buf_SGLX: torch.Tensor, ctx: AttnContext, num_rows: int) -> torch.Tensor:
    """The pass's rows of a one-head cache buffer up to the longest: `[B, L, X]`."""
    return buf_SGLX[ctx.slot_start:ctx.slot_start + num_rows, 0, :ctx.kv_len]


def _attend_cached(q_BHTD, k_buf_SGLD, v_buf_SGLD, ctx: AttnContext, scale: float) -> torch.Tensor:
    """Attention over the cache, a run of rows at a time (`ctx.segments`), each run read in place
    up to its own longest row. The H query heads share the G cached heads in groups of H/G,
    so each cached head's keys and values are read once for its whole group."""
    B, H, T, D = q_BHTD.shape
    G = k_buf_SGLD.shape[1]
    out_BHTD = q_BHTD.new_empty(B, H, T, v_buf_SGLD.shape[-1])
    for start, end, L, mask in ctx.segments:
        n = end - start
        rows = slice(ctx.slot_start + start, ctx.slot_start + end)
        k_nGLD, v_nGLD = k_buf_SGLD[rows, :, :L], v_buf_SGLD[rows, :, :L]
        q_nGQD = q_BHTD[start:end].reshape(n, G, H // G * T, D)  # Q = query heads of a group x T
        scores = torch.matmul(q_nGQD, k_nGLD.transpose(-1, -2)).mul_(scale)
        if mask is not None:
            scores.view(n, G, H // G, T, L).masked_fill_(~mask, float("-inf"))
        out_BHTD[start:end] = torch.matmul(torch.softmax(scores, -1), v_nGLD).view(n, H, T, -1)
    return out_BHTD


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
        """Per-token cache entries, as (heads, width): keys and values, `G` heads of `Dh` each."""
        return [(self.num_kv_heads, self.head_dim)] * 2

    def forward(self, x_BTD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.wq(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k = self.wk(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, ctx.pos_BT, ctx.rope), self.rotary(k, ctx.pos_BT, ctx.rope)
        v = self.wv(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        scale = 1.0 / math.sqrt(self.head_dim)
        if ctx.cache is not None:
            k_buf, v_buf = ctx.cache.layers[self.layer_idx]
            _cache(k_buf, ctx, k)
            _cache(v_buf, ctx, v)
            if ctx.cache_rows_N is None:
                out = _attend_cached(q.transpose(1, 2), k_buf, v_buf, ctx, scale)
                return self.wo(out.transpose(1, 2).reshape(B, T, -1))
        out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx, scale)
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
        """Per-token cache entries, as (heads, width): the latent (R) and the shared RoPE key (P),
        one head each."""
        return [(1, self.kv_rank), (1, self.rope_dim)]

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
            _cache(lat_buf, ctx, latent_BTR.unsqueeze(2))
            _cache(rope_buf, ctx, k_rope_BTP.unsqueeze(2))
            if ctx.cache_rows_N is None:  # decode: the rows' cached prefix, read with a mask
                latent_BTR, k_rope_BTP = _cached_rows(lat_buf, ctx, B), _cached_rows(rope_buf, ctx, B)
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
