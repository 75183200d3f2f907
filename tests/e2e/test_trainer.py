"""The RL loop: runs end to end, resumes deterministically, stops cleanly on bad input."""

import json

import pytest
import torch

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.obs.metrics import read_metrics
from rlfusion.runtime.actor import ActorStage, NonFiniteLossError
from rlfusion.rl.kl import kl_estimate
from rlfusion.runtime.dataflow import group_problem
from rlfusion.runtime.advantage_stage import apply_kl_reward_penalty, compute_advantages
from rlfusion.runtime.critic import gae_advantages
from rlfusion.errors import CollapseError
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.run_state import read_state
from rlfusion.runtime.trainer import RLTrainer, resume

TIMING_KEYS = {"time", "rollout_tokens_per_s", "update_tokens_per_s", "engine_decode_gflop_per_s", "time_rollout_s",
               "engine_decode_peak_share", "update_gflop_per_s", "update_peak_share", "device_matmul_peak_gflop_per_s",
               "time_update_s", "time_step_s", "time_queue_s", "time_decode_s", "time_prefill_s",
               "time_stop_sync_s", "time_switch_s", "time_advantage_s", "queue_share",
               # switches since the last step: an evaluation or checkpoint between steps adds one
               "optimizer_offloads", "optimizer_restores"}


def _cfg(base, tmp_path, name, **over) -> TrainConfig:
    items = [f"base={str(base)!r}".replace("'", '"'), f"out_dir=\"{tmp_path}\"", f"run_name={name}",
             "max_steps=4", "checkpoint_every=2", "eval_every=2", "eval_problems=8",
             "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=12",
             "reward=\"reward_fns:length_reward\"", "deterministic=true", "threads=1",
             "collapse_patience=0", "deploy.backend=local"]
    items += [f"{k}={v}" for k, v in over.items()]
    return load_config(TrainConfig, None, items)


def _step_rows(run_dir):
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("utilization")}
            for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r}


def test_resume_after_kill_reproduces_the_uninterrupted_run(base, tmp_path):
    full = RLTrainer(_cfg(base, tmp_path, "full"), tmp_path / "full", base)
    full.run(progress=False)
    part = RLTrainer(_cfg(base, tmp_path, "part"), tmp_path / "part", base)
    real_step = part.train_step

    def killed_during_step_4():
        if part.step == 3:
            raise KeyboardInterrupt  # the process dies after step 3; its checkpoint is step 2
        return real_step()

    part.train_step = killed_during_step_4
    with pytest.raises(KeyboardInterrupt):
        part.run(progress=False)
    resumed = resume(tmp_path / "part")
    assert resumed.step == 2
    resumed.run(progress=False)
    a, b = _step_rows(tmp_path / "full"), _step_rows(tmp_path / "part")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert any(a[s]["kept_fraction"] > 0 for s in a), "the test needs real updates"
    for s in (3, 4):
        assert a[s] == pytest.approx(b[s], rel=1e-6, abs=1e-9), s


def test_run_folder_contents(base, tmp_path):
    trainer = RLTrainer(_cfg(base, tmp_path, "r", max_steps=2), tmp_path / "r", base)
    result = trainer.run(progress=False)
    assert result.steps == 2
    for name in ("metrics.jsonl", "config.json", "checkpoint/model.safetensors",
                 "checkpoint/trainer_state.pt", "final/model.safetensors", "timeline.png"):
        assert (tmp_path / "r" / name).exists(), name
    assert json.loads((tmp_path / "r" / "config.json").read_text())["max_steps"] == 2
    events = json.loads((tmp_path / "r" / "timeline.json").read_text())["traceEvents"]
    # the local backend's one device does what a Ray device does: the switch, and evaluation too
    assert {e["name"] for e in events if e.get("ph") == "X"} == {"rollout", "switch", "reward", "reference", "queue",
                                                                 "advantage", "train", "eval"}
    rows = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "utilization_mean" in r]
    assert len(rows) == 2 and all(0.8 < r["utilization_device0"] <= 1.0 for r in rows), rows
    # after the first update (AdamW's state exists from then on) it goes to host and back every step
    assert all(r["optimizer_offloads"] == r["optimizer_restores"] == 1 for r in rows[1:]), rows


def test_non_finite_loss_stops_and_keeps_last_checkpoint(base, tmp_path, monkeypatch):
    trainer = RLTrainer(_cfg(base, tmp_path, "nan", max_steps=6), tmp_path / "nan", base)
    original = ActorStage._micro_loss

    def poisoned(self, *args):
        loss, m = original(self, *args)
        return (loss * float("nan"), m) if self.version >= 2 else (loss, m)

    monkeypatch.setattr(ActorStage, "_micro_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"its last checkpoint \(step 2\) is in .*--resume"):
        trainer.run(progress=False)
    state = read_state(tmp_path / "nan" / "checkpoint" / "trainer_state.pt")
    assert state["step"] == 2


def test_collapse_guard_stops_a_run_that_only_truncates(base, tmp_path):
    # An untrained model rarely emits EOS within 12 tokens: most responses are truncated.
    trainer = RLTrainer(_cfg(base, tmp_path, "collapse", max_steps=6, collapse_patience=2),
                        tmp_path / "collapse", base)
    with pytest.raises(CollapseError, match="lower optim.lr"):
        trainer.run(progress=False)
    assert trainer.bad_steps == 2 and trainer.step < 6


@pytest.mark.parametrize("override, message", [
    ("nope=1", "unknown config key 'nope'"),
    ("algo.clip_low=2", "algo.clip_low=2"),
    ("rollout.group_size=x", "rollout.group_size"),
    ("algo.advantage=ppo2", "allowed: grpo, rloo, reinforce_pp"),
    ("optim.lr=0.5", "optim.lr=0.5"),
])
def test_bad_config_is_one_clear_line(override, message, capsys, tmp_path):
    assert main(["train", override, f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_existing_run_folder_is_not_overwritten(base, tmp_path, capsys):
    (tmp_path / "taken" / "checkpoint").mkdir(parents=True)
    (tmp_path / "taken" / "checkpoint" / "trainer_state.pt").write_text("")
    (tmp_path / "taken" / "config.json").write_text("{}")
    assert main(["train", f"base={base}", f"out_dir={tmp_path}", "run_name=taken"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "taken" / "config.json").read_text() == "{}"


def test_reward_model_hook_scores_batches(base, tmp_path):
    cfg = _cfg(base, tmp_path, "rm", max_steps=1, reward='"reward_fns:ShortIsGood"')
    trainer = RLTrainer(cfg, tmp_path / "rm", base)
    device = trainer.devices.workers[0]  # the local backend's one device
    problems = [group_problem(trainer.task, cfg.seed, g) for g in range(2)]
    with device.ctx.switch.rollout():
        trajs = device.generator.stage.generate(problems, [0, 1])
    device.scorer.reward.score(trajs)
    texts = [trainer.tokenizer.decode(t.response_ids) for t in trajs]
    assert [t.reward for t in trajs] == [1.0 if len(x) < 6 else 0.0 for x in texts]


def test_bad_reward_spec_is_one_clear_line(base, tmp_path):
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        RLTrainer(_cfg(base, tmp_path, "x", reward='"reward_fns:nope"'), tmp_path / "x", base)


def test_ppo_with_critic_trains_the_value_model(base, tmp_path):
    cfg = _cfg(base, tmp_path, "ppo", max_steps=3, **{"algo.advantage": "gae", "algo.kl_coef": 0, "algo.lam": 1})
    trainer = RLTrainer(cfg, tmp_path / "ppo", base)
    device = trainer.devices.workers[0]
    head_before = device.learner.critic.model.lm_head.weight.clone()
    metrics = [trainer.train_step() for _ in range(3)]
    assert all("value_error" in m for m in metrics)
    assert not torch.equal(head_before, device.learner.critic.model.lm_head.weight)
    with device.ctx.switch.rollout():
        trajs = device.generator.stage.generate([group_problem(trainer.task, cfg.seed, 99)], [99])
    device.scorer.reward.score(trajs)
    device.learner.critic.values(trajs)
    gae_advantages(trajs, cfg.algo)
    for t in trajs:
        assert len(t.token_advantages) == len(t.response_ids) == len(t.returns)
        # gamma = lam = 1: every token's return is the Monte Carlo return, the sequence reward
        assert t.returns == pytest.approx([t.reward] * len(t.response_ids), abs=1e-5)


def _direct_step(trainer: RLTrainer) -> dict[str, float]:
    """Reference: the stages called one after another on shared trajectories, no queue and no
    switch (the device's stage objects, called directly)."""
    cfg, device = trainer.cfg, trainer.devices.workers[0]
    generator, scorer, learner = device.generator, device.scorer, device.learner
    P = cfg.rollout.prompts_per_step
    groups = list(range(trainer.step * P, (trainer.step + 1) * P))
    with device.ctx.switch.rollout():  # (the switch moves state bitwise: nothing it computes changes)
        trajs = generator.stage.generate([group_problem(trainer.task, cfg.seed, g) for g in groups], groups,
                                         trainer.devices.version)
    scorer.reward.score(trajs)
    metrics = {}
    if scorer.reference is not None:
        scorer.reference.logprobs(trajs)
        if cfg.algo.kl_mode == "reward":
            for t in trajs:
                t.kl = float(kl_estimate(torch.tensor(t.behaviour_logprobs), torch.tensor(t.ref_logprobs),
                                                    cfg.algo.kl_kind).sum())
            metrics.update(apply_kl_reward_penalty(trajs, cfg.algo))
    kept = compute_advantages(trajs, cfg.algo, cfg.rollout.group_size)
    if learner.critic is not None:
        device.ctx.switch.enter_train()
        learner.critic.values(trajs)
        gae_advantages(trajs, cfg.algo)
        metrics.update(learner.critic.update(trajs))
    device.ctx.switch.enter_train()
    if kept:
        metrics.update(learner.actor.update(kept))
    else:
        learner.actor.skip_update()
    trainer.devices.version += 1
    trainer.step += 1
    metrics["reward_mean"] = sum(t.reward for t in trajs) / len(trajs)
    metrics["kept_fraction"] = len(kept) / len(trajs)
    return metrics


@pytest.mark.parametrize("over", [{}, {"algo.kl_mode": "reward"}, {"algo.advantage": "gae"},
                                  {"algo.ppo_epochs": 2, "algo.dynamic_sampling": "false"}])
def test_queue_dataflow_equals_direct_stage_calls(base, tmp_path, over):
    """Routing the stages through DistQueue changes nothing they compute."""
    cfg = _cfg(base, tmp_path, "q", **over)
    via_queue, direct = (RLTrainer(cfg, tmp_path / name, base) for name in ("a", "b"))
    for _ in range(2):
        torch.manual_seed(1)
        got = via_queue.train_step()
        torch.manual_seed(1)
        want = _direct_step(direct)
        assert {k: got[k] for k in want} == want and got["kept_fraction"] > 0
    assert len(via_queue.devices.queue) == 0  # every row retired after the update
    via_queue.sync_model()
    direct.sync_model()
    for (k, a), b in zip(via_queue.model.state_dict().items(), direct.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert via_queue.version == 2 and any(  # the updates did change the weights
        not torch.equal(p, q) for p, q in zip(via_queue.model.parameters(), RLTrainer(cfg, tmp_path / "c", base).model.parameters()))


@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_a_run_whose_reward_sometimes_fails_goes_on_and_counts_the_failures(base, tmp_path, policy):
    cfg = _cfg(base, tmp_path, f"flaky-{policy}", max_steps=3, reward='"reward_fns:fails_on_every_fourth"',
               reward_failure_limit=0.9, reward_on_failure=policy)
    trainer = RLTrainer(cfg, tmp_path / f"flaky-{policy}", base)
    metrics = [trainer.train_step() for _ in range(3)]
    assert all("reward_failures" in m for m in metrics)
    assert sum(m["reward_failures"] for m in metrics) > 0  # some of the 24 responses have a length divisible by 4
    if policy == "drop":
        assert all(m["kept_fraction"] <= 1 - m["reward_failed_groups"] / cfg.rollout.prompts_per_step for m in metrics)
