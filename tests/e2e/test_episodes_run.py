"""`rlfusion train` with an environment: episodes run through StaleSync's partial rollouts and the
queue, the step reports what they did, and a run killed with episodes paused mid-rollout resumes
from its checkpoint to the same steps as the uninterrupted run (the environments rebuilt by
replaying the paused episodes' actions)."""

import pytest

from rlfusion.config import load_config
from rlfusion.obs.metrics import read_metrics
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer, resume

# wall-clock figures (they differ between any two runs)
TIMING = ("time", "utilization", "queue_share", "env_hidden_share", "device_matmul_peak", "engine_decode_gflop",
          "engine_decode_peak", "update_gflop", "update_peak", "rollout_tokens_per_s", "update_tokens_per_s",
          "optimizer_offloads", "optimizer_restores")


def _cfg(base, tmp_path, name):
    items = [f'base="{base}"', f'out_dir="{tmp_path}"', f"run_name={name}", "max_steps=4", "checkpoint_every=2",
             "eval_every=2", "eval_problems=6", "rollout.prompts_per_step=3", "rollout.group_size=2",
             "rollout.max_new_tokens=16", "deterministic=true", "threads=1", "collapse_patience=0",
             "deploy.backend=local", "stalesync.enabled=true", "stalesync.max_staleness=1",
             "stalesync.rollout_finish_threshold=0.5", 'env.name="env_fns:ScriptedEnv"', "env.workers=1",
             'reward="reward_fns:length_reward"']
    return load_config(TrainConfig, None, items)


def _rows(run_dir):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)}
            for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r}


def test_an_episode_run_reports_its_episodes_and_resumes_to_the_same_steps(base, tmp_path):
    full = RLTrainer(_cfg(base, tmp_path, "full"), tmp_path / "full", base)
    full.run(progress=False)
    part = RLTrainer(_cfg(base, tmp_path, "part"), tmp_path / "part", base)
    real_step = part.train_step

    def killed_during_step_4():
        if part.step == 3:
            raise KeyboardInterrupt
        return real_step()

    part.train_step = killed_during_step_4
    with pytest.raises(KeyboardInterrupt):
        part.run(progress=False)
    resumed = resume(tmp_path / "part")
    assert resumed.step == 2
    resumed.run(progress=False)
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "part")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        assert a[s]["env_episodes"] > 0 and a[s]["env_turns_per_episode"] > 1 and a[s]["env_failures"] == 0
        assert a[s]["staleness_max"] <= 1
    assert any(a[s]["env_calls"] > 0 for s in a)
    for s in (3, 4):
        assert a[s] == pytest.approx(b[s], rel=1e-6, abs=1e-9), s
