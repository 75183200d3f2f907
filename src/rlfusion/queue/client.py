"""`DistQueue`: the in-process client every RL stage talks to.

    producers ──put(columns, row_ids?)──► DistQueue ──get(consumer, columns, count, policy)──► consumers
                                           │  lock + condition: one writer or reader at a time
                                           ├─ QueueController  (readiness, consumed marks, groups, versions)
                                           └─ StorageShard     (cell values)

A put is validated in full before anything changes, so a bad put leaves the queue as it was.
A get marks what it returns consumed by that consumer in the same critical section, so no row
is delivered twice to one consumer and none is lost. Producers of new rows wait while the
queue is at capacity and raise `QueueFullError` after their timeout; nothing is dropped.

This module does not know about Ray, torch.distributed or the wire format (`packing.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfusion.queue.controller import POLICIES, Policy, QueueController
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
    """Rows returned by one `get`: `columns[name][i]` belongs to `row_ids[i]`."""

    row_ids: list[int]
    group_ids: list[int]
    versions: list[int]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.row_ids)


class DistQueue:
    """Thread-safe in-process queue of rows with per-cell readiness and per-consumer marks."""

    def __init__(self, cfg: QueueConfig):
        self.cfg = cfg
        self.schema = Schema(tuple(cfg.columns))
        self.controller = QueueController(cfg.group_size)
        self.storage = StorageShard()
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
        columns = rows_to_columns(data) if not isinstance(data, Mapping) else dict(data)
        if row_ids is not None:
            num_rows = len(row_ids)
        elif columns:
            first = next(iter(columns.values()))
            num_rows = len(first) if isinstance(first, Sequence) else 0  # check_columns names the column
        else:  # empty rows, filled in by later puts
            num_rows = len(group_ids or [])
        self.schema.check_columns(columns, num_rows)
        if row_ids is not None:
            if group_ids is not None or versions is not None:
                raise ValueError("group_ids and versions are set when rows are created, not on existing rows")
            with self._cond:
                self.controller.check_writable(row_ids, list(columns))
                self.storage.write(row_ids, columns)
                self.controller.mark_ready(row_ids, list(columns))
                self._cond.notify_all()
            return list(row_ids)
        return self._put_new(columns, num_rows, group_ids, versions, timeout)

    def _put_new(self, columns: dict[str, Sequence[Any]], num_rows: int, group_ids: Sequence[int] | None,
                 versions: Sequence[int] | None, timeout: float | None) -> list[int]:
        for name, given in (("group_ids", group_ids), ("versions", versions)):
            if given is not None and (len(given) != num_rows or not all(isinstance(x, int) for x in given)):
                raise ValueError(f"{name}: expected {num_rows} ints, got {list(given)!r}")
        if group_ids is None and self.cfg.group_size is not None:
            raise ValueError(f"group_ids are required: the queue has group_size={self.cfg.group_size}")
        cap = self.cfg.capacity
        if cap is not None and num_rows > cap:
            raise ValueError(f"put of {num_rows} rows can never fit capacity={cap}")
        timeout = self.cfg.put_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if group_ids is not None:
                    self.controller.check_new_groups(group_ids)
                if cap is None or self.controller.num_live + num_rows <= cap:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueFullError(f"queue stayed full ({self.controller.num_live}/{cap} rows) "
                                         f"for {timeout:.3g}s; retire consumed rows or raise capacity")
                self._cond.wait(left)
            first = self.controller.next_row_id
            groups = list(group_ids) if group_ids is not None else list(range(first, first + num_rows))
            ids = self.controller.add_rows(groups, list(versions or [0] * num_rows), list(columns))
            self.storage.write(ids, columns)
            self._cond.notify_all()
        return ids

    # ---- reads ----

    def get(self, consumer: str, columns: Sequence[str], count: int, policy: Policy = "fifo",
            block: bool = False, timeout: float | None = None) -> Batch:
        """Up to `count` rows whose `columns` are all ready and that `consumer` has not had,
        now marked consumed by it. With `block`, wait until `count` rows are available or
        `timeout` passes (None: forever), then return what there is (possibly fewer)."""
        self._check_get(consumer, columns, count, policy)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            rows = self.controller.select(consumer, columns, count, policy)
            while block and len(rows) < count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
                rows = self.controller.select(consumer, columns, count, policy)
            self.controller.mark_consumed(consumer, rows)
            meta = [self.controller.rows[r] for r in rows]
            return Batch(rows, [m.group_id for m in meta], [m.version for m in meta],
                         self.storage.read(rows, columns))

    def _check_get(self, consumer: str, columns: Sequence[str], count: int, policy: str) -> None:
        if not consumer or not isinstance(consumer, str):
            raise ValueError(f"consumer must be a non-empty string, got {consumer!r}")
        self.schema.check_names(columns)
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        G = self.cfg.group_size
        if policy == "group" and (G is None or count % G):
            raise ValueError(f"policy 'group' needs a queue group_size and count a multiple of it "
                             f"(group_size={G}, count={count})")

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
        if [tuple(c) for c in state["schema"]] != self.schema.to_list():
            raise ValueError(f"checkpoint columns {state['schema']} differ from this queue's {self.schema.to_list()}")
        if state["controller"]["group_size"] != self.cfg.group_size:
            raise ValueError(f"checkpoint group_size {state['controller']['group_size']} differs "
                             f"from this queue's {self.cfg.group_size}")
        with self._cond:
            self.controller.load_state_dict(state["controller"])
            self.storage.load_state_dict(state["storage"])
            self._cond.notify_all()
