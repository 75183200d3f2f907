"""Data parallelism: FSDP2 (`fully_shard`) over the `dp` mesh axis, and the batch split.

Owns the wrapping order (each block, then the root module), whether gradients are averaged or
summed, and `shard_batch`, the one place that decides which rows of a global batch a
data-parallel rank trains on. Expert-parallel parameters are left out of FSDP: they differ
between the ranks of an EP group, so FSDP must not average them; `ExpertParallelExperts.sync_grads`
(or the RL actor, over its expert-data-parallel group) reduces them instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from rlfusion.model.transformer import Block
from rlfusion.parallel.expert_parallel import ExpertParallelExperts


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, sum_gradients: bool = False) -> None:
    """Each block, then the root, sharded over `dp_mesh`; the expert-parallel shards stay out.
    FSDP2 averages gradients over the mesh; with `sum_gradients` it sums them (for a loss
    already normalized by the global batch), with plain-sum collectives (gloo has no
    PREMUL_SUM)."""
    ignored = {p for m in module.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    for sub in module.modules():
        if isinstance(sub, Block):
            fully_shard(sub, mesh=dp_mesh, ignored_params=ignored or None)
    fully_shard(module, mesh=dp_mesh, ignored_params=ignored or None)
    if sum_gradients:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)


def shard_batch(x_B: torch.Tensor, dp_index: int, dp: int) -> torch.Tensor:
    """Rows `[i*B/dp, (i+1)*B/dp)` of a global batch for data-parallel rank `i`."""
    if x_B.shape[0] % dp:
        raise ValueError(f"batch size {x_B.shape[0]} must be divisible by layout.dp={dp}")
    rows = x_B.shape[0] // dp
    return x_B[dp_index * rows:(dp_index + 1) * rows]
