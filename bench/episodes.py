"""Multi-turn episodes: how much of the environment's time the engine decodes through, and what
turns cost against single-turn responses of the same lengths.

A 3-turn workload: the shipped `tiny` base samples episodes (temperature 1) of 3-term problems
of the built-in task, where every `=` of its scratchpad calls a calculator that answers the
running sum after a 20 ms delay (`StepSumEnv`, below: a tool as slow as a remote sandbox or a
search call). A response `17+5=22;22+23=45;#45` is three turns: `17+5=` (call, observation
`22;`), `22+23=` (call, observation `45;`), `#45` (the answer). 128 episodes at once on one engine
(`engine/episodes.EpisodeRunner`, 32 environment workers), at most 3 turns each.

    env_time_hidden_share    of the time an environment call was in flight, the share the engine
                             spent decoding other rows (the rest it waited with nothing to run)
    episodes_vs_single_turn  sampled tokens/s of the episodes against single-turn responses of
                             exactly the same sampled lengths (forced), same prompts, same engine:
                             what the turns cost (each answer is an extend pass, each call a wait)

Repetitions alternate the two workloads; medians are reported.

    python bench/episodes.py           # 5 repetitions of 128 episodes
    python bench/episodes.py --quick   # 2 repetitions
    python bench/episodes.py --smoke   # 8 episodes, 1 repetition (a test runs it)
"""

from __future__ import annotations

import time

from rlfusion.rl.env import EnvStep
from rlfusion.rl.tools.calculator import Calculator

DELAY_S = 0.02
TERMS = 3  # so an episode that follows the scratchpad format is exactly 3 turns
# environment processes: each answers one call at a time, so 128 episodes of 20 ms calls need
# tens of them (env.workers); 4 would cap the workload at 200 calls/s (tokens/s ratio 0.13)
WORKERS = 32


class StepSumEnv:
    """Each `=` of the scratchpad is a call: the sum before it (`22+23`, the text since the last
    `;`), answered as `45;` after `DELAY_S` seconds. (This module is what the environment workers
    import: the bench's own imports wait inside `main`, so a worker starts quickly.)"""

    stop = ("=",)

    def reset(self, problem) -> None:
        self.calculator = Calculator()

    def step(self, action: str) -> EnvStep:
        time.sleep(DELAY_S)
        return EnvStep(self.calculator(action[:-1].rsplit(";", 1)[-1]) + ";")


def main() -> None:
    import argparse
    import dataclasses
    import random
    import statistics

    import torch

    from rlfusion.engine.engine import EngineConfig, LLMEngine
    from rlfusion.engine.types import Request, SamplingParams
    from rlfusion.evaluate import encode_prompt
    from rlfusion.model.checkpoint import load_base, resolve_base
    from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
    from rlfusion.engine.episodes import EpisodeRunner
    from rlfusion.rl.env import EnvConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        print("smoke run: sizes too small for the figures to mean anything")
    n, reps = (8, 1) if args.smoke else (128, 2 if args.quick else 5)
    torch.set_num_threads(2)
    model, tokenizer, _ = load_base(resolve_base("tiny"))
    model.eval()
    task = ArithmeticTask(ArithmeticConfig(min_terms=TERMS, max_terms=TERMS))
    env = EnvConfig(f"{__name__ if __name__ != '__main__' else 'episodes'}:StepSumEnv", max_turns=3, workers=min(WORKERS, n))

    def episodes(seed: int):
        problems = [task.sample(random.Random(f"{seed}/{i}")) for i in range(n)]
        runner = EpisodeRunner.build(LLMEngine(model, EngineConfig(max_num_seqs=128, seed=seed)), tokenizer, env, 1.0)
        params = SamplingParams(temperature=1.0, max_new_tokens=120, stop_ids=(tokenizer.eos_id, *runner.stop_ids))
        for i, p in enumerate(problems):
            runner.add_request(Request(f"{i}", encode_prompt(tokenizer, p.prompt), params), p)
        runner.step()  # (the workers start on the first calls; a warm pool is what a run has)
        t0, done = time.perf_counter(), []
        while runner.has_unfinished():
            done += runner.step()
        seconds = time.perf_counter() - t0
        stats = runner.take_stats()
        runner.close()
        return problems, done, seconds, stats

    def single_turn(problems, done, seed: int) -> float:
        """The same prompts, each forced to its episode's sampled length, in one go."""
        lengths = {c.request_id: sum(c.output_mask) for c in done}
        engine = LLMEngine(model, EngineConfig(max_num_seqs=128, seed=seed))
        base = SamplingParams(temperature=1.0, max_new_tokens=1, stop_ids=())
        requests = [Request(f"{i}", encode_prompt(tokenizer, p.prompt),
                            dataclasses.replace(base, max_new_tokens=max(lengths[f"{i}"], 1)))
                    for i, p in enumerate(problems)]
        t0 = time.perf_counter()
        engine.generate(requests)
        return time.perf_counter() - t0

    shares, ratios, turns, calls = [], [], [], []
    for rep in range(reps):
        problems, done, ep_s, stats = episodes(rep)
        st_s = single_turn(problems, done, rep)
        tokens = sum(sum(c.output_mask) for c in done)
        flight = stats["env_hidden_s"] + stats["env_exposed_s"]
        shares.append(stats["env_hidden_s"] / flight if flight else 1.0)
        ratios.append((tokens / ep_s) / (tokens / st_s))
        turns.append(stats["env_turns"] / stats["env_episodes"])
        calls.append(stats["env_calls"])
        print(f"rep {rep}: {n} episodes, {turns[-1]:.2f} turns each, {stats['env_calls']:.0f} calls of "
              f"{DELAY_S * 1000:.0f} ms, {tokens} sampled tokens: episodes {ep_s:.2f} s ({tokens / ep_s:,.0f} tok/s), "
              f"single-turn {st_s:.2f} s ({tokens / st_s:,.0f} tok/s); in flight {flight:.2f} s, "
              f"hidden {stats['env_hidden_s']:.2f} s, exposed {stats['env_exposed_s']:.2f} s")
    print(f"turns per episode {statistics.median(turns):.2f}, calls per repetition {statistics.median(calls):.0f}, "
          f"{WORKERS} environment workers (at most {WORKERS / DELAY_S:.0f} calls/s)")
    print(f"episodes_vs_single_turn_tokens_per_s: {statistics.median(ratios):.2f} (reported; equal sampled tokens)")
    print(f"target env_time_hidden_share: {statistics.median(shares):.2f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
