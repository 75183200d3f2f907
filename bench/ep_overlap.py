"""The expert all-to-all hidden behind computation, on an emulated link: the chunked overlap
inside one layer (`layout.a2a_chunks`) against blocking, then Adaptive Pipe — the forward of one
micro-batch overlapped with the backward of another (`layout.overlap_fb`, parallel/overlap.py) —
against the chunked and blocking all-to-all in an interleaved 1F1B pipeline.

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

Part 1, the chunked overlap: layout ep2 (dp2, one expert half per rank), a model with MoE
layers shaped like a real one (routed and shared experts), forward + backward steps; blocking
and chunked steps alternate, `--reps` each, medians per rank, the mean over the ranks.

Part 2, Adaptive Pipe: 4 ranks, pp2 × vpp2 × ep2 (dp2 in each stage), 9 layers (the first dense) in 4 stages of 2 MoE layers each,
8 micro-batches per step. Three schedules alternate step by step: interleaved 1F1B with the
blocking all-to-all (the link is sized so it is `A2A_SHARE` of this step), interleaved 1F1B
with the chunked overlap, and overlap_fb (whose unpaired warm-up and cool-down actions use the
chunked overlap). Exposed share = the seconds a rank waited on expert all-to-alls over its
step's seconds. 4 ranks share the machine's 2 cores: a waiting rank spins, as a device waiting
on its link holds it, so each schedule's step is its ranks' compute plus their exposed waits,
as on separate devices (the ratios hold; the absolute times are twice a lone rank's).

    python bench/ep_overlap.py            # 9 steps of each
    python bench/ep_overlap.py --quick    # 4 steps of each
    python bench/ep_overlap.py --smoke    # 1 step of each, 2 x 16 tokens per rank (a test runs it)
    python bench/ep_overlap.py --record   # also write the planner's efficiency (src/rlfusion/sim/ep_overlap.json)
                                          # (measured with Adaptive Pipe)
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
PIPE_ROWS, PIPE_MICRO = 32, 16  # part 2: rows per data-parallel rank, micro-batches per step


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


def pipe_config(seq: int = SEQ) -> ModelConfig:
    return model_config(seq).replace(num_layers=9)  # a dense layer and 8 MoE layers: 2 MoE layers per stage


PIPE_SCHEDULES = {  # part 2: name → the layout's overlap settings
    "interleaved": dict(vpp=2),
    "interleaved chunked": dict(vpp=2, a2a_chunks=CHUNKS),
    "overlap_fb": dict(vpp=2, overlap_fb=True, a2a_chunks=CHUNKS),
}


def _pipe_rank_main(reps: int, rows: int, seq: int) -> dict:
    torch.set_num_threads(1)
    cfg = pipe_config(seq)
    micro = min(PIPE_MICRO, rows)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank() // 2 % 2)  # one batch per dp rank
    tokens = torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g)
    models = {}
    for name, kw in PIPE_SCHEDULES.items():
        torch.manual_seed(0)
        models[name] = parallelize(MoETransformer(cfg).train(), ParallelLayout(pp=2, dp=2, ep=2, **kw),
                                   n_microbatches=micro)
    base = models["interleaved"]
    for _ in range(2):  # size the link from the blocking interleaved step on loopback
        free = [_step(base, tokens)[0] for _ in range(3)]
    step_s = statistics.median(free)
    c = base.comm_counter()
    # one bandwidth for every rank's link, sized on the ranks' totals (their byte counts differ:
    # the V gives rank 0 the dense first layer)
    need = torch.tensor([float(c.sent_bytes), A2A_SHARE / (1 - A2A_SHARE) * step_s - c.calls * LATENCY_S])
    torch.distributed.all_reduce(need)
    bandwidth = need[0] / max(1e-9, float(need[1]))
    for pm in models.values():
        pm.emulate_link(LATENCY_S, float(bandwidth))
    runs = {name: [] for name in models}
    for _ in range(reps + 2):  # the first two rounds warm up (and let Adaptive Pipe pick its order)
        for name, pm in models.items():
            runs[name].append(_step(pm, tokens)[:2])
    out = {name: {"step_s": statistics.median(t for t, _ in r[2:]), "wait_s": statistics.median(w for _, w in r[2:])}
           for name, r in runs.items()}
    return {**out, "bandwidth": float(bandwidth), "free_step_s": step_s,
            "order": models["overlap_fb"].overlap_report()}


def pipeline_part(reps: int, rows: int, seq: int) -> dict:
    ranks = run_world(_pipe_rank_main, 4, reps, rows, seq, timeout=1800)
    mean = lambda key, name: statistics.mean(r[name][key] for r in ranks)  # noqa: E731
    print(f"\npp2 x vpp2 x ep2 on 4 gloo ranks, {rows} x {seq} tokens per data-parallel rank in "
          f"{min(PIPE_MICRO, rows)} micro-batches, {pipe_config().num_layers} layers; emulated link "
          f"{ranks[0]['bandwidth'] / 1e6:.0f} MB/s + {LATENCY_S * 1e6:.0f} us per transfer; loopback step "
          f"{ranks[0]['free_step_s'] * 1e3:.0f} ms")
    print(f"{'':<21} {'step ms':>8} {'a2a waited ms':>14} {'share of step':>14}")
    for name in PIPE_SCHEDULES:
        s, w = mean("step_s", name), mean("wait_s", name)
        print(f"{name:<21} {s * 1e3:>8.1f} {w * 1e3:>14.1f} {w / s:>14.1%}")
    order = ranks[0]["order"]
    if order.get("overlap_fb_forward_first", -1) >= 0:
        print(f"Adaptive Pipe's order within a pair: {'forward' if order['overlap_fb_forward_first'] else 'backward'} "
              f"first (probe passes: mean pair {order['overlap_fb_pair_s_forward_first'] * 1e3:.1f} ms forward first, "
              f"{order['overlap_fb_pair_s_backward_first'] * 1e3:.1f} ms backward first, summed over the ranks)")
    return {name: {k: mean(k, name) for k in ("step_s", "wait_s")} for name in PIPE_SCHEDULES}


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
    pipe = pipeline_part(reps, PIPE_ROWS if not args.smoke else 4, seq)  # (smoke: 4 micro-batches, the fewest)
    fb, inter = pipe["overlap_fb"], pipe["interleaved"]
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        path = Path(__file__).resolve().parents[1] / "src" / "rlfusion" / "sim" / "ep_overlap.json"
        path.write_text(json.dumps({
            "efficiency": round(1 - fb["wait_s"] / inter["wait_s"], 3), "mechanism": "overlap_fb",
            "source": f"python bench/ep_overlap.py, {datetime.date.today()}, {commit}: Adaptive Pipe (overlap_fb) "
                      f"against interleaved 1F1B with the blocking all-to-all, pp2 x vpp2 x ep2, a2a "
                      f"{inter['wait_s'] / inter['step_s']:.0%} of the blocking step"}, indent=1) + "\n")
        print(f"wrote {path}")
    print(f"target exposed_a2a_overlapped_vs_blocking: {ratio:.2f} (goal <= 0.25)")
    print(f"target step_time_overlapped_vs_blocking: {over_step / block_step:.2f} (goal <= 0.9)")
    for name in PIPE_SCHEDULES:
        print(f"exposed_a2a_share_{name.replace(' ', '_')}: {pipe[name]['wait_s'] / pipe[name]['step_s']:.3f}")
    print(f"target exposed_a2a_share_overlap_fb: {fb['wait_s'] / fb['step_s']:.3f} (goal <= 0.05)")
    print(f"target step_time_overlap_fb_vs_interleaved: {fb['step_s'] / inter['step_s']:.2f} (goal <= 0.8)")


if __name__ == "__main__":
    main()
