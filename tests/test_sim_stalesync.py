"""The simulator's model of the runtime's StaleSync (`stalesync_model = "runtime"`,
rlfusion/sim/rl_stalesync.py): the staleness bound, s = 0 = synchronous, separated overlap, and
agreement with the real StalenessBook + engine scheduler driven by the same lengths."""

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from rlfusion.sim.calibration import cpu_default
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate
from rlfusion.sim.rl_stalesync import _balanced_parts

CAL = cpu_default()
RNG = random.Random(3)
# a long tail like the real task's: median ~24, some at the 160 cap
LENGTHS = tuple(min(160, max(1, round(24 * math.exp(RNG.gauss(0.0, 0.57))))) for _ in range(4096))
BASE = RLSimConfig(prompts_per_step=8, samples_per_prompt=4, num_steps=6, max_batch_per_engine=16,
                   min_prefill_batch=4, max_response_len=160, response_lengths=LENGTHS,
                   partial_rollout=True, stalesync_model="runtime")


@pytest.mark.parametrize("mode", ["colocated", "separated", "shared"])
@pytest.mark.parametrize("s", [0, 1, 2, 3])
@pytest.mark.parametrize("threshold", [0.25, 0.75, 1.0, 3])
@pytest.mark.parametrize("devices", [2, 4])
def test_staleness_bound_never_exceeded(mode, s, threshold, devices):
    cfg = BASE.replace(mode=mode, staleness=s, rollout_finish_threshold=threshold,
                       devices_per_supernode=devices)
    r = simulate(cfg, CAL)
    assert r.updates == cfg.num_steps
    assert r.staleness_per_sample and max(r.staleness_per_sample) <= s
    assert r.max_staleness <= s
    assert r.max_groups_in_flight <= (s + 1) * cfg.prompts_per_step
    assert all(0.0 <= u <= 1.0 for u in r.utilization.values())
    ends = r.update_end_s
    assert list(ends) == sorted(ends) and ends[0] > 0


@pytest.mark.parametrize("mode", ["colocated", "separated", "shared"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_s0_matches_the_synchronous_simulation(mode, devices):
    if mode == "separated" and devices == 1:
        pytest.skip("separated needs 2 devices")
    # an engine's slots hold exactly its contiguous share (the synchronous model fills engines
    # in order from one pool; the runtime splits the prompts contiguously)
    engines = devices // 2 if mode == "separated" else devices
    cfg = BASE.replace(mode=mode, devices_per_supernode=devices, staleness=0, min_prefill_batch=1)
    cfg = cfg.replace(max_batch_per_engine=cfg.samples_per_step // engines)
    cal = CAL.replace(reference_overhead_s=0.0)
    sync = simulate(cfg.replace(stalesync_model="samples", partial_rollout=False), cal)
    stale = simulate(cfg, cal)
    n = cfg.samples_per_step
    assert stale.staleness_per_sample == (0,) * (cfg.num_steps * n)
    # the same samples trained in the same updates, each rollout generating exactly its batch
    assert stale.generated_per_update == tuple(sum(LENGTHS[k * n:(k + 1) * n]) for k in range(cfg.num_steps))
    assert stale.tokens_per_s == pytest.approx(sync.tokens_per_s, rel=0.03)
    assert stale.max_groups_in_flight == cfg.prompts_per_step


def _overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def test_separated_overlap_runs_rollout_and_update_concurrently():
    r = simulate(BASE.replace(mode="separated", staleness=1), CAL)
    trains = [e for e in r.timeline if e.role == "train"]
    rollouts = [e for e in r.timeline if e.role == "rollout"]
    assert trains and rollouts
    # every update k >= 0 runs alongside the rollout for update k + 1 (weights v_k)
    for u in trains:
        assert any(_overlaps(u, ro) and ro.version == u.version for ro in rollouts)
    # and the pipeline fill: the first update starts only after the first rollout ended
    assert trains[0].start >= min(ro.end for ro in rollouts if ro.version == 0)
    s0 = simulate(BASE.replace(mode="separated", staleness=0), CAL)
    assert not any(_overlaps(u, ro) for u in s0.timeline if u.role == "train"
                   for ro in s0.timeline if ro.role == "rollout")


def test_overlap_beats_sync_when_separated():
    sync = simulate(BASE.replace(mode="separated", staleness=0), CAL)
    stale = simulate(BASE.replace(mode="separated", staleness=1), CAL)
    assert stale.tokens_per_s > sync.tokens_per_s


def test_partial_rollout_carries_samples_over():
    r = simulate(BASE.replace(mode="colocated", staleness=1, rollout_finish_threshold=0.5), CAL)
    assert 1 in r.staleness_per_sample  # some trained samples started under older weights


def test_rollout_stats_account_for_each_steps_engine_time():
    r = simulate(BASE.replace(mode="colocated", staleness=1, rollout_finish_threshold=0.5),
                 CAL.replace(stop_sync_s=0.001))
    assert len(r.rollout_stats) == len(r.update_end_s)
    for k, st in enumerate(r.rollout_stats):
        # the busiest engine's passes are its rollout time on the timeline for that step's version
        per_lane: dict[str, float] = {}
        for e in r.timeline:
            if e.role == "rollout" and e.version == k:
                per_lane[e.device] = per_lane.get(e.device, 0.0) + e.end - e.start
        if r.generated_per_update[k]:
            assert st["engine_decode_passes"] >= 1 and st["time_stop_sync_s"] > 0  # 2 engines meet
            assert st["time_decode_s"] + st["time_prefill_s"] == pytest.approx(max(per_lane.values()))
        else:
            assert not per_lane


def test_balanced_parts_is_the_trainers():
    pytest.importorskip("torch")
    from rlfusion.runtime.trainer import _balanced_parts as real

    rng = random.Random(0)
    for _ in range(200):
        n, parts = rng.randint(0, 20), rng.randint(1, 4)
        started = [rng.random() < 0.4 for _ in range(n)]
        groups = [SimpleNamespace(gid=i, started=s) for i, s in enumerate(started)]
        items = [(i, None, ["x"] if s else []) for i, s in enumerate(started)]
        assert [[g.gid for g in p] for p in _balanced_parts(groups, parts)] == \
               [[it[0] for it in p] for p in real(items, parts)]


# ---- the real StalenessBook and engine scheduler, driven with the same lengths ----

def _real_run(cfg: RLSimConfig):
    """The runtime's co-located StaleSync loop on one rollout device: StalenessBook plans,
    run_groups' stop rule over the real Scheduler (a token per scheduled row), take_batch.
    Returns generated tokens, sorted staleness and engine seconds per update."""
    from rlfusion.engine.scheduler import Scheduler, SchedulerConfig
    from rlfusion.engine.types import Request, SamplingParams
    from rlfusion.runtime.stalesync import StaleSyncConfig, StalenessBook

    G, P = cfg.samples_per_prompt, cfg.prompt_len
    book = StalenessBook(StaleSyncConfig(enabled=True, max_staleness=cfg.staleness,
                                         rollout_finish_threshold=cfg.rollout_finish_threshold),
                         cfg.prompts_per_step, G)
    counter = itertools.count()
    params = SamplingParams(max_new_tokens=10_000)
    out = []
    for k in range(cfg.num_steps):
        plan = book.plan(k, k, lambda: next(counter))
        sched = Scheduler(SchedulerConfig(cfg.max_batch_per_engine, cfg.max_batched_tokens, 10_000,
                                          cfg.min_prefill_batch))
        owner, open_count, finished, done, before, order = {}, {}, set(), {}, 0, []
        for gid, _, partial in sorted(plan["items"], key=lambda it: it[0]):
            if partial:
                reqs = [Request(f"{gid}/{t.metrics['sample']}", list(t.prompt_ids), params,
                                list(t.response_ids), [0.0] * len(t.response_ids), list(t.versions))
                        for t in partial]
                before += sum(len(t.response_ids) for t in partial)
            else:
                reqs = [Request(f"{gid}/{i}", [1] * P, params) for i in range(G)]
            for r in reqs:
                owner[r.request_id] = gid
                order.append(r.request_id)
                sched.add(r)
            open_count[gid] = len(reqs)
        seconds = 0.0
        while sched.has_unfinished() and not (len(finished) >= plan["quota"] and plan["due"] <= finished):
            step = sched.schedule()
            if step.decode:
                seconds += CAL.decode_step_s(len(step.decode))
            if step.prefill:
                seconds += CAL.prefill_s(sum(s.num_tokens for s in step.prefill))
            for seq in step.decode + step.prefill:
                r = seq.request
                r.output_ids.append(0)
                r.logprobs.append(0.0)
                r.versions.append(k)
                gid, i = map(int, r.request_id.split("/"))
                if len(r.output_ids) >= LENGTHS[(gid * G + i) % len(LENGTHS)]:
                    sched.finish(seq)
                    done[r.request_id] = r
                    open_count[gid] -= 1
                    if open_count[gid] == 0:
                        finished.add(gid)
        aborted = {s.request_id: s.request for s in sched.abort(set(owner) - set(done))}

        def traj(r):
            return SimpleNamespace(group_id=int(r.request_id.split("/")[0]), prompt_ids=r.prompt_ids,
                                   response_ids=list(r.output_ids), versions=list(r.versions),
                                   metrics={"sample": int(r.request_id.split("/")[1])})
        # run_groups returns finished and unfinished samples in request order
        book.record([traj(done[rid]) for rid in order if rid in done],
                    [traj(aborted[rid]) for rid in order if rid in aborted],
                    [gid for gid, _, _ in plan["items"]])
        batch, _ = book.take_batch(k)
        generated = sum(len(r.output_ids) for r in list(done.values()) + list(aborted.values())) - before
        out.append((generated, sorted(k - min(t.versions) for t in batch), seconds))
    return out


@pytest.mark.parametrize("s,threshold", [(0, 1.0), (1, 0.75), (1, 1.0), (2, 0.5), (3, 0.25), (1, 5)])
def test_matches_the_runtime_book_and_scheduler(s, threshold):
    pytest.importorskip("torch")  # rlfusion.runtime imports it
    cfg = BASE.replace(mode="colocated", devices_per_supernode=1, staleness=s,
                       rollout_finish_threshold=threshold, num_steps=8)
    real = _real_run(cfg)
    sim = simulate(cfg, CAL)
    assert sim.generated_per_update == tuple(g for g, _, _ in real)
    n = 0
    per_update = []
    for _, st, _ in real:  # the simulator lists each batch's samples in group order
        per_update.append(sorted(sim.staleness_per_sample[n:n + len(st)]))
        n += len(st)
    assert per_update == [st for _, st, _ in real] and n == len(sim.staleness_per_sample)
    rollout_s = [sum(e.end - e.start for e in sim.timeline if e.role == "rollout" and e.version == k)
                 for k in range(cfg.num_steps)]
    assert rollout_s == pytest.approx([sec for _, _, sec in real], rel=1e-9, abs=1e-12)


def test_stop_rule_cadence_mirrors_the_runtime():
    """The runtime model meets as often as `RolloutStage.run_groups` does."""
    from rlfusion.runtime.stages import SYNC_EVERY

    assert RLSimConfig().stop_sync_every == SYNC_EVERY


def test_separated_overlap_with_scorers_on_the_train_devices():
    """reference_placement "train": the rollout engine only generates and the reference pass
    runs on the train lane before each update."""
    cfg = BASE.replace(mode="separated", staleness=1, devices_per_supernode=2)
    on_rollout = simulate(cfg, CAL)
    on_train = simulate(cfg.replace(reference_placement="train"), CAL)
    lanes = lambda r: {e.device for e in r.timeline if e.role == "ref"}
    assert lanes(on_rollout) == {"engine0"} and lanes(on_train) == {"train"}
    assert max(on_train.staleness_per_sample) <= 1 and on_train.updates == cfg.num_steps
