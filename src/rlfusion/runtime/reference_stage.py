"""The scorer's reference stage: each response's log-probabilities under the frozen reference
(base) model, and the summed KL estimate against them that KL reward shaping subtracts.
"""

from __future__ import annotations

import torch

from rlfusion.model import lora
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.kl import kl_estimate
from rlfusion.rl.trajectory import Trajectory, batch_routes, device_of, pack, split_by_token_budget, token_logprobs


class ReferenceStage:
    """Log-probabilities of each response under the frozen reference (base) model."""

    def __init__(self, model: MoETransformer, temperature: float, microbatch_tokens: int, replay: bool = False,
                 shares_policy: bool = False):
        """`replay`: route each token by the rollout's recorded experts (`algo.routing_replay_reference`).
        `shares_policy`: `model` is the device's LoRA policy itself, whose frozen base (its
        adapters switched off for the pass, `lora.base_only`) is the reference: left as it is."""
        self.shares_policy = shares_policy
        self.model = model if shares_policy else model.eval().requires_grad_(False)
        self.temperature, self.microbatch_tokens, self.replay = temperature, microbatch_tokens, replay

    @torch.no_grad()
    def logprobs(self, trajs: list[Trajectory]) -> None:
        with lora.base_only():  # (a copy's adapters, if any, are its init: the base too)
            self._logprobs(trajs)

    def _logprobs(self, trajs: list[Trajectory]) -> None:
        for micro in split_by_token_budget(trajs, self.microbatch_tokens):
            batch = pack(micro, device_of(self.model))
            routes = batch_routes(batch, self.model.config.top_k, replay=True) if self.replay else None
            logprobs_N, _ = token_logprobs(self.model, batch, self.temperature, routes)
            per_seq = logprobs_N[batch.response_N].split([len(t.response_ids) for t in micro])
            for t, lp in zip(micro, per_seq):
                t.ref_logprobs = lp.tolist()


def add_summed_kl(trajs: list[Trajectory], kind: str) -> None:
    """Each sample's `kl`: its per-token KL estimate (`kind`, `algo.kl_kind`) between behaviour
    and reference logprobs, summed over its sampled tokens — one number per sample, what reward
    shaping subtracts."""
    for t in trajs:
        kl = kl_estimate(torch.tensor(t.behaviour_logprobs), torch.tensor(t.ref_logprobs), kind)
        t.kl = float((kl * torch.tensor(t.sampled, dtype=kl.dtype)).sum())
