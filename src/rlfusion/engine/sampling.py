"""Batched token sampling: greedy, temperature, top-k, top-p, with per-row parameters.

Legend: B rows, V vocab.
"""

from __future__ import annotations

import torch

from rlfusion.engine.types import SamplingParams


def sample(logits_BV: torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(token_ids_B, logprobs_B)`; logprobs under the temperature-scaled distribution."""
    logits_BV = logits_BV.float()
    temps = [p.temperature for p in params]
    if all(t == 0 for t in temps):  # all greedy: no randomness consumed
        tokens_B = logits_BV.argmax(-1)
        return tokens_B, logits_BV.log_softmax(-1).gather(-1, tokens_B[:, None]).squeeze(-1)
    temp_B = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits_BV.device)
    scaled_BV = logits_BV / temp_B[:, None]
    logprobs_BV = scaled_BV.log_softmax(-1)
    filtered_BV = _top_p(_top_k(scaled_BV, params), params)
    probs_BV = filtered_BV.softmax(-1)
    sampled_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    greedy_B = torch.tensor([t == 0 for t in temps], device=logits_BV.device)
    tokens_B = torch.where(greedy_B, logits_BV.argmax(-1), sampled_B)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def _top_k(scaled_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    ks = [p.top_k if 0 < p.top_k < scaled_BV.shape[-1] else 0 for p in params]
    if not any(ks):
        return scaled_BV
    k_B = torch.tensor([k or scaled_BV.shape[-1] for k in ks], device=scaled_BV.device)
    sorted_BV = scaled_BV.sort(-1, descending=True).values
    kth_B1 = sorted_BV.gather(-1, (k_B - 1)[:, None])
    return scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))


def _top_p(scaled_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.top_p >= 1.0 for p in params):
        return scaled_BV
    p_B = torch.tensor([p.top_p for p in params], device=scaled_BV.device)
    sorted_BV, order_BV = scaled_BV.sort(-1, descending=True)
    cum_BV = sorted_BV.softmax(-1).cumsum(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    drop_sorted = (cum_BV - sorted_BV.softmax(-1)) >= p_B[:, None]
    drop_BV = torch.zeros_like(drop_sorted).scatter(-1, order_BV, drop_sorted)
    return scaled_BV.masked_fill(drop_BV, float("-inf"))
