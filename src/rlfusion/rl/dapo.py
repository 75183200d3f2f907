"""DAPO options: dynamic sampling (drop uninformative groups) and the soft overlong penalty.

Both are pure functions of rewards or lengths; resampling to refill a batch and adding the
penalty to rewards are the caller's job.

Legend: G groups, S samples per group, N responses.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_mask(rewards_GS: Tensor) -> Tensor:
    """Bool [G]: True for groups whose rewards are not all equal.

    A group where every sample scores the same has zero group-relative advantage, so it adds
    no gradient, only noise in the token normalizer; DAPO drops it and samples more.
    """
    if rewards_GS.dim() != 2:
        raise ValueError(f"rewards_GS must be [num_groups, group_size], got shape {tuple(rewards_GS.shape)}")
    return (rewards_GS != rewards_GS[:, :1]).any(dim=1)


def overlong_penalty(lengths_N: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, a reward term in [-factor, 0] per response.

    0 up to max_len - buffer_len, then linear down to -factor at max_len, -factor beyond:
    (max_len - buffer_len - length) / buffer_len * factor, clamped. The ramp tells the policy
    that length costs before truncation makes the answer wrong outright.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    if not lengths_N.is_floating_point():
        lengths_N = lengths_N.to(torch.get_default_dtype())
    penalty_N = (max_len - buffer_len - lengths_N) / buffer_len * factor
    return penalty_N.clamp(min=-factor, max=0.0)
