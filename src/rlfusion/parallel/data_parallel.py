"""Data parallelism: the step every data-parallel rank takes together, for the RL actor, the
critic and pre-training alike.

- Which rows a rank trains on: `shard_rows` (a batch of variable-length sequences, balanced by
  tokens or by a cost such as the a·tokens + b·len² of `seq_balance.SeqCost`) and `shard_batch` (equal
  contiguous rows of a dense batch).
- Sharded replicas: FSDP2 (`fully_shard`) over the `dp` mesh axis, averaging or summing.
  Expert-parallel parameters are left out of FSDP: they differ between the ranks of an EP group,
  so FSDP must not average them; `ExpertParallelExperts.sync_grads` (or the RL actor, over its
  expert-data-parallel group) reduces them instead.
- Whole replicas (or the same shard of a layout on each rank): `sum_over_replicas` sums
  gradients and token-weighted metrics, `group_sum` the batch's global counts.
- Lock step: where a forward pass is itself a collective across data-parallel ranks (expert
  all-to-all, FSDP gathers), every rank runs as many passes as the busiest (`lockstep_count`,
  `filler_pass`).
- `clip_grad_norm` over any mix of whole tensors, TP/FSDP shards (DTensor), expert shards and
  pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlfusion.model.kv_cache import PackedSeqs
from rlfusion.model.transformer import Block
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.sharded import is_dtensor, is_fsdp_module
from rlfusion.queue.packing import split_balanced


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, sum_gradients: bool = False) -> None:
    """Each block, then the root, sharded over `dp_mesh`; the expert-parallel shards stay out.
    FSDP2 averages gradients over the mesh; with `sum_gradients` it sums them (for a loss
    already normalized by the global batch), with plain-sum collectives (gloo has no
    PREMUL_SUM)."""
    from torch.distributed.fsdp import fully_shard  # only sharded layouts pay its import

    ignored = {p for m in module.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters()}
    for sub in module.modules():
        if isinstance(sub, Block):
            fully_shard(sub, mesh=dp_mesh, ignored_params=ignored or None)
    fully_shard(module, mesh=dp_mesh, ignored_params=ignored or None)
    if sum_gradients:
        for sub in module.modules():
            if is_fsdp_module(sub):
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)


# how far over an even share a rank may go to train on rows it already holds: the ranks meet in
# lock-step, so every rank waits for the heaviest; at 0.05 the default step's split ran 4.6% of
# tokens over even for a few KB of locality (bench/update_profile.py), at 0.005 ~97% stay local
LOCAL_SLACK = 0.005


def shard_rows(lengths: Sequence[int], num_ranks: int, cost: Callable[[int], float] | None = None,
               homes: Sequence[int | None] | None = None) -> list[list[int]]:
    """Indices of the sequences each data-parallel rank trains on (ascending per rank): longest
    first onto the lightest rank, weighing each sequence by its tokens, or with `cost` by
    `cost(tokens)` (attention's quadratic term makes one long sequence dearer than the same
    tokens in short ones).

    With `homes` (each sequence's home rank, the one whose device already holds its data, or
    None), a sequence goes to its home rank instead whenever that keeps the rank within
    `local_bound`: no rank then ends above max((1 + LOCAL_SLACK) x an even share, the busiest
    rank of the plain split). Should the placement end above it all the same (a row that
    could not go home landed late), the plain split is returned."""
    weights = list(lengths) if cost is None else [cost(n) for n in lengths]
    plain = split_balanced(weights, num_ranks)
    if homes is None or not weights:
        return plain
    bound = local_bound(weights, plain)
    loads = [0.0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        k = homes[i]
        if k is None or not 0 <= k < num_ranks or loads[k] + weights[i] > bound:
            k = min(range(num_ranks), key=lambda k: (loads[k], len(parts[k]), k))
        parts[k].append(i)
        loads[k] += weights[i]
    return plain if max(loads) > bound else [sorted(p) for p in parts]


def local_bound(weights: Sequence[float], split: list[list[int]]) -> float:
    """The most a rank may carry when rows go to their home ranks (`shard_rows`): the larger of
    an even share plus `LOCAL_SLACK` and the busiest rank of `split` (the plain split's)."""
    even = sum(weights) / len(split)
    busiest = max(sum(weights[i] for i in part) for part in split)
    return max((1 + LOCAL_SLACK) * even, busiest) * (1 + 1e-12)  # (float sums in another order)


def shard_batch(x_B: torch.Tensor, dp_index: int, dp: int) -> torch.Tensor:
    """Rows `[i*B/dp, (i+1)*B/dp)` of a global batch for data-parallel rank `i`."""
    if x_B.shape[0] % dp:
        raise ValueError(f"batch size {x_B.shape[0]} must be divisible by layout.dp={dp}")
    rows = x_B.shape[0] // dp
    return x_B[dp_index * rows:(dp_index + 1) * rows]


def group_sum(counts: list[int], group: Any) -> list[int]:
    """`counts` summed over the data-parallel group (as they are without one)."""
    if group is None:
        return counts
    t = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, expert_params: set[int] = frozenset(),
                    ep_group: Any = None, stage_group: Any = None) -> torch.Tensor:
    """`clip_grad_norm_` that also takes the shards of a training layout mixed with whole
    tensors: a TP or FSDP shard's (DTensor) squares are summed over its mesh's sharded dims
    (`_sharded_squares`), expert shards' (`expert_params`) over their expert-parallel group, a
    whole tensor counts once; with a `stage_group` (the pipeline's) each rank holds its stages'
    parameters only, and the stages' sums are added over it."""
    if not expert_params and stage_group is None and not any(is_dtensor(p) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    dense = [p.grad.detach() for p in params if p.grad is not None and id(p) not in expert_params]
    whole = [g.pow(2).sum() for g in dense if not is_dtensor(g)]
    squares = _sharded_squares([g for g in dense if is_dtensor(g)])
    if whole:
        squares = squares + torch.stack(whole).sum()
    if expert_params:  # every rank joins the sum, also one whose local experts got no tokens
        experts = [p.grad.detach() for p in params if p.grad is not None and id(p) in expert_params]
        expert_sq = (torch.stack([g.pow(2).sum() for g in experts]).sum() if experts
                     else torch.zeros((), device=local_tensor(params[0]).device))
        if ep_group is not None:
            dist.all_reduce(expert_sq, group=ep_group)
        squares = squares + expert_sq
    if stage_group is not None:
        dist.all_reduce(squares, group=stage_group)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef)
    return total


def _sharded_squares(grads: list) -> torch.Tensor:
    """The sum of squares of DTensor gradients: each rank sums its local shards' squares per mesh
    and set of sharded mesh dims, then one all-reduce over each sharded dim (a replicated dim
    holds the same values, so it is not summed) — a collective per such group, not per tensor.
    A partial placement (not expected in gradients) goes through `full_tensor()`."""
    groups: dict[tuple, tuple[Any, tuple[int, ...], list[torch.Tensor]]] = {}
    total = torch.zeros((), device=grads[0].to_local().device if grads else None)
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
    grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad for p in params]
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


def lockstep_count(count: int, group: Any) -> int:
    """The most passes any rank of `group` runs (`count` without a group)."""
    if group is None:
        return count
    most = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return int(most)


def lockstep_shape(rows: int, longest: int, group: Any) -> tuple[int, int]:
    """The most rows and the longest row of any data-parallel rank."""
    if group is None:
        return rows, longest
    t = torch.tensor([rows, longest], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]), int(t[1])


def filler_pass(model: nn.Module, backward: bool) -> None:
    """A forward (and backward) over one token that contributes nothing: it joins the
    collectives of another rank's pass. The routers' load counts are left as they were."""
    routers = model.routers()
    counts = [r.tokens_per_expert.clone() for r in routers]
    device = local_tensor(next(model.parameters())).device
    out = model(torch.zeros(1, 1, dtype=torch.long, device=device), packed=PackedSeqs.from_lengths([1]))
    if backward:
        (out.float().sum() * 0.0).backward()
    for r, c in zip(routers, counts):
        r.tokens_per_expert.copy_(c)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds this rank's data (the local shard of a DTensor)."""
    return t._local_tensor if is_dtensor(t) else t


def any_rank(flag: bool, groups) -> bool:
    """Whether any rank of the given groups (None: no group) raised `flag` (collective)."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    for group in groups:
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def sum_router_loads(routers: list, group: Any) -> None:
    """Each router's `tokens_per_expert` summed over the data-parallel `group` (every replica
    then sees the load of the whole batch)."""
    if not routers:
        return
    flat = torch.cat([r.tokens_per_expert for r in routers])
    dist.all_reduce(flat, group=group)
    for r, load in zip(routers, flat.split([r.tokens_per_expert.numel() for r in routers])):
        r.tokens_per_expert.copy_(load)
