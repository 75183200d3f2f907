"""Continuous batching vs static batching on a long-tail rollout of the built-in task.

Workload: held-out-style task prompts; each request generates exactly as many tokens as the
task's reference response (+ EOS), so the response-length distribution is the task's real long
tail (p99/median ~4.5) whatever the model's weights are. Both generators use the same model,
runner and KV cache; only the scheduling differs. Runs are interleaved, repeated, and the median
ratio is reported (the machine is shared and noisy).

    python bench/engine.py            # full run
    python bench/engine.py --quick    # fewer prompts and repetitions
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.static import generate_static
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.model.config import get_preset
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def workload(num_prompts: int, seed: int) -> list[Request]:
    tok = CharTokenizer.arithmetic()
    task = ArithmeticTask(ArithmeticConfig(seed=seed))
    rng = random.Random(seed)
    problems = [task.sample(rng) for _ in range(num_prompts)]
    return [Request(f"r{i}", encode_prompt(tok, p.prompt),
                    SamplingParams(temperature=1.0, max_new_tokens=len(p.solution) + 1))
            for i, p in enumerate(problems)]


def fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_ids), r.params) for r in requests]


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    completions = fn()
    return time.perf_counter() - start, sum(len(c.output_ids) for c in completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    num_prompts, reps = (256, 2) if args.quick else (768, 3)
    batch = 128
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = MoETransformer(get_preset("tiny")).eval()
    requests = workload(num_prompts, seed=0)
    lengths = sorted(r.params.max_new_tokens for r in requests)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    print(f"{num_prompts} prompts, response tokens median {median}, p99 {p99} "
          f"(p99/median {p99 / median:.1f}), batch/max_num_seqs {batch}, {reps} repetitions")

    run_engine = lambda: LLMEngine(model, EngineConfig(max_num_seqs=batch, seed=0)).generate(fresh(requests))
    run_static = lambda: generate_static(model, fresh(requests), batch_size=batch, seed=0)
    timed(lambda: run_engine()[:0] or [])  # warm-up
    ratios = []
    for rep in range(reps):
        t_engine, n_engine = timed(run_engine)
        t_static, n_static = timed(run_static)
        assert n_engine == n_static == sum(lengths), "both must produce the same useful tokens"
        ratios.append((n_engine / t_engine) / (n_static / t_static))
        print(f"rep {rep}: continuous {n_engine / t_engine:8.0f} tok/s   static "
              f"{n_static / t_static:8.0f} tok/s   ratio {ratios[-1]:.2f}")
    print(f"target continuous_vs_static_tokens_per_s: {statistics.median(ratios):.2f} (goal >= 2.0)")


if __name__ == "__main__":
    main()
