"""Multi-turn episodes on a rollout engine whose routed experts are split over devices
(`deploy.infer_ep=2`, on the shared 4-rank gloo world): the engines step in lock-step through
turns, environment waits and extend passes (a rank with no episodes, or only waiting ones,
joins every pass empty), and each rank's greedy episodes equal a full replica's."""

import copy

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.fusion.reshard import split_experts
from rlfusion.model.config import get_preset
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlfusion.engine.episodes import EpisodeRunner
from rlfusion.rl.env import EnvConfig

EPISODES_PER_RANK = (3, 2, 1, 0)
TOK = CharTokenizer.arithmetic()


def _episodes(engine: LLMEngine, problems) -> dict[str, tuple]:
    runner = EpisodeRunner.build(engine, TOK, EnvConfig("env_fns:ScriptedEnv", workers=1), 1.0)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_ids=(TOK.eos_id, *runner.stop_ids))
    for i, p in enumerate(problems):
        runner.add_request(Request(f"{i}", encode_prompt(TOK, p.prompt), params), p)
    done = {}
    try:
        while runner.has_unfinished():
            for c in runner.step():
                done[c.request_id] = (c.output_ids, c.output_mask, c.logprobs)
    finally:
        runner.close()
    return done


def ep_episodes() -> dict:
    torch.manual_seed(0)
    model = MoETransformer(get_preset("tiny")).eval()
    rank = torch.distributed.get_rank()
    problems = ArithmeticTask(ArithmeticConfig()).train_problems(EPISODES_PER_RANK[rank], seed=rank)
    out = {"full": _episodes(LLMEngine(model, EngineConfig(max_num_seqs=4)), problems)}
    replica = copy.deepcopy(model)
    mesh = split_experts(replica, ParallelLayout(dp=4, ep=2))
    engine = LLMEngine(replica, EngineConfig(max_num_seqs=4))
    engine.lockstep = mesh.ep.group
    out["ep2"] = _episodes(engine, problems)
    out["stats"] = engine.take_stats()
    return out


WORLD = (ep_episodes, (), 120)


def test_episodes_in_an_ep2_engine_equal_a_full_replicas(world):
    turns = 0
    for rank, out in enumerate(world):
        assert set(out["ep2"]) == set(out["full"]) and len(out["full"]) == EPISODES_PER_RANK[rank]
        for rid, (tokens, mask, logprobs) in out["full"].items():
            got_tokens, got_mask, got_logprobs = out["ep2"][rid]
            assert (got_tokens, got_mask) == (tokens, mask), (rank, rid)
            assert all(abs(a - b) <= 1e-4 for a, b in zip(got_logprobs, logprobs))
            turns += mask.count(0) > 0
    assert turns > 0  # some episodes had an observation to extend
    assert world[3]["stats"]["idle_passes"] > 0 and world[3]["stats"]["decode_rows"] == 0
    assert any(out["stats"]["extend_passes"] for out in world)
