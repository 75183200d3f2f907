"""The simulator's model of the runtime's StaleSync (`stalesync_model = "runtime"`,
rlfusion/sim/rl_stalesync.py): it runs the runtime's StalenessBook, stop rule and device split
over the engine's scheduler, without torch; the staleness bound, s = 0 = synchronous, separated
overlap."""

import ast
import math
import random
import subprocess
from pathlib import Path
import sys

import pytest

from rlfusion.sim.calibration import cpu_default
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate
import rlfusion.runtime.trainer as trainer
import rlfusion.stalesync.book as rules
import rlfusion.stalesync.schedule as schedule
from rlfusion.engine import scheduler as engine_scheduler
from rlfusion.sim import rl_stalesync

CAL = cpu_default()
RNG = random.Random(3)
# a long tail like the real task's: median ~24, some at the 160 cap
LENGTHS = tuple(min(160, max(1, round(24 * math.exp(RNG.gauss(0.0, 0.57))))) for _ in range(4096))
BASE = RLSimConfig(prompts_per_step=8, group_size=4, num_steps=6, max_num_seqs=16,
                   min_prefill_batch=4, max_new_tokens=160, response_lengths=LENGTHS,
                   partial_rollout=True, stalesync_model="runtime")


@pytest.mark.parametrize("mode", ["colocated", "separated", "fully_shared", "hybrid"])
@pytest.mark.parametrize("s", [0, 1, 2, 3])
@pytest.mark.parametrize("threshold", [0.25, 0.75, 1.0, 3])
@pytest.mark.parametrize("devices", [2, 4])
def test_staleness_bound_never_exceeded(mode, s, threshold, devices):
    if mode == "hybrid" and s == 0:
        pytest.skip("hybrid placement needs s >= 1")
    cfg = BASE.replace(mode=mode, max_staleness=s, rollout_finish_threshold=threshold,
                       devices_per_supernode=devices)
    r = simulate(cfg, CAL)
    assert r.updates == cfg.num_steps
    assert r.staleness_per_sample and max(r.staleness_per_sample) <= s
    assert r.staleness_max <= s
    assert r.max_groups_in_flight <= (s + 1) * cfg.prompts_per_step
    assert all(0.0 <= u <= 1.0 for u in r.utilization.values())
    ends = r.update_end_s
    assert list(ends) == sorted(ends) and ends[0] > 0


@pytest.mark.parametrize("mode", ["colocated", "separated", "fully_shared"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_s0_matches_the_synchronous_simulation(mode, devices):
    if mode == "separated" and devices == 1:
        pytest.skip("separated needs 2 devices")
    # an engine's slots hold exactly its contiguous share (the synchronous model fills engines
    # in order from one pool; the runtime splits the prompts contiguously)
    engines = devices // 2 if mode == "separated" else devices
    cfg = BASE.replace(mode=mode, devices_per_supernode=devices, max_staleness=0, min_prefill_batch=1)
    cfg = cfg.replace(max_num_seqs=cfg.samples_per_step // engines)
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
    r = simulate(BASE.replace(mode="separated", max_staleness=1), CAL)
    trains = [e for e in r.timeline if e.role == "train"]
    rollouts = [e for e in r.timeline if e.role == "rollout"]
    assert trains and rollouts
    # every update k >= 0 runs alongside the rollout for update k + 1 (weights v_k)
    for u in trains:
        assert any(_overlaps(u, ro) and ro.version == u.version for ro in rollouts)
    # and the pipeline fill: the first update starts only after the first rollout ended
    assert trains[0].start >= min(ro.end for ro in rollouts if ro.version == 0)
    s0 = simulate(BASE.replace(mode="separated", max_staleness=0), CAL)
    assert not any(_overlaps(u, ro) for u in s0.timeline if u.role == "train"
                   for ro in s0.timeline if ro.role == "rollout")


def test_hybrid_train_devices_join_each_rollout_after_their_update():
    """engine1 is the train device: it updates while engine0 decodes the next rollout, then
    joins that rollout with the new weights; from the second batch on, part of every batch is
    fresh (staleness 0) and the rest one version old."""
    r = simulate(BASE.replace(mode="hybrid", max_staleness=1, num_steps=8), CAL)
    assert r.staleness_max == 1 and r.updates == 8
    trains = [e for e in r.timeline if e.role == "train"]
    assert trains and {e.device for e in trains} == {"engine1"}
    for u in trains:
        joined = [e for e in r.timeline if e.device == "engine1" and e.role == "rollout" and e.version == u.version + 1]
        alongside = [e for e in r.timeline if e.device == "engine0" and e.role == "rollout" and _overlaps(u, e)]
        assert alongside and all(e.version == u.version for e in alongside)
        if joined:  # (it may get no new group when the last update took the whole rollout)
            assert min(e.start for e in joined) >= u.end
    n = BASE.samples_per_step
    later = r.staleness_per_sample[2 * n:]
    assert 0 in later and 1 in later
    with pytest.raises(ValueError, match="mode='hybrid' needs stalesync_model='runtime' and max_staleness >= 1"):
        BASE.replace(mode="hybrid", max_staleness=0)
    with pytest.raises(ValueError, match="mode='hybrid' needs >= 2 engines"):
        simulate(BASE.replace(mode="hybrid", max_staleness=1, devices_per_supernode=1), CAL)


def test_overlap_beats_sync_when_separated():
    sync = simulate(BASE.replace(mode="separated", max_staleness=0), CAL)
    stale = simulate(BASE.replace(mode="separated", max_staleness=1), CAL)
    assert stale.tokens_per_s > sync.tokens_per_s


def test_partial_rollout_carries_samples_over():
    r = simulate(BASE.replace(mode="colocated", max_staleness=1, rollout_finish_threshold=0.5), CAL)
    assert 1 in r.staleness_per_sample  # some trained samples started under older weights


def test_rollout_stats_account_for_each_steps_engine_time():
    r = simulate(BASE.replace(mode="colocated", max_staleness=1, rollout_finish_threshold=0.5),
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
            assert 1 <= st["engine_decode_rows_mean"] <= BASE.max_num_seqs  # rows per pass, as the runtime's metric
            assert st["time_decode_s"] + st["time_prefill_s"] == pytest.approx(max(per_lane.values()))
        else:
            assert not per_lane


def test_the_sim_runs_the_runtime_rules_and_the_engine_scheduler(monkeypatch):
    """Every rule the simulation applies is the runtime's function: counting the calls shows
    each one in use (the book's admission, deadline, quota, batch choice; the stop rule and the
    device split in the rollout; the engine's scheduler)."""
    calls = {}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("admissible", "due_groups", "rollout_quota", "select_batch", "staleness"):
        counted(rules, name)
    for name in ("rollout_stops", "staleness"):
        counted(rl_stalesync, name)
    counted(schedule, "assign_groups")
    counted(schedule.StaleSyncSchedule, "step")
    counted(engine_scheduler.Scheduler, "schedule")
    assert rl_stalesync.StalenessBook is rules.StalenessBook and rl_stalesync.Scheduler is engine_scheduler.Scheduler
    # one orchestration: the runtime's trainer and the simulator run the same schedule
    assert trainer.StaleSyncSchedule is rl_stalesync.StaleSyncSchedule is schedule.StaleSyncSchedule
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in ast.walk(ast.parse(Path(rl_stalesync.__file__).read_text())) if isinstance(node, ast.Call)}
    assert not called & {"take_batch", "plan", "collect", "assign_groups", "assign_hybrid", "join_share"}
    cfg = BASE.replace(mode="colocated", max_staleness=1, rollout_finish_threshold=0.5)
    r = simulate(cfg, CAL)
    assert r.updates == cfg.num_steps
    for name in ("admissible", "due_groups", "rollout_quota", "select_batch", "rollout_stops", "assign_groups",
                 "schedule", "step"):
        assert calls.get(name, 0) >= cfg.num_steps, name
    # staleness: the book checks each trained group (its oldest sample) and the sim reports each sample
    assert calls["staleness"] == len(r.staleness_per_sample) + len(r.staleness_per_sample) // cfg.group_size


def test_the_sim_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from rlfusion.sim.rl_config import RLSimConfig\n"
            "from rlfusion.sim.calibration import cpu_default\n"
            "from rlfusion.sim.rl_sim import simulate\n"
            "import rlfusion.sim.rl_stalesync\n"
            "r = simulate(RLSimConfig(prompts_per_step=4, group_size=2, num_steps=2, max_staleness=1,\n"
            "             partial_rollout=True, stalesync_model='runtime', rollout_finish_threshold=0.5), cpu_default())\n"
            "assert r.updates == 2\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_threshold_stops_the_rollout_early_and_carries_the_tail():
    """With threshold 0.25 a co-located rollout stops once a quarter of the groups finished:
    the first step generates less than with threshold 1, and the rest resumes under newer
    weights, within the bound."""
    cfg = BASE.replace(mode="colocated", max_staleness=1, devices_per_supernode=1)
    full = simulate(cfg, CAL)
    early = simulate(cfg.replace(rollout_finish_threshold=0.25), CAL)
    assert early.generated_per_update[0] < full.generated_per_update[0]
    assert 1 in early.staleness_per_sample and max(early.staleness_per_sample) <= 1


def test_stop_rule_cadence_mirrors_the_runtime():
    """The runtime model meets as often as `RolloutStage.run_groups` does."""
    from rlfusion.runtime import rollout_stage
    from rlfusion.stalesync.rules import STOP_SYNC_EVERY

    assert RLSimConfig().stop_sync_every == STOP_SYNC_EVERY and rollout_stage.STOP_SYNC_EVERY is STOP_SYNC_EVERY


def test_separated_overlap_with_scorers_on_the_train_devices():
    """scorers "train": the rollout engine only generates and the reference pass
    runs on the train lane before each update."""
    cfg = BASE.replace(mode="separated", max_staleness=1, devices_per_supernode=2)
    on_rollout = simulate(cfg, CAL)
    on_train = simulate(cfg.replace(scorers="train"), CAL)
    lanes = lambda r: {e.device for e in r.timeline if e.role == "ref"}
    assert lanes(on_rollout) == {"engine0"} and lanes(on_train) == {"train"}
    assert max(on_train.staleness_per_sample) <= 1 and on_train.updates == cfg.num_steps


def test_kept_cache_rows_resume_without_prefill():
    """resume_kv = "keep" (the runtime's default): a paused sample goes back to the device that
    aborted it and decodes on from its saved row, so the rollouts prefill less than with
    "recompute" (prompt + partial output again) and the run is faster, within the same bound."""
    cfg = BASE.replace(mode="colocated", max_staleness=2, rollout_finish_threshold=0.5)
    keep, recompute = simulate(cfg, CAL), simulate(cfg.replace(resume_kv="recompute"), CAL)
    prefill = [sum(st["time_prefill_s"] for st in r.rollout_stats) for r in (keep, recompute)]
    assert prefill[0] < prefill[1]
    assert keep.tokens_per_s > recompute.tokens_per_s
    assert max(keep.staleness_per_sample) <= 2
    with pytest.raises(ValueError, match="simulate.resume_kv='copy'; allowed: keep, recompute"):
        cfg.replace(resume_kv="copy")
