"""The trained policy, `ActorStage`: PPO-style updates on packed, token-budgeted micro-batches,
as one replica of a data-parallel group and, with a training layout, as a shard of the model
(`deploy.train_tp` / `train_ep` / `train_fsdp`) or as the stages of a pipeline
(`deploy.train_pp` / `train_vpp`: padded micro-batches through 1F1B or interleaved 1F1B, the
loss's per-token inputs carried to the last stage beside the rows: `actor_pipeline.py`).

Legend: N tokens (packed), V vocab.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfusion.errors import RunError
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel.balance import BalanceConfig, ExpertBalancer
from rlfusion.parallel.data_parallel import (any_rank, clip_grad_norm, filler_pass, group_sum, lockstep_count,
                                             sum_over_replicas, sum_router_loads)
from rlfusion.parallel.recompute import HostPool, SavedTensorMeter, apply_plan, fixed_plan, measured_plan
from rlfusion.rl.kl import kl_loss
from rlfusion.rl.policy_loss import entropy_bonus, entropy_from_logits, ppo_policy_loss
from rlfusion.rl.mismatch import MismatchMeter
from rlfusion.rl.trajectory import (Trajectory, batch_routes, pack, packed_routes, split_by_token_budget, stale_positions,
                                    token_logprobs)
from rlfusion.runtime.actor_pipeline import pipeline_pass
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig

class NonFiniteLossError(RunError):
    """The loss or gradient became NaN/inf; the run stops and keeps its last good checkpoint."""


class ActorStage:
    """The trained policy: PPO-style updates on packed, token-budgeted micro-batches.

    With a `dp_group` each rank holds a full replica (or, with a training layout, its shard of
    the model) and its share of the samples: loss normalizers are the global token and sequence
    counts and gradients are summed over the group before clipping, so every rank takes the
    full-batch step and the replicas stay equal. In a pipeline (`layout.layout.pp > 1`) `model`
    is None: this rank holds `layout.chunks`, the stages it runs."""

    def __init__(self, model: MoETransformer | None, algo: AlgoConfig, optim: OptimConfig,
                 temperature: float, total_updates: int = 0, dp_group: Any = None, layout: Any = None,
                 dp_sharded: bool = False):
        self.model, self.algo, self.optim_cfg, self.temperature = model, algo, optim, temperature
        self.dp_group = dp_group
        self.pm = layout
        self.pipeline = layout is not None and layout.layout.pp > 1
        self.stage_group = layout.mesh.group("pp") if self.pipeline else None
        # what the optimizer updates: every weight, or only the adapters (LoRA: the base is frozen)
        self.params = [p for p in (layout.parameters() if self.pipeline else model.parameters()) if p.requires_grad]
        self.device = layout.device if layout is not None else self.params[0].device  # where batches go
        # `layout`: the `ParallelModel` when `model` is split over a training layout. Its routed
        # experts' shards are summed over their expert-data-parallel group (not the dp group),
        # and its forward passes are collectives (expert all-to-all) across data-parallel ranks,
        # so those ranks run equally many (`_lockstep`). `dp_sharded`: the model is sharded over
        # `dp_group` (FSDP2), which gathers its parameters in every pass (collectives too) and
        # sums its gradients itself; only the routed experts' are left to `_sync`
        experts = list(layout.experts) if layout is not None else []
        self.expert_params = {id(p) for m in experts for p in m.parameters(recurse=False)}
        self.edp_group = experts[0].edp_group if experts else None
        self.ep_group = experts[0].ep.group if experts and experts[0].ep.size > 1 else None
        self.dp_sharded = dp_sharded
        self.lockstep = (bool(experts) or dp_sharded) and dp_group is not None
        self.total_updates = total_updates  # horizon of the lr decay; 0 = constant
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr,
                                           betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay)
        self.version = 0
        # activations: recompute / swap (`optim.recompute`), measured per micro-batch
        self.modules = nn.ModuleList(layout.chunks if self.pipeline else [model])
        self.pool = HostPool(self.modules) if optim.recompute in ("swap", "plan") else None
        self.plan = None  # the planner's choice, made on the first update (`optim.recompute=plan`)
        if optim.recompute not in ("none", "plan"):
            for module in self.modules:
                apply_plan(module, fixed_plan(module, optim.recompute), self.pool)
        self._activations = [0, 0]  # the largest micro-batch's saved bytes on the device, in host memory
        # expert load prediction + migration (`optim.expert_balance`)
        self.balancer = (ExpertBalancer(layout, BalanceConfig(margin=optim.expert_balance_margin))
                         if optim.expert_balance else None)
        # routing replay (`algo.routing_replay`) and the rollout-vs-trainer mismatch of each update
        self.replay = algo.routing_replay == "rollout"
        self.top_k = (layout.config if layout is not None else model.config).top_k
        self.num_moe_layers = (layout.config if layout is not None else model.config).num_moe_layers
        self.meter = MismatchMeter()

    def routers(self) -> list:
        return self.pm.routers() if self.pipeline else self.model.routers()

    def train(self, mode: bool = True) -> None:
        self.modules.train(mode)

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One or more optimizer steps on `trajs`; returns averaged metrics."""
        self.train()
        self.meter = MismatchMeter()
        on_policy = self.algo.ppo_epochs == 1 and self.algo.minibatches == 1
        if not on_policy:
            self._set_proximal(trajs)
        totals: dict[str, float] = {}
        num_updates = 0
        for _ in range(self.algo.ppo_epochs):
            for minibatch in _chunks(trajs, self.algo.minibatches):  # always `minibatches` chunks
                if not minibatch and self.dp_group is None:
                    continue
                step_metrics = self._step(minibatch, on_policy)
                if step_metrics is None:  # empty on every rank
                    continue
                for k, v in step_metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                num_updates += 1
        for group in (self.dp_group, self.stage_group):  # (a pipeline's stages each saw their own layers)
            if group is not None:
                self.meter.reduce(group, self.num_moe_layers)
        self.version += 1
        return {**{k: v / max(num_updates, 1) for k, v in totals.items()}, **self.meter.metrics()}

    def skip_update(self) -> None:
        """No sample carried signal this step: the policy is unchanged, its version moves on
        (so the learning-rate schedule and token versions stay in step with the loop)."""
        self.version += 1

    @torch.no_grad()
    def _set_proximal(self, trajs: list[Trajectory]) -> None:
        if self.pipeline:
            self._pipeline_pass(trajs, None, 0, 0, backward=False)
            return
        for micro in self._lockstep(split_by_token_budget(trajs, self.optim_cfg.microbatch_tokens) if trajs else []):
            if micro is None:
                filler_pass(self.model, backward=False)
                continue
            batch = pack(micro, self.device)
            logprobs_N, _ = self._forward(micro, batch)
            per_seq = logprobs_N[batch.response_N].split([len(t.response_ids) for t in micro])
            for t, lp in zip(micro, per_seq):
                t.proximal_logprobs = lp.tolist()

    def lr_at(self, version: int) -> float:
        cfg = self.optim_cfg
        if version < cfg.warmup_steps:
            return cfg.lr * (version + 1) / (cfg.warmup_steps + 1)
        if not self.total_updates:
            return cfg.lr
        frac = min(1.0, version / self.total_updates)
        return cfg.lr * (1.0 - (1.0 - cfg.min_lr_ratio) * frac)

    def _step(self, trajs: list[Trajectory], on_policy: bool) -> dict[str, float] | None:
        lr = self.lr_at(self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens, num_seqs = self._global_counts(trajs)
        if num_tokens == 0:
            return None
        if self.pipeline:
            metrics, bad_loss = self._pipeline_pass(trajs, on_policy, num_tokens, num_seqs, backward=True)
        else:
            metrics, bad_loss = self._packed_backward(trajs, on_policy, num_tokens, num_seqs)
        # an expert shard that no token reached still takes its (zero-gradient) step, as one
        # process's stacked experts do, so every rank's optimizer state covers the same tensors
        for p in self.params:
            if p.grad is None and id(p) in self.expert_params:
                p.grad = torch.zeros_like(p)
        if any_rank(bad_loss is not None, (self.dp_group, self.stage_group)) and bad_loss is None:
            bad_loss = float("nan")  # another rank's loss
        if bad_loss is not None:
            raise NonFiniteLossError(f"loss became {bad_loss} at policy version {self.version}")
        if self.dp_group is not None:
            metrics = self._sync(metrics)
        if self.pipeline:  # the loss (and its metrics) lives on the last stage's pipeline device
            parts: list[dict[str, float]] = [{} for _ in range(dist.get_world_size(self.stage_group))]
            dist.all_gather_object(parts, metrics, group=self.stage_group)
            metrics = parts[self.pm.loss_pp_index]
        grad_norm = clip_grad_norm(self.params, self.optim_cfg.grad_clip, self.expert_params, self.ep_group,
                                   self.stage_group)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"gradient norm became {grad_norm.item()} at policy version {self.version}")
        self.optimizer.step()
        if self.balancer is not None:  # the load this update measured → migrate for the next one
            rollout = self.optim_cfg.expert_balance_source == "rollout"  # its recorded routes' load, else the trainer's
            report = self.balancer.step(self.optimizer, self.balancer.load_of(packed_routes(trajs)) if rollout else None)
            metrics["expert_load_max_over_mean"] = max(layer.measured for layer in report.layers)
            metrics["expert_migrated_layers"] = float(sum(layer.migrated for layer in report.layers))
            metrics["expert_migrated_mb"] = report.bytes_moved / 2**20
        if not self.pipeline:
            metrics["activation_mb"] = self._activations[0] / 2**20
            if self.pool is not None:
                metrics["activation_host_mb"] = self._activations[1] / 2**20
            self._activations = [0, 0]
        if self.optim_cfg.router_bias_update:
            if self.dp_group is not None:  # every replica sees the load of the whole batch
                sum_router_loads(self.routers(), self.dp_group)
            rate = (self.pm.config if self.pipeline else self.model.config).bias_update_rate
            for router in self.routers():
                router.update_bias(rate)
        else:
            for router in self.routers():
                router.tokens_per_expert.zero_()
        metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = lr
        return metrics

    def _global_counts(self, trajs: list[Trajectory]) -> tuple[int, int]:
        tokens, seqs = group_sum([sum(sum(t.sampled) for t in trajs), len(trajs)], self.dp_group)
        return tokens, seqs

    def _sync(self, metrics: dict[str, float]) -> dict[str, float]:
        params = self.params
        replicated = [] if self.dp_sharded else [p for p in params if id(p) not in self.expert_params]
        metrics = sum_over_replicas(replicated, metrics, self.dp_group)
        for p in params:
            if id(p) in self.expert_params and self.edp_group is not None:
                dist.all_reduce(p.grad, group=self.edp_group)
        return metrics

    def _lockstep(self, micros: list) -> list:
        """`micros` padded with None to the most any data-parallel rank has, when the forward
        passes are collectives across those ranks (expert parallelism); else as they are."""
        if not self.lockstep:
            return micros
        return micros + [None] * (lockstep_count(len(micros), self.dp_group) - len(micros))

    # ---- packed micro-batches (no pipeline) ----

    def _packed_backward(self, trajs, on_policy, num_tokens, num_seqs) -> tuple[dict[str, float], float | None]:
        metrics: dict[str, float] = {}
        bad_loss = None
        micros = split_by_token_budget(trajs, self.optim_cfg.microbatch_tokens) if trajs else []
        if self.optim_cfg.recompute == "plan" and self.plan is None:
            self._make_plan(micros)
        for micro in self._lockstep(micros):
            if micro is None or bad_loss is not None:  # only keeps in step with the other ranks
                filler_pass(self.model, backward=True)
                continue
            if self.pool is not None:
                self.pool.reset()
            with SavedTensorMeter(self.modules) as meter:
                loss, m = self._micro_loss(micro, on_policy, num_tokens, num_seqs)
            self._activations = [max(self._activations[0], meter.total_bytes),
                                 max(self._activations[1], self.pool.bytes_out if self.pool else 0)]
            if not math.isfinite(loss.item()):
                bad_loss = loss.item()
                if not self.lockstep:
                    break  # with a DP group the peers learn of it below instead of hanging in the sum
                (loss * 0.0).backward()  # its backward is a collective too
                continue
            loss.backward()
            for k, v in m.items():  # token-weighted average over micro-batches
                metrics[k] = metrics.get(k, 0.0) + v * sum(sum(t.sampled) for t in micro) / num_tokens
        return metrics, bad_loss

    def _make_plan(self, micros: list) -> None:
        """`optim.recompute=plan`: measure each layer's and module's saved bytes and forward time
        on the largest micro-batch (the same on every data-parallel rank: the most tokens any
        has, so their collectives pair up) and apply the planner's choice for the budget."""
        most = lockstep_count(max((sum(t.num_tokens for t in m) for m in micros), default=0), self.dp_group)
        largest = max(micros, key=lambda m: sum(t.num_tokens for t in m), default=None)
        if largest is None or sum(t.num_tokens for t in largest) < most:  # another rank's is larger
            forward = lambda: filler_pass(self.model, backward=False)  # noqa: E731  (joins its collectives)
        else:
            forward = lambda: token_logprobs(self.model, pack(largest, self.device), self.temperature)  # noqa: E731
        plan = measured_plan(self.model, forward, self.optim_cfg.activation_budget_mb * 2**20)
        # one plan for every rank: a recomputed module replays its collectives (expert
        # all-to-all, TP) in backward, which a rank that keeps it would not join
        group = None if self.pm is not None else self.dp_group  # a layout spans the whole world
        if self.pm is not None or self.dp_group is not None:
            box = [plan]
            src = 0 if group is None else min(dist.get_process_group_ranks(group))
            dist.broadcast_object_list(box, src=src, group=group)
            plan = box[0]
        self.plan = plan
        apply_plan(self.model, plan, self.pool)

    def _forward(self, micro: list[Trajectory], batch, measure: bool = True):
        """The policy's logprobs and logits over `batch` (the trajectories `micro`), its MoE
        routed by the rollout's recorded experts with `algo.routing_replay=rollout`; `measure`:
        this is the policy before the update, whose gap to the rollout the meter records."""
        routes = batch_routes(batch, self.top_k, self.replay)
        logprobs_N, logits_NV = token_logprobs(self.model, batch, self.temperature, routes)
        if measure:
            stale_N = stale_positions(micro, self.version).to(logprobs_N.device)
            self.meter.add_tokens(logprobs_N, batch.behaviour_logprobs_N, batch.loss_mask_N, stale_N)
            self.meter.add_routes(routes, stale_N)
        return logprobs_N, logits_NV

    def _micro_loss(self, micro, on_policy, num_tokens, num_seqs):
        batch = pack(micro, self.device)
        logprobs_N, logits_NV = self._forward(micro, batch, measure=on_policy)
        mask = batch.loss_mask_N
        if on_policy:
            proximal = logprobs_N.detach()
        else:
            proximal = torch.zeros_like(logprobs_N)
            proximal[batch.response_N] = torch.tensor([x for t in micro for x in t.proximal_logprobs], device=self.device)
        loss, metrics = self._loss(logprobs_N, logits_NV, proximal, batch.behaviour_logprobs_N,
                                   batch.advantages_N, mask, batch.seq_idx_N, batch.ref_logprobs_N,
                                   num_tokens, num_seqs)
        loss = loss + self.model.aux_loss() * (float(mask.sum()) / num_tokens)
        return loss, metrics

    def _loss(self, logprobs_N, logits_NV, proximal_N, behaviour_N, advantages_N, mask_N, seq_idx_N,
              ref_N, num_tokens, num_seqs):
        """The policy loss with its KL and entropy terms, normalized by the global batch."""
        loss, metrics = ppo_policy_loss(
            logprobs_N, proximal_N, behaviour_N, advantages_N, mask_N,
            seq_idx_N, clip_low=self.algo.clip_low, clip_high=self.algo.clip_high,
            agg=self.algo.loss_agg, behaviour_weight_cap=self.algo.behaviour_weight_cap,
            num_tokens=num_tokens, num_seqs=num_seqs, is_correction=self.algo.is_correction,
            is_mask=(self.algo.is_mask_low, self.algo.is_mask_high),
            seq_mask_threshold=self.algo.seq_mask_threshold)
        if self.algo.kl_coef and self.algo.kl_mode == "loss" and ref_N is not None:
            kl, m = kl_loss(logprobs_N, ref_N, mask_N, self.algo.kl_coef,
                            self.algo.kl_kind, num_tokens=num_tokens)
            loss, metrics = loss + kl, {**metrics, **m}
        if self.algo.entropy_coef:
            ent, m = entropy_bonus(entropy_from_logits(logits_NV), mask_N, self.algo.entropy_coef,
                                   num_tokens=num_tokens)
            loss, metrics = loss + ent, {**metrics, **m}
        return loss, metrics

    # ---- the pipeline: padded micro-batches, the loss on the last stage (`actor_pipeline.py`) ----

    def _pipeline_pass(self, trajs, on_policy, num_tokens, num_seqs, backward: bool):
        measure = on_policy or not backward  # the policy before the update: the mismatch meter's
        return pipeline_pass(self.pm, trajs, self._loss, temperature=self.temperature,
                             microbatch_tokens=self.optim_cfg.microbatch_tokens, dp_group=self.dp_group,
                             on_policy=on_policy, num_tokens=num_tokens, num_seqs=num_seqs, backward=backward,
                             replay=self.replay, meter=self.meter if measure else None, version=self.version)


def _chunks(items: list, n: int) -> list[list]:
    """Exactly `n` contiguous chunks (trailing ones empty when there are fewer items), so every
    data-parallel rank takes the same number of optimizer steps."""
    size = max(1, math.ceil(len(items) / n))
    return [items[i * size:(i + 1) * size] for i in range(n)]
