"""Two processes in a gloo world, as two devices of a run: the bucketed weight broadcast (what a
separated-mode weight sync does) and the stop-rule sums of a partial rollout on two devices, for
the calibration's `transfer_GBps` and `stop_sync_s` (`calibrate_all.measure_calibration`).
"""

from __future__ import annotations

import queue
import statistics
import time

from rlfusion.engine.scheduler import MAX_NUM_SEQS  # torch-free: the rollout's default slots
from rlfusion.measure.calibrate import Setup, load_base_model, median_time, task_prompts

BUCKET_MB = 4.0  # the weight-sync bucket (DeployConfig.bucket_mb)
PAIR_JOIN_S = 120  # the two processes' rendezvous and each collective, at most
PAIR_DEADLINE_S = 300  # their whole run (about a minute on 2 busy cores, seconds in a smoke run), at most


def _pair_worker(rank: int, setup: Setup, port: int, out) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    model, tokenizer = load_base_model(setup)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=PAIR_JOIN_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=PAIR_JOIN_S))
    params = [p.data for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    limit = int(BUCKET_MB * 2**20)

    def broadcast() -> None:  # DeviceWorker.sync_weights: contiguous buckets from rank 0
        bucket, size = [], 0
        for p in params + [None]:
            if p is None or (bucket and size + p.numel() * p.element_size() > limit):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.broadcast(flat, src=0)
                if rank:
                    torch.cat([t.reshape(-1) for t in bucket]).copy_(flat)  # the copy-back
                bucket, size = [], 0
            if p is not None:
                bucket.append(p)
                size += p.numel() * p.element_size()

    dist.barrier()
    bcast_s = median_time(broadcast, 1 if setup.smoke else 3 if setup.quick else 5)
    dist.barrier()
    counts = torch.zeros(4, dtype=torch.int64)  # RolloutStage.run_groups' stop-rule sums
    for _ in range(20):
        dist.all_reduce(counts)
    reps = 20 if setup.smoke else 100 if setup.quick else 300
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(counts)
    sum_s = (time.perf_counter() - start) / reps
    dist.barrier()
    loaded_s = _stop_sums_while_decoding(model, tokenizer, rank, setup.quick)
    dist.barrier()
    out.put((rank, nbytes, bcast_s, sum_s, loaded_s))
    dist.destroy_process_group()


def _stop_sums_while_decoding(model, tokenizer, rank: int, quick: bool) -> float:
    """Seconds per stop-rule sum while both processes decode, as in a partial rollout on two
    devices (`RolloutStage.run_groups`: a sum every `STOP_SYNC_EVERY` engine steps): both run the
    same number of steps (fixed-length generation), so the time in the sum is the collective
    plus the wait for the other process's share of step-to-step jitter."""
    import torch
    import torch.distributed as dist

    from rlfusion.engine.engine import EngineConfig, LLMEngine
    from rlfusion.engine.types import Request, SamplingParams
    from rlfusion.stalesync.rules import STOP_SYNC_EVERY

    model.eval()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=MAX_NUM_SEQS, seed=rank))
    # 24 sums (quick: 12) of 8 steps each: one slow step of either process weighs on few of them
    params = SamplingParams(temperature=1.0, max_new_tokens=96 if quick else 192)  # no stop ids
    for i, ids in enumerate(task_prompts(tokenizer, 64, seed=100 + rank)):
        engine.add_request(Request(f"r{i}", list(ids), params))
    counts = torch.zeros(4, dtype=torch.int64)
    waited, calls, steps = 0.0, 0, 0
    while engine.has_unfinished():
        if steps % STOP_SYNC_EVERY == 0:
            start = time.perf_counter()
            dist.all_reduce(counts)
            waited += time.perf_counter() - start
            calls += 1
        engine.step()
        steps += 1
    return waited / calls


def measure_pair(setup: Setup) -> dict:
    """Two spawned processes: the weight broadcast and the stop-rule sums (`_pair_worker`). This
    process holds their rendezvous store (a port the OS gives it, never one another process can
    take first); a process that dies, or the two not done in `PAIR_DEADLINE_S`, is an error."""
    import datetime
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=PAIR_JOIN_S))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pair_worker, args=(r, setup, store.port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + PAIR_DEADLINE_S
    try:
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a broadcast benchmark process died (exit code {dead[0]})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the broadcast benchmark's two processes did not finish in "
                                       f"{PAIR_DEADLINE_S} s ({len(results)} of 2 reported)")
    finally:
        for p in procs:  # done after their results; killed if one failed or the time ran out
            p.join(timeout=60 if len(results) == len(procs) else 0)
            if p.is_alive():
                p.kill()
                p.join()
    results.sort()
    nbytes = results[0][1]
    bcast_s = max(r[2] for r in results)
    return {"transfer_GBps": nbytes / bcast_s / 1e9, "weight_GB": nbytes / 1e9,
            "grad_sync_GB": nbytes / 1e9,  # fp32 grads, one per parameter, same bytes
            # both ranks wait in the same sums: their mean is the cost of one
            "stop_sync_s": statistics.mean(r[4] for r in results), "_bcast_s": bcast_s,
            "_idle_sum_s": max(r[3] for r in results)}
