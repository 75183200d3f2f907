"""`Trajectory` (one sampled response and everything the RL stages add to it) and `PackedBatch`
(trajectories concatenated with no padding: the unit of training).

Legend: N packed tokens, S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlfusion.model.kv_cache import PackedSeqs
from rlfusion.model.routes import NO_ROUTE, Routes
from rlfusion.rl.problem import Problem


@dataclass
class Trajectory:
    """One sample. Rollout fills the response fields; reward, reference and advantage stages
    fill theirs. `versions[i]` is the policy version that generated `response_ids[i]`; `sample`
    is its index among the `group_size` samples of its prompt group."""

    group_id: int
    problem: Problem
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    finish_reason: str
    reward: float = 0.0
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    proximal_logprobs: list[float] | None = None  # pre-update policy, for multi-step updates
    # PPO with a critic: per-token values, GAE advantages and returns (else `advantage` is
    # one number for the whole response, as in GRPO-style estimators).
    values: list[float] | None = None
    token_advantages: list[float] | None = None
    returns: list[float] | None = None
    sample: int = 0
    correct: float = 0.0  # the task's score, before any shaping (`reward` is shaped)
    reward_failed: bool = False  # the user's reward function failed for it (its reward is 0)
    kl: float = 0.0  # summed per-token KL estimate against the reference policy
    train: bool = True  # kept for the update (dynamic sampling may drop its group)
    row_id: int = -1  # its DistQueue row, once it has one
    # the rollout's routed experts of every token it fed (all but the last), per MoE layer:
    # `[num_tokens - 1, L * K]` from the engine, flat from the queue (`model.routes`); None: not recorded
    routes: Any = None
    # a multi-turn episode's: 1 where the response token was sampled, 0 where an environment
    # appended it (an observation: no loss, no advantage, no KL); None: every token was sampled
    response_mask: list[int] | None = None
    env_reward: float = 0.0  # the rewards its environment's steps returned, summed
    env_failed: bool = False  # its environment failed (reward 0, counted)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @classmethod
    def of_completion(cls, c: Any, group_id: int = 0, problem: Problem | None = None,
                      finish_reason: str | None = None) -> "Trajectory":
        """A rollout engine's completion (`engine.types.Completion`) as a sample of group
        `group_id`: its tokens, logprobs, versions and routes (`finish_reason`: the completion's
        unless given)."""
        return cls(group_id, problem, c.prompt_ids, c.output_ids, c.logprobs, c.versions,
                   finish_reason or c.finish_reason, routes=c.routes, response_mask=c.output_mask)

    @property
    def sampled(self) -> list[int]:
        """Per response token, 1 where the policy sampled it (0: an observation)."""
        return [1] * len(self.response_ids) if self.response_mask is None else list(self.response_mask)


@dataclass
class PackedBatch:
    """Prompt + response of each trajectory concatenated along one token axis.

    Position t predicts token t + 1, so every per-token field is aligned with `targets_N`;
    `response_N` is True exactly where the target is a response token (the per-response values
    are read there), `loss_mask_N` 1 where it is a sampled one (an episode's observation tokens
    are response tokens the policy did not sample: no loss, advantage or KL there).
    """

    tokens_N: torch.Tensor  # int64
    targets_N: torch.Tensor  # int64, the next token (0 at each sequence's last position)
    loss_mask_N: torch.Tensor  # float32
    seq_idx_N: torch.Tensor  # int64, which trajectory each position belongs to
    advantages_N: torch.Tensor  # float32, the trajectory's advantage on its response targets
    behaviour_logprobs_N: torch.Tensor  # float32, 0 off the response
    ref_logprobs_N: torch.Tensor | None  # float32, 0 off the response; None without a reference
    packed: PackedSeqs
    # the rollout's routes per position, `[N, L * K]` int64 (`NO_ROUTE` rows: none recorded, as
    # at each sequence's last position); None when no trajectory has them
    routes_NX: torch.Tensor | None = None
    response_N: torch.Tensor | None = None  # bool; None: `loss_mask_N` (no observation tokens)

    def __post_init__(self) -> None:
        if self.response_N is None:
            self.response_N = self.loss_mask_N.bool()

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask_N.sum())


def pack(trajs: list[Trajectory], device: torch.device | str | None = None) -> PackedBatch:
    """The samples as one packed batch, its tensors on `device` (default: the CPU)."""
    tokens, targets, mask, response, seq_idx, adv, behaviour, ref = [], [], [], [], [], [], [], []
    for s, t in enumerate(trajs):
        ids = t.prompt_ids + t.response_ids
        P, R = len(t.prompt_ids), len(t.response_ids)
        sampled = t.sampled
        tokens += ids
        targets += ids[1:] + [0]
        mask += [0.0] * (P - 1) + [float(m) for m in sampled] + [0.0]
        response += [False] * (P - 1) + [True] * R + [False]
        seq_idx += [s] * len(ids)
        adv += [0.0] * (P - 1) + [a * m for a, m in zip(t.token_advantages or [t.advantage] * R, sampled)] + [0.0]
        behaviour += [0.0] * (P - 1) + [b * m for b, m in zip(t.behaviour_logprobs, sampled)] + [0.0]
        if t.ref_logprobs is not None:
            ref += [0.0] * (P - 1) + list(t.ref_logprobs) + [0.0]
    has_ref = bool(trajs) and all(t.ref_logprobs is not None for t in trajs)
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)
    return PackedBatch(
        tokens_N=i64(tokens), targets_N=i64(targets), loss_mask_N=f32(mask),
        seq_idx_N=i64(seq_idx), advantages_N=f32(adv), behaviour_logprobs_N=f32(behaviour),
        ref_logprobs_N=f32(ref) if has_ref else None,
        packed=PackedSeqs.from_lengths([t.num_tokens for t in trajs]),
        routes_NX=packed_routes(trajs, device), response_N=torch.tensor(response, dtype=torch.bool, device=device))


def has_routes(t: Trajectory) -> bool:
    return t.routes is not None and len(t.routes) > 0


def packed_routes(trajs: list[Trajectory], device: torch.device | str | None = None) -> torch.Tensor | None:
    """Each trajectory's routes per position, concatenated like its tokens (`PackedBatch.routes_NX`),
    or None when none has any."""
    widths = {torch.as_tensor(t.routes).numel() // (t.num_tokens - 1) for t in trajs if has_routes(t)}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"trajectories carry routes of different widths {sorted(widths)} (MoE layers x top-k)")
    width = widths.pop()
    rows = []
    for t in trajs:
        fed = (torch.as_tensor(t.routes).to(torch.int64).reshape(t.num_tokens - 1, width) if has_routes(t)
               else torch.full((t.num_tokens - 1, width), NO_ROUTE, dtype=torch.int64))
        rows += [fed, torch.full((1, width), NO_ROUTE, dtype=torch.int64)]  # the last token was never fed
    return torch.cat(rows).to(device)


def stale_positions(trajs: list[Trajectory], version: int) -> torch.Tensor:
    """Per packed position (`pack`'s order), whether the token it feeds the model was sampled
    by a policy older than `version`: a response target by its own version, a prompt position
    by the first response token's (the version that prefilled it); False at each last position."""
    out: list[bool] = []
    for t in trajs:
        old = [v < version for v in t.versions]
        out += [bool(old) and old[0]] * (len(t.prompt_ids) - 1) + old + [False]
        out += [False] * (t.num_tokens - len(t.prompt_ids) - len(old))  # (no versions: none stale)
    return torch.tensor(out, dtype=torch.bool)


def batch_routes(batch: PackedBatch, top_k: int, replay: bool) -> Routes | None:
    """The routes of a forward over `batch`: its recorded ones, replayed or only compared with
    the router's own choice; None when the batch has none."""
    if batch.routes_NX is None:
        return None
    N = len(batch.tokens_N)
    return Routes(batch.routes_NX.view(N, -1, top_k), replay=replay)


def split_by_token_budget(items: list, max_tokens: int, size=lambda t: t.num_tokens) -> list[list]:
    """Length-sorted micro-batches of at most `max_tokens` tokens each (an item longer than the
    budget gets a micro-batch of its own). Sorting keeps sequences of similar length together,
    which keeps the padded attention view of each micro-batch small."""
    if max_tokens < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {max_tokens}")
    micro, current, used = [], [], 0
    for item in sorted(items, key=size):
        if current and used + size(item) > max_tokens:
            micro.append(current)
            current, used = [], 0
        current.append(item)
        used += size(item)
    return micro + ([current] if current else [])


def response_values(batch: PackedBatch, values_N: torch.Tensor, trajs: list[Trajectory]) -> list[torch.Tensor]:
    """Split a per-position tensor into each trajectory's response-aligned values."""
    return list(values_N[batch.response_N].split([len(t.response_ids) for t in trajs]))


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters live (where its input batches go)."""
    return next(model.parameters()).device


def token_logprobs(model, batch: PackedBatch, temperature: float = 1.0,
                   routes: Routes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of `targets_N` under `model` (temperature-scaled like the sampler),
    and the logits they came from: `(logprobs_N, logits_NV)`. `routes`: the pass's MoE routes
    (`batch_routes`: replayed and compared with the batch's recorded ones)."""
    logits_NV = model(batch.tokens_N.unsqueeze(0), packed=batch.packed, routes=routes)[0].float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
    logprobs_N = logits_NV.log_softmax(-1).gather(-1, batch.targets_N.unsqueeze(-1)).squeeze(-1)
    return logprobs_N, logits_NV
