"""KL divergence to a frozen reference policy: per-token estimators, as a loss term or a reward penalty.

Estimators are Schulman's k1/k2/k3 of KL(policy || reference) from tokens sampled by the policy.
The module knows nothing about the reference model itself, only its logprobs of the same tokens.

Legend: N tokens, S sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlfusion.rl.policy_loss import token_mean

# exp(20) ~ 5e8: a bound far above any sane per-token KL that keeps k3 finite for outlier tokens.
_MAX_LOG_RATIO = 20.0

_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    # Each maps d = ref - logp to a per-token estimate.
    "k1": lambda d: -d,  # unbiased, high variance, can be negative
    "k2": lambda d: 0.5 * d.square(),  # biased, low variance, >= 0
    "k3": lambda d: d.clamp(max=_MAX_LOG_RATIO).exp() - d - 1.0,  # unbiased, low variance, >= 0
}
KL_KINDS = tuple(_ESTIMATORS)


def kl_estimate(logprobs_N: Tensor, ref_logprobs_N: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference); the reference side is detached.

    k1 = logp - ref; k2 = 0.5 (logp - ref)^2; k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    if kind not in _ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    if logprobs_N.shape != ref_logprobs_N.shape:
        raise ValueError(
            f"logprobs_N and ref_logprobs_N must share one shape, got "
            f"{tuple(logprobs_N.shape)} and {tuple(ref_logprobs_N.shape)}"
        )
    return _ESTIMATORS[kind](ref_logprobs_N.detach() - logprobs_N)


def kl_loss(
    logprobs_N: Tensor, ref_logprobs_N: Tensor, mask_N: Tensor, coef: float,
    kind: str = "k3", num_tokens: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """coef * token-mean KL estimate, added to the policy loss (GRPO-style, k3 by default)."""
    if coef < 0.0:
        raise ValueError(f"kl coef must be >= 0, got {coef}")
    if mask_N.shape != logprobs_N.shape:
        raise ValueError(f"mask_N must match logprobs_N: {tuple(mask_N.shape)}, {tuple(logprobs_N.shape)}")
    valid_N = mask_N.bool()
    # `where` first: off-mask positions may hold values whose exp overflows.
    logprobs_N = torch.where(valid_N, logprobs_N, 0.0)
    kl_N = kl_estimate(logprobs_N, torch.where(valid_N, ref_logprobs_N, 0.0), kind)
    loss = coef * token_mean(kl_N, mask_N, num_tokens)
    count = int(valid_N.sum())
    kl_mean = float(kl_N.detach().sum()) / count if count else 0.0  # off-mask kl_N is exactly 0
    return loss, {"kl": kl_mean}


def kl_reward_penalty(
    rewards_S: Tensor, logprobs_N: Tensor, ref_logprobs_N: Tensor, seq_idx_N: Tensor,
    coef: float, kind: str = "k1", mask_N: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Each sequence's reward minus coef * (sum of its tokens' KL estimates), detached.

    Token s of `seq_idx_N` belongs to sequence `seq_idx_N[s]` in [0, S); `mask_N` (optional)
    drops non-response tokens of a packed batch. k1 by default, as in classic RLHF.
    """
    if coef < 0.0:
        raise ValueError(f"kl coef must be >= 0, got {coef}")
    if rewards_S.dim() != 1:
        raise ValueError(f"rewards_S must be 1-D [num_seqs], got shape {tuple(rewards_S.shape)}")
    if seq_idx_N.shape != logprobs_N.shape:
        raise ValueError(
            f"seq_idx_N must match logprobs_N, got {tuple(seq_idx_N.shape)} and {tuple(logprobs_N.shape)}"
        )
    if seq_idx_N.numel() and not (0 <= int(seq_idx_N.min()) and int(seq_idx_N.max()) < rewards_S.shape[0]):
        raise ValueError(f"seq_idx_N must lie in [0, {rewards_S.shape[0]}), the number of rewards")
    kl_N = kl_estimate(logprobs_N.detach(), ref_logprobs_N, kind)
    if mask_N is not None:
        kl_N = torch.where(mask_N.bool(), kl_N, 0.0)
    seq_kl_S = kl_N.new_zeros(rewards_S.shape[0]).index_add(0, seq_idx_N, kl_N)
    rewards_S = rewards_S.detach() if rewards_S.is_floating_point() else rewards_S.to(kl_N.dtype)
    penalized_S = rewards_S - coef * seq_kl_S.to(rewards_S.dtype)
    metrics = {"kl_seq_mean": float(seq_kl_S.mean()) if seq_kl_S.numel() else 0.0}
    return penalized_S, metrics
