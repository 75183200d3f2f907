"""The trained policy, `ActorStage`: PPO-style updates on packed, token-budgeted micro-batches,
as one replica of a data-parallel group and, with a training layout, as a shard of the model
(`deploy.train_tp` / `train_ep` / `train_fsdp`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.errors import RunError
from rlfusion.model.kv_cache import PackedSeqs
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.kl import kl_loss
from rlfusion.rl.policy_loss import entropy_bonus, entropy_from_logits, ppo_policy_loss
from rlfusion.rl.trajectory import Trajectory, pack, split_by_token_budget, token_logprobs
from rlfusion.runtime.replicas import clip_grad_norm, group_sum, sum_over_replicas
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig


class NonFiniteLossError(RunError):
    """The loss or gradient became NaN/inf; the run stops and keeps its last good checkpoint."""


class ActorStage:
    """The trained policy: PPO-style updates on packed, token-budgeted micro-batches.

    With a `dp_group` each rank holds a full replica (or, with a training layout, its shard of
    the model) and its share of the samples: loss normalizers are the global token and sequence
    counts and gradients are summed over the group before clipping, so every rank takes the
    full-batch step and the replicas stay equal."""

    def __init__(self, model: MoETransformer, algo: AlgoConfig, optim: OptimConfig,
                 temperature: float, total_updates: int = 0, dp_group: Any = None, layout: Any = None,
                 dp_sharded: bool = False):
        self.model, self.algo, self.optim_cfg, self.temperature = model, algo, optim, temperature
        self.dp_group = dp_group
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
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr,
                                           betas=(optim.beta1, optim.beta2),
                                           weight_decay=optim.weight_decay)
        self.version = 0

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One or more optimizer steps on `trajs`; returns averaged metrics."""
        self.model.train()
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
        self.version += 1
        return {k: v / max(num_updates, 1) for k, v in totals.items()}

    def skip_update(self) -> None:
        """No sample carried signal this step: the policy is unchanged, its version moves on
        (so the learning-rate schedule and token versions stay in step with the loop)."""
        self.version += 1

    @torch.no_grad()
    def _set_proximal(self, trajs: list[Trajectory]) -> None:
        for micro in self._lockstep(split_by_token_budget(trajs, self.optim_cfg.microbatch_tokens) if trajs else []):
            if micro is None:
                self._filler_pass(backward=False)
                continue
            batch = pack(micro)
            logprobs_N, _ = token_logprobs(self.model, batch, self.temperature)
            per_seq = logprobs_N[batch.loss_mask_N.bool()].split([len(t.response_ids) for t in micro])
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
        metrics: dict[str, float] = {}
        bad_loss = None
        for micro in self._lockstep(split_by_token_budget(trajs, self.optim_cfg.microbatch_tokens) if trajs else []):
            if micro is None or bad_loss is not None:  # only keeps in step with the other ranks
                self._filler_pass(backward=True)
                continue
            loss, m = self._micro_loss(micro, on_policy, num_tokens, num_seqs)
            if not math.isfinite(loss.item()):
                bad_loss = loss.item()
                if not self.lockstep:
                    break  # with a DP group the peers learn of it below instead of hanging in the sum
                (loss * 0.0).backward()  # its backward is a collective too
                continue
            loss.backward()
            for k, v in m.items():  # token-weighted average over micro-batches
                metrics[k] = metrics.get(k, 0.0) + v * sum(len(t.response_ids) for t in micro) / num_tokens
        # an expert shard that no token reached still takes its (zero-gradient) step, as one
        # process's stacked experts do, so every rank's optimizer state covers the same tensors
        for p in self.model.parameters():
            if p.grad is None and id(p) in self.expert_params:
                p.grad = torch.zeros_like(p)
        if self.dp_group is not None and self._any_rank(bad_loss is not None) and bad_loss is None:
            bad_loss = float("nan")  # another rank's loss
        if bad_loss is not None:
            raise NonFiniteLossError(f"loss became {bad_loss} at policy version {self.version}")
        if self.dp_group is not None:
            metrics = self._sync(metrics)
        grad_norm = clip_grad_norm(list(self.model.parameters()), self.optim_cfg.grad_clip,
                                    self.expert_params, self.ep_group)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"gradient norm became {grad_norm.item()} at policy version {self.version}")
        self.optimizer.step()
        if self.optim_cfg.router_bias_update:
            if self.dp_group is not None:  # every replica sees the load of the whole batch
                self._sum_router_loads()
            self.model.update_router_bias()
        else:
            for router in self.model.routers():
                router.tokens_per_expert.zero_()
        metrics["grad_norm"] = float(grad_norm)
        metrics["lr"] = lr
        return metrics

    def _global_counts(self, trajs: list[Trajectory]) -> tuple[int, int]:
        tokens, seqs = group_sum([sum(len(t.response_ids) for t in trajs), len(trajs)], self.dp_group)
        return tokens, seqs

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return bool(t.item())

    def _sum_router_loads(self) -> None:
        routers = self.model.routers()
        if not routers:
            return
        flat = torch.cat([r.tokens_per_expert for r in routers])
        dist.all_reduce(flat, group=self.dp_group)
        for r, load in zip(routers, flat.split([r.tokens_per_expert.numel() for r in routers])):
            r.tokens_per_expert.copy_(load)

    def _sync(self, metrics: dict[str, float]) -> dict[str, float]:
        params = list(self.model.parameters())
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
        most = torch.tensor([len(micros)], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
        return micros + [None] * (int(most) - len(micros))

    def _filler_pass(self, backward: bool) -> None:
        """A forward (and backward) over one token that contributes nothing: it joins the
        collectives of the other ranks' pass. The routers' load counts are left as they were."""
        routers = self.model.routers()
        counts = [r.tokens_per_expert.clone() for r in routers]
        out = self.model(torch.zeros(1, 1, dtype=torch.long), packed=PackedSeqs.from_lengths([1]))
        if backward:
            (out.float().sum() * 0.0).backward()
        for r, c in zip(routers, counts):
            r.tokens_per_expert.copy_(c)

    def _micro_loss(self, micro, on_policy, num_tokens, num_seqs):
        batch = pack(micro)
        logprobs_N, logits_NV = token_logprobs(self.model, batch, self.temperature)
        mask = batch.loss_mask_N
        if on_policy:
            proximal = logprobs_N.detach()
        else:
            proximal = torch.zeros_like(logprobs_N)
            proximal[mask.bool()] = torch.tensor([x for t in micro for x in t.proximal_logprobs])
        loss, metrics = ppo_policy_loss(
            logprobs_N, proximal, batch.behaviour_logprobs_N, batch.advantages_N, mask,
            batch.seq_idx_N, clip_low=self.algo.clip_low, clip_high=self.algo.clip_high,
            agg=self.algo.loss_agg, behaviour_weight_cap=self.algo.behaviour_weight_cap,
            num_tokens=num_tokens, num_seqs=num_seqs)
        if self.algo.kl_coef and self.algo.kl_mode == "loss" and batch.ref_logprobs_N is not None:
            kl, m = kl_loss(logprobs_N, batch.ref_logprobs_N, mask, self.algo.kl_coef,
                            self.algo.kl_kind, num_tokens=num_tokens)
            loss, metrics = loss + kl, {**metrics, **m}
        if self.algo.entropy_coef:
            ent, m = entropy_bonus(entropy_from_logits(logits_NV), mask, self.algo.entropy_coef,
                                   num_tokens=num_tokens)
            loss, metrics = loss + ent, {**metrics, **m}
        loss = loss + self.model.aux_loss() * (float(mask.sum()) / num_tokens)
        return loss, metrics


def _chunks(items: list, n: int) -> list[list]:
    """Exactly `n` contiguous chunks (trailing ones empty when there are fewer items), so every
    data-parallel rank takes the same number of optimizer steps."""
    size = max(1, math.ceil(len(items) / n))
    return [items[i * size:(i + 1) * size] for i in range(n)]
