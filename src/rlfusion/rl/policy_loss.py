"""Actor and critic losses: decoupled PPO with clip-higher, the clipped value loss, entropy bonus,
and the behaviour weights that correct for samples drawn by another policy than the trainer's.

Tensors are flat over the tokens of a packed batch; `mask_N` picks the response tokens and
`seq_idx_N` names each token's sequence. Every loss divides by a normalizer the caller may pass
(`num_tokens`, `num_seqs`) so gradient-accumulated micro-batches add up to the full-batch loss.
The module knows nothing about models, packing or optimizers. Metrics are masked means over the
tokens given (per micro-batch), as python floats.

Legend: N tokens, S sequences, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

AGGREGATIONS = ("token", "seq")
IS_CORRECTIONS = ("none", "tis", "mis", "seq_mask")


def ppo_policy_loss(
    logprobs_N: Tensor,
    proximal_logprobs_N: Tensor,
    behaviour_logprobs_N: Tensor,
    advantages_N: Tensor,
    mask_N: Tensor,
    seq_idx_N: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token",
    behaviour_weight_cap: float = 2.0,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_correction: str = "tis",
    is_mask: tuple[float, float] = (0.5, 2.0),
    seq_mask_threshold: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL): clip the ratio to the proximal policy, reweight from the behaviour one.

    ratio = exp(logprobs - proximal) is clipped to [1 - clip_low, 1 + clip_high] (clip_high >
    clip_low is DAPO's clip-higher). Each token's loss is scaled by a detached weight w built
    from exp(proximal - behaviour), the importance ratio of the trainer's policy to the one that
    sampled it (a stale version, another engine or precision); `is_correction` says how
    (`behaviour_weights`): "tis" truncates it at `behaviour_weight_cap`, "mis" zeroes tokens
    outside `is_mask`, "seq_mask" drops whole sequences by their geometric mean and truncates
    the rest, "none" uses w = 1. With fresh samples proximal == behaviour, w == 1 and every mode
    is plain PPO. Gradients reach only `logprobs_N`. `agg="token"` averages over all tokens
    (sum / num_tokens); `agg="seq"` averages each sequence's token mean over sequences
    (sum / num_seqs). Masked tokens keep their place in both normalizers: they count as samples
    whose weight is 0, so micro-batches still add up without knowing each other's masks.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if behaviour_weight_cap < 1.0:
        raise ValueError(f"behaviour_weight_cap must be >= 1 got {behaviour_weight_cap}")
    _require_same_shape(
        logprobs_N, proximal_logprobs_N, behaviour_logprobs_N, advantages_N, mask_N, seq_idx_N
    )
    valid_N = mask_N.bool()
    proximal_N, advantages_N = proximal_logprobs_N.detach(), advantages_N.detach()
    # `where` before `exp`: off-mask positions may hold anything, and exp(inf) * 0 grads are nan.
    log_ratio_N = torch.where(valid_N, logprobs_N - proximal_N, 0.0)
    ratio_N = log_ratio_N.exp()
    clipped_ratio_N = ratio_N.clamp(1.0 - clip_low, 1.0 + clip_high)
    log_weight_N = torch.where(valid_N, proximal_N - behaviour_logprobs_N.detach(), 0.0)
    w = behaviour_weights(log_weight_N, valid_N, seq_idx_N, is_correction,
                          behaviour_weight_cap, is_mask, seq_mask_threshold)
    surrogate_N = ratio_N * advantages_N
    clipped_surrogate_N = clipped_ratio_N * advantages_N
    loss_N = -torch.minimum(surrogate_N, clipped_surrogate_N) * w.weight_N
    if agg == "token":
        loss = token_mean(loss_N, mask_N, num_tokens)
    else:
        loss = _seq_mean(loss_N, valid_N, seq_idx_N, num_seqs)
    metrics = {
        "clip_fraction": _mean(clipped_surrogate_N < surrogate_N, valid_N),
        "approx_kl": _mean(ratio_N - 1.0 - log_ratio_N, valid_N),  # k3 of KL(proximal || current)
        "ratio_mean": _mean(ratio_N, valid_N),
        "behaviour_weight_mean": _mean(w.weight_N, valid_N),
        "behaviour_weight_capped_fraction": _mean(w.truncated_N, valid_N),
        "is_masked_fraction": _mean(w.masked_N, valid_N),  # tokens whose weight was set to 0
        "is_seq_masked_fraction": w.seq_masked_fraction,
        # |proximal - behaviour| per token: with fresh samples, how far the engine's logprobs
        # are from the trainer's on the same tokens (another engine, precision or kernels)
        "behaviour_logprob_gap": _mean((proximal_N - behaviour_logprobs_N.detach()).abs(), valid_N),
    }
    return loss, metrics


@dataclass(frozen=True)
class BehaviourWeights:
    """One correction's detached per-token weights, and what it did to the raw importance ratio."""

    weight_N: Tensor  # what each token's loss is scaled by
    truncated_N: Tensor  # bool: the ratio was cut down to the cap
    masked_N: Tensor  # bool: the weight was set to 0 (the token gets no loss)
    seq_masked_fraction: float  # share of the sequences present that were dropped whole


def behaviour_weights(
    log_weight_N: Tensor, valid_N: Tensor, seq_idx_N: Tensor, correction: str,
    cap: float, is_mask: tuple[float, float], seq_mask_threshold: float,
) -> BehaviourWeights:
    """The weight `correction` gives each token from log(pi_proximal / pi_behaviour), 0 off-mask."""
    if correction == "tis":
        return truncated_weights(log_weight_N, cap)
    if correction == "mis":
        return masked_weights(log_weight_N, *is_mask)
    if correction == "seq_mask":
        return seq_masked_weights(log_weight_N, valid_N, seq_idx_N, seq_mask_threshold, cap)
    if correction == "none":
        return unit_weights(log_weight_N)
    raise ValueError(f"is_correction must be one of {IS_CORRECTIONS}, got {correction!r}")


def truncated_weights(log_weight_N: Tensor, cap: float) -> BehaviourWeights:
    """TIS: w = min(ratio, cap). Biased a little, but the variance of a rare large ratio is bounded."""
    raw_N = log_weight_N.exp()
    return BehaviourWeights(raw_N.clamp(max=cap), raw_N > cap, torch.zeros_like(raw_N, dtype=torch.bool), 0.0)


def masked_weights(log_weight_N: Tensor, low: float, high: float) -> BehaviourWeights:
    """MIS: w = ratio inside [low, high], 0 outside. A token the engine and trainer disagree on
    that much is more likely a numerical fault than a sample worth learning from, so it is
    dropped rather than kept at the cap; the band holds 1, so fresh samples are never masked."""
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"is_mask must satisfy 0 <= low <= 1 <= high, got ({low}, {high})")
    raw_N = log_weight_N.exp()
    inside_N = (raw_N >= low) & (raw_N <= high)
    return BehaviourWeights(torch.where(inside_N, raw_N, 0.0), torch.zeros_like(inside_N), ~inside_N, 0.0)


def seq_masked_weights(
    log_weight_N: Tensor, valid_N: Tensor, seq_idx_N: Tensor, threshold: float, cap: float
) -> BehaviourWeights:
    """Sequence masking: a sequence whose geometric-mean ratio exp(mean log ratio over its
    response tokens) lies outside [1/threshold, threshold] gets weight 0 on every token; the
    rest keep TIS weights. The geometric mean does not grow with length, so one threshold fits
    short and long responses; a whole response sampled far from the trainer's policy is dropped
    rather than corrected token by token."""
    if threshold < 1.0:
        raise ValueError(f"seq_mask_threshold must be >= 1, got {threshold}")
    num_slots = int(seq_idx_N.max()) + 1 if seq_idx_N.numel() else 0
    sums_S = log_weight_N.new_zeros(num_slots).index_add(0, seq_idx_N, log_weight_N)  # 0 off-mask
    counts_S = log_weight_N.new_zeros(num_slots).index_add(0, seq_idx_N, valid_N.to(log_weight_N.dtype))
    present_S = counts_S > 0
    dropped_S = present_S & ((sums_S / counts_S.clamp(min=1)).abs() > math.log(threshold))
    dropped_N = dropped_S[seq_idx_N]
    tis = truncated_weights(log_weight_N, cap)
    num_present = int(present_S.sum())
    return BehaviourWeights(
        torch.where(dropped_N, 0.0, tis.weight_N), tis.truncated_N & ~dropped_N, dropped_N,
        float(dropped_S.sum()) / num_present if num_present else 0.0)


def unit_weights(log_weight_N: Tensor) -> BehaviourWeights:
    """No correction: w = 1, plain PPO against the proximal policy."""
    none_N = torch.zeros_like(log_weight_N, dtype=torch.bool)
    return BehaviourWeights(torch.ones_like(log_weight_N), none_N, none_N, 0.0)


def value_loss(
    values_N: Tensor, old_values_N: Tensor, returns_N: Tensor, mask_N: Tensor,
    clip: float = 0.2, num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped value loss: 0.5 * max((v - R)^2, (v_clipped - R)^2), v kept within `clip` of old.

    Taking the max makes clipping pessimistic: the critic cannot move far in one update.
    """
    if clip <= 0.0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    _require_same_shape(values_N, old_values_N, returns_N, mask_N)
    old_values_N, returns_N = old_values_N.detach(), returns_N.detach()
    clipped_values_N = old_values_N + (values_N - old_values_N).clamp(-clip, clip)
    error_N = (values_N - returns_N).square()
    clipped_error_N = (clipped_values_N - returns_N).square()
    loss = token_mean(0.5 * torch.maximum(error_N, clipped_error_N), mask_N, num_tokens)
    valid_N = mask_N.bool()
    metrics = {
        "value_clip_fraction": _mean(clipped_error_N > error_N, valid_N),
        "value_mean": _mean(values_N, valid_N),
        "value_error": _mean(error_N, valid_N),
    }
    return loss, metrics


def entropy_from_logits(logits_NV: Tensor) -> Tensor:
    """Entropy of softmax(logits) per row, in float32; rows may hold -inf (banned tokens)."""
    logp_NV = F.log_softmax(logits_NV.float(), dim=-1)
    p_NV = logp_NV.exp()
    # 0 * log 0 is 0, not nan: keep -inf logprobs out of the product.
    return -(p_NV * torch.where(p_NV > 0, logp_NV, 0.0)).sum(dim=-1)


def entropy_bonus(
    entropy_N: Tensor, mask_N: Tensor, coef: float, num_tokens: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """loss = -coef * token-mean entropy: minimizing it keeps the policy from collapsing early."""
    if coef < 0.0:
        raise ValueError(f"entropy coef must be >= 0, got {coef}")
    _require_same_shape(entropy_N, mask_N)
    loss = -coef * token_mean(entropy_N, mask_N, num_tokens)
    return loss, {"entropy": _mean(entropy_N, mask_N.bool())}


def token_mean(x_N: Tensor, mask_N: Tensor, num_tokens: float | None = None) -> Tensor:
    """sum(x over masked tokens) / num_tokens (default: the mask's count, at least 1)."""
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    total = torch.where(mask_N.bool(), x_N, 0.0).sum()
    return total / (num_tokens if num_tokens is not None else mask_N.sum().clamp(min=1))


def _seq_mean(loss_N: Tensor, valid_N: Tensor, seq_idx_N: Tensor, num_seqs: float | None) -> Tensor:
    """Each sequence's token mean, summed over sequences, / num_seqs (default: sequences present)."""
    if num_seqs is not None and num_seqs <= 0:
        raise ValueError(f"num_seqs must be > 0, got {num_seqs}")
    num_slots = int(seq_idx_N.max()) + 1 if seq_idx_N.numel() else 0
    sums_S = loss_N.new_zeros(num_slots).index_add(0, seq_idx_N, torch.where(valid_N, loss_N, 0.0))
    counts_S = loss_N.new_zeros(num_slots).index_add(0, seq_idx_N, valid_N.to(loss_N.dtype))
    present_S = counts_S > 0
    total = (sums_S / counts_S.clamp(min=1)).sum()
    return total / (num_seqs if num_seqs is not None else present_S.sum().clamp(min=1))


def _mean(x_N: Tensor, valid_N: Tensor) -> float:
    count = int(valid_N.sum())
    return float(torch.where(valid_N, x_N.detach().float(), 0.0).sum()) / count if count else 0.0


def _require_same_shape(*tensors: Tensor) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"per-token tensors must share one shape, got {shapes}")
