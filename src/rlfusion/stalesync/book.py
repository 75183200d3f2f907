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
    group's samples are in the queue as `rows`; of its `samples` samples with tokens, the oldest
    token's version is `oldest` and the sum of each one's oldest version `version_sum` (the
    staleness statistics read them). An unfinished group's samples are paused on the rollout
    device of index `held_by`, or (`held_by` = -1) handed over through the queue as `rows`.
    `tokens`: the response tokens its samples hold (what dropping the group discards)."""

    group_id: int
    finished: bool
    tokens: int
    rows: tuple[int, ...] = ()
    held_by: int = -1
    oldest: int = 0
    version_sum: int = 0
    samples: int = 0

    @classmethod
    def finished_group(cls, group_id: int, tokens: int, rows: tuple[int, ...], versions: list[int]) -> "GroupReport":
        """A finished group's report from each sample's oldest token version (`versions`)."""
        return cls(group_id, True, tokens, rows, oldest=min(versions, default=0), version_sum=sum(versions),
                   samples=len(versions))


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
    held_by: int = -1
    oldest: int = 0  # finished: its samples' oldest token version,
    version_sum: int = 0  # the sum of each sample's oldest version,
    samples: int = 0  # and how many samples have tokens

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
            g.started, g.finished, g.tokens, g.rows, g.held_by = True, r.finished, r.tokens, r.rows, r.held_by
            g.oldest, g.version_sum, g.samples = r.oldest, r.version_sum, r.samples
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
        with_tokens = [g for g in take if g.samples]
        worst = max((staleness(update_version, (g.oldest,)) for g in with_tokens), default=0)
        if worst > self.s:
            raise StalenessViolation(f"a sample has staleness {worst} > max_staleness {self.s}")
        samples = sum(g.samples for g in with_tokens)
        self.stats["trained_groups"] += len(take)
        return take, {"staleness_max": float(worst),
                      "staleness_mean": sum(g.samples * update_version - g.version_sum for g in with_tokens)
                      / max(samples, 1),
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


# ---- the wire: reports as a rollout device answers them (columns of small ints) ----

def pack_reports(reports: list[GroupReport]) -> list[int]:
    """`reports` in their wire form, small non-negative ints, nine per group: group id,
    finished, tokens (0 for a finished group: only an unfinished one can be dropped), holder + 1,
    oldest version, version sum, samples, first row and row count — a put's rows have
    consecutive ids. About a quarter of their pickled size as objects."""
    out: list[int] = []
    for r in reports:
        if r.rows and tuple(r.rows) != tuple(range(r.rows[0], r.rows[0] + len(r.rows))):
            raise ValueError(f"group {r.group_id}: rows {r.rows} are not consecutive")
        out += [r.group_id, int(r.finished), 0 if r.finished else r.tokens, r.held_by + 1, r.oldest, r.version_sum,
                r.samples, r.rows[0] if r.rows else 0, len(r.rows)]
    return out


def unpack_reports(packed: list[int]) -> list[GroupReport]:
    return [GroupReport(g, bool(f), t, tuple(range(a, a + n)), h - 1, o, v, s)
            for g, f, t, h, o, v, s, a, n in zip(*(packed[i::9] for i in range(9)))]
