"""The learner's advantage stage, run by the first train device before each update: the scored
rows' numbers from the queue (never their tokens), KL reward shaping, group-relative (or batch)
advantages, the dynamic-sampling filter, and the kept rows split over the data-parallel ranks,
each row preferably onto the rank whose device already holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlfusion.errors import RunError
from rlfusion.parallel.data_parallel import shard_rows
from rlfusion.parallel.seq_balance import SeqCost
from rlfusion.rl import advantages as adv
from rlfusion.rl.dapo import dynamic_sampling_mask
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.train_config import AlgoConfig


def apply_kl_reward_penalty(trajs: list[Trajectory], algo: AlgoConfig) -> dict[str, float]:
    """Each sample's reward minus `kl_coef` x its summed KL estimate (`kl`, written by the
    reference stage), as in classic RLHF."""
    kl = [t.kl for t in trajs]
    for t, k in zip(trajs, kl):
        t.reward -= algo.kl_coef * k
    return {"kl_seq_mean": sum(kl) / len(kl) if kl else 0.0}


def compute_advantages(trajs: list[Trajectory], algo: AlgoConfig, group_size: int) -> list[Trajectory]:
    """Set `advantage` on every trajectory from the rewards of its group (GRPO, RLOO) or of the
    batch (REINFORCE++); returns the ones to train on (dynamic sampling may drop groups whose
    rewards are all equal: they carry no group-relative signal). GAE's per-token advantages
    need the critic's values: `gae_advantages` computes them where the critic runs."""
    if algo.advantage == "gae":
        return trajs
    rewards_GS = torch.tensor([t.reward for t in trajs]).view(-1, group_size)
    if algo.advantage == "grpo":
        adv_GS = adv.grpo_advantages(rewards_GS, scale_by_std=algo.scale_by_std)
    elif algo.advantage == "rloo":
        adv_GS = adv.rloo_advantages(rewards_GS)
    else:
        adv_GS = adv.reinforce_pp_advantages(rewards_GS.flatten()).view_as(rewards_GS)
    for t, a in zip(trajs, adv_GS.flatten().tolist()):
        t.advantage = a
    if not algo.dynamic_sampling:
        return trajs
    # Filter on the task score, not the shaped reward: KL or overlong penalties make every
    # reward slightly different, which would keep groups that carry no real signal.
    correct_GS = torch.tensor([t.correct for t in trajs]).view(-1, group_size)
    keep_G = dynamic_sampling_mask(correct_GS).tolist()
    return [t for k, t in enumerate(trajs) if keep_G[k // group_size]]


def advantage_stage(queue: Any, cfg: Any, rows: int | list[int], num_ranks: int, cost: SeqCost | None = None,
                    rank_of: Mapping[int, int] | None = None
                    ) -> tuple[list[dataflow.RowNumbers], list[dataflow.RankRows], dict[str, float]]:
    """The advantage stage of one update, on the first train device: the scored rows' numbers
    from the queue — `rows`: a count (the first that many complete groups, a synchronous step's)
    or the row ids (StaleSync's batch) — (reward, score, lengths, KL; never their tokens), KL
    reward shaping if any, advantages, which rows the update keeps, and the kept rows split over
    `num_ranks` data-parallel ranks by tokens, or with `cost` by its a·tokens + b·tokens²
    (`optim.dp_balance=cost`); with `rank_of` (reading device -> data-parallel rank) a row goes
    to the rank that reads it on the device it lives on where the balance allows (`shard_rows`),
    and `split_local_fraction` is the share of the update's tokens read there. Nothing is
    written back: each rank's share carries its rows' advantages and shaped rewards
    (`dataflow.RankRows`), and the split goes to the train devices anyway. Returns the rows (in
    (group, sample) order), each rank's share, and the batch's aggregates (what the controller
    records)."""
    timeout = cfg.deploy.queue_timeout_s
    reads = dataflow.advantage_reads(cfg)
    count = rows if isinstance(rows, int) else len(rows)
    batch = dataflow.read_rows(queue, "advantage", reads, rows, timeout, policy="group")
    if len(batch) != count:
        raise RunError(f"the advantage stage waited {timeout:g} s for {count} scored rows and the queue had "
                       f"{len(batch)} (deploy.queue_timeout_s)")
    rows = dataflow.to_numbers(batch)
    lives_on = dict(zip(batch.row_ids, batch.shards)) if getattr(batch, "shards", None) and rank_of else None
    rows.sort(key=lambda r: (r.group_id, r.sample))
    out: dict[str, float] = {}
    if cfg.algo.kl_coef and cfg.algo.kl_mode == "reward":
        out.update(apply_kl_reward_penalty(rows, cfg.algo))
    failed_groups = {r.group_id for r in rows if r.reward_failed}
    scored = rows if cfg.reward_on_failure == "zero" else [r for r in rows if r.group_id not in failed_groups]
    kept = {id(r) for r in compute_advantages(scored, cfg.algo, cfg.rollout.group_size)} if scored else set()
    for r in rows:
        r.train = id(r) in kept
    train = [r for r in rows if r.train]
    homes = None if lives_on is None else [rank_of.get(lives_on[r.row_id]) for r in train]
    parts = shard_rows([r.num_tokens for r in train], num_ranks, cost, homes)
    split = [dataflow.RankRows.of([train[i] for i in part]) for part in parts]
    if homes is not None:  # the update's tokens its ranks read from their own device
        local = sum(train[i].num_tokens for k, part in enumerate(parts) for i in part if homes[i] == k)
        out["split_local_fraction"] = local / max(1, sum(r.num_tokens for r in train))
    out.update({
        "reward_mean": sum(r.reward for r in rows) / count,
        "correct_mean": sum(r.correct for r in rows) / count,
        "kept_fraction": len(train) / count,
        "response_length_mean": sum(r.response_len for r in rows) / count,
        "response_tokens": sum(r.response_len for r in rows),  # the update's samples, generated in any step
        "response_length_max": max(r.response_len for r in rows),
        "truncated_fraction": sum(r.truncated for r in rows) / count,
        "update_tokens": sum(r.num_tokens for r in train),
        "reward_failures": sum(r.reward_failed for r in rows),  # samples whose user reward failed
        "reward_failed_groups": len(failed_groups),
    })
    return rows, split, out
