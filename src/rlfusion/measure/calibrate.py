"""Microbenchmarks of the real RL components on this machine -> a measured `Calibration`.

Each number the RL simulator needs is timed on the component that does that work in a real
run, one device (worker process, `threads` threads) at a time, with the shipped tiny base model:

    decode_step_ms(b)        LLMEngine.step() with b rows decoding (continuous batching, the
                             rollout's max_num_seqs), median over the steps of a fixed-length run
    decode_context_ms        decode passes of `CONTEXT_ROWS` rows at the table's context and at
                             `LONG_CONTEXT` (the base built for it): the cost per row and position
    decode_segment_ms        a mixed-length decode pass in several runs of rows read apart against
                             a one-run pass of equal reads: the cost per run beyond the first
    prefill                  the engine's first step of a 1-row and of a 128-row run (a line
                             through the two: fixed + per-token cost)
    train tokens/s, overhead ActorStage.update() (GRPO loss, KL to the reference, AdamW) on 64 and
                             on 256 synthetic task-shaped samples and on 32 long ones: the plane
                             through the three in (tokens, sum of squared lengths)
    reference tokens/s       ReferenceStage.logprobs() on the same samples, the same way
    switch_s                 the colocated switch: optimizer state to host + KV cache in, and
                             back (HostPool, KVCache), half the round trip
    reference_switch_s       fully shared mode: reference weights to host and back
    transfer_GBps            two processes in a gloo world: bucketed weight broadcast (what a
                             separated-mode weight sync does), bytes / seconds: `pair.py`
    concurrent_speed         two Ray device actors (as the real runs place them, 1 thread
                             each) run a rollout + long-context decode + update workload alone
                             and then both at once: time alone / time together (two busy 1-thread
                             processes on this VM, with Ray's own processes beside them, do not
                             get two full cores), in all and per part (decode, context, train)
    lockstep_speed           the same with the two meeting as colocated devices do (a barrier
                             after each part, the gradient all-reduce): `contention.py`

Nothing here sees an RL step's throughput: the simulator predicts that from these numbers.
torch and the model are imported inside the functions, so importing this module costs nothing
until a measurement runs. `calibrate_all.measure_calibration` runs them all (with
`contention.py`'s two-process probe) into a `Calibration`.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import dataclass

from rlfusion.engine.scheduler import MAX_NUM_SEQS  # torch-free: the rollout's default slots


DECODE_BATCHES = (1, 4, 16, 32, 64, 128)
LONG_CONTEXT = 1280  # the longest context priced (the replay workload's: prompt + a 1,000-token cap);
#                      the base decodes past its own context with the same weights (rotary positions)
CONTEXT_ROWS = 32  # rows of the long-context decode passes: a replay device's share (64 samples / 2)


@dataclass(frozen=True)
class Setup:
    """What every measurement runs with: the base checkpoint, torch's thread count, quick mode;
    `smoke` (a bench's `--smoke`: its figures are not measurements) times each repeated
    measurement once."""

    base: str
    threads: int
    quick: bool
    smoke: bool = False


def load_base_model(setup: Setup, max_seq_len: int | None = None):
    """The base model and tokenizer (`max_seq_len`: the context to build it with; None: its own)."""
    import torch

    from rlfusion.model.checkpoint import load_checkpoint

    torch.set_num_threads(setup.threads)
    torch.manual_seed(0)
    model, tokenizer, _ = load_checkpoint(setup.base, max_seq_len=max_seq_len)
    return model, tokenizer


def task_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """`n` encoded prompts of the default (arithmetic) task."""
    from rlfusion.evaluate import encode_prompt
    from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    task, rng = ArithmeticTask(ArithmeticConfig()), random.Random(seed)
    return [encode_prompt(tokenizer, task.sample(rng).prompt) for _ in range(n)]


# ---- rollout engine ----------------------------------------------------------------------

def engine_step_times(model, prompts: list[list[int]], new_tokens: int,
                      max_num_seqs: int = MAX_NUM_SEQS) -> list[float]:
    """Seconds of every engine step of one run where each prompt generates `new_tokens` (no
    stop token), `max_num_seqs` rows at a time."""
    from rlfusion.engine.engine import EngineConfig, LLMEngine
    from rlfusion.engine.types import Request, SamplingParams

    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, seed=0))
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)  # no stop ids
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), params))
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure_engine(model, tokenizer, quick: bool, long_model) -> dict:
    """Decode step time per batch size and the prefill line on `model`; the decode cost per row
    and context position and per run of rows read apart on `long_model` (the same weights
    built for `LONG_CONTEXT`)."""
    new_tokens = 24 if quick else 48
    model.eval()
    engine_step_times(model, task_prompts(tokenizer, 32), 8)  # warm-up
    decode, prefill = {}, {}
    for b in DECODE_BATCHES:
        prompts = task_prompts(tokenizer, b, seed=b)
        runs = [engine_step_times(model, prompts, new_tokens) for _ in range(1 if quick else 2)]
        decode[b] = statistics.median(t for run in runs for t in run[1:]) * 1e3
        tokens = sum(len(p) for p in prompts)  # the engine prefills them packed
        prefill[tokens] = statistics.median(run[0] for run in runs) * 1e3
    (t_small, ms_small), (t_big, ms_big) = min(prefill.items()), max(prefill.items())
    per_token = max(0.0, (ms_big - ms_small) / (t_big - t_small))
    # the table's steps attend over the longest prompt plus about half the new tokens
    reference = max(len(p) for p in task_prompts(tokenizer, DECODE_BATCHES[-1], seed=DECODE_BATCHES[-1])) + new_tokens // 2
    return {"decode_batch_sizes": tuple(decode), "decode_step_ms": tuple(decode.values()),
            "prefill_ms_per_token": per_token,
            "prefill_fixed_ms": max(0.0, ms_small - per_token * t_small),
            "decode_reference_context": reference,
            "decode_context_ms": decode_context_ms(long_model, reference, quick),
            "decode_segment_ms": decode_segment_ms(long_model, quick)}


def segment_lengths(rows: int = 64, runs: int = 7) -> list[int]:
    """Context lengths of `rows` rows (rounded down to a multiple of `runs`), longest first, in
    about `runs` runs of mixed lengths that
    the decode pass reads apart (`row_segments`; the two shortest share one, within
    `SEGMENT_SLACK`): each run's lengths spread over x1.3, each run x1.6 longer than the next,
    the longest below `LONG_CONTEXT`."""
    per = rows // runs
    out = []
    for j in reversed(range(runs)):
        base = 50 * 1.6 ** j
        out += [round(base * (1.3 - 0.3 * i / max(1, per - 1))) for i in range(per)]
    return out


def decode_segment_ms(model, quick: bool) -> float:
    """What each run of rows a decode pass reads apart costs beyond the first: a pass over rows
    of mixed lengths in several runs (`segment_lengths`, as a long-tailed rollout's rows sorted
    longest first fall) against one over as many rows all at one length that reads as many
    positions (one run, no mask), in turn."""
    from rlfusion.model.row_segments import row_segments

    lengths = segment_lengths()
    runs = row_segments(lengths)
    reads = sum((end - start) * positions for start, end, positions in runs)
    uniform = max(1, round(reads / len(lengths)))
    mixed, one = decode_passes(model, [lengths, [uniform] * len(lengths)])
    mixed_s, one_s = _interleaved_medians([mixed, one], 12 if quick else 40)
    return max(0.0, (mixed_s - one_s) * 1e3 / (len(runs) - 1))


def decode_context_ms(model, reference: int, quick: bool, rows: int = CONTEXT_ROWS) -> float:
    """Extra decode-step time per row and per context position: `rows` rows decoding at
    context `reference` vs near the model's context length (every row at the same position).
    The cache a long context reads outgrows the processor's caches (2 KB per token of the tiny
    model: 32 rows x 1,280 positions are 84 MB), so the model must be built for the longest
    context a workload reads: a slope measured over short contexts under-prices it."""
    longest = model.config.max_seq_len - 1
    if longest <= reference:
        return 0.0
    long_step, ref_step = context_steps(model, rows, (longest, reference))
    # the two contexts in turn, so drift in machine speed cancels
    long_s, ref_s = _interleaved_medians([long_step, ref_step], 12 if quick else 40)
    return max(0.0, (long_s - ref_s) * 1e3 / (rows * (longest - reference)))


def context_steps(model, rows: int, contexts: tuple[int, ...]) -> list:
    """One decode pass of `rows` rows at each of `contexts` (every row at that context), as
    callables (`decode_passes`)."""
    return decode_passes(model, [[c] * rows for c in contexts])


def decode_passes(model, passes: list[list[int]]) -> list:
    """One decode pass per entry of `passes`, each the context lengths of its rows (row i's new
    token at position length - 1, attending over its whole context), as callables over one
    shared KV cache."""
    import torch

    from rlfusion.model.kv_cache import CacheBatch

    rows = max(len(p) for p in passes)
    cache = model.new_kv_cache(rows, max(max(p) for p in passes) + 1)
    tokens_B1 = torch.randint(1, model.config.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(0))

    def step(lengths: list[int]):
        start_B = torch.tensor([n - 1 for n in lengths])
        tokens = tokens_B1[:len(lengths)]

        def run() -> None:
            with torch.inference_mode():
                model(tokens, CacheBatch(cache, 0, start_B))
        return run
    return [step(p) for p in passes]


# ---- trainer, reference, switch ------------------------------------------------------------

def synthetic_trajectories(tokenizer, n: int, vocab: int, seed: int = 0, median: int = 24,
                           cap: int = 160) -> list:
    """`n` samples shaped like the task's: real prompts, log-normal response lengths (median
    `median`, p99/median ~4, at most `cap`), random tokens, GRPO-like advantages, behaviour and
    reference logprobs."""
    from rlfusion.rl.trajectory import Trajectory

    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(task_prompts(tokenizer, n, seed)):
        length = min(cap, max(2, round(median * rng.lognormvariate(0.0, 0.57))))
        response = [rng.randrange(1, vocab) for _ in range(length)]
        out.append(Trajectory(i // 8, None, prompt, response, [-1.0] * length, [0] * length,
                              "stop", advantage=rng.choice((-1.0, 1.0)),
                              ref_logprobs=[-1.0] * length))
    return out


def _plane(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(fixed seconds, tokens per second, seconds per squared sequence length) of a pass
    through three (tokens, sum of squared lengths, seconds) points: two batches of short
    samples and one of long ones. A negative fixed cost (noise: the update has none to speak
    of) is 0, the other two then fitted by least squares through the origin; where noise makes
    the squared term or the rate come out negative, the squared term is 0 and the line through
    the short batches holds."""
    (a0, b0, y0), (a1, b1, y1), (a2, b2, y2) = points

    def det(m):
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    rows = [[1.0, a0, b0], [1.0, a1, b1], [1.0, a2, b2]]
    ys = [y0, y1, y2]
    d = det(rows)
    if d:
        solved = [det([[ys[r] if c == k else rows[r][c] for c in range(3)] for r in range(3)]) / d
                  for k in range(3)]
        fixed, per_token, per_square = solved
        if fixed < 0:  # y = per_token * tokens + per_square * squares, least squares
            saa, sab, sbb = (sum(p[0] * p[0] for p in points), sum(p[0] * p[1] for p in points),
                             sum(p[1] * p[1] for p in points))
            say, sby = sum(p[0] * p[2] for p in points), sum(p[1] * p[2] for p in points)
            d2 = saa * sbb - sab * sab
            fixed, per_token, per_square = (0.0, (say * sbb - sby * sab) / d2, (saa * sby - sab * say) / d2) \
                if d2 else (0.0, 0.0, 0.0)
        if per_square > 0 and per_token > 0:
            return fixed, 1.0 / per_token, per_square
    fixed, rate = _line({a0: y0, a1: y1})
    return fixed, rate, 0.0


def _line(points: dict[int, float]) -> tuple[float, float]:
    """(fixed seconds, tokens per second) of the line through the smallest and largest point."""
    (x0, y0), (x1, y1) = min(points.items()), max(points.items())
    slope = (y1 - y0) / (x1 - x0)
    if slope <= 0:  # noise swamped the difference: no fixed cost, mean rate of the big run
        return 0.0, x1 / y1
    return max(0.0, y0 - slope * x0), 1.0 / slope


def median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians(fns: list, reps: int) -> list[float]:
    """Median seconds of each of `fns`, timed in turn `reps` times (after a warm-up of each), so
    a change in this shared machine's speed shifts them all alike instead of bending the line
    drawn through them."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure_train_and_reference(model, tokenizer, quick: bool, switch_model=None, smoke: bool = False) -> dict:
    """The update's and the reference pass's cost planes (`_plane`) and the switches, on `model`
    (built for the long samples' context); the switch restores a KV cache sized for
    `switch_model`'s context (default `model`'s). `smoke`: each timed once."""
    from rlfusion.runtime.actor import ActorStage
    from rlfusion.runtime.reference_stage import ReferenceStage
    from rlfusion.runtime.train_config import AlgoConfig, OptimConfig

    reps = 1 if smoke else 2 if quick else 5
    vocab = model.config.vocab_size
    actor = ActorStage(copy.deepcopy(model), AlgoConfig(), OptimConfig(), temperature=1.0)
    reference = ReferenceStage(copy.deepcopy(model), 1.0, OptimConfig().microbatch_tokens)
    # two batches of task-shaped samples and one of long ones (a replay device's share of an
    # update, responses of median 300 and up to 1,000 tokens) of about the same tokens as the
    # larger: the long batch prices the attention over each sequence, which grows with its square
    batches = [synthetic_trajectories(tokenizer, n, vocab, seed=n) for n in (64, 256)]
    batches.append(synthetic_trajectories(tokenizer, 32, vocab, seed=32, median=300, cap=1000))
    shapes = [(sum(t.num_tokens for t in trajs), sum(t.num_tokens ** 2 for t in trajs)) for trajs in batches]
    seconds = _interleaved_medians([lambda trajs=trajs: actor.update(trajs) for trajs in batches]
                                   + [lambda trajs=trajs: reference.logprobs(trajs) for trajs in batches], reps)
    train_fixed, train_rate, train_square = _plane([(*x, y) for x, y in zip(shapes, seconds[:3])])
    ref_fixed, ref_rate, ref_square = _plane([(*x, y) for x, y in zip(shapes, seconds[3:])])
    switch_s, ref_switch_s = _measure_switches(actor, reference, switch_model or model, reps)
    return {"train_tokens_per_s_per_device": train_rate, "train_step_overhead_s": train_fixed,
            "train_context_ns": train_square * 1e9,
            "reference_tokens_per_s_per_device": ref_rate, "reference_overhead_s": ref_fixed,
            "reference_context_ns": ref_square * 1e9,
            "switch_s": switch_s, "reference_switch_s": ref_switch_s}


def _measure_switches(actor, reference, model, reps: int) -> tuple[float, float]:
    """(one actor switch, one reference offload + restore), as the device workers do them."""
    from rlfusion.fusion.offload import HostPool, optimizer_tensors

    cache = model.new_kv_cache(MAX_NUM_SEQS, model.config.max_seq_len)
    cache.release()
    pool, ref_pool = HostPool(), HostPool()

    def round_trip() -> None:
        actor.optimizer.zero_grad(set_to_none=True)
        pool.offload(optimizer_tensors(actor.optimizer))
        cache.restore()
        cache.release()
        pool.restore()

    def reference_round_trip() -> None:
        ref_pool.offload(reference.model.parameters())
        ref_pool.restore()

    return median_time(round_trip, reps) / 2, median_time(reference_round_trip, reps)


def measure_advantage(tokenizer, vocab: int, quick: bool, n: int = 256) -> float:
    """Seconds per sample of one update's advantage stage, as the first train device runs it
    between the rollout and the update (`advantage_stage.advantage_stage`): each row's numbers
    read from a DistQueue, advantages computed, the kept rows split over two data-parallel
    ranks, and the rows retired after the update — on `n` synthetic samples whose rows the
    rollout devices have put (their puts are rollout work, not timed here)."""
    from rlfusion.queue import DistQueue
    from rlfusion.runtime import dataflow
    from rlfusion.runtime.advantage_stage import advantage_stage
    from rlfusion.runtime.train_config import TrainConfig

    cfg, group = TrainConfig(), 8
    base = synthetic_trajectories(tokenizer, n, vocab, seed=1)
    for i, t in enumerate(base):  # a third of the samples right
        t.reward = t.correct = float(i % 3 == 0)
        t.sample = i % group
    rows_put = dataflow.trajectory_columns(base, dataflow.ROLLOUT.writes + dataflow.REWARD.writes)

    def one_update() -> float:
        queue = DistQueue(dataflow.queue_config(group))
        queue.put(rows_put, group_ids=[t.group_id for t in base], versions=[0] * n)  # the rollout's puts
        start = time.perf_counter()
        rows, _, _ = advantage_stage(queue, cfg, n, num_ranks=2)
        queue.retire([r.row_id for r in rows])
        return time.perf_counter() - start

    one_update()  # warm-up
    return statistics.median(one_update() for _ in range(3 if quick else 7)) / n


# ---- the whole calibration -----------------------------------------------------------------

def default_setup(threads: int = 1, quick: bool = False, smoke: bool = False) -> Setup:
    from rlfusion.model.checkpoint import find_base

    base = find_base()
    if base is None:
        raise ValueError("no tiny base model found: run `rlfusion pretrain` first")
    return Setup(str(base), threads, quick, smoke)
