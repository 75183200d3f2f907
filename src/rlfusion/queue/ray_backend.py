"""The Ray backend of DistQueue: one controller actor for metadata, N storage shards for data.

    producer ──1 reserve / begin_write──► QueueControllerActor   (row ids, each row's shard, readiness,
             ──2 write(WireBatch)───────► shard k                 consumed marks, policies, capacity;
             ──3 commit─────────────────► QueueControllerActor     no cell data)
    consumer ──1 acquire(consumer, columns, count, policy)──► controller: row ids and their shards, now consumed
             ──2 read(row ids, columns)───────────────────► each shard holding some of them, directly

A shard is a `StorageHost` (`shard_host.py`). In an RL run each device worker hosts one, so a
device's rows live with it: the writer picks a new row's shard (its client's own, else r % N, as
for the driver) and the controller records it; a later column goes where its row lives; a client
in a device process moves its own shard's rows by plain calls. A queue without devices starts N
standalone shard actors. Data never passes through the controller: it hands out row ids and
shards, the client moves the packed columns (`WireBatch`) to and from the shards itself. Writes
are two-phase (see `QueueController`), so a reader never sees a cell whose data is not stored
yet. A device that dies takes its rows with it; the run stops then anyway and resumes from a
checkpoint, which holds the rows.

`RayDistQueue` has the same methods and guarantees as the in-process `DistQueue`, and the same
checkpoint format (with each row's shard, so a restore puts it back on its device), so a state
saved by one loads into the other. Another process attached to the same Ray cluster reaches the
queue by name with `RayDistQueue.connect(name)`.

Not here: torch.distributed (see `hierarchical.py`) and which stage reads what.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from rlfusion.queue.client import (Batch, QueueConfig, QueueFullError, QueueStats, check_checkpoint,
                                   check_get_args, normalize_put)
from rlfusion.queue.controller import Policy, QueueController
from rlfusion.queue.packing import pack_columns, unpack_columns
from rlfusion.queue.schema import Schema
from rlfusion.queue.shard_host import STORAGE_GROUP, StorageHost


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
        self.drop_after_read: dict[int, int] = {}  # row id -> its shard

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

    def get_shards(self) -> list[Any]:  # (for clients that connect, or were sent before `set_shards`)
        return self.shards

    async def reserve(self, num_rows: int, group_ids: list[int] | None, versions: list[int] | None,
                      columns: list[str], timeout: float, shard: int | None = None) -> tuple[list[int], list[int]]:
        """New row ids with `columns` pending, once there is room (QueueFullError after `timeout`),
        and their shard: the writer's own `shard`, or r % N for a writer without one."""
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
            ids = self.controller.add_rows(num_rows, group_ids, versions, columns, ready=False)
            where = [r % self.num_shards if shard is None else shard for r in ids]
            self.controller.place(ids, where)
            return ids, where

    def begin_write(self, row_ids: list[int], columns: list[str]) -> list[int]:
        """Reserve the cells of existing rows; their shards (a column goes where its row lives)."""
        self.controller.begin_write(row_ids, columns)
        self.stats.put_requests += 1
        return [self.controller.rows[r].shard for r in row_ids]

    async def commit(self, row_ids: list[int], columns: list[str], shards: list[int]) -> None:
        self.controller.commit(row_ids, columns)
        # rows retired while their data was on the way: their shards just stored it again
        self._drop({r: k for r, k in zip(row_ids, shards) if self.controller.is_retired(r)})
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

    def _serve(self, consumer: str, rows: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Mark `rows` consumed by `consumer` and being read; their group ids, versions and shards."""
        self.controller.mark_consumed(consumer, rows)
        for r in rows:
            self.reading[r] = self.reading.get(r, 0) + 1
        self.stats.get_requests += 1
        self.stats.rows_served += len(rows)
        meta = [self.controller.rows[r] for r in rows]
        return [m.group_id for m in meta], [m.version for m in meta], [m.shard for m in meta]

    async def acquire(self, consumer: str, columns: list[str], count: int, policy: Policy, block: bool,
                      timeout: float | None, groups: list[int] | None = None, min_count: int | None = None
                      ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Row ids (with group ids, versions and shards) for `consumer`, marked consumed by it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        found: list[int] = []
        need = count if min_count is None else min_count

        def enough() -> bool:
            found[:] = self.controller.select(consumer, columns, count, policy, groups)
            return (not block or len(found) >= need
                    or (groups is not None and self.controller.groups_taken(consumer, groups)))
        async with self._condition():
            await self._wait_until(enough, deadline)
            groups, versions, shards = self._serve(consumer, found)
        return found, groups, versions, shards

    async def acquire_rows(self, consumer: str, row_ids: list[int], columns: list[str],
                           timeout: float | None) -> tuple[list[int], list[int], list[int]]:
        """`row_ids` for `consumer` once their `columns` are ready (woken by each commit),
        marked consumed by it; returns their group ids, versions and shards."""
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
        done = self._retire(row_ids)
        await self._notify()
        return done

    def _retire(self, row_ids: list[int]) -> list[int]:
        """Retire live rows and drop their cells from their shards; the ids retired."""
        where = {r: self.controller.rows[r].shard for r in row_ids if r in self.controller.rows}
        self._drop(where)  # (`retire` skips exactly the rows `where` lacks)
        return self.controller.retire(row_ids)

    async def clear_consumed(self, consumers: list[str]) -> list[int]:
        return await self.retire(self.controller.consumed_by_all(consumers))

    def release(self, row_ids: list[int]) -> None:
        """A reader has its copy of these rows: drop any that were retired meanwhile."""
        done = {}
        for r in row_ids:
            self.reading[r] -= 1
            if not self.reading[r]:
                del self.reading[r]
                if r in self.drop_after_read:
                    done[r] = self.drop_after_read.pop(r)
        self._drop(done)

    def _drop(self, where: dict[int, int]) -> None:
        """Drop rows' cells from their shards (`where`: row id -> shard) once no reader reads them."""
        self.drop_after_read.update({r: k for r, k in where.items() if r in self.reading})
        free = [r for r in where if r not in self.reading]
        for k, rows in _by_shard(free, [where[r] for r in free]).items():
            _storage(self.shards[k], "shard_drop").remote(rows)  # fire and forget: the rows are unreachable

    def num_live(self) -> int:
        return self.controller.num_live

    def get_stats(self) -> QueueStats:
        return self.stats

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
        self.reading, self.drop_after_read = {}, {}  # leases of the old state mean nothing now
        await self._notify()

    async def abort_write(self, row_ids: list[int], columns: list[str], created: bool) -> None:
        """A write whose shard step failed: its cells stop being pending (rows it created are
        retired), so they neither block capacity nor refuse a retry."""
        if created:
            self._retire(row_ids)
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


def _by_shard(row_ids: Sequence[int], shards: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}  # shard -> its rows among `row_ids` (`shards[i]`: row i's), in order
    for r, k in zip(row_ids, shards):
        out.setdefault(k, []).append(r)
    return out


def _storage(shard: Any, method: str) -> Any:
    """A shard's `method` on its host's storage thread, which answers while a device's main thread is busy."""
    return getattr(shard, method).options(concurrency_group=STORAGE_GROUP)


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
    """DistQueue client for the Ray backend; see the module docstring for the data path.
    `wire_bytes` counts every byte this client moved to and from storage, its own shard's
    included; `remote_bytes` the part that crossed a process boundary."""

    def __init__(self, cfg: QueueConfig, num_shards: int = 1, name: str | None = None,
                 _actors: tuple[Any, list[Any] | None] | None = None, placement: list[Any] | None = None,
                 hosted: bool = False):
        """`hosted`: the shards are `StorageHost`s the caller starts (an RL run's device workers)
        and names with `host_shards`; only the controller starts here. `placement`: a Ray
        scheduling strategy per shard started here, then the controller's (e.g. bundles of the
        devices' placement group); None spreads the shards over the cluster's nodes."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        started = 0 if hosted else num_shards
        if placement is not None and len(placement) != started + 1:
            raise ValueError(f"placement needs {started + 1} strategies (one per shard started here, then the "
                             f"controller's), got {len(placement)}")
        if not ray.is_initialized():
            raise RuntimeError("RayDistQueue needs Ray: call ray.init() (or ray.init(address=...)) first")
        self.cfg, self.schema, self.num_shards, self.name = cfg, Schema(tuple(cfg.columns)), num_shards, name
        self.wire_bytes = 0  # bytes this client moved to and from storage, local or remote
        self.remote_bytes = 0  # the part of them that crossed a process boundary
        self.meta_bytes = 0  # row ids, group ids, versions and shards this client sent to or got from the controller
        self.local, self.local_index = None, None  # this process's own shard and its index (`attach`)
        self._own: list[Any] = []  # the shard actors this client started (`shutdown` ends them)
        if _actors is not None:
            self.controller, self._shards = _actors
            return
        named = {} if name is None else {"name": name}  # lives as long as this process's Ray job
        where = placement or ["SPREAD"] * started + ["DEFAULT"]
        # The actors only move metadata and bytes: they take no CPU slot from the RL workers.
        self.controller = ray.remote(QueueControllerActor).options(
            num_cpus=0, max_concurrency=1000, scheduling_strategy=where[-1], **named).remote(cfg, num_shards)
        self._shards = None
        if not hosted:
            host = ray.remote(concurrency_groups={STORAGE_GROUP: 1})(StorageHost)
            self._own = [host.options(num_cpus=0, scheduling_strategy=where[k]).remote(self.schema, k)
                         for k in range(num_shards)]
            self.host_shards(self._own)

    @classmethod
    def connect(cls, name: str) -> "RayDistQueue":
        """Attach to a queue another process created with `name` (same Ray cluster)."""
        try:
            controller = ray.get_actor(name)
        except ValueError:
            raise ValueError(f"no DistQueue named {name!r} on this Ray cluster") from None
        cfg, num_shards = ray.get(controller.config.remote())
        return cls(cfg, num_shards, name, _actors=(controller, None))  # the shards: from the controller, on first use

    def host_shards(self, hosts: Sequence[Any]) -> None:
        """The actors (`StorageHost`s) serving shards 0..N-1, told to the controller for every client."""
        if len(hosts) != self.num_shards:
            raise ValueError(f"the queue has {self.num_shards} shards, got {len(hosts)} hosts")
        self._shards = list(hosts)
        ray.get(self.controller.set_shards.remote(self._shards))

    def attach(self, host: StorageHost, index: int) -> None:
        """`host`, in this client's process, serves shard `index`: new rows go there, by plain calls."""
        if not 0 <= index < self.num_shards:
            raise ValueError(f"shard {index} is out of range: the queue has {self.num_shards} shards")
        self.local, self.local_index = host, index

    @property
    def shards(self) -> list[Any]:  # the shard actors by index, learned from the controller once
        if not self._shards:
            self._shards = ray.get(self.controller.get_shards.remote())
            if not self._shards:
                raise RuntimeError("the queue's shards are not hosted yet (RayDistQueue.host_shards)")
        return self._shards

    def __getstate__(self) -> dict[str, Any]:  # a copy in another process has no shard of its own
        return {**self.__dict__, "local": None, "local_index": None}

    def shutdown(self) -> None:
        """Kill the controller and the shards started here (their data is gone: checkpoint first)."""
        for a in [self.controller, *self._own]:
            ray.kill(a)

    def __len__(self) -> int:
        return _call(self.controller.num_live.remote())

    @property
    def stats(self) -> QueueStats:
        s = _call(self.controller.get_stats.remote())
        s.bytes_served = sum(self._each("shard_bytes_served"))
        return s

    def _each(self, method: str, args: list[tuple] | None = None) -> list[Any]:
        """`method(*args[k])` on every shard k (this process's own by a plain call); the answers."""
        args = args or [()] * self.num_shards
        refs = {k: _storage(sh, method).remote(*args[k]) for k, sh in enumerate(self.shards) if k != self.local_index}
        mine = getattr(self.local, method)(*args[self.local_index]) if self.local is not None else None
        got = dict(zip(refs, ray.get(list(refs.values()))))
        return [mine if k == self.local_index else got[k] for k in range(self.num_shards)]

    # ---- writes ----

    def put(self, data: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]], *,
            row_ids: Sequence[int] | None = None, group_ids: Sequence[int] | None = None,
            versions: Sequence[int] | None = None, timeout: float | None = None) -> list[int]:
        """Same contract as `DistQueue.put`. New rows live on this client's own shard (r % N for
        a client without one); a column added to existing rows goes where they live."""
        columns, num_rows = normalize_put(self.schema, data, row_ids, group_ids, versions)
        names = list(columns)
        if row_ids is None:
            timeout = self.cfg.put_timeout_s if timeout is None else timeout
            ids, where = _call(self.controller.reserve.remote(
                num_rows, None if group_ids is None else list(group_ids),
                None if versions is None else list(versions), names, timeout, self.local_index))
        else:
            ids = list(row_ids)
            where = _call(self.controller.begin_write.remote(ids, names))
        self.meta_bytes += _nbytes((ids, group_ids, versions, where))
        try:
            self._write_shards(ids, where, columns)
        except BaseException:
            ray.get(self.controller.abort_write.remote(ids, names, row_ids is None))
            raise
        _call(self.controller.commit.remote(ids, names, where))
        return ids

    def _write_shards(self, ids: list[int], where: list[int], columns: dict[str, list[Any]]) -> None:
        if not columns:
            return
        pos = {r: i for i, r in enumerate(ids)}
        refs, mine = [], None
        for k, rows in _by_shard(ids, where).items():
            part = {c: [vals[pos[r]] for r in rows] for c, vals in columns.items()}
            wire = pack_columns(self.schema, part, len(rows))
            self.wire_bytes += wire.nbytes
            if k == self.local_index:
                mine = (rows, wire)
            else:
                self.remote_bytes += wire.nbytes
                refs.append(_storage(self.shards[k], "shard_write").remote(rows, wire))
        if mine is not None:  # while the remote writes travel
            self.local.shard_write(*mine)
        ray.get(refs)

    # ---- reads ----

    def get(self, consumer: str, columns: Sequence[str], count: int, policy: Policy = "fifo",
            block: bool = False, timeout: float | None = None, groups: Sequence[int] | None = None,
            min_count: int | None = None) -> Batch:
        """Same contract as `DistQueue.get`; the cells come straight from the shards, and the
        batch names each row's shard."""
        check_get_args(self.schema, self.cfg.group_size, consumer, columns, count, policy)
        rows, groups, versions, where = _call(self.controller.acquire.remote(
            consumer, list(columns), count, policy, block, timeout, None if groups is None else list(groups),
            min_count))
        self.meta_bytes += _nbytes((rows, groups, versions, where))
        return Batch(rows, groups, versions, self._read_shards(consumer, rows, where, columns), where)

    def get_rows(self, consumer: str, row_ids: Sequence[int], columns: Sequence[str],
                 timeout: float | None = None) -> Batch:
        """Same contract as `DistQueue.get_rows`; the cells come straight from the shards, and
        the batch names each row's shard."""
        self.schema.check_names(columns)
        rows = list(row_ids)
        groups, versions, where = _call(self.controller.acquire_rows.remote(consumer, rows, list(columns), timeout))
        self.meta_bytes += _nbytes((rows, groups, versions, where))
        return Batch(rows, groups, versions, self._read_shards(consumer, rows, where, columns), where)

    def _read_shards(self, consumer: str, rows: list[int], where: list[int],
                     columns: Sequence[str]) -> dict[str, list[Any]]:
        by_shard = _by_shard(rows, where)
        remote = [k for k in by_shard if k != self.local_index]
        wires = {}
        try:
            refs = [_storage(self.shards[k], "shard_read").remote(by_shard[k], list(columns)) for k in remote]
            if self.local_index in by_shard:  # while the remote reads travel
                wires[self.local_index] = self.local.shard_read(by_shard[self.local_index], list(columns))
            if refs:
                wires.update(zip(remote, ray.get(refs)))
        except BaseException:  # nothing reached the consumer: it may take these rows again
            ray.get(self.controller.unacquire.remote(consumer, rows))
            raise
        finally:
            if rows:
                self.controller.release.remote(rows)
        cell: dict[int, dict[str, Any]] = {}
        for k, wire in wires.items():
            self.wire_bytes += wire.nbytes
            if k != self.local_index:
                self.remote_bytes += wire.nbytes
            vals = unpack_columns(wire)
            for i, r in enumerate(by_shard[k]):
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
        """The in-process format; the controller's part records each row's shard."""
        controller = _call(self.controller.state_dict.remote())
        cells: dict[int, dict[str, Any]] = {}
        for st in self._each("shard_state_dict"):
            cells.update(st["cells"])
        return {"schema": self.schema.to_list(), "controller": controller,
                "storage": {"cells": dict(sorted(cells.items()))}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each row back on the shard the checkpoint records for it (its device's), or on
        r % N where it records none (in-process and older checkpoints) or one this queue lacks."""
        check_checkpoint(self.schema, self.cfg.group_size, state)
        recorded, n = state["controller"].get("shards", {}), self.num_shards
        home = {}
        for r, *_ in state["controller"]["rows"]:
            k = recorded.get(r)
            home[r] = k if isinstance(k, int) and 0 <= k < n else r % n
        parts: list[dict[int, Any]] = [{} for _ in range(n)]
        for r, row in state["storage"]["cells"].items():
            parts[home.get(int(r), int(r) % n)][int(r)] = row
        self._each("shard_load_state_dict", [({"cells": p},) for p in parts])
        _call(self.controller.load_state_dict.remote({**state["controller"], "shards": home}))
