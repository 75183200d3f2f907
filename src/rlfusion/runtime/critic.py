"""PPO's value model on the train devices, `CriticStage`, and the per-token GAE advantages it
feeds (`gae_advantages`, whitened over every data-parallel rank's tokens with one all-reduce).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel.data_parallel import group_sum, sum_over_replicas
from rlfusion.rl import advantages as adv
from rlfusion.rl.policy_loss import value_loss
from rlfusion.rl.trajectory import Trajectory, device_of, pack, response_values, split_by_token_budget
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig


def gae_advantages(trajs: list[Trajectory], algo: AlgoConfig, group: Any = None) -> None:
    """Per-token GAE with the sequence reward on the last response token, whitened over the
    batch: with a data-parallel `group`, over every rank's tokens (each rank holds a share of
    the samples), so the result does not depend on how the batch was split."""
    R = max((len(t.response_ids) for t in trajs), default=0)
    rewards, values, mask = (torch.zeros(len(trajs), R) for _ in range(3))
    for s, t in enumerate(trajs):
        n = len(t.response_ids)
        rewards[s, n - 1] = t.reward
        values[s, :n] = torch.tensor(t.values)
        mask[s, :n] = 1.0
    adv_SR, ret_SR = adv.gae_advantages(rewards, values, mask, algo.gamma, algo.lam)
    valid = mask.bool()
    # sums in float64, so the whitening is the same for any split of the batch
    sums = torch.tensor([float(valid.sum()), adv_SR[valid].double().sum(), adv_SR[valid].double().pow(2).sum()],
                        dtype=torch.float64)
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    n, total, squares = sums.tolist()
    mean = total / max(n, 1.0)
    std = max(((squares - n * mean * mean) / max(n - 1.0, 1.0)) ** 0.5, 1e-6)
    adv_SR = (adv_SR - mean) / std  # whitened over the batch, as in standard PPO
    for s, t in enumerate(trajs):
        n_s = len(t.response_ids)
        t.token_advantages, t.returns = adv_SR[s, :n_s].tolist(), ret_SR[s, :n_s].tolist()


class CriticStage:
    """The value model for PPO: the base decoder with a one-output head instead of the LM head."""

    def __init__(self, base: MoETransformer, algo: AlgoConfig, optim: OptimConfig, dp_group: Any = None):
        self.model = copy.deepcopy(base).train()
        self.model.lm_head = torch.nn.Linear(base.config.d_model, 1, bias=False, device=device_of(base))
        torch.nn.init.zeros_(self.model.lm_head.weight)  # V = 0 at start: advantages = returns
        self.algo, self.microbatch_tokens = algo, optim.microbatch_tokens
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.critic_lr)
        self.dp_group = dp_group  # replicas on several devices: each its share of the samples

    def _values(self, trajs: list[Trajectory]):
        batch = pack(trajs, device_of(self.model))
        values_N = self.model(batch.tokens_N.unsqueeze(0), packed=batch.packed)[0, :, 0].float()
        return batch, values_N

    @torch.no_grad()
    def values(self, trajs: list[Trajectory]) -> None:
        for micro in split_by_token_budget(trajs, self.microbatch_tokens):
            batch, values_N = self._values(micro)
            for t, v in zip(micro, response_values(batch, values_N, micro)):
                t.values = v.tolist()

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One step on `trajs` (with a `dp_group`, this replica's share: the loss is normalized
        by the group's token count and gradients are summed, so every replica takes the
        full-batch step)."""
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = group_sum([sum(len(t.response_ids) for t in trajs)], self.dp_group)[0]
        if num_tokens == 0:
            return {}
        metrics: dict[str, float] = {}
        for micro in split_by_token_budget(trajs, self.microbatch_tokens) if trajs else []:
            batch, values_N = self._values(micro)
            mask = batch.response_N
            old, ret = torch.zeros_like(values_N), torch.zeros_like(values_N)
            old[mask] = torch.tensor([v for t in micro for v in t.values], device=values_N.device)
            ret[mask] = torch.tensor([r for t in micro for r in t.returns], device=values_N.device)
            loss, m = value_loss(values_N, old, ret, batch.loss_mask_N, self.algo.value_clip,
                                 num_tokens=num_tokens)
            loss.backward()
            share = int(mask.sum()) / num_tokens
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v * share
        if self.dp_group is not None:
            metrics = sum_over_replicas(list(self.model.parameters()), metrics, self.dp_group)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return metrics
