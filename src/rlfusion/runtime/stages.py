"""The RL stages, one module per stage, grouped by the role that runs them:

    problems ─► RolloutStage ─► trajectories ─► RewardStage ─► ReferenceStage ─► advantages ─► ActorStage
                (engine, policy vN)             (.reward)      (.ref_logprobs)   (.advantage)   (update → vN+1)

    generator  rollout_stage.py    RolloutStage: synchronous rollout, StaleSync's partial rollout
    scorer     reward_stage.py     RewardStage and its fault policy
               reference_stage.py  ReferenceStage, the summed KL estimate
    learner    advantage_stage.py  KL shaping, advantages, dynamic sampling, the data-parallel split
               critic.py           CriticStage, GAE
               actor.py            ActorStage

Each stage reads and writes `Trajectory` fields (or the advantage stage's `RowNumbers`) only;
none knows how it is placed or scheduled. What is left here is the run's stop on collapse,
which the trainer raises.
"""

from __future__ import annotations

from rlfusion.errors import RunError


class CollapseError(RunError):
    """Rewards stayed at 0 or responses ran to the length limit for too long."""
