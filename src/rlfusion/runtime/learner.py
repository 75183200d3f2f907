"""The learner role of a train device: the update, and the trained state.

    update(rows)        the first train device runs the advantage stage (`advantage_stage.py`)
                        and splits the kept rows over the data-parallel ranks; the split goes to
                        the other train devices by broadcast, carrying each row's advantage and
                        shaped reward (`dataflow.RankRows`); each device reads its rank's rows
                        from the queue by id (one reader per model-parallel group with
                        hierarchical reads), runs critic + GAE for PPO and one full-batch actor
                        step; the first retires the rows
    sync_weights()      separated mode: the new weights to the rollout devices (bucketed)
    weights / state     the policy's weights, optimizer state and version, whole (gathered
                        from a training layout's shards), and loading them back

The actor trains as a full replica or in a training layout (`train_layout.py`); what moves
between training and generation is the device's `DeviceSwitch`. The learner never generates.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.queue.controller import runs_rows
from rlfusion.engine.runner import autocast
from rlfusion.errors import RunError
from rlfusion.model.flops import causal_positions, forward_flops
from rlfusion.model import lora
from rlfusion.model.files import load_weights_into
from rlfusion.model.transformer import MoETransformer
from rlfusion.obs.metrics import NumberPacker
from rlfusion.parallel.seq_balance import SeqCost
from rlfusion.parallel.state import LayoutState
from rlfusion.queue.hierarchical import GroupQueue
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.advantage_stage import advantage_stage
from rlfusion.runtime.critic import CriticStage, gae_advantages
from rlfusion.runtime.device_binding import on_host
from rlfusion.runtime.role_context import RoleContext
from rlfusion.runtime.train_layout import apply_layout

A2A_WAIT = "a2a wait"  # timeline phase: a train device waiting on its expert all-to-all (inside "train")


class Learner:
    """The actor (and PPO's critic) of one train device. `model` is the loaded base, which the
    optimizer updates (in a training layout: split into this device's shards and stages);
    `policy` is what the rollout engine generates from (the same module, or a full replica
    the switch fills before every rollout); `train_group`: every train device (None with one);
    `peak_flops`: this device's matmul peak, what the update's achieved rate is compared with.
    Built once the device world is joined: a layout's groups are collective."""

    def __init__(self, ctx: RoleContext, model: MoETransformer, policy: MoETransformer, peak_flops: float,
                 train_group: Any):
        cfg, plan = ctx.cfg, ctx.plan
        self.ctx, self.policy, self.model_config, self.peak_flops = ctx, policy, model.config, peak_flops
        # a checkpoint's optimizer state is keyed by the plain model's order of trained parameters
        param_index = {name: i for i, (name, _) in enumerate(lora.trained_parameters(model))}
        # how the update's rows are split over data-parallel ranks (`optim.dp_balance`)
        self.split_cost = SeqCost.from_config(model.config) if cfg.optim.dp_balance == "cost" else None
        self.train_group = self.dp_group = train_group if len(plan.train) > 1 else None
        self.train_model: MoETransformer | None = model
        self.part = lora.trained_part(model)  # the state's names that change (LoRA: the adapters)
        self.pm = self.layout_state = None  # the layout's model, its shards ↔ whole tensors (checkpoints)
        self.reads: Any = ctx.queue  # where `update` reads its rows: the queue, or its TP group's reader
        if plan.train_layout:
            self.pm, self.dp_group, self.reads = apply_layout(ctx, model, self._a2a_wait)
            if plan.train_pp > 1:  # this device's stages are all it keeps of the model
                self.train_model = ctx.switch.train_model = None
            self.layout_state = LayoutState(self.pm, param_index)
        # the devices that read each data-parallel rank's rows (its model-parallel group, or its
        # first device alone with hierarchical reads): the split prefers rows already on them
        groups = {i: plan.model_parallel_group(i) for i in range(plan.train_dp)}
        one = isinstance(self.reads, GroupQueue)
        self.rank_of = {d: i for i, group in groups.items() for d in (group[:1] if one else group)}
        self.critic: CriticStage | None = None  # PPO's value model, next to the actor
        if cfg.algo.advantage == "gae":  # from the base weights, before any update
            if self.pm is not None:  # the driver refuses this first (trainer._check_train_layout)
                raise ValueError("algo.advantage=gae needs full replicas: the critic sums its gradients "
                                 "over the data-parallel group itself, not over a training layout's")
            self.critic = CriticStage(self.train_model, cfg.algo, cfg.optim, dp_group=self.dp_group)
        self.actor = ActorStage(self.train_model, cfg.algo, cfg.optim, cfg.rollout.temperature,
                                total_updates=cfg.max_steps, dp_group=self.dp_group, layout=self.pm,
                                dp_sharded=plan.train_fsdp)
        ctx.switch.attach(optimizer=self.actor.optimizer, pm=self.pm,
                          critic=(self.critic.model, self.critic.optimizer) if self.critic else None)
        self._packer = NumberPacker()  # the update's answer recurs every step

    # ---- the update ----

    def update(self, rows: int | tuple[int, ...], version: int) -> Any:
        """One synchronous update from scored rows in the queue — a count (the first that many)
        or the row ids as runs (StaleSync's batch) — from policy `version` (the controller's count of
        updates, which the actor follows: its learning-rate schedule reads it). The first train
        device runs the advantage stage and splits the kept rows over the data-parallel ranks
        (by tokens, or by cost with `optim.dp_balance=cost`); the split goes to the other train
        devices over their group, each reads its rows by id and trains, then the first retires
        the rows. With no row kept the policy is unchanged and its version moves on. The first
        device answers the batch's aggregates with the update's metrics (`trained`: whether the
        weights changed), packed (`NumberPacker`); the others answer None."""
        ctx, plan = self.ctx, self.ctx.plan
        self.actor.version = version
        rows = rows if isinstance(rows, int) else runs_rows(rows)  # ids cross as runs (`row_runs`)
        lead = ctx.device == plan.train[0]
        summary: dict[str, float] = {}
        split: list[dataflow.RankRows] | None = None
        try:
            if lead:
                with ctx.spans.span("advantage"):
                    start = time.perf_counter()
                    numbers, split, summary = advantage_stage(ctx.queue, ctx.cfg, rows, plan.train_dp,
                                                              self.split_cost, self.rank_of)
                    summary["time_advantage_s"] = time.perf_counter() - start
        finally:  # the split goes to the other train devices; None tells them the stage failed
            if self.train_group is not None:
                box = [split]
                dist.broadcast_object_list(box, src=plan.train[0], group=self.train_group)
                split = box[0]
        if split is None:  # (not the first: it raised) the first train device's error says why
            return None
        trained = any(part.row_ids for part in split)
        metrics = self._train_on(split[plan.dp_index(ctx.device)]) if trained else {}
        if not trained:
            self.actor.skip_update()
        if not lead:
            return None  # the first train device answers for all
        with ctx.spans.span("queue"):
            ctx.queue.retire([r.row_id for r in numbers])
        return self._packer.pack({**summary, **metrics, "trained": float(trained)})

    def _train_on(self, part: dataflow.RankRows) -> dict[str, float]:
        """One full-batch step of the actor (and the critic, with GAE advantages) on this data-
        parallel rank's rows, read from the queue by id."""
        ctx, plan = self.ctx, self.ctx.plan
        consumer = "actor"
        position = plan.model_parallel_group(plan.dp_index(ctx.device)).index(ctx.device)
        if position and not isinstance(self.reads, GroupQueue):
            consumer = f"actor/mp{position}"  # each device of a model-parallel group reads its rows: a reader of its own
        with ctx.spans.span("queue"):
            try:
                batch = self.reads.get_rows(consumer, part.row_ids, dataflow.actor_reads(ctx.cfg),
                                            timeout=ctx.cfg.deploy.queue_timeout_s)
            except TimeoutError as e:
                raise RunError(f"the update on device {ctx.device}: {e} (deploy.queue_timeout_s)") from None
        trajs = dataflow.to_trajectories(batch)
        part.fill(trajs)
        metrics: dict[str, float] = {}
        experts = self.pm is not None and self.pm.experts
        if experts:
            self.pm.reset_comm_counters()
        with ctx.switch.train(), autocast(ctx.where, ctx.compute_dtype):
            if self.critic is not None:
                with ctx.spans.span("critic"):
                    self.critic.values(trajs)
                    gae_advantages(trajs, ctx.cfg.algo, self.dp_group)
                    metrics.update(self.critic.update(trajs))
            start = time.perf_counter()
            metrics.update(self.actor.update(trajs))
            metrics.update(self._update_rate(trajs, time.perf_counter() - start))
        if experts:
            metrics.update(self._expert_comm())
        return metrics

    def _update_rate(self, trajs: list[Trajectory], seconds: float) -> dict[str, float]:
        """The useful FLOP/s of this device's share of the actor update — 3 forwards of its rows
        per epoch (`model.flops.forward_flops`), split over the devices that hold one model copy —
        and its share of the device's matmul peak."""
        plan = self.ctx.plan
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        holders = len(plan.model_parallel_group(plan.dp_index(self.ctx.device)))
        flops = (3 * self.ctx.cfg.algo.ppo_epochs * forward_flops(self.model_config, sum(lengths),
                                                                  causal_positions(lengths)) / holders)
        rate = flops / max(seconds, 1e-9)
        return {"update_gflop_per_s": rate / 1e9, "update_peak_share": rate / self.peak_flops}

    def _a2a_wait(self, start: float, end: float) -> None:
        self.ctx.spans.add(A2A_WAIT, start, end)

    def _expert_comm(self) -> dict[str, float]:
        """The update's expert all-to-all on the train devices (a collective over them): the
        longest any device waited on it (its exposed communication, `deploy.train_a2a_chunks`
        hides it behind computation), the megabytes the devices sent, the part of them that
        crossed to another node (`deploy.ranks_per_node`), and 1 when the experts dispatched
        node by node (the hierarchical all-to-all), else 0; with Adaptive Pipe
        (`deploy.train_schedule=overlap_fb`) the order it chose within a pair and the pair times
        it chose from (`overlap_fb_*`, the same on every device)."""
        c = self.pm.comm_counter()
        waited, sent = torch.tensor([c.wait_s]), torch.tensor([float(c.sent_bytes), float(c.internode_bytes)])
        if self.train_group is not None:
            dist.all_reduce(waited, op=dist.ReduceOp.MAX, group=self.train_group)
            dist.all_reduce(sent, group=self.train_group)
        hierarchical = any(e.rail is not None for e in self.pm.experts)  # what their forward dispatches by
        return {"ep_a2a_exposed_s": float(waited), "ep_a2a_mb": float(sent[0]) / 1e6,
                "ep_a2a_internode_mb": float(sent[1]) / 1e6, "ep_a2a_hierarchical": float(hierarchical),
                **self.pm.overlap_report()}

    @property
    def trained(self) -> Any:
        """What this device trains: its part of the training layout, or the whole model."""
        return self.pm if self.pm is not None else self.policy

    def sync_weights(self, sync_group: Any) -> int:
        """Hybrid mode (full replicas; train devices also generate): the first train device
        broadcasts the new weights to the rollout devices over `sync_group`
        (`DeviceSwitch.broadcast_weights`). Returns bytes sent or received. (Separated mode
        syncs shard to shard instead: `DeviceWorker.sync_weights`.)"""
        plan = self.ctx.plan
        lead = self.ctx.device == plan.train[0]
        joins = self.ctx.device in plan.rollout or lead
        return self.ctx.switch.broadcast_weights(plan.train[0], sync_group, joins)

    # ---- the trained state ----

    def weights(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The policy's full weights, or with LoRA only its adapters (the base never changes) (in
        a training layout: gathered, collective over the train devices; with `keep=False` this
        device only joins the gathers and returns None)."""
        if self.pm is not None:
            return self.pm.full_state_dict(keep=keep, part=self.part)
        return on_host(lora.trained_state(self.policy)) if keep else None

    def state(self, keep: bool = True) -> dict[str, Any] | None:
        """The policy weights, optimizer state and version, whole (train devices hold identical
        replicas; in a training layout the shards are gathered: every train device must call
        this, and one with `keep=False` drops each gathered tensor at once and returns None)."""
        self.ctx.switch.enter_train()  # offloaded for a rollout whose update was skipped
        optimizer = self.actor.optimizer.state_dict()
        if self.pm is not None:  # keyed by the plain model's parameter order, as a replica's
            optimizer = self.layout_state.optimizer_whole(optimizer, keep)
        weights = self.weights(keep)
        return {"model": weights, "optimizer": on_host(optimizer), "version": self.actor.version} if keep else None

    def load_state(self, state: dict[str, Any]) -> None:
        if self.pm is None:
            load_weights_into(self.policy, state["model"], "the loaded state", part=self.part)
        else:  # each device keeps its shard (its stages) of the whole tensors; the replica is filled per rollout
            self.layout_state.load_weights(state["model"], part=self.part)
        self.ctx.switch.policy_changed()
        self.ctx.switch.enter_train()
        optimizer = state["optimizer"]
        if self.pm is not None:  # whole optimizer states → this device's shards and stages
            optimizer = self.layout_state.optimizer_part(optimizer, self.actor.optimizer.state_dict()["param_groups"])
        # own storages (a state read from disk may not be resizable, and offloading resizes them)
        optimizer = {**optimizer, "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                for k, v in st.items()} for i, st in optimizer["state"].items()}}
        self.actor.optimizer.load_state_dict(optimizer)
        self.actor.version = state["version"]

    def critic_state(self) -> dict[str, Any]:
        return on_host({"model": self.critic.model.state_dict(), "optimizer": self.critic.optimizer.state_dict()})

    def load_critic_state(self, state: dict[str, Any]) -> None:
        self.critic.model.load_state_dict(state["model"])
        self.critic.optimizer.load_state_dict(state["optimizer"])
