"""DistQueue's Ray backend (controller actor + storage shards) and hierarchical reads over gloo.

The Ray backend must behave exactly like the in-process one: the same operations give the
same batches and the same checkpoint. Hierarchical reads must give every rank of a TP2 × PP2
group identical data while the queue sees one request per group instead of one per rank.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings, strategies as st

from rlfusion.queue import ColumnSpec, DistQueue, QueueConfig, QueueFullError
from rlfusion.queue.ray_backend import RayDistQueue
from rlfusion.queue.shard_host import STORAGE_GROUP, StorageHost

COLUMNS = (ColumnSpec("prompt", "int32", variable_length=True), ColumnSpec("logprobs", "float32", variable_length=True),
           ColumnSpec("reward", "float64"), ColumnSpec("meta", "object"))


def script(q) -> list:
    """A sequence of operations covering partial readiness, groups and versions; returns what
    every read returned."""
    out = []
    a = q.put({"prompt": [[1, 2], [3]], "meta": ["x", {"k": 1}]}, group_ids=[0, 0], versions=[2, 1])
    b = q.put([{"prompt": [40000, 5], "logprobs": [-0.5, -0.25]}], group_ids=[1], versions=[0])
    out.append(q.get("ref", ["prompt"], 5))
    q.put({"logprobs": [[-1.0, -2.0], [-3.0]], "reward": [1.0, 0.1]}, row_ids=a)
    out.append(q.get("actor", ["prompt", "logprobs", "reward"], 4, policy="group"))
    q.put([{"prompt": [7], "logprobs": [-0.125], "reward": 0.5}], group_ids=[1], versions=[3])
    q.put({"reward": [2.0]}, row_ids=b)
    out.append(q.get("actor", ["prompt", "logprobs", "reward"], 4, policy="group"))
    out.append(q.get("old", ["prompt"], 3, policy="oldest_version"))
    out.append(q.get("share", ["prompt"], 9, groups=[1]))  # readers sharing a batch's groups
    out.append(q.count_consumed("share", [0, 1]))
    out.append(q.get("share", ["prompt"], 9, groups=[0, 1]))
    out.append(q.count_consumed("share", [0, 1]))
    out.append(q.get("share", ["prompt"], 9, block=True, timeout=60, groups=[0, 1], min_count=1))  # all taken: at once
    out.append(q.retire(a))
    out.append(q.get("new", ["prompt", "meta"], 9))
    return out


@pytest.mark.parametrize("num_shards", [1, 3])
def test_ray_backend_matches_in_process(ray_session, num_shards):
    cfg = QueueConfig(COLUMNS, group_size=2)
    rq = RayDistQueue(cfg, num_shards=num_shards)
    assert script(rq) == script(DistQueue(cfg))
    assert rq.stats.get_requests == 8 and rq.stats.bytes_served > 0
    rq.shutdown()


def test_ray_bad_input_and_back_pressure(ray_session):
    q = RayDistQueue(QueueConfig(COLUMNS, capacity=3), num_shards=2)
    ids = q.put({"prompt": [[1], [2]]})
    before = q.state_dict()
    for kwargs, match in [({"data": {"nope": [1]}}, "unknown column"),
                          ({"data": {"prompt": [[1.5]]}}, "column 'prompt'"),
                          ({"data": {"reward": [1.0]}, "row_ids": [99]}, "row 99 does not exist"),
                          ({"data": {"prompt": [[1]]}, "row_ids": [0]}, "already written")]:
        data = kwargs.pop("data")
        with pytest.raises(ValueError, match=match):
            q.put(data, **kwargs)
        assert q.state_dict() == before
    with pytest.raises(QueueFullError, match="full"):
        q.put({"prompt": [[3], [4]]}, timeout=0.1)
    assert len(q) == 2
    q.retire([ids[0]])
    with pytest.raises(ValueError, match=f"row {ids[0]} is retired"):
        q.put({"reward": [1.0]}, row_ids=[ids[0]])
    q.put({"prompt": [[3], [4]]}, timeout=5)
    assert [p for p in q.get("c", ["prompt"], 9).columns["prompt"]] == [[2], [3], [4]]
    q.shutdown()


def test_ray_checkpoint_interchangeable_with_in_process(ray_session, tmp_path):
    cfg = QueueConfig(COLUMNS, group_size=2, capacity=10)
    q = RayDistQueue(cfg, num_shards=2)
    ids = q.put({"prompt": [[1, 2], [3]], "meta": ["p", "p"]}, group_ids=[0, 0], versions=[4, 5])
    q.put({"logprobs": [[-1.0, -1.0]], "reward": [1.0]}, row_ids=[ids[0]])  # row 1 is an unfinished rollout
    q.get("reward_stage", ["logprobs"], 5)
    torch.save(q.state_dict(), tmp_path / "q.pt")
    state = torch.load(tmp_path / "q.pt", weights_only=False)
    local = DistQueue(cfg)
    local.load_state_dict(state)
    assert local.state_dict() == state
    restored = RayDistQueue(cfg, num_shards=3)  # a different shard count is fine
    restored.load_state_dict(local.state_dict())
    assert restored.state_dict() == state
    assert len(restored.get("reward_stage", ["logprobs"], 5)) == 0  # consumed mark survived
    restored.put({"logprobs": [[-2.0]], "reward": [0.0]}, row_ids=[ids[1]])  # finish the partial row
    b = restored.get("actor", ["prompt", "logprobs", "reward", "meta"], 2, policy="group")
    assert b.row_ids == ids and b.versions == [4, 5] and b.columns["logprobs"] == [[-1.0, -1.0], [-2.0]]
    for x in (q, restored):
        x.shutdown()


@ray.remote(num_cpus=0, concurrency_groups={STORAGE_GROUP: 1})  # as the device workers' actors
class Device(StorageHost):
    """A device worker's stand-in: it hosts shard `index` of the queue `name`, as `DeviceWorker`
    does, and its main thread writes, reads and works."""

    def __init__(self, name: str, index: int):
        self.queue = RayDistQueue.connect(name)
        StorageHost.__init__(self, self.queue, index)
        self.busy_since: float | None = None

    def put(self, data: dict) -> list[int]:
        return self.queue.put(data)

    def get_rows(self, row_ids: list[int], columns: list[str]) -> tuple[list, list, int, int]:
        b = self.queue.get_rows("self", row_ids, columns)
        return b.columns[columns[0]], b.shards, self.queue.wire_bytes, self.queue.remote_bytes

    def busy(self, seconds: float) -> tuple[float, float]:
        self.busy_since = time.time()
        time.sleep(seconds)  # (a rollout or an update: the main thread is taken)
        return self.busy_since, time.time()

    def started(self) -> float | None:  # asked on the storage thread
        return self.busy_since


def test_rows_live_with_the_device_that_writes_them(ray_session):
    """A device's rows go to its own shard by a plain call (no byte crosses a process), a peer
    reads them from it while the device's main thread is busy, a column added to them goes where
    they live, and the checkpoint records their shard so a restore puts them back there."""
    name = f"hosted-{uuid.uuid4().hex}"
    cfg = QueueConfig(COLUMNS)
    q = RayDistQueue(cfg, num_shards=2, name=name, hosted=True)
    devices = [Device.remote(name, k) for k in range(2)]
    q.host_shards(devices)
    ids = ray.get(devices[1].put.remote({"prompt": [[1, 2], [3]], "reward": [1.0, 2.0]}))
    busy = devices[1].busy.remote(3.0)
    while ray.get(devices[1].started.options(concurrency_group=STORAGE_GROUP).remote()) is None:
        time.sleep(0.05)  # until the device's main thread is in `busy`
    b = q.get("peer", ["prompt", "reward"], 5)
    read_at = time.time()
    start, end = ray.get(busy)
    assert start < read_at < end  # answered by the storage thread, not after the busy main thread
    assert b.row_ids == ids and b.shards == [1, 1] and b.columns["prompt"] == [[1, 2], [3]]
    assert q.remote_bytes == q.wire_bytes > 0  # the driver has no shard: all its bytes crossed
    q.put({"logprobs": [[-1.0, -2.0], [-3.0]]}, row_ids=ids)  # written by a peer, where the rows live
    got, shards, wire, remote = ray.get(devices[1].get_rows.remote(ids, ["logprobs", "prompt"]))
    assert got == [[-1.0, -2.0], [-3.0]] and shards == [1, 1]
    assert wire > 0 and remote == 0  # its own rows, written and read in process
    other = q.put({"prompt": [[7], [8]]})  # a writer without a shard: r % N
    assert q.get_rows("peer", other, ["prompt"]).shards == [r % 2 for r in other]

    state = q.state_dict()
    assert state["controller"]["shards"] == {ids[0]: 1, ids[1]: 1, **{r: r % 2 for r in other}}
    q.load_state_dict(state)  # each row back on its device
    cells = ray.get([d.shard_state_dict.options(concurrency_group=STORAGE_GROUP).remote() for d in devices])
    assert sorted(cells[1]["cells"]) == sorted([*ids, *(r for r in other if r % 2)])
    assert q.state_dict() == state
    # no shard recorded (in-process and older checkpoints), or one this queue lacks: r % N
    older = {**state, "controller": {k: v for k, v in state["controller"].items() if k != "shards"}}
    elsewhere = {**state, "controller": {**state["controller"], "shards": {r: 5 for r in ids + other}}}
    for s in (older, elsewhere):
        q.load_state_dict(s)
        assert q.get_rows("c", ids, ["prompt"]).shards == [r % 2 for r in ids]
    for d in devices:
        ray.kill(d)
    q.shutdown()


@ray.remote(num_cpus=0)
class Producer:
    def run(self, name: str, p: int, n: int) -> None:
        q = RayDistQueue.connect(name)
        for i in range(n):
            q.put({"prompt": [[p, i] + [0] * (i % 5)], "reward": [float(p * 1000 + i)]})


@ray.remote(num_cpus=0)
class Consumer:
    def run(self, name: str, consumer: str, total: int, batch: int, clear: list[str] | None) -> list[float]:
        q = RayDistQueue.connect(name)
        seen: list[float] = []
        while len(seen) < total:
            b = q.get(consumer, ["prompt", "reward"], batch, block=True, timeout=0.5)
            for pr, rw in zip(b.columns["prompt"], b.columns["reward"]):
                assert rw == pr[0] * 1000 + pr[1]
            seen += b.columns["reward"]
            if clear:
                q.clear_consumed(clear)
        return seen


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_producers=st.integers(1, 3), num_consumers=st.integers(1, 2), rows=st.integers(1, 25),
       batch=st.integers(1, 6), num_shards=st.integers(1, 3), capacity=st.one_of(st.none(), st.integers(8, 16)))
def test_ray_actors_hammer_queue_exactly_once(ray_session, num_producers, num_consumers, rows, batch,
                                              num_shards, capacity):
    name = f"hammer-{uuid.uuid4().hex}"
    q = RayDistQueue(QueueConfig(COLUMNS, capacity=capacity, put_timeout_s=30), num_shards=num_shards, name=name)
    consumers = [f"c{i}" for i in range(num_consumers)]
    total = num_producers * rows
    clear = consumers if capacity is not None else None
    producers = [Producer.remote() for _ in range(num_producers)]
    readers = [Consumer.remote() for _ in consumers]
    done = [r.run.remote(name, c, total, batch, clear) for r, c in zip(readers, consumers)]
    ray.get([p.run.remote(name, k, rows) for k, p in enumerate(producers)], timeout=60)
    expected = sorted(float(p * 1000 + i) for p in range(num_producers) for i in range(rows))
    for seen in ray.get(done, timeout=60):
        assert sorted(seen) == expected  # nothing lost, nothing twice
    for a in producers + readers:
        ray.kill(a)
    q.shutdown()


# ---- hierarchical reads on 4 gloo ranks: one TP2 × PP2 model-parallel group ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hier_worker(rank: int, world: int, port: int, gcs: str, namespace: str, name: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from rlfusion.queue.hierarchical import GroupQueue
    # the driver's namespace, which holds its named actors
    ray.init(address=gcs, namespace=namespace, log_to_driver=False, configure_logging=False)
    q = RayDistQueue.connect(name)
    # rank = pp_stage * tp + tp_rank: rank 0 (stage 0, tp 0) reads, rank 2 (last stage, tp 0) writes
    gq = GroupQueue(q if rank in (0, 2) else None, q.schema, None, reader=0, writer=2)
    batches = [gq.get("actor", ["prompt", "logprobs", "meta"], 3) for _ in range(2)]
    written = gq.put({"reward": [float(sum(b.row_ids)) for b in batches]},
                     row_ids=[batches[0].row_ids[0], batches[1].row_ids[0]])
    every_rank = q.get(f"rank{rank}", ["prompt"], 3)  # the non-hierarchical way: every rank asks
    dist.barrier()
    results[rank] = ([(b.row_ids, b.group_ids, b.versions, b.columns) for b in batches], written,
                     gq.requests, gq.bytes_broadcast, every_rank.row_ids)
    ray.shutdown()
    dist.destroy_process_group()


def test_hierarchical_read_gives_every_rank_identical_data(ray_session):
    name = f"hier-{os.getpid()}"
    q = RayDistQueue(QueueConfig(COLUMNS), num_shards=2, name=name)
    lengths = [3, 50, 7, 1, 200, 9]  # long tail
    q.put({"prompt": [list(range(n)) for n in lengths],
           "logprobs": [[-0.5 * i for i in range(n)] for n in lengths],
           "meta": [f"m{i}" for i in range(6)]},
          versions=[0, 1, 2, 3, 4, 5])
    before = q.stats.get_requests
    results = mp.Manager().dict()
    namespace = ray.get_runtime_context().namespace
    mp.spawn(_hier_worker, args=(4, _free_port(), ray_session, namespace, name, results), nprocs=4, join=True)
    batches = [results[r][0] for r in range(4)]
    assert all(b == batches[0] for b in batches)  # identical on every rank
    assert [len(b[0]) for b in batches[0]] == [3, 3] and batches[0][0][3]["meta"] == ["m0", "m1", "m2"]
    assert batches[0][1][3]["prompt"][1] == list(range(200))
    assert [results[r][1] is not None for r in range(4)] == [False, False, True, False]  # only the writer put
    assert [results[r][2] for r in range(4)] == [2, 0, 1, 0]  # queue requests per rank
    assert results[1][3] == results[0][3] > 0
    hier_gets = 2  # one per get, for the whole group
    every_rank_gets = q.stats.get_requests - before - hier_gets
    assert every_rank_gets == 4  # one per rank for one get: exactly t·p = 4 times the hierarchical count
    assert sorted(results[r][4] == [0, 1, 2] for r in range(4)) == [True] * 4
    assert q.get("check", ["reward"], 6).columns["reward"] == [0.0 + 1 + 2, 3.0 + 4 + 5]  # written by rank 2
    q.shutdown()


def test_ray_failed_shard_write_or_read_loses_and_blocks_nothing(ray_session, monkeypatch):
    q = RayDistQueue(QueueConfig(COLUMNS, capacity=2), num_shards=1)
    ids = q.put({"prompt": [[1], [2]]})

    def broken(*args, **kwargs):
        raise ConnectionError("shard unreachable")

    monkeypatch.setattr(RayDistQueue, "_write_shards", broken)
    with pytest.raises(ConnectionError):
        q.put({"reward": [1.0]}, row_ids=[ids[0]])  # existing rows: the cells are not left pending
    monkeypatch.undo()
    q.put({"reward": [1.0]}, row_ids=[ids[0]])  # the retry is accepted
    q.retire([ids[1]])
    monkeypatch.setattr(RayDistQueue, "_write_shards", broken)
    with pytest.raises(ConnectionError):
        q.put({"prompt": [[3]]})  # new rows: retired, capacity given back
    monkeypatch.undo()
    assert len(q) == 1
    q.put({"prompt": [[4]]}, timeout=1)
    real_get = ray.get
    calls = {"n": 0}

    def failing_read(refs, *a, **kw):  # the shard read (the second ray.get of a get) fails once
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("shard unreachable")
        return real_get(refs, *a, **kw)

    monkeypatch.setattr(ray, "get", failing_read)
    with pytest.raises(ConnectionError):
        q.get("actor", ["prompt"], 5)
    monkeypatch.undo()
    assert q.get("actor", ["prompt"], 5).columns["prompt"] == [[1], [4]]  # nothing lost for "actor"
    q.shutdown()
