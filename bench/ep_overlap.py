"""Overlapped expert all-to-all (`layout.a2a_chunks`) against blocking, on an emulated link.

Two gloo ranks on one machine exchange tokens over loopback, where an all-to-all costs next to
nothing, so there would be nothing to hide. Each rank's expert all-to-alls therefore run over
an emulated link (`expert_parallel.LinkModel`): a transfer's bytes (the more of what the rank
sends to and receives from its peer) arrive `LATENCY_S` plus bytes / bandwidth after it is
issued, one transfer at a time, in the background. The bandwidth is sized from a step without
emulation so that the all-to-all is `A2A_SHARE` of the blocking step (the bench prints the share
it got). A rank's exposed communication is the time it waited on expert all-to-alls
(`CommCounter.wait_s`): the whole transfer when blocking, only what computation did not cover
when overlapped. A waiting rank spins on its core, as a device waiting on its link holds it.

The same pair of steps also runs on loopback alone first: gloo's loopback transfers are not
free (memory copies through the kernel), so the overlapped step gains there too, and the
emulated-link figures include that part. The bench prints the step ratio the emulated waits
alone would explain beside the measured one.

Layout ep2 (dp2, one expert half per rank), a model with MoE layers shaped like a real one
(routed and shared experts), forward + backward steps; blocking and overlapped steps alternate,
`--reps` each, medians per rank, the mean over the ranks.

    python bench/ep_overlap.py            # 9 steps of each
    python bench/ep_overlap.py --quick    # 4 steps of each
    python bench/ep_overlap.py --smoke    # 1 step of each, 2 x 16 tokens per rank (a test runs it)
    python bench/ep_overlap.py --record   # also write the planner's efficiency (src/rlfusion/sim/ep_overlap.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, parallelize
from rlfusion.parallel.launch import run_world

LATENCY_S = 20e-6  # per transfer
A2A_SHARE = 0.3  # of the blocking step, what the emulated bandwidth is sized for
CHUNKS = 4  # layout.a2a_chunks of the overlapped runs
ROWS, SEQ = 8, 128  # per rank
SMOKE_ROWS, SMOKE_SEQ = 2, 16  # --smoke


def model_config(seq: int = SEQ) -> ModelConfig:
    return ModelConfig(vocab_size=512, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                       num_dense_layers=1, dense_ffn_dim=512, num_experts=8, top_k=4, expert_ffn_dim=512,
                       num_shared_experts=1, max_seq_len=seq + 1)


def _step(pm, tokens) -> tuple[float, float, int]:
    """Seconds of one forward + backward, seconds waited on expert all-to-alls, bytes sent."""
    for p in pm.parameters():
        p.grad = None
    pm.reset_comm_counters()
    torch.distributed.barrier()
    start = time.perf_counter()
    pm.forward_backward(tokens[:, :-1], tokens[:, 1:])
    took = time.perf_counter() - start
    c = pm.comm_counter()
    return took, c.wait_s, c.sent_bytes


def _rank_main(reps: int, rows: int = ROWS, seq: int = SEQ) -> dict:
    cfg = model_config(seq)
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    tokens = torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g)
    models = {}
    for name, chunks in (("blocking", 0), ("overlapped", CHUNKS)):
        torch.manual_seed(0)
        models[name] = parallelize(MoETransformer(cfg).train(), ParallelLayout(dp=2, ep=2, a2a_chunks=chunks))
    # size the link: a blocking step on loopback, its bytes
    for _ in range(2):
        free = [_step(models["blocking"], tokens) for _ in range(3)]
    step_s = statistics.median(t for t, _, _ in free)
    sent = max(b for _, _, b in free)
    calls = models["blocking"].comm_counter().calls
    bandwidth = torch.tensor(sent / max(1e-9, A2A_SHARE / (1 - A2A_SHARE) * step_s - calls * LATENCY_S))
    torch.distributed.all_reduce(bandwidth, op=torch.distributed.ReduceOp.MIN)  # one link for both
    out = {}
    for link in ("loopback", "emulated"):  # the same pair on loopback alone, then on the link
        if link == "emulated":
            for pm in models.values():
                pm.emulate_link(LATENCY_S, float(bandwidth))
        runs = {name: [] for name in models}
        for _ in range((reps if link == "emulated" else max(2, reps // 2)) + 1):  # the first round warms up
            for name, pm in models.items():
                runs[name].append(_step(pm, tokens))
        for name, r in runs.items():
            key = name if link == "emulated" else f"{name} loopback"
            out[key] = {"step_s": statistics.median(t for t, _, _ in r[1:]),
                        "wait_s": statistics.median(w for _, w, _ in r[1:])}
    return {**out, "free_step_s": step_s, "bytes": sent, "calls": calls, "bandwidth": float(bandwidth)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--record", action="store_true",
                        help="write the measured efficiency for the planner (src/rlfusion/sim/ep_overlap.json)")
    args = parser.parse_args()
    if args.smoke and args.record:
        parser.error("--record writes a measurement for the planner; a --smoke run measures nothing")
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    reps = args.reps or (1 if args.smoke else 4 if args.quick else 9)
    rows, seq = (SMOKE_ROWS, SMOKE_SEQ) if args.smoke else (ROWS, SEQ)
    ranks = run_world(_rank_main, 2, reps, rows, seq, timeout=1200)
    mean = lambda key, name: statistics.mean(r[name][key] for r in ranks)  # noqa: E731
    block_step, over_step = mean("step_s", "blocking"), mean("step_s", "overlapped")
    block_wait, over_wait = mean("wait_s", "blocking"), mean("wait_s", "overlapped")
    r0 = ranks[0]
    print(f"ep2 on 2 gloo ranks, {rows} x {seq} tokens per rank, {model_config().num_layers} layers; emulated link "
          f"{r0['bandwidth'] / 1e6:.0f} MB/s + {LATENCY_S * 1e6:.0f} us per transfer ({r0['bytes'] / 1e6:.1f} MB in "
          f"{r0['calls']} transfers per step and rank); loopback step {r0['free_step_s'] * 1e3:.0f} ms")
    print(f"{'':<21} {'step ms':>8} {'a2a waited ms':>14} {'share of step':>14}")
    for name in ("blocking loopback", "overlapped loopback", "blocking", "overlapped"):
        s, w = mean("step_s", name), mean("wait_s", name)
        print(f"{name:<21} {s * 1e3:>8.1f} {w * 1e3:>14.1f} {w / s:>14.1%}")
    print(f"on loopback alone (no emulated link) the overlapped step is "
          f"{mean('step_s', 'overlapped loopback') / mean('step_s', 'blocking loopback'):.2f}x the blocking one; the "
          f"step the emulated waits alone would give: {(block_step - block_wait + over_wait) / block_step:.2f}x")
    ratio = over_wait / block_wait
    print(f"all-to-all share of the blocking step: {block_wait / block_step:.2f} (sized for {A2A_SHARE})")
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        path = Path(__file__).resolve().parents[1] / "src" / "rlfusion" / "sim" / "ep_overlap.json"
        path.write_text(json.dumps({
            "efficiency": round(1 - ratio, 3), "chunks": CHUNKS,
            "source": f"python bench/ep_overlap.py, {datetime.date.today()}, {commit}: ep2, a2a "
                      f"{block_wait / block_step:.0%} of the blocking step"}, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"target exposed_a2a_overlapped_vs_blocking: {ratio:.2f} (goal <= 0.25)")
    print(f"target step_time_overlapped_vs_blocking: {over_step / block_step:.2f} (goal <= 0.9)")


if __name__ == "__main__":
    main()
