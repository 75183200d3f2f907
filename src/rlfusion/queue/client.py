"""`DistQueue`: the in-process client every RL stage talks to.

    producers ──put(columns, row_ids?)──► DistQueue ──get(consumer, columns, count, policy)──► consumers
                                           │  lock + condition: one writer or reader at a time
                                           ├─ QueueController  (readiness, consumed marks, groups, versions)
                                           └─ StorageShard     (cell values)

Values are stored in a canonical form (a 1-D tensor cell becomes a list; see
`ColumnSpec.normalize`), so every backend hands back the same Python values.
A put is validated in full before anything changes, so a bad put leaves the queue as it was.
A get marks what it returns consumed by that consumer in the same critical section, so no row
is delivered twice to one consumer and none is lost. Producers of new rows wait while the
queue is at capacity and raise `QueueFullError` after their timeout; nothing is dropped.

`Batch`, `QueueConfig` and `QueueStats` are shared with the Ray backend (`ray_backend.py`),
which has the same methods. This module does not know about Ray, torch.distributed or the
wire format (`packing.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfusion.queue.controller import POLICIES, Policy, QueueController
from rlfusion.queue.packing import split_balanced
from rlfusion.queue.schema import ColumnSpec, Schema, rows_to_columns
from rlfusion.queue.storage import StorageShard


class QueueFullError(TimeoutError):
    """A put of new rows waited `timeout` seconds and the queue stayed at capacity."""


@dataclass(frozen=True)
class QueueConfig:
    """`capacity`: most live (not retired) rows, None for unbounded. `group_size`: rows per
    group, required by the "group" policy. `put_timeout_s`: how long a put waits for room."""

    columns: tuple[ColumnSpec, ...]
    capacity: int | None = None
    group_size: int | None = None
    put_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {self.capacity}")
        if self.put_timeout_s < 0:
            raise ValueError(f"put_timeout_s must be >= 0, got {self.put_timeout_s}")


@dataclass
class Batch:
    """Rows returned by one `get`: `columns[name][i]` belongs to `row_ids[i]`. `shards[i]`: the
    storage shard holding row i (the Ray backend's; in an RL run, the device it lives on); None
    from the in-process queue."""

    row_ids: list[int]
    group_ids: list[int]
    versions: list[int]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    shards: list[int] | None = field(default=None, compare=False)  # where the rows are, not what they hold

    def __len__(self) -> int:
        return len(self.row_ids)

    def select(self, idx: Sequence[int]) -> "Batch":
        return Batch([self.row_ids[i] for i in idx], [self.group_ids[i] for i in idx],
                     [self.versions[i] for i in idx], {c: [v[i] for i in idx] for c, v in self.columns.items()},
                     None if self.shards is None else [self.shards[i] for i in idx])

    def split_balanced(self, num_ranks: int, length_columns: Sequence[str]) -> list["Batch"]:
        """This batch split across `num_ranks` DP ranks so each gets a near-equal total of
        tokens, counted as the summed lengths of `length_columns` (e.g. prompt + response)."""
        for c in length_columns:
            if c not in self.columns:
                raise ValueError(f"length column {c!r} is not in this batch (it has {sorted(self.columns)})")
        lengths = [sum(len(self.columns[c][i]) for c in length_columns) for i in range(len(self))]
        return [self.select(part) for part in split_balanced(lengths, num_ranks)]


@dataclass
class QueueStats:
    """Traffic counters: requests a backend served and what it sent. `bytes_served` counts
    tensor bytes on the wire (0 for the in-process backend, which has no wire)."""

    get_requests: int = 0
    put_requests: int = 0
    rows_served: int = 0
    bytes_served: int = 0


def check_get_args(schema: Schema, group_size: int | None, consumer: str, columns: Sequence[str],
                   count: int, policy: str) -> None:
    if not consumer or not isinstance(consumer, str):
        raise ValueError(f"consumer must be a non-empty string, got {consumer!r}")
    schema.check_names(columns)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    if policy == "group" and (group_size is None or count % group_size):
        raise ValueError(f"policy 'group' needs a queue group_size and count a multiple of it "
                         f"(group_size={group_size}, count={count})")


def check_checkpoint(schema: Schema, group_size: int | None, state: dict[str, Any]) -> None:
    """A queue checkpoint must have this queue's columns and group size (one-line error if not)."""
    if [tuple(c) for c in state["schema"]] != schema.to_list():
        raise ValueError(f"checkpoint columns {state['schema']} differ from this queue's {schema.to_list()}")
    if state["controller"]["group_size"] != group_size:
        raise ValueError(f"checkpoint group_size {state['controller']['group_size']} differs "
                         f"from this queue's {group_size}")


def normalize_put(schema: Schema, data: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]],
                  row_ids: Sequence[int] | None, group_ids: Sequence[int] | None,
                  versions: Sequence[int] | None) -> tuple[dict[str, list[Any]], int]:
    """A put's columns in stored form and its row count, or a ValueError (nothing changed)."""
    columns = rows_to_columns(data) if not isinstance(data, Mapping) else dict(data)
    if row_ids is not None:
        num_rows = len(row_ids)
        if group_ids is not None or versions is not None:
            raise ValueError("group_ids and versions are set when rows are created, not on existing rows")
    elif columns:
        first = next(iter(columns.values()))
        num_rows = len(first) if isinstance(first, Sequence) else 0  # normalize_columns names the column
    else:  # empty rows, filled in by later puts
        num_rows = len(group_ids or [])
    return schema.normalize_columns(columns, num_rows), num_rows


class DistQueue:
    """Thread-safe in-process queue of rows with per-cell readiness and per-consumer marks."""

    def __init__(self, cfg: QueueConfig):
        self.cfg = cfg
        self.schema = Schema(tuple(cfg.columns))
        self.controller = QueueController(cfg.group_size)
        self.storage = StorageShard()
        self.stats = QueueStats()
        self.wire_bytes = self.remote_bytes = 0  # bytes this client moved to and from storage (none in process)
        self._cond = threading.Condition(threading.Lock())

    def __len__(self) -> int:
        with self._cond:
            return self.controller.num_live

    # ---- writes ----

    def put(self, data: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]], *,
            row_ids: Sequence[int] | None = None, group_ids: Sequence[int] | None = None,
            versions: Sequence[int] | None = None, timeout: float | None = None) -> list[int]:
        """Write cells. Without `row_ids`, add new rows (waiting for room up to `timeout`,
        default `cfg.put_timeout_s`); with them, add columns to those existing rows.
        `data` is either column -> one value per row, or a list of row dicts. Returns row ids."""
        columns, num_rows = normalize_put(self.schema, data, row_ids, group_ids, versions)
        with self._cond:
            self.stats.put_requests += 1
            if row_ids is not None:
                self.controller.check_writable(row_ids, list(columns))
                self.storage.write(row_ids, columns)
                self.controller.mark_ready(row_ids, list(columns))
                self._cond.notify_all()
                return list(row_ids)
            cap = self.cfg.capacity
            self.controller.check_new_rows(num_rows, group_ids, versions, cap)
            timeout = self.cfg.put_timeout_s if timeout is None else timeout
            deadline = time.monotonic() + timeout
            while not self.controller.has_room(num_rows, cap):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueFullError(f"queue stayed full ({self.controller.num_live}/{cap} rows) "
                                         f"for {timeout:.3g}s; retire consumed rows or raise capacity")
                self._cond.wait(left)
                if group_ids is not None:  # another producer may have added to these groups meanwhile
                    self.controller.check_new_groups(group_ids)
            ids = self.controller.add_rows(num_rows, group_ids, versions, list(columns))
            self.storage.write(ids, columns)
            self._cond.notify_all()
        return ids

    # ---- reads ----

    def get(self, consumer: str, columns: Sequence[str], count: int, policy: Policy = "fifo",
            block: bool = False, timeout: float | None = None, groups: Sequence[int] | None = None,
            min_count: int | None = None) -> Batch:
        """Up to `count` rows whose `columns` are all ready and that `consumer` has not had,
        now marked consumed by it; with `groups`, rows of those group ids only. With `block`,
        wait until `min_count` rows (default `count`) are available or `timeout` passes (None:
        forever), then return what there is (possibly fewer); with `groups` the wait also ends
        once `consumer` has had every row of those groups (`group_size` each)."""
        check_get_args(self.schema, self.cfg.group_size, consumer, columns, count, policy)
        need = count if min_count is None else min_count
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            rows = self.controller.select(consumer, columns, count, policy, groups)
            while block and len(rows) < need and not (groups is not None and
                                                      self.controller.groups_taken(consumer, groups)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
                rows = self.controller.select(consumer, columns, count, policy, groups)
            self.controller.mark_consumed(consumer, rows)
            self.stats.get_requests += 1
            self.stats.rows_served += len(rows)
            meta = [self.controller.rows[r] for r in rows]
            cells = self.storage.read(rows, columns)
        for c in columns:  # copies, so a consumer editing its lists cannot change the stored cells
            if self.schema.spec(c).variable_length:
                cells[c] = [list(v) for v in cells[c]]
        return Batch(rows, [m.group_id for m in meta], [m.version for m in meta], cells)

    def get_rows(self, consumer: str, row_ids: Sequence[int], columns: Sequence[str],
                 timeout: float | None = None) -> Batch:
        """The named rows, in that order, marked consumed by `consumer`: a reader told which
        rows to take (by the controller of a run) waits until their `columns` are all ready,
        up to `timeout` seconds (None: forever; TimeoutError after it)."""
        self.schema.check_names(columns)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.controller.check_rows(consumer, row_ids)
            while not self.controller.rows_ready(row_ids, columns):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"rows for {consumer!r} not ready in {timeout:.3g}s")
                self._cond.wait(left)
                self.controller.check_rows(consumer, row_ids)
            self.controller.mark_consumed(consumer, row_ids)
            self.stats.get_requests += 1
            self.stats.rows_served += len(row_ids)
            meta = [self.controller.rows[r] for r in row_ids]
            cells = self.storage.read(row_ids, columns)
        for c in columns:
            if self.schema.spec(c).variable_length:
                cells[c] = [list(v) for v in cells[c]]
        return Batch(list(row_ids), [m.group_id for m in meta], [m.version for m in meta], cells)

    def count_consumed(self, consumer: str, groups: Sequence[int]) -> int:
        """How many live rows of these group ids `consumer` has had (readers that share a
        consumer's rows know from it when all of a batch is taken)."""
        with self._cond:
            return self.controller.count_consumed(consumer, groups)

    # ---- retiring ----

    def retire(self, row_ids: Sequence[int]) -> list[int]:
        """Drop these rows' data and free their capacity; returns the ids actually retired."""
        with self._cond:
            done = self.controller.retire(row_ids)
            self.storage.drop(done)
            self._cond.notify_all()
        return done

    def clear_consumed(self, consumers: Sequence[str]) -> list[int]:
        """Retire every row that all of `consumers` have consumed."""
        if not consumers:
            raise ValueError("clear_consumed needs at least one consumer")
        with self._cond:
            done = self.controller.retire(self.controller.consumed_by_all(consumers))
            self.storage.drop(done)
            self._cond.notify_all()
        return done

    # ---- checkpoint ----

    def state_dict(self) -> dict[str, Any]:
        """Plain Python (and whatever the cells hold): safe for `torch.save`."""
        with self._cond:
            return {"schema": self.schema.to_list(), "controller": self.controller.state_dict(),
                    "storage": self.storage.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_checkpoint(self.schema, self.cfg.group_size, state)
        with self._cond:
            self.controller.load_state_dict(state["controller"])
            self.storage.load_state_dict(state["storage"])
            self._cond.notify_all()
