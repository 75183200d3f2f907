"""StaleSync's rules: pure functions over typed values (the package docstring tells the
schedule they make)."""


from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

from rlfusion.config import check_fields

OVERDUE = ("wait", "drop")
RESUME_KV = ("keep", "recompute")
MAX_STALENESS = 8
# engine steps between the rollout devices' stop-rule sums (2: -10% tokens/s from lock-step waits); the
# runtime's partial rollout and the simulator's model of it both read it
STOP_SYNC_EVERY = 8
JOIN_SHARE = 0.25  # hybrid placement: the train devices' share of the first overlapped rollout's new groups


@dataclass(frozen=True)
class StaleSyncConfig:
    """`enabled=false` runs the plain synchronous loop. `enabled=true` with `max_staleness=0` and
    threshold 1 reproduces it through the StaleSync machinery."""

    enabled: bool = False
    max_staleness: int = 1
    rollout_finish_threshold: float = 1.0  # (0, 1]: fraction of the update's groups; > 1: a count
    overdue: str = "wait"  # what happens to a group that reaches its deadline unfinished
    # how an aborted request resumes (on the device that paused it, which keeps its samples):
    # "keep" its cache row (saved in host memory through the update; it decodes on at once), or "recompute" its
    # prompt and partial output's keys and values with the newer weights (a prefill)
    resume_kv: str = "keep"

    def __post_init__(self) -> None:
        t = self.rollout_finish_threshold
        check_fields("stalesync", {
            "max_staleness": (0 <= self.max_staleness <= MAX_STALENESS,
                              f"must be in [0, {MAX_STALENESS}] (0 = synchronous; (s+1) x the batch is in flight)"),
            "rollout_finish_threshold": (0 < t <= 1 or (t > 1 and float(t).is_integer()),
                                         "allowed: a fraction in (0, 1] or a whole count > 1"),
            "overdue": (self.overdue in OVERDUE, f"allowed: {', '.join(OVERDUE)}"),
            "resume_kv": (self.resume_kv in RESUME_KV, f"allowed: {', '.join(RESUME_KV)}"),
        }, self)
        if not self.enabled:
            self._refuse_unused_keys()

    def _refuse_unused_keys(self) -> None:
        # The synchronous loop reads none of these: a changed one is a forgotten `enabled=true`.
        # A value equal to the default cannot be told from an unset key, so it passes.
        for f in fields(self):
            if f.name != "enabled" and getattr(self, f.name) != f.default:
                raise ValueError(f"stalesync.{f.name}={getattr(self, f.name)!r} has no effect unless "
                                 f"stalesync.enabled=true; set stalesync.enabled=true or drop the key")


class GroupItem(NamedTuple):
    """An entry of a rollout: a group to run. A new group (`resume` false) starts `group_size`
    samples of problem `problem_id`; a resumed one continues its paused samples, held by the
    rollout device of index `held_by`, or (`held_by` = -1) handed over through the queue as
    rows `rows`."""

    group_id: int
    problem_id: int
    resume: bool = False
    held_by: int = -1
    rows: tuple[int, ...] = ()


def pack_items(items: list[GroupItem]) -> tuple[list[int], list[int]]:
    """A rollout device's part of a plan in its wire form, small non-negative ints: the new
    groups (problem id = group id) as runs of consecutive ids (first, count, ...), and the
    others as (group id, problem id, resume, holder + 1, first row, row count) each — a put's
    rows have consecutive ids."""
    runs: list[int] = []
    others: list[int] = []
    for it in items:
        if not it.resume and it.problem_id == it.group_id and not it.rows and it.held_by == -1:
            if runs and runs[-2] + runs[-1] == it.group_id:
                runs[-1] += 1
            else:
                runs += [it.group_id, 1]
            continue
        if it.rows and tuple(it.rows) != tuple(range(it.rows[0], it.rows[0] + len(it.rows))):
            raise ValueError(f"group {it.group_id}: rows {it.rows} are not consecutive")
        others += [it.group_id, it.problem_id, int(it.resume), it.held_by + 1, it.rows[0] if it.rows else 0,
                   len(it.rows)]
    return runs, others


def unpack_items(packed: tuple[list[int], list[int]]) -> list[GroupItem]:
    """`pack_items`' inverse, in group order."""
    runs, others = packed
    out = [GroupItem(g, g) for first, n in zip(runs[::2], runs[1::2]) for g in range(first, first + n)]
    out += [GroupItem(g, p, bool(r), h - 1, tuple(range(a, a + n)))
            for g, p, r, h, a, n in zip(*(others[i::6] for i in range(6)))]
    return sorted(out, key=lambda it: it.group_id)


@dataclass(frozen=True)
class RolloutPlan:
    """One partial rollout, with weights `version`, for the update of `update_version`.

    `items` are every unfinished group in flight (`GroupItem`), oldest first; `due` the ones among them whose deadline is this update; `quota` how many more groups
    must finish before the rollout may stop; `drop`: the due groups that have not finished when
    it stops are given up (`overdue="drop"`) instead of waited for."""

    version: int
    update_version: int
    items: tuple[GroupItem, ...]
    due: frozenset[int]
    quota: int
    drop: bool

    @property
    def group_ids(self) -> list[int]:
        return [it.group_id for it in self.items]


# ---- the rules (pure functions) ----

def overlaps(mode: str, cfg: StaleSyncConfig) -> bool:
    """Whether the next update's rollout runs alongside the update: separated and hybrid
    placements (rollout devices that do not train) with StaleSync and s >= 1."""
    return mode in ("separated", "hybrid") and cfg.enabled and cfg.max_staleness >= 1


def finish_quota(threshold: float, batch_groups: int) -> int:
    """Finished groups an update's rollout aims for: `threshold` × B rounded up for a fraction in
    (0, 1], the count itself for a threshold > 1; never more than B."""
    return min(batch_groups, math.ceil(threshold * batch_groups - 1e-9) if threshold <= 1 else int(threshold))


def admissible(in_flight: int, reserved: int, max_staleness: int, batch_groups: int) -> int:
    """How many new groups may be admitted: the groups in flight plus `reserved` (taken for an
    update that has not run yet) stay at most (s + 1) × B, so each can train within s updates."""
    return max(0, (max_staleness + 1) * batch_groups - in_flight - reserved)


def is_due(admitted_version: int, max_staleness: int, update_version: int) -> bool:
    """A group admitted under weights `admitted_version` must be in the update of
    `admitted_version + s` at the latest."""
    return admitted_version + max_staleness <= update_version


def due_groups(groups, max_staleness: int, update_version: int) -> frozenset[int]:
    """Ids of the `groups` whose deadline is the update of `update_version` (or earlier)."""
    return frozenset(g.group_id for g in groups if is_due(g.admitted_version, max_staleness, update_version))


def rollout_quota(quota: int, finished: int, due: int, drop: bool) -> int:
    """How many more groups a rollout must finish: the threshold's `quota` less the `finished`
    groups already waiting to train. With `drop` and `due` groups in the rollout, at least one:
    a due group gets this last rollout before it can be given up."""
    left = max(0, quota - finished)
    return max(left, 1) if drop and due else left


def rollout_stops(finished: int, due_unfinished: int, busy: int, failed: int, *, quota: int,
                  drop_overdue: bool) -> bool:
    """The partial rollout's stop rule, over one device's counts or their sums over the rollout
    devices: stop on a failure, when nothing is left to run, or once `quota` groups have
    finished and no due group is unfinished (with `drop_overdue` the unfinished due groups are
    given up instead)."""
    return bool(failed) or not busy or (finished >= quota and (drop_overdue or not due_unfinished))


def contiguous_parts(items: list, num_parts: int) -> list[list]:
    """Contiguous, near-equal parts (order kept, so concatenating the results restores it)."""
    k, r = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + k + (i < r)
        out.append(list(items[start:end]))
        start = end
    return out


def handover_group(group_id: int) -> int:
    """The queue group of group `group_id`'s samples while they are handed over from one rollout
    device to another (negative: never one of the update's groups)."""
    return -1 - group_id


def assign_groups(items, num_devices: int, home: Callable[[int], int] | None = None) -> list[list[GroupItem]]:
    """Which rollout device runs which group. A resumed group goes back to the device that holds
    its paused samples — `home(item.held_by)`, the identity by default — and one handed over
    through the queue (or with no home among these devices) to the part with the fewest groups;
    then the new groups, contiguous in order, fill up the parts with the fewest groups first
    (with no resumed group: contiguous near-equal parts, as the synchronous rollout splits its
    prompts). Each part oldest first: the engine admits in order, and the oldest are due
    soonest."""
    home = home or (lambda i: i)
    parts: list[list[GroupItem]] = [[] for _ in range(num_devices)]
    loose = []
    for it in items:
        if it.resume:
            h = home(it.held_by) if it.held_by >= 0 else -1
            (parts[h] if 0 <= h < num_devices else loose).append(it)
    for it in loose:
        min(parts, key=len).append(it)
    new = [it for it in items if not it.resume]
    counts = [len(p) for p in parts]
    quota = [0] * num_devices
    for _ in new:
        i = min(range(num_devices), key=lambda j: (counts[j], j))
        counts[i] += 1
        quota[i] += 1
    start = 0
    for i in range(num_devices):
        parts[i].extend(new[start:start + quota[i]])
        start += quota[i]
    for part in parts:
        part.sort(key=lambda it: it.group_id)
    return parts


def assign_hybrid(items, late: list[bool], share: float) -> list[list[GroupItem]]:
    """Hybrid placement's spread: the devices flagged `late` join the rollout after their update,
    so they get about `share` of the new groups (the newest: due last) and no resumed ones (a
    carried-over tail needs a device that decodes from the start; a late device hands its
    paused samples over through the queue); the others get the rest, spread as `assign_groups`
    does (a resumed group back to the early device holding it). Each part oldest first."""
    early_idx = [i for i, flag in enumerate(late) if not flag]
    late_idx = [i for i, flag in enumerate(late) if flag]
    if not early_idx or not late_idx:
        return assign_groups(items, len(late))
    new = [it for it in items if not it.resume]
    n_late = min(len(new), round(share * len(new)))
    parts: list[list[GroupItem]] = [[] for _ in late]
    early_parts = assign_groups([it for it in items if it.resume] + new[:len(new) - n_late], len(early_idx),
                                home=lambda i: early_idx.index(i) if i in early_idx else -1)
    for i, part in zip(early_idx, early_parts):
        parts[i] = part
    for i, part in zip(late_idx, contiguous_parts(new[len(new) - n_late:], len(late_idx))):
        parts[i] = part
    return parts


def join_share(rollout_s: float, busy_s: float, early: int, late: int) -> float:
    """The share of a rollout's new groups that hybrid placement's `late` train devices take,
    from the last step: each was busy (scoring and updating) `busy_s` of the rollout's
    `rollout_s`, so it can decode for the rest of it, and the `early` devices for all of it."""
    free = max(0.0, 1.0 - busy_s / max(rollout_s, 1e-9))
    return late * free / (early + late * free)


def select_batch(finished: list, max_staleness: int, update_version: int, batch_groups: int) -> list:
    """The finished groups the update of `update_version` trains: every due one, then the oldest
    others up to B groups (more only if more are due), in group order."""
    due = [g for g in finished if is_due(g.admitted_version, max_staleness, update_version)]
    others = [g for g in finished if not is_due(g.admitted_version, max_staleness, update_version)]
    return sorted(due + others[:max(0, batch_groups - len(due))], key=lambda g: g.group_id)


def staleness(update_version: int, versions) -> int:
    """A sample's staleness at the update of `update_version`: how many updates its oldest token's
    weights are behind (0 for a sample without tokens)."""
    return update_version - min(versions, default=update_version)
