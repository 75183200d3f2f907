"""Advantage estimators: GRPO (and Dr. GRPO), RLOO, REINFORCE++ and per-token GAE for PPO.

Each turns rewards (and, for GAE, critic values) into detached advantages. They know nothing
about how rewards were produced or how the advantages are packed into a training batch.

Legend: G groups, S samples per group, N samples, B response rows, T response tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards_GS: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps); just r - group mean when `scale_by_std` is False.

    The std is the population std (unbiased=False): the group is the whole population being
    normalized, and it stays defined for groups of one. Dropping the division (Dr. GRPO) removes
    the bias toward groups that are nearly all right or all wrong. All-equal groups give 0.
    """
    rewards_GS = _as_float(rewards_GS).detach()
    _require_2d(rewards_GS, "rewards_GS")
    centered_GS = rewards_GS - rewards_GS.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered_GS
    return centered_GS / (rewards_GS.std(dim=1, keepdim=True, correction=0) + eps)


def rloo_advantages(rewards_GS: Tensor) -> Tensor:
    """r_i minus the mean of the other S - 1 rewards of its group (leave-one-out baseline).

    The baseline excludes the sample itself, so the estimate stays unbiased.
    """
    rewards_GS = _as_float(rewards_GS).detach()
    _require_2d(rewards_GS, "rewards_GS")
    group_size = rewards_GS.shape[1]
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs group_size >= 2, got {group_size}")
    others_mean_GS = (rewards_GS.sum(dim=1, keepdim=True) - rewards_GS) / (group_size - 1)
    return rewards_GS - others_mean_GS


def reinforce_pp_advantages(rewards_N: Tensor, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: (r - batch mean) / (batch std + eps), one global baseline for the batch.

    Population std, as in `grpo_advantages`. Any shape is accepted; the whole tensor is the batch.
    """
    rewards_N = _as_float(rewards_N).detach()
    if rewards_N.numel() == 0:
        raise ValueError("reinforce_pp_advantages needs at least one reward, got an empty tensor")
    return (rewards_N - rewards_N.mean()) / (rewards_N.std(correction=0) + eps)


def gae_advantages(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Per-token GAE over right-padded response rows; returns `(advantages_BT, returns_BT)`.

    `mask_BT` is 1 on response tokens and 0 on padding. The value after a row's last valid token
    is taken as 0 (the episode ends there), whatever the padding holds. returns = advantages +
    values, the critic's regression target. Both outputs are detached and 0 on padding.
    """
    if not (rewards_BT.shape == values_BT.shape == mask_BT.shape) or rewards_BT.dim() != 2:
        raise ValueError(
            "gae_advantages needs rewards_BT, values_BT and mask_BT of one [B, T] shape, got "
            f"{tuple(rewards_BT.shape)}, {tuple(values_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae_advantages needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    valid_BT = mask_BT.bool()
    # `where`, not a product: padding may hold inf/nan, and 0 * inf is nan.
    rewards_BT = torch.where(valid_BT, _as_float(rewards_BT).detach(), 0.0)
    values_BT = torch.where(valid_BT, _as_float(values_BT).detach(), 0.0)
    advantages_BT = torch.zeros_like(values_BT)
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_advantage_B = torch.zeros_like(values_BT[:, 0])
    # Right padding makes every padded step a zero delta, so the recursion needs no resets.
    for t in reversed(range(values_BT.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        next_advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages_BT[:, t] = next_advantage_B
        next_value_B = values_BT[:, t]
    advantages_BT = torch.where(valid_BT, advantages_BT, 0.0)
    return advantages_BT, advantages_BT + values_BT


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _require_2d(rewards_GS: Tensor, name: str) -> None:
    if rewards_GS.dim() != 2:
        raise ValueError(f"{name} must be [num_groups, group_size], got shape {tuple(rewards_GS.shape)}")
