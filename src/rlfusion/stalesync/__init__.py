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

Where the samples are: a rollout device keeps a group's samples while the group is unfinished
(its paused requests, as the engine keeps their cache rows) and resumes them itself in a later
rollout; once every sample of the group has finished, the device scores them (where reward and
reference live there) and puts them into the DistQueue itself. The controller's book holds ids
and versions only, and the update reads its rows from the queue by id, as the synchronous step
does. With hybrid placement a train device joins each rollout late, so it hands the samples of
its unfinished groups over through the queue (rows of group `handover_group(g)`) and an early
device resumes them.

Off-policy correction is the actor loss's decoupled ratio (proximal = the pre-update policy,
recomputed) with importance weights π_prox / π_behaviour truncated at `algo.behaviour_weight_cap`,
which is always on; with s = 0 the weights are 1.

This package owns the schedule, torch-free: `rules.py` holds the pure functions over typed
values — admission (`admissible`), the deadline (`is_due`, `due_groups`), the quota
(`finish_quota`, `rollout_quota`), the stop rule (`rollout_stops`), the spread of groups over
rollout devices (`assign_groups`, `assign_hybrid` and its `join_share`) and the choice of an
update's groups (`select_batch`); `book.py`'s `StalenessBook` holds the state (groups in flight,
requeued prompts) and applies them, handing each rollout a `RolloutPlan`. The book holds
metadata only — group ids, problem ids, admitted version, where the paused samples are, each
finished sample's oldest version and its queue row: the samples stay on the rollout devices
while paused and go into the DistQueue once their group finishes, so `take_batch` hands the
update row ids. The trainer executes the plans, and the simulator (`rlfusion.sim.rl_stalesync`)
runs the same book and rules over the engine's scheduler.
"""
