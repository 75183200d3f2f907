"""Data-parallel replicas of a trained model — full copies, or shards of a training layout
whose dp replicas hold the same shard: the sums over the data-parallel group that make every
replica take the full-batch step, and gradient clipping that also takes layout shards. Used by
the actor (`actor.py`) and the critic (`stages.CriticStage`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def group_sum(counts: list[int], group: Any) -> list[int]:
    """`counts` summed over the data-parallel group (as they are without one)."""
    if group is None:
        return counts
    t = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, expert_params: set[int] = frozenset(),
                    ep_group: Any = None) -> torch.Tensor:
    """`clip_grad_norm_` that also takes the shards of a training layout mixed with whole
    tensors: a TP or FSDP shard's (DTensor) squares are summed over its mesh's sharded dims
    (`_sharded_squares`), expert shards' (`expert_params`) over their expert-parallel group, a
    whole tensor counts once."""
    if not expert_params and not any(isinstance(p, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    dense = [p.grad.detach() for p in params if p.grad is not None and id(p) not in expert_params]
    whole = [g.pow(2).sum() for g in dense if not isinstance(g, DTensor)]
    squares = _sharded_squares([g for g in dense if isinstance(g, DTensor)])
    if whole:
        squares = squares + torch.stack(whole).sum()
    if expert_params:  # every rank joins the sum, also one whose local experts got no tokens
        experts = [p.grad.detach() for p in params if p.grad is not None and id(p) in expert_params]
        expert_sq = torch.stack([g.pow(2).sum() for g in experts]).sum() if experts else torch.zeros(())
        if ep_group is not None:
            dist.all_reduce(expert_sq, group=ep_group)
        squares = squares + expert_sq
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef)
    return total


def _sharded_squares(grads: list[DTensor]) -> torch.Tensor:
    """The sum of squares of DTensor gradients: each rank sums its local shards' squares per mesh
    and set of sharded mesh dims, then one all-reduce over each sharded dim (a replicated dim
    holds the same values, so it is not summed) — a collective per such group, not per tensor.
    A partial placement (not expected in gradients) goes through `full_tensor()`."""
    groups: dict[tuple, tuple[Any, tuple[int, ...], list[torch.Tensor]]] = {}
    total = torch.zeros(())
    for g in grads:
        if any(p.is_partial() for p in g.placements):
            total = total + g.full_tensor().pow(2).sum()
            continue
        mesh = g.device_mesh
        dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
        key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names, dims)
        groups.setdefault(key, (mesh, dims, []))[2].append(g.to_local().pow(2).sum())
    for mesh, dims, parts in groups.values():  # the same order on every rank (the parameters')
        part = torch.stack(parts).sum()
        for dim in dims:
            dist.all_reduce(part, group=mesh.get_group(dim))
        total = total + part
    return total


def sum_over_replicas(params: list[torch.Tensor], metrics: dict[str, float], group: Any) -> dict[str, float]:
    """Sum gradients (one flat buffer) and the token-weighted metrics over the DP group (a
    tensor-parallel shard is summed with the same shard of the other replicas). No `params`:
    the metrics only (a sharded model's gradients are summed by its own reduce-scatter)."""
    for p in params:
        if p.grad is None:  # a rank with no samples in this minibatch still joins the sum
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, metrics, group=group)
    keys = sorted({k for m in gathered for k in m})
    return {k: sum(m.get(k, 0.0) for m in gathered) for k in keys}
