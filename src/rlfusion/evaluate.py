"""Held-out evaluation: greedy accuracy (and optional pass@k) of a model on a task's problems.

Generation goes through the rollout engine, so evaluation exercises the same path as RL rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlfusion.engine.engine import EngineConfig, LLMEngine, run_to_completion
from rlfusion.engine.scheduler import MAX_NUM_SEQS
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.problem import Problem

RewardFn = Callable[[str, Problem], float]


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # greedy, fraction of problems with reward 1
    num_problems: int
    mean_response_tokens: float
    pass_at_k: float | None = None  # fraction solved by at least one of k samples
    k: int = 0


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


def evaluate(model: MoETransformer, tokenizer: Tokenizer, problems: list[Problem],
             reward_fn: RewardFn, max_new_tokens: int = 200, k: int = 0,
             max_num_seqs: int = MAX_NUM_SEQS, seed: int = 0, env: Any = None) -> EvalResult:
    """`env` (an `EnvConfig` with a name): each problem is a greedy episode with that environment;
    one that fails scores 0. (`k` samples single-turn.)"""
    was_training = model.training
    model.eval()
    max_new = eval_max_new_tokens(tokenizer, problems, max_new_tokens, model.config.max_seq_len)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, seed=seed))
    if env is not None and env.name:
        from rlfusion.engine.episodes import EpisodeRunner

        episodes = EpisodeRunner.build(engine, tokenizer, env, failure_limit=1.0)
        try:
            results = greedy_episodes(episodes, tokenizer, problems, max_new)
        finally:
            episodes.close()
        scored = [(0.0 if failed else reward_fn(tokenizer.decode(c.output_ids), p), len(c.output_ids))
                  for (c, failed), p in zip(results, problems)]
    else:
        completions = greedy_completions(engine, tokenizer, problems, max_new)
        scored = [(reward_fn(tokenizer.decode(c.output_ids), p), len(c.output_ids)) for c, p in zip(completions, problems)]
    pass_k = None
    if k > 0:
        sampled = SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_ids=(tokenizer.eos_id,))
        rewards_k, _ = _score(model, tokenizer, problems, reward_fn, sampled, k, max_num_seqs, seed)
        pass_k = sum(max(rewards_k[i * k:(i + 1) * k]) > 0 for i in range(len(problems))) / len(problems)
    model.train(was_training)
    return summarize(scored, pass_k, k)


def summarize(scored: list[tuple[float, int]], pass_k: float | None = None, k: int = 0) -> EvalResult:
    """An `EvalResult` from each problem's greedy (reward, response length)."""
    return EvalResult(sum(r > 0 for r, _ in scored) / len(scored), len(scored),
                      sum(n for _, n in scored) / len(scored), pass_k, k)


def eval_max_new_tokens(tokenizer: Tokenizer, problems: list[Problem], max_new_tokens: int, max_seq_len: int) -> int:
    """The response budget of an evaluation: `max_new_tokens`, or less where the longest prompt
    leaves less room in the model's context."""
    return min(max_new_tokens, max_seq_len - 1 - max(len(encode_prompt(tokenizer, p.prompt)) for p in problems))


def greedy_completions(engine: Any, tokenizer: Tokenizer, problems: list[Problem], max_new_tokens: int) -> list:
    """One greedy completion per problem from `engine` (its KV cache must be allocated)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_ids=(tokenizer.eos_id,))
    requests = [Request(f"eval/{i}", encode_prompt(tokenizer, p.prompt), greedy) for i, p in enumerate(problems)]
    return run_to_completion(engine, requests)


def greedy_episodes(episodes: Any, tokenizer: Tokenizer, problems: list[Problem], max_new_tokens: int) -> list:
    """One greedy episode per problem (`engine.episodes.EpisodeRunner`): `(completion, failed)`
    each, in problem order; `max_new_tokens` counts the observations too."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_ids=(tokenizer.eos_id, *episodes.stop_ids))
    requests = [Request(f"eval/{i}", encode_prompt(tokenizer, p.prompt), greedy) for i, p in enumerate(problems)]
    for r, p in zip(requests, problems):
        episodes.add_request(r, p, judged=False)  # (an evaluation's failures score 0; they do not stop a run)
    done: dict[str, Any] = {}
    while episodes.has_unfinished():
        for c in episodes.step():
            done[c.request_id] = c
    return [(done[r.request_id], episodes.episode_fields(r.request_id, finished=True)["env_failed"])
            for r in requests]


def _score(model, tokenizer, problems, reward_fn, params, k, max_num_seqs, seed):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, seed=seed))
    requests = [Request(f"{i}/{j}", encode_prompt(tokenizer, p.prompt), params)
                for i, p in enumerate(problems) for j in range(k)]
    completions = engine.generate(requests)
    rewards = [reward_fn(tokenizer.decode(c.output_ids), problems[i // k])
               for i, c in enumerate(completions)]
    return rewards, [len(c.output_ids) for c in completions]
