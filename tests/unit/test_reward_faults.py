"""A reward function or reward model that fails (returns a non-number or one out of range, raises,
or hangs past the timeout) fails those samples: reward 0 and a `reward_failed` mark, counted by
the advantage stage. When most recent rewards failed the run ends with one `RewardError` that
names the `reward=` spec and the sample."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

import reward_fns
from rlfusion.errors import RewardError, RunError
from rlfusion.rl.problem import Problem
from rlfusion.rl.rewards import load_reward_fn
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime.reward_stage import RewardStage
from rlfusion.runtime.train_config import AlgoConfig, TrainConfig


class _Tok:
    """The part of the tokenizer contract scoring uses: decode, and the end token a response is
    read up to (none of these responses holds it)."""

    eos_id = 0

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


PROMPTS = ["3+4=", "5+5=", "1+1=", "12+7=", "9+0="]


def _trajs(prompts: list[str] = PROMPTS) -> list[Trajectory]:
    return [Trajectory(group_id=i, problem=Problem(prompt=p, answer="0"), prompt_ids=[1, 2],
                       response_ids=[ord(c) for c in f"answer{i}"], behaviour_logprobs=[0.0] * 7,
                       versions=[0] * 7, finish_reason="stop") for i, p in enumerate(prompts)]


def _stage(spec: str, timeout_s: float | None = 5.0, reward_range=(-math.inf, math.inf), failure_limit=0.5,
           **algo) -> RewardStage:
    return RewardStage(load_reward_fn(spec), _Tok(), AlgoConfig(**algo), 16, name=spec, timeout_s=timeout_s,
                       reward_range=reward_range, failure_limit=failure_limit)


@pytest.mark.parametrize("timeout_s", [None, 5.0])  # inline and on the daemon thread
def test_a_failed_sample_is_recorded_and_the_run_goes_on(timeout_s):
    stage = _stage("reward_fns:none_on_12_plus_7", timeout_s)
    trajs = _trajs()
    stage.score(trajs)  # 1 of 5 failed: not most
    assert [t.reward_failed for t in trajs] == [False, False, False, True, False]
    assert trajs[3].reward == trajs[3].correct == 0.0


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_most_failing_names_spec_sample_and_prompt(timeout_s):
    stage = _stage("reward_fns:none_on_12_plus_7", timeout_s)
    with pytest.raises(RewardError) as info:
        stage.score(_trajs(["12+7="] * 5))
    msg = str(info.value)
    assert "reward='reward_fns:none_on_12_plus_7' returned None for sample 0 of 5" in msg
    assert "'12+7='" in msg and "'answer0'" in msg and "must return a finite number" in msg
    assert "5 of the last 5 samples' rewards failed (more than reward_failure_limit=0.5)" in msg
    assert isinstance(info.value, RunError)  # the CLI prints it as one line, exit 2


def test_the_failure_share_is_over_the_recent_samples():
    stage = _stage("reward_fns:none_on_12_plus_7", failure_limit=0.5)
    for _ in range(20):  # 1 in 5 fails, for 100 samples: never most of the last 64
        stage.score(_trajs())
    assert sum(stage.recent) == 13 and len(stage.recent) == 64
    with pytest.raises(RewardError, match="of the last 64 samples"):
        for _ in range(13):  # every sample fails from here: the window tips past half
            stage.score(_trajs(["12+7="] * 5))


def test_out_of_range_fails_the_sample():
    stage = _stage("reward_fns:length_reward", reward_range=(0.0, 0.5))
    trajs = _trajs()
    stage.score(trajs[:1] * 0 + trajs)  # length_reward is 0 or 1: the 1s are out of range
    expected = [float(len(f"answer{i}") % 3 == 0) for i in range(len(trajs))]
    assert [t.reward_failed for t in trajs] == [e > 0.5 for e in expected]


@pytest.mark.parametrize("spec, shown", [("reward_fns:string_reward", "'1.0'"),
                                         ("reward_fns:nan_reward", "nan")])
def test_non_numbers_and_nan_refused(spec, shown):
    with pytest.raises(RewardError, match=f"returned {shown} for sample 0 of 5"):
        _stage(spec).score(_trajs())


def test_raise_is_attributed_with_cause():
    with pytest.raises(RewardError) as info:
        _stage("reward_fns:divides_by_zero").score(_trajs())
    msg = str(info.value)
    assert msg.startswith("reward='reward_fns:divides_by_zero' raised ZeroDivisionError: division by zero on sample 0")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_hang_times_out_quickly():
    stage = _stage("reward_fns:hangs", timeout_s=0.5)
    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        stage.score(_trajs())
    assert time.perf_counter() - start < 2.0
    msg = str(info.value)
    assert "reward='reward_fns:hangs' did not return within 0.5 s" in msg
    assert "stuck on sample 0" in msg and "raise reward_timeout_s=" in msg


def test_hung_reward_does_not_block_process_exit():
    """The abandoned thread is a daemon: the process that raised exits at once."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import reward_fns\n"
            "from rlfusion.rl.rewards import DaemonCaller, CallTimeout\n"
            "try:\n    DaemonCaller().call(lambda: reward_fns.hangs('', None), 0.2)\n"
            "except CallTimeout:\n    print('timed out')\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[1])],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "timed out", out.stderr
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_fast_function_results_unchanged(timeout_s):
    stage = _stage("reward_fns:length_reward", timeout_s)
    trajs = _trajs()
    for _ in range(3):  # the worker thread is reused between calls
        stage.score(trajs)
        expected = [float(len(f"answer{i}") % 3 == 0) for i in range(len(trajs))]
        assert [t.reward for t in trajs] == expected
        assert [t.correct for t in trajs] == expected
        assert all(type(t.reward) is float for t in trajs)


def test_fast_function_after_a_timeout_gets_a_fresh_thread():
    stage = RewardStage(lambda text, p: 1.0, _Tok(), AlgoConfig(), 16, name="m:f", timeout_s=0.3)
    stage.reward = reward_fns.hangs
    with pytest.raises(RewardError, match="did not return within 0.3 s"):
        stage.score(_trajs())
    stage.reward = lambda text, p: 2
    trajs = _trajs()
    stage.score(trajs)
    assert [t.reward for t in trajs] == [2.0] * len(trajs)


def test_overlong_penalty_still_applied():
    stage = _stage("reward_fns:length_reward", overlong_buffer=4)
    trajs = _trajs()
    stage.score(trajs)
    assert [t.reward for t in trajs] == [t.correct for t in trajs]  # 7 tokens: below 16-4
    long = _trajs()
    for t in long:
        t.response_ids = [ord("a")] * 16
    stage.score(long)
    assert all(math.isclose(t.reward, t.correct - 1.0) for t in long)


def test_reward_model_checks():
    trajs = _trajs()
    _stage("reward_fns:ShortIsGood").score(trajs)
    assert [t.reward for t in trajs] == [0.0] * len(trajs)  # "answerN" is 7 characters
    with pytest.raises(RewardError, match=r"returned 'good' for sample 0 of 5.*score\(\) must return finite numbers"):
        _stage("reward_fns:ReturnsStrings").score(_trajs())
    with pytest.raises(RewardError, match=r"score\(\) returned None; it must return one finite number per sample"):
        _stage("reward_fns:ReturnsNone").score(_trajs())
    with pytest.raises(RewardError, match="reward model returned 1 scores for 5 samples"):
        _stage("reward_fns:ReturnsTooFew").score(_trajs())


def test_task_verifier_runs_inline_and_unnamed_stage_names_the_function():
    stage = RewardStage(reward_fns.nan_reward, _Tok(), AlgoConfig(), 16, name="task", timeout_s=5.0)
    assert stage.caller is None  # trusted: no thread
    with pytest.raises(RewardError, match="reward='task' returned nan"):
        stage.score(_trajs())
    unnamed = RewardStage(reward_fns.nan_reward, _Tok(), AlgoConfig(), 16)
    with pytest.raises(RewardError, match="reward='reward_fns:nan_reward' returned nan"):
        unnamed.score(_trajs())


def test_accepts_numbers_of_other_types():
    np = pytest.importorskip("numpy")
    import torch
    for value in (1, True, np.float32(0.5), torch.tensor(0.25)):
        stage = RewardStage(lambda text, p, v=value: v, _Tok(), AlgoConfig(), 16, name="m:f", timeout_s=5.0)
        trajs = _trajs()
        stage.score(trajs)
        assert trajs[0].reward == float(value) and type(trajs[0].reward) is float


def test_config_timeout_must_be_positive():
    assert TrainConfig().reward_timeout_s == 60.0
    with pytest.raises(ValueError, match="reward_timeout_s"):
        TrainConfig(reward_timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardStage(reward_fns.length_reward, _Tok(), AlgoConfig(), 16, timeout_s=-1)


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_number_too_large_and_sys_exit_are_reward_faults(timeout_s):
    with pytest.raises(RewardError, match="returned a int for sample 0"):
        _stage("reward_fns:huge_int", timeout_s).score(_trajs())
    with pytest.raises(RewardError, match="raised SystemExit: 3 on sample 0"):
        _stage("reward_fns:exits", timeout_s).score(_trajs())


@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_the_advantage_stage_counts_failed_rewards_and_drops_their_groups_on_request(policy):
    from rlfusion.queue.client import DistQueue
    from rlfusion.runtime import dataflow
    from rlfusion.runtime.advantage_stage import advantage_stage

    cfg = TrainConfig(reward_on_failure=policy)
    g = cfg.rollout.group_size
    trajs = []
    for group in range(3):  # group 1 has one failed sample; every group has mixed rewards
        for i in range(g):
            t = _trajs(["1+1="])[0]
            t.group_id, t.sample, t.reward = group, i, float(i % 2)
            t.correct, t.reward_failed = t.reward, group == 1 and i == 0
            trajs.append(t)
    queue = DistQueue(dataflow.queue_config(g))
    queue.put(dataflow.trajectory_columns(trajs, dataflow.ROLLOUT.writes + dataflow.REWARD.writes),
              group_ids=[t.group_id for t in trajs], versions=[0] * len(trajs))
    rows, _, summary = advantage_stage(queue, cfg, len(trajs), 1)
    assert summary["reward_failures"] == 1 and summary["reward_failed_groups"] == 1
    trained = {r.group_id for r in rows if r.train}
    assert trained == ({0, 1, 2} if policy == "zero" else {0, 2})


def test_bad_reward_failure_settings_are_refused():
    with pytest.raises(ValueError, match="reward_on_failure='skip' is invalid: allowed: zero, drop"):
        TrainConfig(reward_on_failure="skip")
    with pytest.raises(ValueError, match="reward_max=0.0 is invalid: must be more than reward_min=1"):
        TrainConfig(reward_min=1.0, reward_max=0.0)
    with pytest.raises(ValueError, match=r"reward_failure_limit=1.0 is invalid: must be in \[0, 1\)"):
        TrainConfig(reward_failure_limit=1.0)


def test_an_error_in_the_task_verifier_stops_at_once_in_one_line():
    stage = RewardStage(reward_fns.divides_by_zero, _Tok(), AlgoConfig(), 16, name="task")
    with pytest.raises(RewardError, match="reward='task' raised ZeroDivisionError: division by zero on sample 0"):
        stage.score(_trajs())
