"""The actor's step in a pipeline layout (`deploy.train_pp` / `train_vpp`): a data-parallel
rank's rows right-padded to `[B, T]` tokens, with the loss's per-token inputs `[B, T, K]` beside
them, which ride through the schedule to the last stage as its target; that stage computes the
loss of each micro-batch from its logits. The loss itself is the actor's (`ActorStage._loss`).

Legend: B rows, b rows per micro-batch, T padded tokens per row, N = b·T tokens, V vocab, K
per-token loss inputs (the columns below).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from rlfusion.model.routes import NO_ROUTE
from rlfusion.parallel.data_parallel import lockstep_shape
from rlfusion.rl.mismatch import MismatchMeter
from rlfusion.rl.trajectory import Trajectory, packed_routes

# columns of the per-token loss inputs (`padded_rows`); STALE: the token was sampled by an older
# policy version than `version` (the mismatch metrics by lag)
TARGET, MASK, ADVANTAGE, BEHAVIOUR, PROXIMAL, STALE, REFERENCE = range(7)


def pipeline_pass(pm: Any, trajs: list[Trajectory], loss: Callable, *, temperature: float, microbatch_tokens: int,
                  dp_group: Any, on_policy: bool | None, num_tokens: int, num_seqs: int, backward: bool,
                  replay: bool = False, meter: MismatchMeter | None = None, version: int = 0
                  ) -> tuple[dict[str, float], float | None]:
    """One schedule pass of the layout `pm` over this data-parallel rank's rows (every stage
    reads the same rows): backward, the gradients of `loss(logprobs_N, logits_NV, proximal_N,
    behaviour_N, advantages_N, mask_N, seq_idx_N, ref_N, num_tokens, num_seqs) -> (loss,
    metrics)` (returns its metrics, token-weighted, and a non-finite loss's value, on the last
    stage); forward only (`backward=False`), the proximal logprobs of multi-step updates, kept
    on the last stage, the one that reads them. Every data-parallel rank pads to the same shape
    and micro-batch count, so their passes' collectives (expert all-to-all, FSDP) pair up.
    `replay`: the stages route by the rows' recorded experts (`algo.routing_replay`); `meter`:
    this pass is the policy before the update, whose gap to the rollout (logprobs on the last
    stage, each stage's routes) it records."""
    tokens_BT, side_BTK, valid_BT, n = padded_rows(trajs, dp_group, pm.config.max_seq_len, pm.layout,
                                                   microbatch_tokens, version)
    routes_BTX = padded_routes(trajs, tokens_BT.shape, dp_group) if replay or meter is not None else None
    device = pm.device
    b, T = tokens_BT.shape[0] // n, tokens_BT.shape[1]
    rows_N = torch.arange(b, device=device).repeat_interleave(T)
    metrics: dict[str, float] = {}
    bad: list[float] = []
    micro = iter(range(n))

    def loss_fn(logits_bTV: torch.Tensor, side_bTK: torch.Tensor) -> torch.Tensor:
        first = next(micro) * b
        logits_NV = logits_bTV.flatten(0, 1).float()
        if temperature != 1.0:
            logits_NV = logits_NV / temperature
        side_NK = side_bTK.flatten(0, 1)
        logprobs_N = logits_NV.log_softmax(-1).gather(-1, side_NK[:, TARGET].long().unsqueeze(-1)).squeeze(-1)
        mask_N = side_NK[:, MASK]
        if not backward:  # the proximal policy's logprobs of each row's response
            if meter is not None:
                meter.add_tokens(logprobs_N, side_NK[:, BEHAVIOUR], mask_N, side_NK[:, STALE].bool())
            for i, t in enumerate(trajs[first:first + b]):  # (observation tokens included: response-aligned)
                start = len(t.prompt_ids) - 1
                t.proximal_logprobs = logprobs_N.view(b, T)[i][start:start + len(t.response_ids)].tolist()
            return logprobs_N.sum() * 0.0
        if meter is not None:
            meter.add_tokens(logprobs_N, side_NK[:, BEHAVIOUR], mask_N, side_NK[:, STALE].bool())
        proximal_N = logprobs_N.detach() if on_policy else side_NK[:, PROXIMAL]
        ref_N = side_NK[:, REFERENCE] if side_NK.shape[1] > REFERENCE else None
        value, m = loss(logprobs_N, logits_NV, proximal_N, side_NK[:, BEHAVIOUR], side_NK[:, ADVANTAGE],
                        mask_N, rows_N, ref_N, num_tokens, num_seqs)
        if not math.isfinite(value.item()):
            bad.append(value.item())
            return value.nan_to_num() * 0.0  # its backward still runs: the stages wait for it
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v * float(mask_N.sum()) / num_tokens
        return value

    for chunk in pm.chunks:
        chunk.observed, chunk.replay = [], replay
    pm.pipeline_pass(tokens_BT.to(device), side_BTK.to(device), loss_fn, n, valid_BT.to(device), backward=backward,
                     routes_BTX=routes_BTX.to(device) if routes_BTX is not None else None)
    if meter is not None:  # each stage compares its own layers' routing (summed over the stages later)
        for chunk in pm.chunks:
            for routes in chunk.observed:
                meter.add_layer_overlap(routes)
    return metrics, (bad[0] if bad else None)


def padded_routes(trajs: list[Trajectory], shape_BT: torch.Size, dp_group: Any) -> torch.Tensor | None:
    """The rows' recorded routes right-padded like their tokens (`[B, T, L * K]`, `NO_ROUTE` on
    padding and on rows without routes); the width agreed over the data-parallel ranks (a rank
    with no rows still passes the same shape); None where no rank has any."""
    packed = packed_routes(trajs)
    width = lockstep_shape(packed.shape[1] if packed is not None else 0, 0, dp_group)[0]
    if not width:
        return None
    B, T = shape_BT
    out = torch.full((B, T, width), NO_ROUTE, dtype=torch.int64)
    start = 0
    for i, t in enumerate(trajs):
        if packed is not None:
            out[i, :t.num_tokens] = packed[start:start + t.num_tokens]
        start += t.num_tokens
    return out


def padded_rows(trajs: list[Trajectory], dp_group: Any, max_seq_len: int, layout: Any, microbatch_tokens: int,
                version: int = 0):
    """This rank's rows right-padded to `[B, T]` tokens and `[B, T, K]` loss inputs (row i's
    position t predicts its token t + 1; the mask is 1 on response targets), and the number
    of micro-batches: `microbatch_tokens` tokens each, a multiple of the pipeline depth
    `layout.pp` and at least what its schedule keeps in flight (`layout.min_microbatches`), the
    same on every data-parallel rank of `dp_group` (the largest shape of any)."""
    rows, longest = lockstep_shape(len(trajs), max((t.num_tokens for t in trajs), default=1), dp_group)
    T = min(-(-longest // 16) * 16, max_seq_len)  # fewer distinct schedule shapes
    per_micro = max(1, microbatch_tokens // T)
    pp = layout.pp
    n = max(-(-max(1, -(-rows // per_micro)) // pp) * pp, layout.min_microbatches)
    B = n * -(-rows // n)
    has_ref = bool(trajs) and all(t.ref_logprobs is not None for t in trajs)
    K = REFERENCE + 1 if has_ref else REFERENCE
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    side_BTK = torch.zeros(B, T, K)
    for i, t in enumerate(trajs):
        ids, P, R = t.prompt_ids + t.response_ids, len(t.prompt_ids), len(t.response_ids)
        tokens_BT[i, :len(ids)] = torch.tensor(ids)
        side_BTK[i, :len(ids) - 1, TARGET] = torch.tensor(ids[1:], dtype=torch.float32)
        span = slice(P - 1, P - 1 + R)
        side_BTK[i, span, MASK] = torch.tensor(t.sampled, dtype=torch.float32)
        side_BTK[i, span, ADVANTAGE] = torch.tensor(t.token_advantages or [t.advantage] * R) * side_BTK[i, span, MASK]
        side_BTK[i, span, BEHAVIOUR] = torch.tensor(t.behaviour_logprobs) * side_BTK[i, span, MASK]
        if t.proximal_logprobs is not None:
            side_BTK[i, span, PROXIMAL] = torch.tensor(t.proximal_logprobs)
        if t.versions:
            side_BTK[i, span, STALE] = (torch.tensor(t.versions) < version).float()
        if has_ref:
            side_BTK[i, span, REFERENCE] = torch.tensor(t.ref_logprobs)
    lengths = torch.tensor([t.num_tokens for t in trajs] + [0] * (B - len(trajs)))
    valid_BT = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return tokens_BT, side_BTK, valid_BT, n
