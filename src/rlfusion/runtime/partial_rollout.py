"""A rollout device's side of StaleSync's partial rollout (`rlfusion.stalesync`): the samples of
its unfinished groups, held here between rollouts as the engine holds their cache rows, and the
rollout that resumes them. A group's samples leave the device only when the group has finished
(scored where reward and reference live here, then put into the DistQueue by this device) or,
with hybrid placement, when this device joins the next rollout late and hands its paused
samples over through the queue. The controller gets `GroupReport`s back: ids and versions,
never samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.stalesync.book import GroupReport, pack_reports
from rlfusion.stalesync.rules import GroupItem, handover_group

PAUSED = "aborted"  # the finish reason of a paused (aborted) sample

RunGroups = Callable[[list[tuple[int, Problem, list[Trajectory]]]], dict[str, Any]]


class PartialRollout:
    """The held samples of one rollout device (index `index` among the rollout devices) and its
    partial rollouts. `queue`: the run's queue client; `problem_of(problem_id)`: a group's
    problem."""

    def __init__(self, index: int, queue: Any, problem_of: Callable[[int], Problem], timeout_s: float,
                 columns: tuple[str, ...] = dataflow.ROLLOUT.writes):
        """`columns`: what a handed-over sample carries (the rollout's columns)."""
        self.index, self.queue, self.problem_of, self.timeout_s = index, queue, problem_of, timeout_s
        self.columns = columns
        self.held: dict[int, list[Trajectory]] = {}  # group id -> its samples here (finished and paused)

    def run(self, items: list[GroupItem], run_groups: RunGroups, put: Callable[[list[Trajectory]], list[int]],
            hand_over: bool = False) -> dict[str, Any]:
        """Run the groups `items` (`run_groups` steps the engine: `RolloutStage.run_groups` with
        the rollout's quota and stop rule bound), then settle (`put(samples)` scores, where this
        device scores, and puts finished samples, returning their row ids): finished groups go into the queue,
        dropped ones are discarded, the others stay held — or, with `hand_over`, go into the
        queue for another device to resume. Returns the groups' reports, the dropped group ids
        and the tokens generated (the reports packed: `book.pack_reports`)."""
        out = run_groups(self._start(items))
        ran: dict[int, list[Trajectory]] = {it.group_id: [t for t in self.held.pop(it.group_id, [])
                                                          if t.finish_reason != PAUSED] for it in items}
        for t in out["finished"] + out["unfinished"]:
            ran[t.group_id].append(t)
        dropped = set(out["dropped"])
        reports = [GroupReport(gid, False, _tokens(samples)) for gid, samples in ran.items() if gid in dropped]
        done = [gid for gid, samples in ran.items() if gid not in dropped and all(t.finish_reason != PAUSED
                                                                                  for t in samples)]
        finished = [t for gid in done for t in sorted(ran[gid], key=lambda t: t.sample)]
        rows = iter(put(finished) if finished else [])
        for gid in done:
            samples = ran[gid]
            reports.append(GroupReport.finished_group(gid, _tokens(samples), tuple(next(rows) for _ in samples),
                                                      [min(t.versions) for t in samples if t.versions]))
        for gid, samples in ran.items():
            if gid not in dropped and gid not in done:
                self.held[gid] = samples
        if hand_over:
            reports += self.hand_over()
        held = [GroupReport(gid, False, _tokens(s), held_by=self.index) for gid, s in ran.items() if gid in self.held]
        return {"reports": pack_reports(reports + held), "dropped": sorted(dropped),
                "generated_tokens": out["generated_tokens"]}

    def _start(self, items: list[GroupItem]) -> list[tuple[int, Problem, list[Trajectory]]]:
        """`items` as `run_groups` takes them: (group id, problem, paused samples). A resumed
        group's samples are this device's, or handed over through the queue (read, then the
        rows retired)."""
        handed = [r for it in items if it.resume and it.held_by != self.index for r in it.rows]
        if handed:
            samples = self._read(handed)
            for t in samples:
                self.held.setdefault(t.group_id, []).append(t)
        groups = []
        for it in items:
            problem = self.problem_of(it.problem_id)
            if not it.resume:
                groups.append((it.group_id, problem, []))
                continue
            if it.group_id not in self.held:
                raise RuntimeError(f"rollout device {self.index} was asked to resume group {it.group_id}, "
                                   "whose paused samples it does not hold")
            samples = self.held[it.group_id]
            for t in samples:
                t.problem = problem
            groups.append((it.group_id, problem, [t for t in samples if t.finish_reason == PAUSED]))
        return groups

    def _read(self, rows: list[int]) -> list[Trajectory]:
        batch = self.queue.get_rows("handover", rows, self.columns, timeout=self.timeout_s)
        self.queue.retire(rows)
        out = dataflow.to_trajectories(batch)
        for t, g in zip(out, batch.group_ids):
            t.group_id = handover_group(g)  # (the map is its own inverse)
        return out

    def hand_over(self) -> list[GroupReport]:
        """Every held group into the queue (rows of `handover_group(g)`), for an early device to
        resume: this device will join the next rollout late (hybrid placement)."""
        if not self.held:
            return []
        groups = list(self.held.items())
        samples = [t for _, s in groups for t in s]
        cols = dataflow.trajectory_columns(samples, self.columns)
        rows = iter(self.queue.put(cols, group_ids=[handover_group(t.group_id) for t in samples],
                                   versions=[min(t.versions, default=0) for t in samples]))
        self.held = {}
        return [GroupReport(gid, False, _tokens(s), tuple(next(rows) for _ in s)) for gid, s in groups]

    # ---- checkpoint ----

    def state(self) -> dict[int, list[Trajectory]]:
        return self.held

    def load_state(self, held: dict[int, list[Trajectory]]) -> None:
        self.held = {int(g): list(s) for g, s in held.items()}


def _tokens(samples: list[Trajectory]) -> int:
    return sum(len(t.response_ids) for t in samples)
