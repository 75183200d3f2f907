"""Mixture-of-Experts layer: top-k router, routed experts computed grouped by expert, shared experts.

Load balancing is configurable: an auxiliary switch-style loss (`aux_loss_coef`) and/or the
auxiliary-loss-free expert bias (`bias_update_rate`), which shifts only *which* experts are
selected, never the combine weights, and is nudged after each optimizer step toward equal load.

Legend: N tokens, D model dim, E experts, K experts per token, F expert FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlfusion.model.config import ModelConfig
from rlfusion.model import lora
from rlfusion.model.layers import SwiGLU
from rlfusion.model.routes import NO_ROUTE, Routes


class Router(nn.Module):
    lora_scale, lora_merged = None, False  # a LoRA adapter's (`lora.add_router_adapter`), none by default

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.score_func, self.norm_topk_prob = cfg.score_func, cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.num_groups, self.topk_groups = cfg.num_expert_groups, cfg.topk_groups
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        # Tokens routed to each expert since the last bias update (training only).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts), persistent=False)

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns `(topk_ids_NK, topk_weights_NK, aux_loss)`. `replay_NK`: experts to route each
        token to instead of its own top-k (rows of `NO_ROUTE`: its own); the weights are this
        router's scores of the experts routed to, so its gradient flows either way. The top-k
        it chose by itself is kept as `own_NK` (until the next call)."""
        logits_NE = F.linear(x_ND.float(), self.weight.float())
        if self.lora_scale is not None and not self.lora_merged and lora.active():
            logits_NE = logits_NE + F.linear(F.linear(x_ND.float(), self.lora_A.float()),
                                             self.lora_B.float()) * self.lora_scale
        scores_NE = logits_NE.softmax(-1) if self.score_func == "softmax" else logits_NE.sigmoid()
        choice_NE = scores_NE + self.expert_bias
        if self.num_groups > 1:
            choice_NE = self._best_groups_only(choice_NE)
        topk_ids_NK = self.own_NK = torch.topk(choice_NE, self.top_k, dim=-1).indices
        if replay_NK is not None:
            replay_NK = replay_NK.to(topk_ids_NK.device, torch.long)
            topk_ids_NK = torch.where((replay_NK[:, :1] != NO_ROUTE), replay_NK, topk_ids_NK)
        weights_NK = scores_NE.gather(-1, topk_ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True).clamp_min(1e-20)
        weights_NK = weights_NK * self.scaling
        aux = x_ND.new_zeros((), dtype=torch.float32)
        if self.training and torch.is_grad_enabled():  # count only tokens that train the model
            counts_E = torch.bincount(topk_ids_NK.flatten(), minlength=self.num_experts)
            self.tokens_per_expert += counts_E.float()
            if self.aux_loss_coef > 0:
                aux = self._aux_loss(scores_NE, counts_E)
        return topk_ids_NK, weights_NK.to(x_ND.dtype), aux

    def _best_groups_only(self, choice_NE: torch.Tensor) -> torch.Tensor:
        """Experts outside the `topk_groups` best groups (a group scores the sum of its two best
        experts, DeepSeek-V3 style) get -inf, so top-k picks only inside the best groups."""
        N, E = choice_NE.shape
        choice_NGe = choice_NE.view(N, self.num_groups, E // self.num_groups)
        group_scores_NG = choice_NGe.topk(2, dim=-1).values.sum(-1)
        best_NG = torch.topk(group_scores_NG, self.topk_groups, dim=-1).indices
        keep_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool).scatter_(1, best_NG, True)
        return choice_NGe.masked_fill(~keep_NG.unsqueeze(-1), float("-inf")).view(N, E)

    def _aux_loss(self, scores_NE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        # Switch-Transformer loss E * sum_i f_i * P_i: f = routed fraction, P = mean router prob.
        probs_NE = scores_NE / scores_NE.sum(-1, keepdim=True)
        frac_E = counts_E.float() / counts_E.sum()
        return self.aux_loss_coef * self.num_experts * (frac_E * probs_NE.mean(0)).sum()

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
        load = self.tokens_per_expert
        if rate > 0 and load.sum() > 0:
            self.expert_bias += rate * torch.sign(load.mean() - load)
        load.zero_()


def expert_ffn(experts: nn.Module, e: int | None, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU (`e`; None: every expert at once, batched), its adapters included
    when `experts` has them (`model/lora.py`)."""
    mm = lora.expert_matmul
    return mm(experts, "down", e, F.silu(mm(experts, "gate", e, x, gate)) * mm(experts, "up", e, x, up), down)


class GroupedExperts(nn.Module):
    """`E` SwiGLU experts stored as stacked weights; tokens are sorted and computed per expert.

    Small batches (decode steps: at most `dense_max_tokens` tokens) take every expert as one
    batched matmul over all experts and combine with the routing weights (zero for experts not
    chosen): E/K times the FLOPs but three kernel calls instead of three per expert, which is
    what a decode step of a small model costs. Large batches sort tokens by expert."""

    dense_max_tokens = 16
    lora_scale, lora_merged = None, False  # LoRA adapters' (`lora.add_expert_adapters`), none by default

    def __init__(self, num_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))

    def expert_forward(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        return expert_ffn(self, e, x_ND, self.w_gate_EDF[e], self.w_up_EDF[e], self.w_down_EFD[e])

    def forward(self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor,
                weights_NK: torch.Tensor, shared=None) -> torch.Tensor:
        """The routed experts' combined output, plus `shared(x_ND)` (the always-on experts)
        when given: an implementation that waits on something (an expert-parallel one, on its
        tokens in flight) may compute that meanwhile."""
        y_ND = self._routed(x_ND, topk_ids_NK, weights_NK)
        return y_ND if shared is None else y_ND + shared(x_ND)

    def _routed(self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = topk_ids_NK.shape
        if N <= self.dense_max_tokens and not torch.is_grad_enabled():
            return self._dense(x_ND, topk_ids_NK, weights_NK)
        flat_ids = topk_ids_NK.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_idx = order // K
        counts = torch.bincount(flat_ids, minlength=self.w_gate_EDF.shape[0]).tolist()
        x_sorted = x_ND[token_idx]
        # one view per expert from a single unbind: its backward writes every expert's gradient
        # into one stacked tensor (indexing `w[e]` per expert would allocate a full-size zero
        # gradient per expert)
        gate, up, down = self.w_gate_EDF.unbind(0), self.w_up_EDF.unbind(0), self.w_down_EFD.unbind(0)
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                x = x_sorted[start:start + count]
                outs.append(expert_ffn(self, e, x, gate[e], up[e], down[e]))
                start += count
        y_sorted = torch.cat(outs) * weights_NK.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x_ND).index_add_(0, token_idx, y_sorted)

    def _dense(self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        E, N = self.w_gate_EDF.shape[0], x_ND.shape[0]
        x_END = x_ND.unsqueeze(0).expand(E, -1, -1)
        y_NED = expert_ffn(self, None, x_END, self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD).transpose(0, 1)
        # only the chosen experts' outputs are combined (an unchosen expert's inf/nan stays out)
        y_NKD = y_NED[torch.arange(N, device=x_ND.device).unsqueeze(1), topk_ids_NK]
        return (y_NKD * weights_NK.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.num_experts, cfg.d_model, cfg.expert_ffn_dim)
        self.shared = (SwiGLU(cfg.d_model, cfg.num_shared_experts * cfg.expert_ffn_dim)
                       if cfg.num_shared_experts else None)
        # Qwen2-MoE scales the shared experts by a learned per-token sigmoid gate.
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.aux_loss = torch.zeros(())

    def forward(self, x_BTD: torch.Tensor, routes: Routes | None = None, layer: int = 0) -> torch.Tensor:
        """`routes`: this pass's replayed / recorded routes; `layer`: this MoE layer's index among
        the model's MoE layers (what `routes` is indexed by)."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        topk_ids, weights, self.aux_loss = self.router(x_ND, routes.replayed(layer) if routes is not None else None)
        if routes is not None:
            routes.observe(layer, self.router.own_NK, topk_ids)
        y_ND = self.experts(x_ND, topk_ids, weights, self.shared_output if self.shared is not None else None)
        return y_ND.view_as(x_BTD)

    def shared_output(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The shared experts' part of the output (gated per token where the model says so)."""
        shared_ND = self.shared(x_ND)
        if self.shared_gate is not None:
            shared_ND = torch.sigmoid(self.shared_gate(x_ND)) * shared_ND
        return shared_ND
