"""The simulator's `planned` recompute/swap option: the same planner as training
(`rlfusion.memory_plan`, which `rlfusion.parallel.recompute` feeds measured profiles) fed the
cost model."""

import argparse
import subprocess
import sys
import time

import pytest

from rlfusion.memory_plan import MemoryPlan, ModuleProfile, plan_memory
from rlfusion.model.config import get_preset
from rlfusion.sim.cli import register_plan_command
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.step import estimate_step

JOB = TrainJob(get_preset("pangu-ultra-moe-718b"), seq_len=8192, global_batch=1536)
REAL_RUN = dict(tp=8, pp=16, vpp=2, ep=32, dp=48, micro_batch=1)  # the reported 718B layout


def test_planned_fits_where_none_does_not_and_costs_less_than_full():
    cluster = get_cluster("910b", 6144)
    none = estimate_step(JOB, ParallelPlan(**REAL_RUN), cluster)
    full = estimate_step(JOB, ParallelPlan(**REAL_RUN, recompute="full"), cluster)
    planned = estimate_step(JOB, ParallelPlan(**REAL_RUN, recompute="planned", swap=True),
                            cluster)
    assert not none.fits and full.fits and planned.fits
    assert planned.memory.total_GB <= cluster.chip.memory_GB < none.memory.total_GB
    assert 0 < planned.recompute_s + planned.swap_exposed_s < full.recompute_s
    assert none.step_s < planned.step_s < full.step_s
    assert len(planned.memory_plans) == 4 * 4 and all(m.fits for m in planned.memory_plans)
    chosen = [n for m in planned.memory_plans for n in (*m.recompute, *m.swap)]
    assert chosen and all(n.startswith("layers.") for n in chosen)
    assert len(set(chosen)) == len(chosen)  # every module chosen once, on its own stage


def test_planned_with_room_to_spare_chooses_nothing():
    job = TrainJob(get_preset("tiny"), seq_len=256, global_batch=8)
    est = estimate_step(job, ParallelPlan(1, 1, 1, 1, 1, 1, "planned", True),
                        get_cluster("h200", 1))
    plain = estimate_step(job, ParallelPlan(1, 1, 1, 1, 1, 1), get_cluster("h200", 1))
    assert est.memory_plans == (MemoryPlan(),)
    assert est.step_s == pytest.approx(plain.step_s)
    assert est.memory.total_GB == pytest.approx(plain.memory.total_GB)


def test_planner_is_shared_with_training():
    recompute = pytest.importorskip("rlfusion.parallel.recompute")
    assert recompute.plan_memory is plan_memory and recompute.MemoryPlan is MemoryPlan
    prof = {"layers.0": ModuleProfile(100, 10, 12e-3), "layers.0.attn": ModuleProfile(40, 10, 1e-2),
            "layers.0.mlp": ModuleProfile(40, 10, 1e-3)}
    assert plan_memory(prof, 100, 75, 1.0, allow_swap=False).recompute == ("layers.0.mlp",)


def test_plan_command_718b_prints_planned_choices(capsys):
    parser = argparse.ArgumentParser()
    register_plan_command(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model", "pangu-ultra-moe-718b", "--cluster",
                              "910b:6144", "--seq", "8192", "--top", "12"])
    start = time.perf_counter()
    assert args.func(args) == 0
    assert time.perf_counter() - start < 60
    out = capsys.readouterr().out
    assert "recompute/swap" in out and "planned: " in out
    assert "best planned recompute/swap" in out


def test_memory_plan_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import rlfusion.memory_plan, "
            "rlfusion.sim.step; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ok"
