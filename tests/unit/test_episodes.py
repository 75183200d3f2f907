"""Multi-turn episodes: the engine continues a kept row with an observation (token in, token out),
the episode runner drives turns and environment calls, observation tokens carry no loss, an
episode paused anywhere resumes to the same tokens, and a misbehaving environment fails only
its episodes."""

import dataclasses

import pytest
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.model.checkpoint import load_base
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.rl.env import import_env
from rlfusion.rl.policy_loss import ppo_policy_loss
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlfusion.rl.trajectory import Trajectory, pack, token_logprobs
from rlfusion.rl.tools.calculator import Calculator, CalculatorEnv
from rlfusion.runtime import dataflow
from rlfusion.engine.episodes import EnvError, EpisodeRunner, segments
from rlfusion.rl.env import EnvConfig
from rlfusion.runtime.train_config import TrainConfig

TOK = CharTokenizer.arithmetic()
STOP = "1"  # `env_fns.ScriptedEnv`'s stop text: the random tiny model writes it most


@pytest.fixture(scope="module")
def model(base):
    m, _, _ = load_base(base)
    return m.eval()


def problems(n, seed=0):
    return ArithmeticTask(ArithmeticConfig()).train_problems(n, seed)


def runner(model, env="env_fns:ScriptedEnv", max_turns=4, timeout_s=5.0, workers=2, limit=0.9, deterministic=False):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=16))
    return EpisodeRunner.build(engine, TOK, EnvConfig(env, max_turns=max_turns, timeout_s=timeout_s, workers=workers),
                               limit, deterministic)


def params(r, max_new=40, temperature=0.0):
    return SamplingParams(temperature=temperature, max_new_tokens=max_new, stop_ids=(TOK.eos_id, *r.stop_ids))


def run_all(r, requests, probs, steps_before_abort=None, keep_cache=False):
    """Episodes to their end; with `steps_before_abort`, paused after that many steps and resumed
    (as a StaleSync rollout resumes its paused samples)."""
    for req, p in zip(requests, probs):
        r.add_request(req, p)
    done, steps = {}, 0
    while r.has_unfinished():
        if steps_before_abort is not None and steps == steps_before_abort:
            paused = r.abort({q.request_id for q in requests} - set(done), keep_cache=keep_cache)
            fields = {c.request_id: r.episode_fields(c.request_id, c.finish_reason != "aborted") for c in paused}
            for c in paused:
                if c.finish_reason != "aborted":
                    done[c.request_id] = c
            for c in paused:
                if c.finish_reason == "aborted":
                    r.add_request(Request.resume(c), probs[int(c.request_id)], fields[c.request_id]["env_reward"])
            steps_before_abort = None
            continue
        for c in r.step():
            done[c.request_id] = c
        steps += 1
    return [done[q.request_id] for q in requests]


def test_an_extended_row_decodes_as_a_fresh_prefill(model):
    """A turn kept its row; its continuation (the same ids plus observation ids) prefills only the
    observation, and the tokens and logprobs after it equal those of a request prefilled whole."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, stop_ids=(TOK.encode(STOP)[0],))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4))
    prompts = [encode_prompt(TOK, p.prompt) for p in problems(3)]
    first = engine.generate([Request(f"{i}", p, greedy, keep_row_after=greedy.stop_ids) for i, p in enumerate(prompts)])
    assert all(c.finish_reason == "stop" for c in first) and len(engine.runner.saved) == 3
    obs = TOK.encode("=42;")
    go_on = dataclass_replace(greedy, stop_ids=())
    engine.take_stats()
    cont = engine.generate([Request(c.request_id, c.prompt_ids, go_on, c.output_ids + obs, c.logprobs + [0.0] * 4,
                                    c.versions + [0] * 4, output_mask=[1] * len(c.output_ids) + [0] * 4)
                            for c in first])
    stats = engine.take_stats()
    assert stats["prefill_passes"] == 0 and stats["extend_tokens"] == 3 * (len(obs) + 1)
    fresh = LLMEngine(model, EngineConfig(max_num_seqs=4)).generate(
        [Request(c.request_id, c.prompt_ids + c.output_ids + obs, dataclass_replace(go_on, max_new_tokens=12 - len(c.output_ids) - 4))
         for c in first])
    for c, f, head in zip(cont, fresh, first):
        n = len(head.output_ids) + 4
        assert c.output_ids[n:] == f.output_ids
        assert torch.allclose(torch.tensor(c.logprobs[n:]), torch.tensor(f.logprobs), atol=1e-5)
        assert c.output_mask == [1] * len(head.output_ids) + [0] * 4 + [1] * len(f.output_ids)


def dataclass_replace(p, **kw):
    import dataclasses
    return dataclasses.replace(p, **kw)


def test_episode_tokens_are_the_sampled_ids_plus_the_observation_ids(model):
    import env_fns

    r = runner(model)
    probs = problems(8)
    try:
        outs = run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r)) for i, p in enumerate(probs)], probs)
        stats = r.take_stats()
    finally:
        r.close()
    turns = 0
    for c in outs:
        runs = segments(c.output_mask)
        turns += len(runs)
        for (a, b), (nxt, _) in zip(runs, runs[1:]):  # each observation is the answer to the turn before it
            action = TOK.decode(c.output_ids[a:b])
            assert c.output_ids[b:nxt] == TOK.encode(env_fns.observation(action))
            assert c.logprobs[b:nxt] == [0.0] * (nxt - b) and set(c.versions[b:nxt]) == {c.versions[b - 1]}
        # the sampled tokens' logprobs are those of one forward over the whole sequence: nothing
        # was re-tokenized and the extended cache rows are right
        t = Trajectory.of_completion(c)
        lp, _ = token_logprobs(model, pack([t]))
        got = lp[pack([t]).loss_mask_N.bool()]
        want = torch.tensor([x for x, m in zip(c.logprobs, c.output_mask) if m])
        assert torch.allclose(got, want, atol=1e-4)
    assert turns > len(outs) and stats["env_calls"] == turns - sum(
        1 for c in outs if c.finish_reason != "stop" or c.output_ids[-1] != TOK.encode(STOP)[0]) or stats["env_calls"] > 0
    assert stats["env_episodes"] == 8 and stats["env_turns"] == turns and stats["env_failures"] == 0


@pytest.mark.parametrize("keep_cache", [False, True])
def test_an_episode_paused_anywhere_resumes_to_the_same_tokens(model, keep_cache):
    probs = problems(4, seed=1)
    r = runner(model, deterministic=True)  # the same batches in both runs, whatever the workers' timing
    try:
        whole = run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r)) for i, p in enumerate(probs)], probs)
        assert max(len(segments(c.output_mask)) for c in whole) >= 3  # several turns to pause between
        for at in (1, 3, 6, 11):  # inside a turn, while a call is pending, after an answer
            again = run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r)) for i, p in enumerate(probs)],
                            probs, steps_before_abort=at, keep_cache=keep_cache)
            for a, b in zip(whole, again):
                assert (a.output_ids, a.output_mask, a.finish_reason) == (b.output_ids, b.output_mask, b.finish_reason)
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    finally:
        r.close()


def test_observation_tokens_get_no_gradient():
    torch.manual_seed(0)
    t = Trajectory(0, None, [1, 4, 5], [6, 7, 8, 9, 10, 11], [-1.0] * 6, [0] * 6, "stop", advantage=1.5,
                   response_mask=[1, 1, 0, 0, 1, 1], ref_logprobs=[-1.2] * 6)
    b = pack([t])
    logits_NV = torch.randn(len(b.tokens_N), 17, requires_grad=True)
    logprobs_N = logits_NV.log_softmax(-1).gather(-1, b.targets_N.unsqueeze(-1)).squeeze(-1)
    loss, _ = ppo_policy_loss(logprobs_N, logprobs_N.detach(), b.behaviour_logprobs_N, b.advantages_N, b.loss_mask_N,
                              b.seq_idx_N, num_tokens=b.num_response_tokens)
    loss.backward()
    # position t predicts token t + 1: positions 4 and 5 predict the observation tokens 8 and 9
    observed = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert b.response_N.sum() == 6 and b.num_response_tokens == 4
    assert torch.all(logits_NV.grad[observed] == 0)
    assert torch.all(logits_NV.grad[b.loss_mask_N.bool()].abs().sum(-1) > 0)


def test_episode_columns_ride_the_queue():
    t = Trajectory(3, None, [1, 4], [6, 7, 8], [-1.0, 0.0, -2.0], [2, 2, 3], "stop", response_mask=[1, 0, 1],
                   env_reward=0.5, env_failed=True)
    cfg = TrainConfig(env=EnvConfig("env_fns:ScriptedEnv"))
    names = dataflow.rollout_writes(cfg, scored=False)
    assert set(dataflow.ENV_COLUMNS) <= set(names) and "response_mask" in dataflow.actor_reads(cfg)
    assert "response_mask" not in dataflow.rollout_writes(TrainConfig(), scored=False)
    cols = dataflow.trajectory_columns([t], names)
    assert cols["response_mask"] == [[1, 0, 1]] and cols["env_failed"] == [1] and cols["env_reward"] == [0.5]


@pytest.mark.parametrize("env, why", [("env_fns:RaisingEnv", "RuntimeError in the environment: the tool broke"),
                                      ("env_fns:SleepingEnv", "did not return within env.timeout_s=1 s"),
                                      ("env_fns:ChattyEnv", "observation of 10000000 characters"),
                                      ("env_fns:ExitingEnv", "worker process exited"),
                                      ("env_fns:GarbageEnv", "reward nan"),
                                      ("env_fns:EmptyEnv", "empty observation")])
def test_a_misbehaving_environment_fails_only_its_episodes(model, env, why):
    probs = problems(8, seed=2)
    faulty = {i for i, p in enumerate(probs) if len(p.prompt) % 2 == 0}
    assert 0 < len(faulty) < len(probs)
    r = runner(model, env=env, timeout_s=1.0)
    try:
        outs = run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r)) for i, p in enumerate(probs)], probs)
        failed = {i for i, c in enumerate(outs) if r.episodes.get(c.request_id) and r.episodes[c.request_id].failed}
        reasons = {i: r.episodes[str(i)].failed for i in failed}
        stats = r.take_stats()
    finally:
        r.close()
    called = {i for i, c in enumerate(outs) if len(segments(c.output_mask)) > 1
              or c.output_ids[-1] == TOK.encode(STOP)[0]}
    assert failed == faulty & called and failed and stats["env_failures"] == len(failed)
    assert all(why in reasons[i] for i in failed)


def test_too_many_failed_episodes_stop_the_run_naming_the_environment(model):
    probs = problems(24, seed=2)
    r = runner(model, env="env_fns:RaisingEnv", limit=0.1)
    try:
        with pytest.raises(EnvError, match=r"env='env_fns:RaisingEnv': \d+ of the last \d+ episodes failed .*"
                                           r"the first: episode \d+ .*RuntimeError"):
            run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r)) for i, p in enumerate(probs)], probs)
    finally:
        r.close()


@pytest.mark.parametrize("spec, msg", [("env_fns", "must be 'module:Class'"),
                                       ("no_such_module:Env", "cannot import module"),
                                       ("env_fns:Missing", "has no class 'Missing'"),
                                       ("env_fns:NoStep", "has no step method")])
def test_bad_env_specs_are_one_line(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        import_env(spec)
    assert "\n" not in str(e.value)


def test_env_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="algo.advantage=gae"):
        TrainConfig(env=EnvConfig("env_fns:ScriptedEnv"), algo=TrainConfig().algo.__class__(advantage="gae"))
    with pytest.raises(ValueError, match="env.max_turns"):
        EnvConfig("a:B", max_turns=0)


def test_the_calculator_adds_and_grades_its_calls():
    env = CalculatorEnv()
    assert CalculatorEnv.stop == ("]",)
    p = ArithmeticTask(ArithmeticConfig()).train_problems(1, 0)[0]
    env.reset(p)
    full = env.step("[" + p.prompt[:-1] + "]")
    assert full.observation == f"={p.answer};" and full.info["tool_call_correct"] == 1.0
    assert env.step("[1+2]").info["tool_call_correct"] == float(p.answer == "3")
    bad = env.step("12+]")
    assert bad.observation == "=;" and bad.info["tool_call_malformed"] == 1.0
    assert Calculator()("7+x") == "" and Calculator()("40+2") == "42"


def test_the_python_environment_runs_calls_in_the_sandbox():
    from rlfusion.rl.tools.tool_env import PythonEnv

    env = PythonEnv()
    assert PythonEnv.stop == ("</tool_call>",)
    env.reset(None)
    step = env.step("I will compute it. <tool_call>print(6 * 7)</tool_call>")
    assert step.observation == "<tool_response>\n42\n</tool_response>" and step.info["tool_call_malformed"] == 0.0
    assert env.step("no call here</tool_call>").info["tool_call_malformed"] == 1.0


def test_stalesync_resumes_episodes_paused_mid_rollout(model):
    """`run_groups` with episodes: a quota ends the rollout early, the paused episodes resume in
    the next with a newer version, and each sample's oldest version is that of a sampled token.
    Each answer is taken at the step after its call (`deterministic`): which episodes the quota
    pauses, and where, does not hang on how fast the environment's workers answer."""
    from rlfusion.runtime.rollout_stage import RolloutStage

    cfg = dataclasses.replace(TrainConfig().rollout, group_size=2, max_new_tokens=40, min_prefill_batch=1)
    stage = RolloutStage(model, TOK, cfg, seed=0, env=EnvConfig("env_fns:ScriptedEnv", workers=2),
                         deterministic=True)
    probs = problems(6, seed=3)
    try:
        first = stage.run_groups([(g, p, []) for g, p in enumerate(probs)], version=0, quota=2, must_finish=set())
        assert first["unfinished"] and all(t.finish_reason == "aborted" for t in first["unfinished"])
        paused = {}
        for t in first["unfinished"]:
            paused.setdefault(t.group_id, []).append(t)
        second = stage.run_groups([(g, probs[g], ts) for g, ts in paused.items()], version=1, quota=99, must_finish=set())
        stats = stage.episodes.take_stats()
    finally:
        stage.episodes.close()
    assert not second["unfinished"] and len(first["finished"]) + len(second["finished"]) >= 2 * len(paused)
    resumed = second["finished"]
    assert any(set(t.versions) == {0, 1} for t in resumed)  # tokens from both policies
    for t in first["finished"] + resumed:
        sampled = [v for v, m in zip(t.versions, t.sampled) if m]
        assert min(t.versions) == min(sampled) and t.response_mask is not None
        # one reward per step the environment answered: each observation's, and the last turn's
        # where its answer did not fit the token budget (the episode ends there, without it)
        answers = len(segments(t.sampled)) - 1 + (t.finish_reason == "length" and t.response_ids[-1] == TOK.encode(STOP)[0])
        assert t.env_reward == 0.25 * answers
    assert stats["env_failures"] == 0


@pytest.mark.parametrize("override, message", [
    ("env=nope:X", "env='nope:X': cannot import module 'nope'"),
    ("env=rlfusion.rl.tools.calculator:CalculatorEnv", "stop text ']' cannot be encoded by the run's tokenizer"),
    ("env.max_turns=0", "env.max_turns=0 is invalid")])
def test_a_bad_env_is_one_line_before_any_device_starts(override, message, capsys, tmp_path):
    from rlfusion.cli import main

    assert main(["train", override, f"out_dir={tmp_path}", "deploy.backend=local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_recorded_routes_cover_every_fed_token_of_an_episode(model):
    """Routes recorded through turns, extends and episodes ended at their budget line up with the
    tokens (what routing replay and the mismatch metrics read)."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=16, record_routes=True))
    r = EpisodeRunner.build(engine, TOK, EnvConfig("env_fns:ScriptedEnv", workers=1), 1.0)
    probs = problems(8, seed=4)
    try:
        outs = [run_all(r, [Request(f"{i}", encode_prompt(TOK, p.prompt), params(r, max_new=n))
                            for i, p in enumerate(probs)], probs) for n in (9, 14)]
    finally:
        r.close()
    trajs = [Trajectory.of_completion(c) for run in outs for c in run]
    assert any(c.finish_reason == "length" and 0 in c.output_mask for run in outs for c in run)
    for t in trajs:
        assert len(t.routes) == t.num_tokens - 1
    batch = pack(trajs)
    assert batch.routes_NX.shape[0] == len(batch.tokens_N)
