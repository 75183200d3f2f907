"""`QueueController`: the queue's metadata, never its data.

It owns, per row: which columns are ready, which consumers have consumed it, its group id and
policy version, and whether it is retired. It decides which rows a `get` returns (the sampling
policies). Cell values live in `StorageShard`s; a distributed backend can put the controller
in one actor and the shards elsewhere without changing this file.

Consumed marks are per row, not per column: a consumer is one task reading a fixed set of
columns, so a column added after it took the row does not hand the row to it again.

A write that goes to remote storage is two-phase: `add_rows` / `begin_write` reserve the
cells (pending: nobody else may write them, nobody may read them yet), the data goes to the
shards, then `commit` makes them ready. A reader therefore never sees a cell before its data
is stored.

Not thread-safe on its own: `DistQueue` calls it under its lock, the Ray controller actor from
its single event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["fifo", "group", "oldest_version"]
POLICIES: tuple[str, ...] = ("fifo", "group", "oldest_version")


def row_runs(row_ids: Sequence[int]) -> tuple[int, ...]:
    """Row ids as runs of consecutive ids, (first, count, first, count, ...): the wire form of a
    list of rows (rows written by one put have consecutive ids, so a batch is a few runs)."""
    out: list[int] = []
    for r in row_ids:
        if out and out[-2] + out[-1] == r:
            out[-1] += 1
        else:
            out += [r, 1]
    return tuple(out)


def runs_rows(runs: Sequence[int]) -> list[int]:
    """`row_runs`' inverse: the row ids, in order."""
    return [r for first, n in zip(runs[::2], runs[1::2]) for r in range(first, first + n)]


@dataclass
class RowMeta:
    """Metadata of one live row."""

    group_id: int
    version: int
    ready: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)  # being written to storage, not yet readable
    consumed: set[str] = field(default_factory=set)
    shard: int | None = None  # the storage shard holding its cells (Ray backend; None in process)


class QueueController:
    """Row metadata and the sampling decisions built on it."""

    def __init__(self, group_size: int | None = None):
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self.rows: dict[int, RowMeta] = {}  # live rows, in insertion (= row id) order
        self.groups: dict[int, list[int]] = {}  # group id -> live row ids
        self.next_row_id = 0  # ids below it that are not live are retired (no set that grows)

    @property
    def num_live(self) -> int:
        return len(self.rows)

    def is_retired(self, row_id: int) -> bool:
        """Rows are only ever added with the next ids and removed by `retire`."""
        return 0 <= row_id < self.next_row_id and row_id not in self.rows

    # ---- checks (raise before anything changes) ----

    def check_writable(self, row_ids: Sequence[int], columns: Sequence[str]) -> None:
        if len(set(row_ids)) != len(row_ids):
            raise ValueError(f"row ids repeat in one put: {list(row_ids)}")
        for r in row_ids:
            if self.is_retired(r):
                raise ValueError(f"row {r} is retired; it cannot be written")
            if r not in self.rows:
                raise ValueError(f"row {r} does not exist (next new row id is {self.next_row_id})")
            m = self.rows[r]
            again = (m.ready | m.pending).intersection(columns)
            if again:
                raise ValueError(f"row {r}: column {sorted(again)[0]!r} is already written")

    def check_new_rows(self, num_rows: int, group_ids: Sequence[int] | None, versions: Sequence[int] | None,
                       capacity: int | None) -> None:
        for name, given in (("group_ids", group_ids), ("versions", versions)):
            if given is not None and (len(given) != num_rows or not all(type(x) is int for x in given)):
                raise ValueError(f"{name}: expected {num_rows} ints, got {list(given)!r}")
        if group_ids is None and self.group_size is not None:
            raise ValueError(f"group_ids are required: the queue has group_size={self.group_size}")
        if capacity is not None and num_rows > capacity:
            raise ValueError(f"put of {num_rows} rows can never fit capacity={capacity}")
        if group_ids is not None:
            self.check_new_groups(group_ids)

    def has_room(self, num_rows: int, capacity: int | None) -> bool:
        return capacity is None or self.num_live + num_rows <= capacity

    def check_new_groups(self, group_ids: Sequence[int]) -> None:
        if self.group_size is None:
            return
        counts: dict[int, int] = {}
        for g in group_ids:
            counts[g] = counts.get(g, 0) + 1
        for g, n in counts.items():
            if len(self.groups.get(g, ())) + n > self.group_size:
                raise ValueError(f"group {g} would have more than group_size={self.group_size} rows")

    # ---- mutations ----

    def add_rows(self, num_rows: int, group_ids: Sequence[int] | None, versions: Sequence[int] | None,
                 columns: Sequence[str], ready: bool = True) -> list[int]:
        """New rows (group id = row id when not given, version 0 when not given) with `columns`
        ready, or pending until `commit` when `ready` is False."""
        ids = list(range(self.next_row_id, self.next_row_id + num_rows))
        self.next_row_id += num_rows
        groups = list(group_ids) if group_ids is not None else ids
        for r, g, v in zip(ids, groups, versions if versions is not None else [0] * num_rows):
            meta = RowMeta(group_id=g, version=v)
            (meta.ready if ready else meta.pending).update(columns)
            self.rows[r] = meta
            self.groups.setdefault(g, []).append(r)
        return ids

    def place(self, row_ids: Sequence[int], shards: Sequence[int]) -> None:
        """Record the storage shard of each row (the Ray backend's: where its cells live)."""
        for r, k in zip(row_ids, shards):
            self.rows[r].shard = k

    def mark_ready(self, row_ids: Sequence[int], columns: Sequence[str]) -> None:
        for r in row_ids:
            self.rows[r].ready.update(columns)

    def begin_write(self, row_ids: Sequence[int], columns: Sequence[str]) -> None:
        self.check_writable(row_ids, columns)
        for r in row_ids:
            self.rows[r].pending.update(columns)

    def commit(self, row_ids: Sequence[int], columns: Sequence[str]) -> None:
        """Pending cells become ready (rows retired meanwhile are skipped)."""
        for r in row_ids:
            m = self.rows.get(r)
            if m is not None:
                m.pending.difference_update(columns)
                m.ready.update(columns)

    def retire(self, row_ids: Sequence[int]) -> list[int]:
        """Retire live rows; unknown or already retired ids are ignored. Returns those retired."""
        done = []
        for r in row_ids:
            meta = self.rows.pop(r, None)
            if meta is None:
                continue
            members = self.groups[meta.group_id]
            members.remove(r)
            if not members:
                del self.groups[meta.group_id]
            done.append(r)
        return done

    def consumed_by_all(self, consumers: Sequence[str]) -> list[int]:
        return [r for r, m in self.rows.items() if all(c in m.consumed for c in consumers)]

    # ---- sampling ----

    def select(self, consumer: str, columns: Sequence[str], count: int, policy: Policy,
               groups: Sequence[int] | None = None) -> list[int]:
        """Row ids to hand `consumer` (not yet marked consumed): at most `count`, all with
        `columns` ready and none consumed by `consumer` before; with `groups`, rows of those
        group ids only."""
        def eligible(r: int) -> bool:
            m = self.rows[r]
            return consumer not in m.consumed and m.ready.issuperset(columns)

        if groups is not None:
            rows = sorted(r for g in set(groups) for r in self.groups.get(g, ()))
            if policy == "oldest_version":
                rows.sort(key=lambda r: self.rows[r].version)
            if policy != "group":
                return [r for r in rows if eligible(r)][:count]
            wanted = set(groups)
        if policy == "fifo":
            out = []
            for r in self.rows:
                if len(out) == count:
                    break
                if eligible(r):
                    out.append(r)
            return out
        if policy == "oldest_version":
            rows = sorted((m.version, r) for r, m in self.rows.items() if eligible(r))
            return [r for _, r in rows[:count]]
        assert policy == "group" and self.group_size is not None
        out = []
        for g, members in self.groups.items():  # dict order = order each group first appeared
            if len(out) + self.group_size > count:
                break
            if groups is not None and g not in wanted:
                continue
            if len(members) == self.group_size and all(eligible(r) for r in members):
                out.extend(members)
        return out

    def check_rows(self, consumer: str, row_ids: Sequence[int]) -> None:
        """Named rows a reader may take: live, distinct and not yet consumed by `consumer`."""
        if len(set(row_ids)) != len(row_ids):
            raise ValueError("row ids to read must be distinct")
        for r in row_ids:
            m = self.rows.get(r)
            if m is None:
                raise ValueError(f"row {r} is not in the queue (never written, or retired)")
            if consumer in m.consumed:
                raise ValueError(f"row {r} was already consumed by {consumer!r}")

    def rows_ready(self, row_ids: Sequence[int], columns: Sequence[str]) -> bool:
        return all(r in self.rows and self.rows[r].ready.issuperset(columns) for r in row_ids)

    def count_consumed(self, consumer: str, groups: Sequence[int]) -> int:
        """How many live rows of these group ids `consumer` has consumed."""
        return sum(consumer in self.rows[r].consumed for g in set(groups) for r in self.groups.get(g, ()))

    def groups_taken(self, consumer: str, groups: Sequence[int]) -> bool:
        """Whether `consumer` has consumed every row these groups will have (`group_size`
        each): nothing more of them can come to it."""
        return (self.group_size is not None
                and self.count_consumed(consumer, groups) == len(set(groups)) * self.group_size)

    def mark_consumed(self, consumer: str, row_ids: Sequence[int]) -> None:
        for r in row_ids:
            self.rows[r].consumed.add(consumer)

    # ---- checkpoint ----

    def state_dict(self) -> dict[str, Any]:
        state = {
            "group_size": self.group_size,
            "next_row_id": self.next_row_id,
            # pending cells were never stored: a restored queue sees them as unwritten
            "rows": [(r, m.group_id, m.version, sorted(m.ready), sorted(m.consumed)) for r, m in self.rows.items()],
        }
        shards = {r: m.shard for r, m in self.rows.items() if m.shard is not None}
        if shards:  # where each row lives (Ray backend), so a restore puts it back on its device
            state["shards"] = shards
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_size = state["group_size"]
        self.next_row_id = state["next_row_id"]  # (older checkpoints also list "retired": derivable)
        self.rows, self.groups = {}, {}
        shards = state.get("shards", {})  # (absent: in-process and older checkpoints)
        for r, g, v, ready, consumed in state["rows"]:
            self.rows[r] = RowMeta(group_id=g, version=v, ready=set(ready), consumed=set(consumed), shard=shards.get(r))
            self.groups.setdefault(g, []).append(r)
