"""Small building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU MLP.

Legend: B batch, T tokens per row, D model dim, H heads, Dh head dim, F FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, the MLP of dense layers and shared experts."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate = nn.Linear(dim, ffn_dim, bias=False)
        self.up = nn.Linear(dim, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Rotary(nn.Module):
    """Rotary position embedding (half-split convention) with a precomputed table."""

    def __init__(self, dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        self.build_tables()

    def build_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos / sin tables on `device` (None: the default one). Not saved in
        checkpoints: derived from the config, also for a model built on the meta device."""
        dim = self.dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles_LF = torch.outer(positions, inv_freq)
        self.register_buffer("cos_LF", angles_LF.cos(), persistent=False)
        self.register_buffer("sin_LF", angles_LF.sin(), persistent=False)

    def forward(self, x_BTHD: torch.Tensor, pos_BT: torch.Tensor,
                table: dict | None = None) -> torch.Tensor:
        """`table`: a per-pass cache, so every layer reuses one gather of cos/sin per position."""
        key = (self.cos_LF.shape[1], x_BTHD.dtype)
        if table is not None and key in table:
            cos, sin = table[key]
        else:
            cos = self.cos_LF[pos_BT].unsqueeze(2).to(x_BTHD.dtype)  # B T 1 F
            sin = self.sin_LF[pos_BT].unsqueeze(2).to(x_BTHD.dtype)
            if table is not None:
                table[key] = (cos, sin)
        x1, x2 = x_BTHD.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
