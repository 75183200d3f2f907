"""StaleSync: RL stages run in parallel under a bound on policy staleness.

Policy version v = number of actor updates so far; every generated token carries the version of
the weights that produced it. A sample's staleness at the update that trains version v is
v − (oldest version among its tokens). With `max_staleness` s no sample with staleness > s is
ever used for an update.

How the bound is kept — admission control plus a deadline, never silent waste:

  * a prompt group is admitted (its rollout may start) only while the groups in flight
    (admitted, not yet trained: carried-over partial ones and a batch already taken for the
    next update included) number fewer than (s + 1) × B, B = groups per update: if each update
    takes B groups, every admitted group can still be trained within s updates. The surplus
    over B keeps the engine's batch full while the slowest groups finish — the long tail no
    longer idles the rollout;
  * a group admitted when the rollout weights were version a is *due* at update a + s: that
    update's rollout does not stop before the due groups finish (`overdue="wait"`), or it stops
    on the threshold and the due groups that have not finished are dropped — their tokens are
    discarded and counted — and their prompts requeued as fresh groups (`overdue="drop"`);
  * `take_batch` checks every sample against the bound and raises if one ever exceeded it.

Partial rollout: a rollout stops once `rollout_finish_threshold` of the update's B groups have
finished (a fraction in (0, 1] or a count > 1) and the due groups are done; the unfinished
requests are aborted with their partial outputs and resumed in the next rollout with the newer
weights, so their tokens carry mixed versions (within the bound).

    co-located (actor trains and generates on the same devices), s ≥ 0:

      devices  │ rollout v_k ─ stop at threshold ─┐ ref+reward │ update k │ rollout v_k+1 ...
               │  (≤ (s+1)B groups in flight; the unfinished are paused, resumed with v_k+1)

    separated (rollout devices ≠ train devices), s ≥ 1: rollout for update k+1 overlaps update k

      rollout  │ rollout v_0 (for u1) │ rollout v_1 (for u2) │ rollout v_2 (for u3) │
      train    │                      │ ref+reward+update 1  │ ref+reward+update 2  │
                                      ▲ weights v_1 broadcast ▲ weights v_2 broadcast

    hybrid (every device generates, some also train), s ≥ 1: as separated, but a train device
    joins the rollout once its update is done, with the new weights; the others get them by
    broadcast when that rollout ends

      rollout  │ rollout (for u1) │ rollout (for u2) ──────────────────────────│
      train    │ rollout (for u1) │ ref+reward+update 1 │ rollout (for u2), new weights │
                                                                             ▲ broadcast

s = 0 admits exactly B groups, runs them to completion and trains them at once: the synchronous
run, with the same random draws in the same order (tested: equal per-step metrics).

Reward, reference and advantage read the update's rows from the DistQueue once its rollout
returns, one stage after another in the driver; what runs in parallel is the device work:
each rollout device scores its own samples and computes their reference logprobs right after
its rollout, and with separated devices the next rollout runs alongside the update.

Off-policy correction is the actor loss's decoupled ratio (proximal = the pre-update policy,
recomputed) with importance weights π_prox / π_behaviour truncated at `algo.behaviour_weight_cap`,
which is always on; with s = 0 the weights are 1.

This module owns the schedule: the rules are pure functions over typed values — admission
(`admissible`), the deadline (`is_due`, `due_groups`), the quota (`finish_quota`, `rollout_quota`),
the stop rule (`rollout_stops`), the spread of groups over rollout devices (`assign_groups`,
`assign_hybrid` and its `join_share`) and
the choice of an update's groups (`select_batch`); `StalenessBook` holds the state (groups in
flight, requeued prompts) and applies them, handing each rollout a `RolloutPlan`. No torch: the
trainer executes the plans, and the simulator (`rlfusion.sim.rl_stalesync`) runs the same book
and rules over the engine's scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from rlfusion.config import check_fields

OVERDUE = ("wait", "drop")
RESUME_KV = ("keep", "recompute")
MAX_STALENESS = 8
JOIN_SHARE = 0.25  # hybrid placement: the train devices' share of the first overlapped rollout's new groups


@dataclass(frozen=True)
class StaleSyncConfig:
    """`enabled=false` runs the plain synchronous loop. `enabled=true` with `max_staleness=0` and
    threshold 1 reproduces it through the StaleSync machinery."""

    enabled: bool = False
    max_staleness: int = 1
    rollout_finish_threshold: float = 1.0  # (0, 1]: fraction of the update's groups; > 1: a count
    overdue: str = "wait"  # what happens to a group that reaches its deadline unfinished
    # how an aborted request resumes: "keep" its cache row (saved in host memory through the
    # update; the device that paused it resumes it and decodes on at once), or "recompute" its
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


@dataclass
class Group:
    """One prompt's samples while in flight. `done` are finished samples, `open` the partial ones
    (aborted, to be resumed); a new group has neither until its first rollout."""

    group_id: int
    problem: Any
    admitted_version: int
    done: list = field(default_factory=list)
    open: list = field(default_factory=list)
    started: bool = False

    @property
    def finished(self) -> bool:
        return self.started and not self.open


class StalenessViolation(AssertionError):
    """A sample was about to train with staleness above the bound (a bug, never expected)."""


# An entry of a rollout: (group id, problem, open samples); no open samples = a new group.
GroupItem = tuple[int, Any, list]


@dataclass(frozen=True)
class RolloutPlan:
    """One partial rollout, with weights `version`, for the update of `update_version`.

    `items` are every unfinished group in flight as `(group_id, problem, open samples)`, oldest
    first; `due` the ones among them whose deadline is this update; `quota` how many more groups
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
        return [gid for gid, _, _ in self.items]


# ---- the rules (pure functions) ----

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


def paused_on(item: GroupItem) -> int:
    """The rollout device (its index) that paused a resumed group's samples, or -1: a new group,
    or samples with no device recorded (every sample of a group runs on one device)."""
    return min((t.paused_on for t in item[2]), default=-1)


def assign_groups(items, num_devices: int, sticky: bool = False,
                  home: Callable[[int], int] | None = None) -> list[list[GroupItem]]:
    """Which rollout device runs which group. Without `sticky`: new groups in contiguous parts
    (as the synchronous rollout splits its prompts); resumed groups (with open samples) one at a
    time to the part with the fewest groups, so the carried-over tail does not pile up on one
    device. With `sticky` (`resume_kv=keep`) a resumed group goes back to the device that paused
    it — `home(paused_on(item))`, the identity by default; the others to the parts with the
    fewest groups — and then the new groups, still contiguous in order, fill up the parts with
    the fewest groups first. Each part oldest first: the engine admits in order, and the oldest
    are due soonest."""
    home = home or (lambda i: i)
    new = [it for it in items if not it[2]]
    parts: list[list[GroupItem]] = [[] for _ in range(num_devices)]
    loose = []
    for it in (it for it in items if it[2]):
        h = home(paused_on(it)) if sticky else -1
        if 0 <= h < num_devices:
            parts[h].append(it)
        else:
            loose.append(it)
    if not sticky:
        parts = contiguous_parts(new, num_devices)
    else:  # the homeless resumed ones first, then water-fill the counts with new groups in order
        for it in loose:
            min(parts, key=len).append(it)
        loose = []
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
    for it in loose:
        min(parts, key=len).append(it)
    for part in parts:
        part.sort(key=lambda it: it[0])
    return parts


def assign_hybrid(items, late: list[bool], share: float, sticky: bool = False) -> list[list[GroupItem]]:
    """Hybrid placement's spread: the devices flagged `late` join the rollout after their update,
    so they get about `share` of the new groups (the newest: due last) and no resumed ones (a
    carried-over tail needs a device that decodes from the start); the others get the rest,
    spread as `assign_groups` does (`sticky`: a resumed group back to the early device that
    paused it). Each part oldest first."""
    early_idx = [i for i, flag in enumerate(late) if not flag]
    late_idx = [i for i, flag in enumerate(late) if flag]
    if not early_idx or not late_idx:
        return assign_groups(items, len(late), sticky)
    new = [it for it in items if not it[2]]
    n_late = min(len(new), round(share * len(new)))
    parts: list[list[GroupItem]] = [[] for _ in late]
    early_parts = assign_groups([it for it in items if it[2]] + new[:len(new) - n_late], len(early_idx), sticky,
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


def select_batch(finished: list[Group], max_staleness: int, update_version: int, batch_groups: int) -> list[Group]:
    """The finished groups the update of `update_version` trains: every due one, then the oldest
    others up to B groups (more only if more are due), in group order."""
    due = [g for g in finished if is_due(g.admitted_version, max_staleness, update_version)]
    others = [g for g in finished if not is_due(g.admitted_version, max_staleness, update_version)]
    return sorted(due + others[:max(0, batch_groups - len(due))], key=lambda g: g.group_id)


def staleness(update_version: int, versions) -> int:
    """A sample's staleness at the update of `update_version`: how many updates its oldest token's
    weights are behind (0 for a sample without tokens)."""
    return update_version - min(versions, default=update_version)


# ---- the state ----

class StalenessBook:
    """Which groups are in flight, which are due, what the next update trains.

    Samples are any objects with `group_id`, `versions` (per-token policy versions) and
    `response_ids`."""

    def __init__(self, cfg: StaleSyncConfig, batch_groups: int, group_size: int):
        self.cfg, self.B, self.G = cfg, batch_groups, group_size
        self.s = cfg.max_staleness
        self.quota = finish_quota(cfg.rollout_finish_threshold, batch_groups)
        self.groups: dict[int, Group] = {}  # in flight, in admission order
        self.requeued: deque = deque()  # problems of dropped groups, admitted again first
        self.next_group_id = 0
        self.stats = {"admitted": 0, "trained_groups": 0, "dropped_groups": 0, "dropped_tokens": 0}

    # ---- admission ----

    @property
    def capacity(self) -> int:
        return (self.s + 1) * self.B

    def admit(self, version: int, sample_problem: Callable[[], Any], reserved: int = 0) -> list[Group]:
        """New groups, generated from weights `version`, as many as `admissible` allows for the
        pool plus `reserved`; requeued prompts first, then `sample_problem()` in turn."""
        new = []
        for _ in range(admissible(len(self.groups), reserved, self.s, self.B)):
            problem = self.requeued.popleft() if self.requeued else sample_problem()
            g = Group(self.next_group_id, problem, version)
            self.next_group_id += 1
            self.groups[g.group_id] = g
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

    def plan(self, version: int, update_version: int, sample_problem: Callable[[], Any],
             reserved: int = 0) -> RolloutPlan:
        """Admit new groups and plan the next rollout (weights `version`, for the update of
        `update_version`)."""
        self.admit(version, sample_problem, reserved)
        groups = self.runnable()
        due = due_groups(groups, self.s, update_version)
        drop = self.cfg.overdue == "drop"
        return RolloutPlan(version, update_version, tuple((g.group_id, g.problem, g.open) for g in groups), due,
                           rollout_quota(self.quota, self.finished_count(), len(due), drop), drop)

    def collect(self, plan: RolloutPlan, out: dict[str, Any]) -> None:
        """Take in a rollout's result (`RolloutStage.run_groups`' dict) for `plan`."""
        self.record(out["finished"], out["unfinished"], plan.group_ids)
        if out["dropped"]:
            self.drop(set(out["dropped"]))

    # ---- results of a rollout ----

    def record(self, finished: list, unfinished: list, started: list[int]) -> None:
        """A rollout's output: finished and partial (aborted) samples, and the ids of the groups
        it ran (their open samples are replaced by what came back)."""
        for gid in started:
            g = self.groups[gid]
            g.started, g.open = True, []
        for t in finished:
            self.groups[t.group_id].done.append(t)
        for t in unfinished:
            self.groups[t.group_id].open.append(t)

    def drop(self, group_ids: set[int]) -> int:
        """Discard these groups' samples and requeue their prompts; returns tokens discarded."""
        tokens = 0
        for gid in sorted(group_ids):
            g = self.groups.pop(gid)
            tokens += sum(len(t.response_ids) for t in g.done + g.open)
            self.requeued.append(g.problem)
        self.stats["dropped_groups"] += len(group_ids)
        self.stats["dropped_tokens"] += tokens
        return tokens

    # ---- the update ----

    def take_batch(self, update_version: int) -> tuple[list, dict[str, float]]:
        """The groups `select_batch` picks for the update of `update_version`, removed from the
        pool; their samples in group order. Raises `StalenessViolation` if a due group is
        unfinished or a sample is staler than the bound."""
        finished = [g for g in self.groups.values() if g.finished]
        overdue = self.due(update_version) - {g.group_id for g in finished}
        if overdue:
            raise StalenessViolation(f"groups {sorted(overdue)} are due at version {update_version} "
                                     "but unfinished")
        take = select_batch(finished, self.s, update_version, self.B)
        batch = []
        for g in take:
            del self.groups[g.group_id]
            batch.extend(g.done)
        stale = [staleness(update_version, t.versions) for t in batch]
        if stale and max(stale) > self.s:
            raise StalenessViolation(f"a sample has staleness {max(stale)} > max_staleness {self.s}")
        self.stats["trained_groups"] += len(take)
        return batch, {"staleness_max": float(max(stale, default=0)),
                       "staleness_mean": sum(stale) / max(len(stale), 1),
                       "groups_in_update": float(len(take)), "groups_in_flight": float(len(self.groups))}

    # ---- checkpoint ----

    def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups.values()), "requeued": list(self.requeued),
                "next_group_id": self.next_group_id, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = {g.group_id: g for g in state["groups"]}
        self.requeued = deque(state["requeued"])
        self.next_group_id = state["next_group_id"]
        self.stats = dict(state["stats"])
