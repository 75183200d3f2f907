"""DP sequence balancing: assign the sequences of a global batch to data-parallel ranks so each
rank's estimated step cost, not just its token count, is near equal.

A sequence of `n` tokens costs `a·n` (GEMMs: projections, MLP, experts) plus `b·n²` (causal
attention scores and values), so a rank with one long sequence is slower than a rank with the
same tokens in short ones. `data_parallel.shard_rows` splits by this cost when given one (the
RL update does with `optim.dp_balance=cost`).

Owns the cost model (from the model shape, or fitted to measured times) and the comparison of
splits the balance bench prints. It does not know how rows reach ranks or how the model
computes attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfusion.model.config import ModelConfig


@dataclass(frozen=True)
class SeqCost:
    """Estimated cost of one sequence: `a * tokens + b * tokens**2` (any consistent unit)."""

    a: float = 1.0
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0 or self.a + self.b == 0:
            raise ValueError(f"seq_cost (a={self.a}, b={self.b}) is invalid: both must be >= 0, "
                             "not both 0")

    def __call__(self, tokens: int) -> float:
        return self.a * tokens + self.b * tokens * tokens

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "SeqCost":
        """Training FLOPs (3x forward): 2 per active weight per token, and per layer 2·n²·H·Dh
        for scores plus as much for values, halved by the causal mask."""
        active = cfg.param_counts()["active_non_embedding"]
        attn_dim = cfg.num_heads * cfg.head_dim
        return cls(a=3 * 2.0 * active, b=3 * 2.0 * cfg.num_layers * attn_dim)

    @classmethod
    def fit(cls, lengths: Sequence[int], seconds: Sequence[float]) -> "SeqCost":
        """Least-squares `a, b` (clamped to >= 0) from measured per-sequence step times."""
        if len(lengths) != len(seconds) or len(lengths) < 2:
            raise ValueError(f"fit needs >= 2 (length, time) pairs, got {len(lengths)} and "
                             f"{len(seconds)}")
        n = torch.tensor(lengths, dtype=torch.float64)
        sol = torch.linalg.lstsq(torch.stack([n, n * n], 1),
                                 torch.tensor(seconds, dtype=torch.float64)[:, None]).solution
        a, b = (max(float(x), 0.0) for x in sol.flatten())
        return cls(a, b) if a + b > 0 else cls()


def contiguous_split(num_seqs: int, num_ranks: int) -> list[list[int]]:
    """The baseline: equal-count contiguous chunks, as `shard_batch` cuts rows."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    sizes = [num_seqs // num_ranks + (r < num_seqs % num_ranks) for r in range(num_ranks)]
    starts = [sum(sizes[:r]) for r in range(num_ranks)]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]


def rank_costs(lengths: Sequence[int], parts: list[list[int]], cost: SeqCost) -> list[float]:
    return [sum(cost(lengths[i]) for i in part) for part in parts]


def max_over_mean(costs: Sequence[float]) -> float:
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0


@dataclass
class SeqBalanceReport:
    """max/mean per-rank cost of the contiguous split, the token-balanced split and the
    cost-balanced split."""

    contiguous: float
    tokens: float
    cost: float


def compare_splits(lengths: Sequence[int], num_ranks: int, cost: SeqCost) -> SeqBalanceReport:
    from rlfusion.parallel.data_parallel import shard_rows

    splits = (contiguous_split(len(lengths), num_ranks), shard_rows(lengths, num_ranks),
              shard_rows(lengths, num_ranks, cost))
    return SeqBalanceReport(*(max_over_mean(rank_costs(lengths, s, cost)) for s in splits))
