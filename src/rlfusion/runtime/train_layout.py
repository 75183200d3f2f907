"""The actor's training layout on the train devices (`deploy.train_tp` / `train_ep` / `train_pp`
/ `train_vpp` / `train_fsdp`), applied with `parallel.parallelize`, and the process groups it
needs — which every device of the world creates, in the same order, train device or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel.api import ParallelModel, parallelize
from rlfusion.parallel.mesh import build_mesh
from rlfusion.queue.hierarchical import GroupQueue
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.role_context import RoleContext
from rlfusion.runtime.train_config import TrainConfig


def apply_layout(ctx: RoleContext, model: MoETransformer, on_a2a_wait: Callable[[float, float], None]
                 ) -> tuple[ParallelModel, Any, Any]:
    """Split the actor over its training layout: pipeline stages over `train_pp` groups of
    train devices (1F1B, interleaved with `train_vpp` chunks each, or Adaptive Pipe's
    forward/backward-overlapped V: `deploy.train_schedule`), TP over `train_tp`
    consecutive devices of a stage (attention heads, dense and shared-expert FFN columns),
    routed experts over `train_ep` devices, data parallel across the rest. Data parallel keeps a
    replica of the rest on each (`ActorStage` sums the replicas' gradients), or with
    `train_fsdp` shards it over them (FSDP2: parameters gathered per block for each pass,
    gradients reduce-scattered as sums, since the loss is normalized by the global batch);
    expert shards are summed over their expert-data-parallel group either way. Every device of
    a model-parallel group (the stages and TP ranks of one data-parallel rank) trains on the
    same rows — the last stage needs the loss's per-token inputs, the first the tokens; with
    `deploy.hierarchical_reads` its first device reads them and broadcasts them to the others.
    `on_a2a_wait(start, end)` sees each wait on the expert all-to-all. Returns the layout's
    model, the data-parallel group (None with one) and where the update reads its rows (the
    queue, or its model-parallel group's `GroupQueue`). Collective: every device joins."""
    plan, layout = ctx.plan, ctx.plan.parallel_layout()
    pm = parallelize(model, layout, n_microbatches=layout.min_microbatches, device_type=ctx.where.type,
                     fsdp=plan.train_fsdp, sum_gradients=True, ranks=list(plan.train))
    for experts in pm.experts:  # the update's waits on expert all-to-all, in the timeline
        experts.counter.on_wait = on_a2a_wait
    reads = ctx.queue
    groups = read_groups(plan, ctx.cfg)
    if groups:
        mine = plan.model_parallel_group(plan.dp_index(ctx.device))
        reads = GroupQueue(ctx.queue if ctx.device == mine[0] else None, ctx.queue.schema,
                           groups[plan.dp_index(ctx.device)], reader=mine[0], writer=mine[0])
    return pm, (pm.mesh.group("dp") if layout.dp > 1 else None), reads


def join_layout_groups(plan: DeploymentPlan, cfg: TrainConfig, model_config: ModelConfig) -> None:
    """On a device outside the training layout (a rollout device in separated mode): join the
    creation of the layout's process groups, in the order the train devices create them."""
    build_mesh(plan.parallel_layout(), model_config, ranks=list(plan.train))
    read_groups(plan, cfg)


def read_groups(plan: DeploymentPlan, cfg: TrainConfig) -> list:
    """With `deploy.hierarchical_reads`, a process group per model-parallel group of the layout
    (created on every device); none when each such group is one device."""
    mp = [plan.model_parallel_group(d) for d in range(plan.train_dp)]
    if len(mp[0]) == 1 or not cfg.deploy.hierarchical_reads:
        return []
    return [dist.new_group(ranks) for ranks in mp]
