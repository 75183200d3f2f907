"""Continuous batching vs static batching on a long-tail rollout of the built-in task, and how
much of a decode step, a prefill pass and an update is compute.

Workload: held-out-style task prompts; each request generates exactly as many tokens as the
task's reference response (+ EOS), so the response-length distribution is the task's real long
tail (p99/median ~4.5) whatever the model's weights are. Both generators use the same model,
runner and KV cache; only the scheduling differs. Runs are interleaved, repeated, and the median
ratio is reported (the machine is shared and noisy).

Kernel efficiency (1 thread, the shipped base): for decode steps at 1, 8, 32 and 128 rows (each
row from a context of 40 positions on: a task prompt and its first generated tokens; the
table prints the mean context measured), a packed prefill of
32 prompts and one update (`ActorStage.update` on 64 task-shaped samples), the useful FLOP/s
(`rlfusion.model.flops.forward_flops`; an update is 3x its forward) against a 512 x 512 matmul's
rate on the same thread (`rlfusion.obs.peak.matmul_peak_flops`), and the host-bound share: wall
time not inside a compute kernel
(`rlfusion.measure.kernels.host_bound_share`: the profiler's per-operator self time of the
operators that touch tensor data, less the dispatch floor each call pays, against the
unprofiled wall time). A decode step is the
engine's whole `step()`: scheduling, the forward, sampling and the token bookkeeping.

    python bench/engine.py            # full run
    python bench/engine.py --quick    # fewer prompts and repetitions
    python bench/engine.py --smoke    # every section at the smallest sizes (a test runs it)
    python bench/engine.py --kernels-only
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.measure.calibrate import synthetic_trajectories, task_prompts
from rlfusion.measure.kernels import dispatch_floor_s, host_bound_share
from rlfusion.model.checkpoint import find_base, load_checkpoint
from rlfusion.model.flops import causal_positions, forward_flops
from rlfusion.obs.peak import matmul_peak_flops
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig
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


DECODE_ROWS = (1, 8, 32, 128)
DECODE_CONTEXT = 40  # positions each decode row attends to when its measurement starts
ROUNDS = 3  # host_bound_share's rounds: each runs `repeats` + 1 steps unprofiled and `repeats` profiled


def decode_engine(model, tokenizer, rows: int) -> LLMEngine:
    """An engine with `rows` task prompts running, decoded on until they hold `DECODE_CONTEXT`
    positions on average (no stop token, so none finishes while measured)."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=rows, seed=0))
    prompts = task_prompts(tokenizer, rows)
    # every row decodes to the end of the model's context, so none finishes while measured
    params = SamplingParams(temperature=1.0, max_new_tokens=model.config.max_seq_len - max(map(len, prompts)))
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), params))
    engine.step()  # prefill
    while engine.take_stats()["decode_passes"] == 0 or \
            statistics.mean(s.num_cached for s in engine.scheduler.running) < DECODE_CONTEXT:
        engine.step()
    return engine


def kernel_rows(repeats: int, rounds: int = ROUNDS) -> list[tuple[str, float, float, float]]:
    """(pass, useful GFLOP/s, share of the matmul peak, host-bound share) per measured pass (a
    decode pass's name gives its rows and mean context)."""
    model, tokenizer, _ = load_checkpoint(find_base())
    model.eval()
    cfg = model.config
    peak, floor = matmul_peak_flops(), dispatch_floor_s()
    out = []
    for rows in DECODE_ROWS:
        engine = decode_engine(model, tokenizer, rows)
        engine.take_stats()
        share, wall, _ = host_bound_share(engine.step, repeats, floor, rounds=rounds)
        st = engine.take_stats()  # the warm-up, timed and profiled steps
        if st["decode_rows"] != rows * st["decode_passes"]:
            raise RuntimeError(f"decode b{rows}: rows finished while measured ({st['decode_rows']} rows over "
                               f"{st['decode_passes']} passes); fewer repeats than {repeats} fit the context")
        flops = forward_flops(cfg, st["decode_rows"], st["decode_context"]) / st["decode_passes"]
        context = st["decode_context"] / st["decode_rows"]
        out.append((f"decode b{rows} (context {context:.0f})", flops / wall / 1e9, flops / wall / peak, share))
    prompts = task_prompts(tokenizer, 32, seed=1)

    def prefill():
        engine = LLMEngine(model, EngineConfig(max_num_seqs=32, seed=0))
        for i, ids in enumerate(prompts):
            engine.add_request(Request(f"p{i}", list(ids), SamplingParams(temperature=1.0, max_new_tokens=1)))
        engine.step()
    flops = forward_flops(cfg, sum(map(len, prompts)), causal_positions([len(p) for p in prompts]))
    share, wall, _ = host_bound_share(prefill, repeats, floor, rounds=rounds)
    out.append(("prefill 32 prompts", flops / wall / 1e9, flops / wall / peak, share))
    trajs = synthetic_trajectories(tokenizer, 64, cfg.vocab_size, seed=0)
    actor = ActorStage(model, AlgoConfig(), OptimConfig(), 1.0)
    model.train()
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    flops = 3 * forward_flops(cfg, sum(lengths), causal_positions(lengths))
    # an update takes longer than a decode step: a quarter of the repeats, at least 3 (smoke: 1)
    update_repeats = min(repeats, max(3, repeats // 4))
    share, wall, _ = host_bound_share(lambda: actor.update(trajs), update_repeats, floor, rounds=rounds)
    out.append(("update 64 samples", flops / wall / 1e9, flops / wall / peak, share))
    print(f"matmul peak (512 x 512 fp32, 1 thread): {peak / 1e9:.1f} GFLOP/s; dispatch floor "
          f"{floor * 1e6:.2f} us per operator call")
    return out


def kernels(repeats: int, rounds: int = ROUNDS) -> None:
    torch.set_num_threads(1)
    rows = kernel_rows(repeats, rounds)
    print("| pass | useful GFLOP/s | share of the matmul peak | host-bound share |")
    print("|---|---|---|---|")
    for name, gflops, frac, share in rows:
        print(f"| {name} | {gflops:.2f} | {frac:.1%} | {share:.2f} |")
    b32 = next(share for name, _, _, share in rows if name.startswith("decode b32 "))
    print(f"target decode_host_bound_share_b32: {b32:.2f} (goal <= 0.10)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="every section at the smallest sizes, in seconds")
    parser.add_argument("--kernels-only", action="store_true", help="only the kernel-efficiency table")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    # kernel repeats: full 3 rounds x 61 steps from context 40 fit the 256 positions
    num_prompts, reps, batch, repeats, rounds = ((16, 1, 8, 1, 1) if args.smoke else (256, 2, 128, 10, ROUNDS)
                                                 if args.quick else (768, 3, 128, 30, ROUNDS))
    if args.kernels_only:
        kernels(repeats, rounds)
        return
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
    kernels(repeats, rounds)


if __name__ == "__main__":
    main()
