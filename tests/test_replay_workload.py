"""The replay workload (`rollout.lengths=replay`): the documented long-tailed length shape, each
response decoded to its drawn length, the same length after an abort and resume, and rewards
that read a response only up to its end token."""

from __future__ import annotations

import random
import statistics

import pytest

from rlfusion.model.checkpoint import find_base, load_checkpoint
from rlfusion.rl.replay import replay_length
from rlfusion.rl.tasks.arithmetic import ArithmeticTask
from rlfusion.runtime.stages import RewardStage, RolloutStage
from rlfusion.runtime.train_config import RolloutConfig, TrainConfig


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
