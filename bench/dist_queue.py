"""DistQueue: bytes on the wire, queue requests, Ray backend throughput, and the RL loop's queue cost.

1. Wire bytes, padded vs packed: 512 rows of a reasoning-trace-like long tail (log-normal
   response lengths, median ~600 tokens, p99 >= 5x median, cap 16k), columns response ids
   (vocab 152k), behaviour logprobs, token versions. Padded = S x max_len per column in its
   natural dtype (int64 ids and versions, float32 logprobs; the mask it would also need is not
   counted). Packed = the `WireBatch` the Ray shards and the hierarchical broadcast send.
2. Queue requests per step, every-rank reads vs hierarchical reads: measured on 4 gloo ranks
   (TP2 x PP2, one DP replica) against a Ray queue; computed the same way for TP8 x PP16.
3. Ray backend throughput with 1, 2 and 4 storage shards: a producer actor and a consumer actor
   move 1024 rows concurrently (batches of 64; actor start-up excluded); rows/s and MB/s of packed data, repeated and
   interleaved, median reported. 2 cores are shared by driver, actors and Ray itself, so the
   shard counts compare relative to each other only.
4. The RL loop through the Ray queue as runs use it: the default run's step (32 prompts x 8
   samples from the shipped base model) on 2 devices, co-located, separated with the scorers on
   the train device (they read each row as soon as its rollout columns are ready) and with
   train_tp=2 (one reader per tensor-parallel group); the devices' time in queue calls (`queue`
   spans: puts, gets, retires, waits for rows) as a share of their step time (`queue_share`) is
   the throughput lost to the queue; the target takes the largest of the three. Beside the
   queue's bytes per step, the part that crossed a process boundary (a device's own rows live
   in its own process and move by plain calls).

    python bench/dist_queue.py            # full run
    python bench/dist_queue.py --quick    # fewer repetitions and RL steps
    python bench/dist_queue.py --smoke    # every section at the smallest sizes (a test runs it)

(Not `bench/queue.py`: a file named `queue.py` in bench/ would shadow the standard library's
`queue`, which torch imports, and break every script in the folder.)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlfusion.queue import ColumnSpec, QueueConfig, Schema, pack_columns
from rlfusion.queue.hierarchical import GroupQueue, requests_per_step
from rlfusion.queue.ray_backend import RayDistQueue

COLUMNS = (ColumnSpec("response_ids", "int32", variable_length=True),
           ColumnSpec("behaviour_logprobs", "float32", variable_length=True),
           ColumnSpec("versions", "int64", variable_length=True), ColumnSpec("reward", "float64"))
NAMESPACE = "rlfusion-bench"


def long_tail_rows(num_rows: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)
    lengths = [min(16384, max(8, int(rng.lognormvariate(6.4, 0.85)))) for _ in range(num_rows)]
    return {"response_ids": [[rng.randrange(152_064) for _ in range(n)] for n in lengths],
            "behaviour_logprobs": [[-rng.random() * 3 for _ in range(n)] for n in lengths],
            "versions": [[7] * n for n in lengths], "reward": [float(rng.random() < 0.5) for _ in lengths]}


def padded_bytes(rows: dict[str, list]) -> int:
    S, max_len = len(rows["reward"]), max(len(r) for r in rows["response_ids"])
    return S * max_len * (8 + 4 + 8) + S * 8  # ids int64, logprobs float32, versions int64; reward


def wire_bytes_section(num_rows: int) -> float:
    rows = long_tail_rows(num_rows, seed=0)
    lengths = sorted(len(r) for r in rows["response_ids"])
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * (len(lengths) - 1))]
    wire = pack_columns(Schema(COLUMNS), rows, num_rows)
    padded, packed = padded_bytes(rows), wire.nbytes
    print(f"\n## wire bytes, {num_rows} rows: response length median {median}, p99 {p99} "
          f"({p99 / median:.1f}x), max {lengths[-1]}")
    dtypes = ", ".join(f"{n} {wire.tensors[n][0].dtype}".replace("torch.", "") for n in wire.tensors)
    print(f"padded {padded / 2**20:.1f} MiB, packed {packed / 2**20:.1f} MiB ({dtypes})")
    return 1 - packed / padded


# ---- queue requests: hierarchical vs every-rank reads on 4 gloo ranks ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, gcs: str, name: str, gets: int, hierarchical: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    ray.init(address=gcs, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    q = RayDistQueue.connect(name)
    if hierarchical:  # rank = stage * 2 + tp: rank 0 reads for the group, rank 2 (last stage) writes
        gq = GroupQueue(q if rank in (0, 2) else None, q.schema, None, reader=0, writer=2)
        for _ in range(gets):
            gq.get("actor", ["response_ids", "behaviour_logprobs", "versions"], 8)
    else:
        for _ in range(gets):
            q.get(f"actor-rank{rank}", ["response_ids", "behaviour_logprobs", "versions"], 8)
    dist.barrier()
    ray.shutdown()
    dist.destroy_process_group()


def requests_section(gets: int) -> tuple[int, int]:
    measured = {}
    for hierarchical in (False, True):
        name = f"req-{os.getpid()}-{hierarchical}"
        q = RayDistQueue(QueueConfig(COLUMNS), num_shards=2, name=name)
        q.put({k: v for k, v in long_tail_rows(8 * gets, seed=1).items()})
        before = q.stats.get_requests
        mp.spawn(_rank, args=(_free_port(), ray.get_runtime_context().gcs_address, name, gets, hierarchical),
                 nprocs=4, join=True)
        measured[hierarchical] = q.stats.get_requests - before
        q.shutdown()
    print(f"\n## queue get requests for {gets} steps, TP2 x PP2 (4 gloo ranks, one DP replica)")
    print("| layout | every-rank reads | hierarchical | reduction | how |\n|---|---|---|---|---|")
    print(f"| TP2 x PP2 | {measured[False]} | {measured[True]} | {measured[False] / measured[True]:.0f}x | measured |")
    for dp, tp, pp in ((1, 8, 16), (4, 8, 16)):
        flat, hier = (requests_per_step(dp, tp, pp, hierarchical=h) * gets for h in (False, True))
        print(f"| DP{dp} x TP8 x PP16 | {flat} | {hier} | {flat / hier:.0f}x | computed |")
    return measured[False], measured[True]


# ---- Ray backend throughput ----

@ray.remote(num_cpus=0)
class Producer:
    def ready(self, name: str) -> None:  # process started, imports and queue handle warm
        RayDistQueue.connect(name)

    def run(self, name: str, rows: dict[str, list], repeats: int, batch: int) -> float:
        q = RayDistQueue.connect(name)
        start = time.perf_counter()
        n = len(rows["reward"])
        for _ in range(repeats):
            for i in range(0, n, batch):
                q.put({k: v[i:i + batch] for k, v in rows.items()})
        return time.perf_counter() - start


@ray.remote(num_cpus=0)
class Consumer:
    def ready(self, name: str) -> None:
        RayDistQueue.connect(name)

    def run(self, name: str, total: int, batch: int) -> tuple[float, int]:
        q = RayDistQueue.connect(name)
        start, got, nbytes = time.perf_counter(), 0, 0
        while got < total:
            b = q.get("c", ["response_ids", "behaviour_logprobs", "versions", "reward"], batch, block=True, timeout=5)
            got += len(b)
            q.retire(b.row_ids)
        return time.perf_counter() - start, got


def throughput_once(num_shards: int, rows: dict[str, list], repeats: int, batch: int) -> float:
    name = f"tp-{os.getpid()}-{num_shards}-{time.monotonic_ns()}"
    q = RayDistQueue(QueueConfig(COLUMNS, capacity=8 * batch), num_shards=num_shards, name=name)
    prod, cons = Producer.remote(), Consumer.remote()
    ray.get([prod.ready.remote(name), cons.ready.remote(name)])  # actor start-up is not queue time
    total = repeats * len(rows["reward"])
    start = time.perf_counter()
    done = cons.run.remote(name, total, batch)
    ray.get(prod.run.remote(name, rows, repeats, batch))
    _, got = ray.get(done)
    seconds = time.perf_counter() - start
    assert got == total
    for a in (prod, cons):
        ray.kill(a)
    q.shutdown()
    return total / seconds


def throughput_section(reps: int, repeats: int, smoke: bool = False) -> dict[int, float]:
    """`smoke`: one run on 2 shards, no warm-up (the same calls; each run starts its own actors)."""
    rows = long_tail_rows(256, seed=2)
    mb_per_row = pack_columns(Schema(COLUMNS), rows, 256).nbytes / 256 / 1e6
    results: dict[int, list[float]] = {2: []} if smoke else {1: [], 2: [], 4: []}
    if not smoke:
        throughput_once(1, rows, 1, 64)  # warm-up: actor processes, imports
    for _ in range(reps):
        for shards in results:
            results[shards].append(throughput_once(shards, rows, repeats, 64))
    print(f"\n## Ray backend throughput (256 long-tail rows x {repeats}, batches of 64, {mb_per_row * 1e3:.0f} kB/row packed; "
          f"median of {reps})")
    print("| shards | rows/s | MB/s | runs (rows/s) |\n|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"| {k} | {med[k]:.0f} | {med[k] * mb_per_row:.1f} | {', '.join(f'{x:.0f}' for x in v)} |")
    return med


# ---- the RL loop: rows put and read by the devices ----

# (name, overrides): how a run uses the queue. Co-located: each device puts its scored rows and
# reads its share for the update. Separated with the scorers on the train devices: reward and
# reference read each row once its rollout columns are ready (per-column readiness) while the
# rollout devices still decode. TP2: one device per tensor-parallel group reads the update's
# rows and broadcasts them (hierarchical reads).
RL_VARIANTS = (("colocated dp2", []),
               ("separated, scorers on the train device", ["deploy.mode=separated", "deploy.scorers=train"]),
               ("colocated tp2, hierarchical reads", ["deploy.train_tp=2"]))


def rl_run(overrides: list[str], steps: int, smoke: bool) -> tuple[list[dict[str, float]], float]:
    """`steps` steps of the default run (after a warm-up step) on 2 Ray devices; each step's
    metrics and the queue's get requests per step."""
    import tempfile
    from pathlib import Path

    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import find_base
    from rlfusion.runtime.train_config import TrainConfig
    from rlfusion.runtime.trainer import RLTrainer

    size = ["rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8"] if smoke else []
    cfg = load_config(TrainConfig, None, ["deploy.num_devices=2", "threads=1", *size, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RLTrainer(cfg, Path(tmp), find_base())
        try:
            trainer.train_step()  # warm-up
            before = trainer.devices.queue.stats.get_requests
            rows = [trainer.train_step() for _ in range(steps)]
            requests = (trainer.devices.queue.stats.get_requests - before) / steps
        finally:
            trainer.close()
    return rows, requests


def rl_loop_section(steps: int, smoke: bool) -> float:
    """Each variant's queue time (the devices' reads, writes, retires and waits for rows) as a
    share of their step time, the throughput the queue costs; returns the largest median."""
    print(f"\n## RL loop through the Ray DistQueue (default run, 2 devices, {steps} steps after a warm-up)")
    print("| run | step s | queue s (busiest device) | queue share | queue MB/step | of it across processes "
          "| get requests/step | controller bytes share |\n|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, overrides in RL_VARIANTS[:1] if smoke else RL_VARIANTS:  # smoke: the variants differ in config only
        rows, requests = rl_run(overrides, steps, smoke)
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("time_step_s", "time_queue_s", "queue_share", "queue_bytes", "queue_remote_bytes",
                         "driver_bytes_share")}
        worst = max(worst, med["queue_share"])
        print(f"| {name} | {med['time_step_s']:.2f} | {med['time_queue_s']:.3f} | {med['queue_share']:.1%} "
              f"| {med['queue_bytes'] / 1e6:.2f} | {med['queue_remote_bytes'] / 1e6:.2f} | {requests:.0f} "
              f"| {med['driver_bytes_share']:.3f} |")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="every section at the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    reps, repeats, steps = (1, 1, 1) if args.smoke else (2, 4, 2) if args.quick else (5, 4, 4)
    reduction = wire_bytes_section(64 if args.smoke else 512)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE, configure_logging=False)
    try:
        flat, hier = requests_section(gets=1 if args.smoke else 4)
        throughput_section(reps, repeats, args.smoke)
    finally:
        ray.shutdown()
    share = rl_loop_section(steps, args.smoke)
    print()
    print(f"target wire_bytes_reduction_packed_vs_padded: {reduction:.3f} (goal >= 0.8)")
    print(f"target hierarchical_request_reduction_tp2_pp2: {flat / hier:.2f} (goal >= 4.0)")
    print(f"target rl_loop_queue_overhead: {share:.4f} (goal <= 0.05)")

if __name__ == "__main__":
    main()
