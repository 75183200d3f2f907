"""The dataflow's table (`runtime/dataflow.py`): in every configuration, a column goes into the
queue only when a stage of that run reads it, and every column a stage reads is written first."""

from __future__ import annotations

import pytest

from rlfusion.config import load_config
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.train_config import TrainConfig


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
@pytest.mark.parametrize("kl", ["algo.kl_coef=0", "algo.kl_mode=loss", "algo.kl_mode=reward"])
@pytest.mark.parametrize("scored_on_device", [True, False])
@pytest.mark.parametrize("routes", ["algo.routing_replay=none", "algo.routing_replay=rollout"])
def test_a_column_is_written_only_when_a_stage_reads_it(advantage, kl, scored_on_device, routes):
    cfg = load_config(TrainConfig, None, [f"algo.advantage={advantage}", kl, routes])
    reference = bool(cfg.algo.kl_coef)
    written = set(dataflow.rollout_writes(cfg, scored_on_device)) | set(dataflow.REWARD.writes)
    written |= set(dataflow.reference_writes(cfg)) if reference else set()
    read = set(dataflow.advantage_reads(cfg)) | set(dataflow.actor_reads(cfg))
    if not scored_on_device:  # the scorers read the rows from the queue
        read |= set(dataflow.REWARD.reads) | (set(dataflow.REFERENCE.reads) if reference else set())
    assert read <= written
    # the advantage stage's results ride its split, never the queue
    assert not dataflow.ADVANTAGE.writes and {"advantage", "shaped_reward", "train"}.isdisjoint(
        c.name for c in dataflow.TRAJECTORY_COLUMNS)
    # what is left unread is the finished sample's record: why it ended (the handover of paused
    # samples reads it; the update reads each token's policy version, for the mismatch by lag)
    assert written - read == {"finish_reason"}
    assert ("routes" in written) == (cfg.algo.routing_replay == "rollout")


@pytest.mark.parametrize("kl", ["algo.kl_coef=0", "algo.kl_mode=loss", "algo.kl_mode=reward"])
@pytest.mark.parametrize("scored_on_device", [True, False])
def test_episode_columns_are_written_only_when_read(kl, scored_on_device):
    """With an environment: the mask goes in for the actor (and the reference's summed KL), the
    environment's outcome only when the rows go in unscored (the reward stage reads it then)."""
    cfg = load_config(TrainConfig, None, [kl, 'env.name="env_fns:ScriptedEnv"'])
    reference = bool(cfg.algo.kl_coef)
    written = set(dataflow.rollout_writes(cfg, scored_on_device)) | set(dataflow.REWARD.writes)
    written |= set(dataflow.reference_writes(cfg)) if reference else set()
    read = set(dataflow.advantage_reads(cfg)) | set(dataflow.actor_reads(cfg))
    if not scored_on_device:
        read |= set(dataflow.reward_reads(cfg)) | (set(dataflow.reference_reads(cfg)) if reference else set())
    assert read <= written and written - read == {"finish_reason"}
    assert "response_mask" in written and ({"env_reward", "env_failed"} <= written) == (not scored_on_device)


def test_the_split_carries_each_rows_advantage_and_shaped_reward():
    rows = [dataflow.RowNumbers(row_id=7 + i, group_id=0, sample=i, reward=0.5 * i, correct=0.0, num_tokens=3,
                                response_len=1, truncated=False, advantage=-1.0 + i) for i in range(3)]
    part = dataflow.RankRows.of([rows[2], rows[0]])
    assert part.row_ids == [9, 7]
    trajs = [Trajectory(0, None, [1], [2], [0.0], [0], "stop", row_id=r) for r in (7, 9)]
    part.fill(trajs)
    assert [(t.advantage, t.reward) for t in trajs] == [(-1.0, 0.0), (1.0, 1.0)]
