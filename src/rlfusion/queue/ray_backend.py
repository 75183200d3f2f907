"""The Ray backend of DistQueue: one controller actor for metadata, N storage-shard actors for data.

    producer ──1 reserve / begin_write──► QueueControllerActor   (row ids, readiness, consumed marks,
             ──2 write(WireBatch)───────► StorageShardActor k      policies, capacity; no cell data)
             ──3 commit─────────────────► QueueControllerActor
    consumer ──1 acquire(consumer, columns, count, policy)──► controller: row ids, now consumed
             ──2 read(row ids, columns)───────────────────► each shard holding some of them, directly

Row r lives on shard r % N. Data never passes through the controller: it hands out row ids, the
client moves the packed columns (`WireBatch`: one flat tensor plus lengths per variable-length
column, integers in their narrowest dtype) to and from the shards itself. Writes are two-phase
(see `QueueController`), so a reader never sees a cell whose data is not stored yet.

`RayDistQueue` has the same methods and guarantees as the in-process `DistQueue`, and the same
checkpoint format, so a state saved by one loads into the other. Another process attached to
the same Ray cluster reaches the queue by name with `RayDistQueue.connect(name)`.

Not here: torch.distributed (see `hierarchical.py`) and which stage reads what.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from rlfusion.queue.client import (Batch, QueueConfig, QueueFullError, QueueStats, check_checkpoint,
                                   check_get_args, normalize_put)
from rlfusion.queue.controller import Policy, QueueController
from rlfusion.queue.packing import WireBatch, narrowest_int_dtype, pack_column, pack_columns, unpack_columns
from rlfusion.queue.schema import Schema
from rlfusion.queue.storage import StorageShard


class QueueControllerActor:
    """Row metadata behind one asyncio event loop: every method runs alone between awaits, so
    the controller needs no lock; waiting puts and gets park on a condition."""

    def __init__(self, cfg: QueueConfig, num_shards: int):
        self.cfg, self.num_shards = cfg, num_shards
        self.controller = QueueController(cfg.group_size)
        self.stats = QueueStats()
        self.shards: list[Any] = []
        self._cond: asyncio.Condition | None = None
        # Rows handed to a reader whose shard read may still be in flight: a retire must not
        # drop their data yet. The client releases them after its read (fire and forget).
        self.reading: dict[int, int] = {}
        self.drop_after_read: set[int] = set()

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # created on the actor's event loop, on first use
            self._cond = asyncio.Condition()
        return self._cond

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def config(self) -> tuple[QueueConfig, int]:
        return self.cfg, self.num_shards

    def set_shards(self, shards: list[Any]) -> None:
        self.shards = shards

    async def reserve(self, num_rows: int, group_ids: list[int] | None, versions: list[int] | None,
                      columns: list[str], timeout: float) -> list[int]:
        """New row ids with `columns` pending, once there is room (QueueFullError after `timeout`)."""
        cap = self.cfg.capacity
        self.controller.check_new_rows(num_rows, group_ids, versions, cap)
        self.stats.put_requests += 1
        deadline = time.monotonic() + timeout
        cond = self._condition()
        async with cond:
            while not self.controller.has_room(num_rows, cap):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueFullError(f"queue stayed full ({self.controller.num_live}/{cap} rows) "
                                         f"for {timeout:.3g}s; retire consumed rows or raise capacity")
                try:
                    await asyncio.wait_for(cond.wait(), left)
                except asyncio.TimeoutError:
                    pass
                if group_ids is not None:
                    self.controller.check_new_groups(group_ids)
            return self.controller.add_rows(num_rows, group_ids, versions, columns, ready=False)

    def begin_write(self, row_ids: list[int], columns: list[str]) -> None:
        self.controller.begin_write(row_ids, columns)
        self.stats.put_requests += 1

    async def commit(self, row_ids: list[int], columns: list[str]) -> None:
        self.controller.commit(row_ids, columns)
        # rows retired while their data was on the way: the shards just stored it again
        self._drop([r for r in row_ids if self.controller.is_retired(r)])
        await self._notify()

    async def _wait_until(self, done: Any, deadline: float | None) -> bool:
        """Wait (woken by each commit and retire) until `done()` holds or `deadline` (monotonic)
        passes; returns `done()`'s last answer. Call with the condition held."""
        cond = self._condition()
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(cond.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    def _serve(self, consumer: str, rows: list[int]) -> tuple[list[int], list[int]]:
        """Mark `rows` consumed by `consumer` and being read; their group ids and versions."""
        self.controller.mark_consumed(consumer, rows)
        for r in rows:
            self.reading[r] = self.reading.get(r, 0) + 1
        self.stats.get_requests += 1
        self.stats.rows_served += len(rows)
        meta = [self.controller.rows[r] for r in rows]
        return [m.group_id for m in meta], [m.version for m in meta]

    async def acquire(self, consumer: str, columns: list[str], count: int, policy: Policy, block: bool,
                      timeout: float | None, groups: list[int] | None = None
                      ) -> tuple[list[int], list[int], list[int]]:
        """Row ids (with group ids and versions) for `consumer`, marked consumed by it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        found: list[int] = []

        def enough() -> bool:
            found[:] = self.controller.select(consumer, columns, count, policy, groups)
            return not block or len(found) >= count
        async with self._condition():
            await self._wait_until(enough, deadline)
            groups, versions = self._serve(consumer, found)
        return found, groups, versions

    async def acquire_rows(self, consumer: str, row_ids: list[int], columns: list[str],
                           timeout: float | None) -> tuple[list[int], list[int]]:
        """`row_ids` for `consumer` once their `columns` are ready (woken by each commit),
        marked consumed by it; returns their group ids and versions."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def ready() -> bool:
            self.controller.check_rows(consumer, row_ids)
            return self.controller.rows_ready(row_ids, columns)
        async with self._condition():
            if not await self._wait_until(ready, deadline):
                raise TimeoutError(f"rows for {consumer!r} not ready in {timeout:.3g}s")
            return self._serve(consumer, row_ids)

    def count_consumed(self, consumer: str, groups: list[int]) -> int:
        return self.controller.count_consumed(consumer, groups)

    async def retire(self, row_ids: list[int]) -> list[int]:
        done = self.controller.retire(row_ids)
        self._drop(done)
        await self._notify()
        return done

    async def clear_consumed(self, consumers: list[str]) -> list[int]:
        return await self.retire(self.controller.consumed_by_all(consumers))

    def release(self, row_ids: list[int]) -> None:
        """A reader has its copy of these rows: drop any that were retired meanwhile."""
        done = []
        for r in row_ids:
            self.reading[r] -= 1
            if not self.reading[r]:
                del self.reading[r]
                if r in self.drop_after_read:
                    self.drop_after_read.discard(r)
                    done.append(r)
        self._drop(done)

    def _drop(self, row_ids: list[int]) -> None:
        busy = [r for r in row_ids if r in self.reading]
        self.drop_after_read.update(busy)
        row_ids = [r for r in row_ids if r not in self.reading]
        by_shard = _by_shard(row_ids, self.num_shards)
        for k, rows in by_shard.items():
            self.shards[k].drop.remote(rows)  # fire and forget: the rows are already unreachable

    def num_live(self) -> int:
        return self.controller.num_live

    def get_stats(self) -> QueueStats:
        return self.stats

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
        self.reading, self.drop_after_read = {}, set()  # leases of the old state mean nothing now
        await self._notify()

    async def abort_write(self, row_ids: list[int], columns: list[str], created: bool) -> None:
        """A write whose shard step failed: its cells stop being pending (rows it created are
        retired), so they neither block capacity nor refuse a retry."""
        if created:
            self._drop(self.controller.retire(row_ids))
        else:
            for r in row_ids:
                if r in self.controller.rows:
                    self.controller.rows[r].pending.difference_update(columns)
        await self._notify()

    async def unacquire(self, consumer: str, row_ids: list[int]) -> None:
        """A get whose shard read failed: the rows become available to `consumer` again."""
        for r in row_ids:
            meta = self.controller.rows.get(r)
            if meta is not None:
                meta.consumed.discard(consumer)
        self.stats.rows_served -= len(row_ids)
        await self._notify()


class StorageShardActor:
    """One slice of the cells (rows r with r % N == k), kept packed: a variable-length cell is a
    1-D tensor slice of the flat tensor it arrived in, so a read only concatenates slices and
    never goes through Python lists."""

    def __init__(self, schema: Schema):
        self.schema, self.storage, self.bytes_served = schema, StorageShard(), 0

    def write(self, row_ids: list[int], wire: WireBatch) -> None:
        cells: dict[str, list[Any]] = dict(wire.objects)
        for name, (values, lengths) in wire.tensors.items():
            cells[name] = values.tolist() if lengths is None else list(torch.split(values, lengths.tolist()))
        self.storage.write(row_ids, cells)

    def read(self, row_ids: list[int], columns: list[str]) -> WireBatch:
        cells = self.storage.read(row_ids, columns)
        wire = WireBatch(len(row_ids))
        for name in columns:
            spec = self.schema.spec(name)
            if spec.dtype == "object":
                wire.objects[name] = cells[name]
            elif spec.variable_length:  # slices of different puts may differ in width: cat promotes
                parts = cells[name]
                flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int8)
                sizes = [p.numel() for p in parts]
                wire.tensors[name] = (flat, torch.tensor(sizes, dtype=narrowest_int_dtype(0, max(sizes, default=0))))
            else:
                wire.tensors[name] = pack_columns(self.schema, {name: cells[name]}, len(row_ids)).tensors[name]
        self.bytes_served += wire.nbytes
        return wire

    def drop(self, row_ids: list[int]) -> None:
        self.storage.drop(row_ids)

    def get_bytes_served(self) -> int:
        return self.bytes_served

    def state_dict(self) -> dict[str, Any]:  # the in-process (list) form, for interchangeable checkpoints
        return {"cells": {r: {c: v.tolist() if isinstance(v, torch.Tensor) else v for c, v in row.items()}
                          for r, row in self.storage.cells.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def cell(name: str, value: Any) -> Any:
            spec = self.schema.spec(name)
            if not spec.variable_length or spec.dtype == "object":
                return value
            return pack_column([value], torch.float64 if spec.dtype == "float64" else torch.float32,
                               is_float=spec.dtype.startswith("float"))[0]

        self.storage.cells = {int(r): {c: cell(c, v) for c, v in row.items()} for r, row in state["cells"].items()}


def _by_shard(row_ids: Sequence[int], num_shards: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in row_ids:
        out.setdefault(r % num_shards, []).append(r)
    return out


def _nbytes(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _call(ref: Any) -> Any:
    """`ray.get`, re-raising an actor's own error (ValueError, QueueFullError, a read's timeout) as itself so the
    caller sees the one-line message, not a remote traceback."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, (ValueError, TimeoutError)):  # QueueFullError is a TimeoutError
            raise e.cause from None
        raise


class RayDistQueue:
    """DistQueue client for the Ray backend; see the module docstring for the data path."""

    def __init__(self, cfg: QueueConfig, num_shards: int = 1, name: str | None = None,
                 _actors: tuple[Any, list[Any]] | None = None, placement: list[Any] | None = None):
        """`placement`: a Ray scheduling strategy per shard, then one for the controller (e.g.
        the bundles of the devices' placement group, so the data sits beside the devices);
        None spreads the shards over the cluster's nodes."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if placement is not None and len(placement) != num_shards + 1:
            raise ValueError(f"placement needs {num_shards + 1} strategies (one per shard, then the controller's), "
                             f"got {len(placement)}")
        if not ray.is_initialized():
            raise RuntimeError("RayDistQueue needs Ray: call ray.init() (or ray.init(address=...)) first")
        self.cfg, self.schema, self.num_shards, self.name = cfg, Schema(tuple(cfg.columns)), num_shards, name
        self.wire_bytes = 0  # bytes this client moved to and from the shards
        self.meta_bytes = 0  # row ids, group ids and versions this client sent to or got from the controller
        if _actors is not None:
            self.controller, self.shards = _actors
            return
        named = {} if name is None else {"name": name}  # lives as long as this process's Ray job
        where = placement or ["SPREAD"] * num_shards + ["DEFAULT"]
        # The actors only move metadata and bytes: they take no CPU slot from the RL workers.
        self.controller = ray.remote(QueueControllerActor).options(
            num_cpus=0, max_concurrency=1000, scheduling_strategy=where[-1], **named).remote(cfg, num_shards)
        self.shards = [ray.remote(StorageShardActor).options(
            num_cpus=0, scheduling_strategy=where[k],
            **({} if name is None else {"name": f"{name}/shard{k}"})).remote(self.schema)
            for k in range(num_shards)]
        ray.get(self.controller.set_shards.remote(self.shards))

    @classmethod
    def connect(cls, name: str) -> "RayDistQueue":
        """Attach to a queue another process created with `name` (same Ray cluster)."""
        try:
            controller = ray.get_actor(name)
        except ValueError:
            raise ValueError(f"no DistQueue named {name!r} on this Ray cluster") from None
        cfg, num_shards = ray.get(controller.config.remote())
        shards = [ray.get_actor(f"{name}/shard{k}") for k in range(num_shards)]
        return cls(cfg, num_shards, name, _actors=(controller, shards))

    def shutdown(self) -> None:
        """Kill the actors (the queue's data is gone; checkpoint first if it matters)."""
        for a in [self.controller, *self.shards]:
            ray.kill(a)

    def __len__(self) -> int:
        return _call(self.controller.num_live.remote())

    @property
    def stats(self) -> QueueStats:
        s = _call(self.controller.get_stats.remote())
        s.bytes_served = sum(ray.get([sh.get_bytes_served.remote() for sh in self.shards]))
        return s

    # ---- writes ----

    def put(self, data: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]], *,
            row_ids: Sequence[int] | None = None, group_ids: Sequence[int] | None = None,
            versions: Sequence[int] | None = None, timeout: float | None = None) -> list[int]:
        """Same contract as `DistQueue.put`."""
        columns, num_rows = normalize_put(self.schema, data, row_ids, group_ids, versions)
        names = list(columns)
        if row_ids is None:
            timeout = self.cfg.put_timeout_s if timeout is None else timeout
            ids = _call(self.controller.reserve.remote(
                num_rows, None if group_ids is None else list(group_ids),
                None if versions is None else list(versions), names, timeout))
        else:
            ids = list(row_ids)
            _call(self.controller.begin_write.remote(ids, names))
        self.meta_bytes += _nbytes((ids, group_ids, versions))
        try:
            self._write_shards(ids, columns)
        except BaseException:
            ray.get(self.controller.abort_write.remote(ids, names, row_ids is None))
            raise
        _call(self.controller.commit.remote(ids, names))
        return ids

    def _write_shards(self, ids: list[int], columns: dict[str, list[Any]]) -> None:
        if not columns:
            return
        pos = {r: i for i, r in enumerate(ids)}
        refs = []
        for k, rows in _by_shard(ids, self.num_shards).items():
            part = {c: [vals[pos[r]] for r in rows] for c, vals in columns.items()}
            wire = pack_columns(self.schema, part, len(rows))
            self.wire_bytes += wire.nbytes
            refs.append(self.shards[k].write.remote(rows, wire))
        ray.get(refs)

    # ---- reads ----

    def get(self, consumer: str, columns: Sequence[str], count: int, policy: Policy = "fifo",
            block: bool = False, timeout: float | None = None, groups: Sequence[int] | None = None) -> Batch:
        """Same contract as `DistQueue.get`; the cells come straight from the shards."""
        check_get_args(self.schema, self.cfg.group_size, consumer, columns, count, policy)
        rows, groups, versions = _call(self.controller.acquire.remote(
            consumer, list(columns), count, policy, block, timeout, None if groups is None else list(groups)))
        self.meta_bytes += _nbytes((rows, groups, versions))
        return Batch(rows, groups, versions, self._read_shards(consumer, rows, columns))

    def get_rows(self, consumer: str, row_ids: Sequence[int], columns: Sequence[str],
                 timeout: float | None = None) -> Batch:
        """Same contract as `DistQueue.get_rows`; the cells come straight from the shards."""
        self.schema.check_names(columns)
        rows = list(row_ids)
        groups, versions = _call(self.controller.acquire_rows.remote(consumer, rows, list(columns), timeout))
        self.meta_bytes += _nbytes((rows, groups, versions))
        return Batch(rows, groups, versions, self._read_shards(consumer, rows, columns))

    def _read_shards(self, consumer: str, rows: list[int], columns: Sequence[str]) -> dict[str, list[Any]]:
        by_shard = _by_shard(rows, self.num_shards)
        try:
            wires = ray.get([self.shards[k].read.remote(rs, list(columns)) for k, rs in by_shard.items()])
        except BaseException:  # nothing reached the consumer: it may take these rows again
            ray.get(self.controller.unacquire.remote(consumer, rows))
            raise
        finally:
            if rows:
                self.controller.release.remote(rows)
        cell: dict[int, dict[str, Any]] = {}
        for rs, wire in zip(by_shard.values(), wires):
            self.wire_bytes += wire.nbytes
            vals = unpack_columns(wire)
            for i, r in enumerate(rs):
                cell[r] = {c: vals[c][i] for c in columns}
        return {c: [cell[r][c] for r in rows] for c in columns}

    def count_consumed(self, consumer: str, groups: Sequence[int]) -> int:
        """Same contract as `DistQueue.count_consumed`."""
        return _call(self.controller.count_consumed.remote(consumer, list(groups)))

    # ---- retiring ----

    def retire(self, row_ids: Sequence[int]) -> list[int]:
        return _call(self.controller.retire.remote(list(row_ids)))

    def clear_consumed(self, consumers: Sequence[str]) -> list[int]:
        if not consumers:
            raise ValueError("clear_consumed needs at least one consumer")
        return _call(self.controller.clear_consumed.remote(list(consumers)))

    # ---- checkpoint (the in-process format; take it while no stage is writing) ----

    def state_dict(self) -> dict[str, Any]:
        controller = _call(self.controller.state_dict.remote())
        cells: dict[int, dict[str, Any]] = {}
        for st in ray.get([sh.state_dict.remote() for sh in self.shards]):
            cells.update(st["cells"])
        return {"schema": self.schema.to_list(), "controller": controller,
                "storage": {"cells": dict(sorted(cells.items()))}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint(self.schema, self.cfg.group_size, state)
        parts: list[dict[int, Any]] = [{} for _ in self.shards]
        for r, row in state["storage"]["cells"].items():
            parts[int(r) % self.num_shards][int(r)] = row
        ray.get([sh.load_state_dict.remote({"cells": p}) for sh, p in zip(self.shards, parts)])
        _call(self.controller.load_state_dict.remote(state["controller"]))
