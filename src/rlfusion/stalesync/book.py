"""`StalenessBook`: which groups are in flight, where their samples are, which are due and what
the next update trains. Metadata only: the samples stay on the rollout devices and in the
DistQueue (see the package docstring)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from rlfusion.stalesync.rules import (GroupItem, RolloutPlan, StaleSyncConfig, admissible, due_groups,
                                      finish_quota, rollout_quota, select_batch, staleness)


class StalenessViolation(AssertionError):
    """A sample was about to train with staleness above the bound (a bug, never expected)."""


@dataclass(frozen=True)
class GroupReport:
    """What a rollout device tells the book of one group it ran: never its samples. A `finished`
    group's samples are in the queue as `rows`, with each sample's oldest token version in
    `versions`; an unfinished one's are paused on the rollout device of index `held_by`, or
    (`held_by` = -1) handed over through the queue as `rows`. `tokens`: the response tokens its
    samples hold (what dropping the group discards)."""

    group_id: int
    finished: bool
    tokens: int
    rows: tuple[int, ...] = ()
    versions: tuple[int, ...] = ()
    held_by: int = -1


@dataclass
class Group:
    """One prompt group while in flight: its problem (`problem_id`: the problem of that group id,
    `dataflow.group_problem`), the weights it was admitted under and the last report of it."""

    group_id: int
    problem_id: int
    admitted_version: int
    started: bool = False
    finished: bool = False
    tokens: int = 0
    rows: tuple[int, ...] = ()
    versions: tuple[int, ...] = ()
    held_by: int = -1

    def item(self) -> GroupItem:
        return GroupItem(self.group_id, self.problem_id, self.started, self.held_by, self.rows)


class StalenessBook:
    """The state StaleSync's rules apply to (`rules.py`): groups in flight in admission order,
    requeued problems, and the counts the run reports."""

    def __init__(self, cfg: StaleSyncConfig, batch_groups: int, group_size: int):
        self.cfg, self.B, self.G = cfg, batch_groups, group_size
        self.s = cfg.max_staleness
        self.quota = finish_quota(cfg.rollout_finish_threshold, batch_groups)
        self.groups: dict[int, Group] = {}  # in flight, in admission order
        self.requeued: deque[int] = deque()  # problem ids of dropped groups, admitted again first
        self.next_group_id = 0
        self.stats = {"admitted": 0, "trained_groups": 0, "dropped_groups": 0, "dropped_tokens": 0}

    # ---- admission ----

    @property
    def capacity(self) -> int:
        return (self.s + 1) * self.B

    def admit(self, version: int, reserved: int = 0) -> list[Group]:
        """New groups, generated from weights `version`, as many as `admissible` allows for the
        pool plus `reserved`: requeued problems first, then each new group's own (problem id =
        group id)."""
        new = []
        for _ in range(admissible(len(self.groups), reserved, self.s, self.B)):
            gid = self.next_group_id
            g = Group(gid, self.requeued.popleft() if self.requeued else gid, version)
            self.next_group_id += 1
            self.groups[gid] = g
            new.append(g)
        self.stats["admitted"] += len(new)
        return new

    def due(self, update_version: int) -> frozenset[int]:
        """Groups that must be in the update of `update_version` (their last chance)."""
        return due_groups(self.groups.values(), self.s, update_version)

    def runnable(self) -> list[Group]:
        """Groups with samples still to generate, oldest first."""
        return [g for g in self.groups.values() if not g.finished]

    def finished_count(self) -> int:
        return sum(g.finished for g in self.groups.values())

    # ---- one rollout ----

    def plan(self, version: int, update_version: int, reserved: int = 0) -> RolloutPlan:
        """Admit new groups and plan the next rollout (weights `version`, for the update of
        `update_version`)."""
        self.admit(version, reserved)
        groups = self.runnable()
        due = due_groups(groups, self.s, update_version)
        drop = self.cfg.overdue == "drop"
        return RolloutPlan(version, update_version, tuple(g.item() for g in groups), due,
                           rollout_quota(self.quota, self.finished_count(), len(due), drop), drop)

    def collect(self, reports: list[GroupReport], dropped: list[int]) -> None:
        """Take in a rollout's reports and the groups it gave up (`overdue="drop"`)."""
        for r in reports:
            g = self.groups[r.group_id]
            g.started, g.finished, g.tokens = True, r.finished, r.tokens
            g.rows, g.versions, g.held_by = r.rows, r.versions, r.held_by
        if dropped:
            self.drop(set(dropped))

    def drop(self, group_ids: set[int]) -> int:
        """Discard these groups (their devices discarded the samples) and requeue their problems;
        returns the tokens discarded."""
        tokens = 0
        for gid in sorted(group_ids):
            g = self.groups.pop(gid)
            tokens += g.tokens
            self.requeued.append(g.problem_id)
        self.stats["dropped_groups"] += len(group_ids)
        self.stats["dropped_tokens"] += tokens
        return tokens

    # ---- the update ----

    def take_batch(self, update_version: int) -> tuple[list[Group], dict[str, float]]:
        """The groups `select_batch` picks for the update of `update_version`, removed from the
        pool, in group order (their queue rows: `batch_rows`). Raises `StalenessViolation` if a
        due group is unfinished or a sample is staler than the bound."""
        finished = [g for g in self.groups.values() if g.finished]
        overdue = self.due(update_version) - {g.group_id for g in finished}
        if overdue:
            raise StalenessViolation(f"groups {sorted(overdue)} are due at version {update_version} "
                                     "but unfinished")
        take = select_batch(finished, self.s, update_version, self.B)
        for g in take:
            del self.groups[g.group_id]
        stale = [staleness(update_version, (v,)) for g in take for v in g.versions]
        if stale and max(stale) > self.s:
            raise StalenessViolation(f"a sample has staleness {max(stale)} > max_staleness {self.s}")
        self.stats["trained_groups"] += len(take)
        return take, {"staleness_max": float(max(stale, default=0)),
                      "staleness_mean": sum(stale) / max(len(stale), 1),
                      "groups_in_update": float(len(take)), "groups_in_flight": float(len(self.groups))}

    # ---- checkpoint ----

    def state_dict(self) -> dict[str, Any]:
        return {"groups": [vars(g).copy() for g in self.groups.values()], "requeued": list(self.requeued),
                "next_group_id": self.next_group_id, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = {g["group_id"]: Group(**g) for g in state["groups"]}
        self.requeued = deque(state["requeued"])
        self.next_group_id = state["next_group_id"]
        self.stats = dict(state["stats"])


def batch_rows(groups: list[Group]) -> list[int]:
    """The queue rows of an update's groups, in group order."""
    return [r for g in groups for r in g.rows]
