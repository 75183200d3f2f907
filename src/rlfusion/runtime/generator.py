"""The generator role of a rollout device: its rollout engine (`RolloutStage`) inside the device's
switch, and what the engine keeps between rollouts (RNG state, StaleSync's paused requests).

    generate(group ids)       a synchronous rollout: each group's problem, `group_size` samples,
                              put into the queue as rows — scored first where the device's
                              scorer holds reward and reference (with shared scoring, put as
                              they finish and scored by whichever device of the step is idle:
                              `Scorer.score_shared`)
    rollout_groups(items)     StaleSync's partial rollout (`partial_rollout.PartialRollout`): the
                              stop rule summed over the rollout devices (`stop_sums.StopSums`);
                              unfinished groups stay here, finished ones go into the queue
    evaluate(indices)         greedy held-out accuracy on this device's share

It owns no scoring: samples are scored by the device's `Scorer` (when the controller says the
device scores its own), and it never trains.
"""

from __future__ import annotations

from typing import Any

from rlfusion.evaluate import greedy_completions, greedy_episodes
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.queue.controller import runs_rows
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.partial_rollout import PartialRollout
from rlfusion.runtime.role_context import RoleContext
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.scorer import Scorer
from rlfusion.runtime.stop_sums import StopSums, no_stop_sync
from rlfusion.stalesync.rules import unpack_items


# shared scoring: finished samples go into the queue in about this many puts per rollout (each
# costs the controller two round trips), of at least SHARE_PUT_ROWS samples
SHARE_PUTS, SHARE_PUT_ROWS = 2, 8


class Generator:
    """A rollout device's engine and its rollouts. `scorer`: the device's scorer, if it has one
    (a rollout scored here needs reward and reference on the device); `rollout_group`: the
    rollout devices' process group (set when the device world is joined), over which a partial
    rollout sums its stop rule."""

    def __init__(self, ctx: RoleContext, stage: RolloutStage, task: Any, tokenizer: Tokenizer,
                 scorer: Scorer | None):
        self.ctx, self.stage, self.task, self.tokenizer, self.scorer = ctx, stage, task, tokenizer, scorer
        self.rollout_group: Any = None
        # StaleSync: the held samples of unfinished groups
        self.partial = PartialRollout(ctx.plan.rollout.index(ctx.device), ctx.queue, self.problem,
                                      ctx.cfg.deploy.queue_timeout_s, dataflow.rollout_writes(ctx.cfg, False))
        self._stop_sync = no_stop_sync()  # the partial rollouts' stop-rule sums since the last report

    def problem(self, problem_id: int) -> Problem:
        return dataflow.group_problem(self.task, self.ctx.cfg.seed, problem_id)

    def generate(self, group_ids: list[int], version: int, score_here: bool = False,
                 share: tuple[int, ...] = ()) -> dict[str, int]:
        """Generate `group_size` samples for each group's problem and put them in the queue as
        rows; with `score_here` (reward and reference live on this device too) the rows carry
        their reward and reference columns when they go in. With `share` (the step's group ids
        on every rollout device, as runs: `queue.controller.row_runs`), the samples go in
        unscored as they finish, in about `SHARE_PUTS` puts, and every device of the step scores
        rows of the step waiting in the queue once its own decoding is done (`Scorer.score_shared`),
        so an idle device scores a busy one's finished samples. Returns counts only: the rows
        this device scored (or put), those of another device's groups, the tokens generated."""
        if share and not score_here:
            raise ValueError("generate(share=...) needs score_here=True: every rollout device scores the "
                             "step's rows")
        problems = [self.problem(g) for g in group_ids]

        def run(on_finish: Any = None) -> list[Trajectory]:
            with self.ctx.switch.rollout():
                out = self.stage.generate(problems, group_ids, version, on_finish=on_finish)
            self._env_spans()
            return out

        if share:
            finished: list[Trajectory] = []
            every = max(SHARE_PUT_ROWS, -(-len(group_ids) * self.ctx.cfg.rollout.group_size // SHARE_PUTS))

            def put_finished(t: Trajectory) -> None:
                finished.append(t)
                if len(finished) >= every:
                    self._put(finished[:], scored=False)
                    finished.clear()
            trajs = run(put_finished)
            self._put(finished, scored=False)
            scored, peer = self.scorer.score_shared(runs_rows(share), set(group_ids))
            return {"rows": scored, "peer_rows": peer, "generated_tokens": _tokens(trajs)}
        trajs = run()
        if score_here:
            self.scorer.score_and_reference(trajs)
        self._put(trajs, scored=score_here)
        return {"rows": len(trajs), "peer_rows": 0, "generated_tokens": _tokens(trajs)}

    def _put(self, trajs: list[Trajectory], scored: bool) -> list[int]:
        """The samples as new queue rows (scored: with this device's scoring columns); their row ids."""
        if scored:
            return self.scorer.put_scored(trajs)
        return self.ctx.put_new(trajs, dataflow.rollout_writes(self.ctx.cfg, scored=False))

    def rollout_groups(self, items: tuple[list[int], ...], version: int, quota: int, must_finish: set[int],
                       drop_overdue: bool, score_here: bool = False) -> dict[str, Any]:
        """StaleSync's partial rollout of the groups `items` (`stalesync.GroupItem`s, packed) inside the
        same switch as `generate` (`partial_rollout.PartialRollout`): the samples of unfinished
        groups stay here (hybrid placement's train devices hand them over through the queue, as
        they join the next rollout late), finished groups go into the queue, scored here when
        reward and reference live here. Answers the groups' reports (ids and versions)."""
        ctx, plan = self.ctx, self.ctx.plan
        sync = (StopSums(self.rollout_group, self._stop_sync, polled=plan.mode == "hybrid")
                if len(plan.rollout) > 1 else None)
        keep = ctx.cfg.stalesync.resume_kv == "keep"

        def run(groups: list) -> dict[str, Any]:
            with ctx.switch.rollout():
                out = self.stage.run_groups(groups, version, quota, must_finish, drop_overdue, sync, keep_cache=keep)
            self._env_spans()
            return out

        def put(trajs: list[Trajectory]) -> list[int]:
            if score_here:
                self.scorer.score_and_reference(trajs)
            return self._put(trajs, scored=score_here)

        hand_over = plan.mode == "hybrid" and ctx.device in plan.train
        return self.partial.run(unpack_items(items), run, put, hand_over=hand_over)

    def evaluate(self, indices: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        """Greedy (reward, response length) of held-out problems `indices`, generated by this
        device's rollout engine from the current policy."""
        heldout = self.task.heldout()
        problems = [heldout[i] for i in indices]
        if not problems and self.ctx.switch.pm is None and self.ctx.plan.infer_ep == 1:
            # (a layout's switch is collective, and so is a lock-step engine's stepping: join them anyway)
            return []
        model, engine, episodes = self.stage.model, self.stage.engine, self.stage.episodes
        was_training = model.training
        model.eval()
        try:
            with self.ctx.switch.rollout("eval"):
                if episodes is not None:  # greedy episodes, their observation tokens within the budget
                    results = greedy_episodes(episodes, self.tokenizer, problems, max_new_tokens)
                else:
                    results = [(c, False) for c in greedy_completions(engine, self.tokenizer, problems, max_new_tokens)]
        finally:
            model.train(was_training)
            engine.take_stats()  # the step's engine counts are the rollout's only
            if episodes is not None:  # (the step's episode counts are the rollout's only)
                episodes.take_stats()
                episodes.take_spans()
        return [(0.0 if failed else float(self.task.reward(self.tokenizer.decode(c.output_ids), p)), len(c.output_ids))
                for (c, failed), p in zip(results, problems)]

    def _env_spans(self) -> None:
        """The environment's time in flight onto the device's timeline (phase "env")."""
        if self.stage.episodes is not None:
            for start, end in self.stage.episodes.take_spans():
                self.ctx.spans.add("env", start, end)

    def take_stats(self) -> dict[str, float]:
        """The engine's pass counts and seconds, with the partial rollouts' stop-rule sums, since
        the last call, and the sequences its KV cache holds (`kv_rows`)."""
        stats, self._stop_sync = {**self.stage.engine.take_stats(), **self._stop_sync}, no_stop_sync()
        if self.stage.episodes is not None:
            stats.update(self.stage.episodes.take_stats())
        return {**stats, "kv_rows": float(self.stage.cfg.max_num_seqs)}

    # ---- what the engine keeps between rollouts (checkpoints) ----

    def rng_state(self) -> Any:
        return self.stage.rng_state()

    def set_rng_state(self, state: Any) -> None:
        self.stage.set_rng_state(state)

    def paused(self) -> dict[str, Any]:
        """StaleSync's paused requests on this rollout device: the samples it holds and, with
        `resume_kv=keep`, their cache rows."""
        return {"samples": self.partial.state(), "cache_rows": self.stage.saved_rows()}

    def load_paused(self, state: dict[str, Any]) -> None:
        self.partial.load_state(state["samples"])
        if self.ctx.cfg.stalesync.resume_kv == "keep":  # else the paused samples recompute theirs
            self.stage.load_saved_rows(state["cache_rows"])


def _tokens(trajs: list[Trajectory]) -> int:
    """The tokens the policy generated (an episode's observations are not theirs)."""
    return sum(sum(t.sampled) for t in trajs)
