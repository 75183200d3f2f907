"""The replay workload (`rollout.lengths=replay`): the documented long-tailed length shape, each
response decoded to its drawn length, the same length after an abort and resume, and rewards
that read a response only up to its end token."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
import torch

from rlfusion.config import load_config
from rlfusion.model.checkpoint import find_base, load_base, load_checkpoint
from rlfusion.rl.replay import replay_length
from rlfusion.rl.tasks.arithmetic import ArithmeticTask
from rlfusion.runtime.reward_stage import RewardStage
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.train_config import RolloutConfig, TrainConfig
from rlfusion.runtime.trainer import RLTrainer


def test_replay_lengths_have_the_documented_long_tail():
    """Defaults scaled to the tiny model: median 50, cap 200 = p99, ~10% at the cap, most of
    the variance between prompt groups."""
    groups = [[replay_length(g, s, 50.0, 1.08, 0.9, 200) for s in range(8)] for g in range(2000)]
    flat = sorted(x for group in groups for x in group)
    median = statistics.median(flat)
    assert 45 <= median <= 55
    assert flat[int(0.99 * len(flat))] >= 4 * median
    assert 0.06 <= sum(x == 200 for x in flat) / len(flat) <= 0.14
    within = statistics.mean(statistics.pvariance(group) for group in groups)
    assert 1 - within / statistics.pvariance(flat) >= 0.8
    assert replay_length(17, 3, 50.0, 1.08, 0.9, 200) == replay_length(17, 3, 50.0, 1.08, 0.9, 200)


def _stage(cap: int = 48, median: float = 12.0) -> tuple[RolloutStage, ArithmeticTask, RolloutConfig]:
    model, tokenizer, _ = load_checkpoint(find_base())
    cfg = RolloutConfig(group_size=4, max_new_tokens=cap, lengths="replay", replay_median=median, max_num_seqs=8)
    return RolloutStage(model, tokenizer, cfg, seed=0), ArithmeticTask(TrainConfig().task), cfg


def _drawn(cfg: RolloutConfig, group: int, sample: int) -> int:
    return replay_length(group, sample, cfg.replay_median, cfg.replay_sigma, cfg.replay_between, cfg.max_new_tokens)


def test_replayed_responses_decode_to_their_drawn_length():
    stage, task, cfg = _stage()
    rng = random.Random(0)
    trajs = stage.generate([task.sample(rng) for _ in range(2)], [5, 6], 0)
    for t in trajs:
        want = _drawn(cfg, t.group_id, t.sample)
        assert len(t.response_ids) == want
        assert t.finish_reason == ("length" if want == cfg.max_new_tokens else "stop")


def test_an_aborted_replayed_response_resumes_to_the_same_length():
    stage, task, cfg = _stage()
    # a short group and a long one: the rollout stops once the short one has finished
    by_len = sorted(range(200), key=lambda g: max(_drawn(cfg, g, s) for s in range(4)))
    short = by_len[0]
    long_ = next(g for g in reversed(by_len) if min(_drawn(cfg, g, s) for s in range(4)) > 2 * max(
        _drawn(cfg, short, s) for s in range(4)))
    rng = random.Random(1)
    problems = {short: task.sample(rng), long_: task.sample(rng)}
    out = stage.run_groups([(g, p, []) for g, p in problems.items()], 0, quota=1, must_finish=set())
    partial = [t for t in out["unfinished"] if t.group_id == long_]
    assert partial and all(0 < len(t.response_ids) < _drawn(cfg, long_, t.sample) for t in partial)
    again = stage.run_groups([(long_, problems[long_], partial)], 1, quota=1, must_finish={long_})
    assert sorted((t.sample, len(t.response_ids)) for t in again["finished"]) == [
        (s, _drawn(cfg, long_, s)) for s in range(4)]


def test_a_reward_reads_the_response_up_to_its_end_token():
    stage, task, _ = _stage()
    tok = stage.tokenizer
    problem = task.sample(random.Random(2))
    right = tok.encode(task.solve(problem.prompt))
    reward = RewardStage(task.reward, tok, TrainConfig().algo, 48)
    trajs = stage.generate([problem], [9], 0)[:2]
    trajs[0].response_ids = right + [tok.eos_id] + tok.encode("1+1=2;#7")  # decoded on past the end
    trajs[1].response_ids = right
    reward.score(trajs)
    assert [t.reward for t in trajs] == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("over, match", [
    ({"lengths": "long"}, "rollout.lengths='long' is invalid: allowed: natural, replay"),
    ({"lengths": "replay", "replay_median": 200.0}, "rollout.replay_median=200.0 is invalid: must be >= 1 and, with rollout.lengths=replay, below"),
    ({"replay_between": 1.5}, "rollout.replay_between=1.5 is invalid: must be in \\[0, 1\\]"),
])
def test_bad_replay_settings_are_one_line_errors(over, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**over)


REPLAY_TOML = Path(__file__).resolve().parents[2] / "configs" / "replay.toml"


def test_the_shipped_replay_workload_has_the_published_shape():
    """configs/replay.toml: median 150, cap 1,000, 5-15% at the cap, p99/median in 3-10 (p99 is
    the cap), most of the variance between prompt groups; it fits the context it asks for."""
    cfg = load_config(TrainConfig, REPLAY_TOML)
    r = cfg.rollout
    assert r.lengths == "replay" and cfg.algo.kl_coef == 0.0 and cfg.context_len > r.max_new_tokens
    groups = [[replay_length(g, s, r.replay_median, r.replay_sigma, r.replay_between, r.max_new_tokens)
               for s in range(r.group_size)] for g in range(2000)]
    flat = sorted(x for group in groups for x in group)
    median = statistics.median(flat)
    assert 140 <= median <= 160
    assert 0.05 <= sum(x == r.max_new_tokens for x in flat) / len(flat) <= 0.15
    assert 3 <= flat[int(0.99 * len(flat))] / median <= 10
    within = statistics.mean(statistics.pvariance(group) for group in groups)
    assert 1 - within / statistics.pvariance(flat) >= 0.7


def test_context_len_loads_the_same_weights_at_a_longer_context():
    """Rotary positions are derived, not stored: at 1,280 positions the base computes the same
    logits over its first 256 and generates past them."""
    short, tokenizer, _ = load_checkpoint(find_base())
    long_, _, _ = load_base(find_base(), max_seq_len=1280)
    assert long_.config.max_seq_len == 1280 and short.config.max_seq_len == 256
    ids = torch.randint(0, tokenizer.vocab_size, (2, 200))
    with torch.no_grad():
        assert torch.equal(short(ids), long_(ids))
    cfg = RolloutConfig(group_size=2, max_new_tokens=400, lengths="replay", replay_median=390.0,
                        replay_sigma=0.01, max_num_seqs=4)
    trajs = RolloutStage(long_, tokenizer, cfg, 0).generate([ArithmeticTask(TrainConfig().task).sample(
        random.Random(3))], [0], 0)
    lengths = [len(t.response_ids) for t in trajs]
    assert lengths == [_drawn(cfg, 0, s) for s in range(2)] and min(lengths) > 256  # past the base's positions


def test_a_cap_the_context_cannot_hold_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="context_len=300 is invalid: must be 0 .* more than rollout.max_new_tokens=400"):
        load_config(TrainConfig, None, ["rollout.max_new_tokens=400", "context_len=300"])
    cfg = load_config(TrainConfig, None, ["rollout.max_new_tokens=400", "deploy.backend=local",
                                          f"out_dir=\"{tmp_path}\""])
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=400 leaves no room for a prompt in the model's "
                                         r"context of 256 tokens .* set context_len > 400"):
        RLTrainer(cfg, tmp_path / "run", find_base())
    assert not (tmp_path / "run").exists()
