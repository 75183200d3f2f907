"""Parallel-strategy search and the `plan` / `simulate` subcommands."""

import argparse
import json
import subprocess
import sys
import time

import pytest

from rlfusion.model.config import get_preset
from rlfusion.sim.cli import register_plan_command, register_simulate_command
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.plan import TrainJob
from rlfusion.sim.search import search_plans


def _parser():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_plan_command(sub)
    register_simulate_command(sub)
    return parser


def test_search_returns_fitting_ranked_plans_fast():
    job = TrainJob(get_preset("pangu-ultra-moe-718b"), seq_len=4096, global_batch=512)
    cluster = get_cluster("910b", 512)
    start = time.perf_counter()
    result = search_plans(job, cluster)
    assert time.perf_counter() - start < 20
    assert result.ranked
    assert all(e.fits and e.memory.total_GB <= cluster.chip.memory_GB for e in result.ranked)
    steps = [e.step_s for e in result.ranked]
    assert steps == sorted(steps)
    assert result.reasons[0].startswith("best:")


def test_plan_command_prints_table(capsys):
    args = _parser().parse_args(["plan", "--model", "tiny", "--cluster", "cpu:4", "--seq",
                                 "256", "--global-batch", "16", "--top", "3"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "why the best plan wins" in out


def test_plan_bad_flags():
    with pytest.raises(SystemExit):
        _parser().parse_args(["plan", "--model", "nope"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["plan", "--seq", "-3"])
    args = _parser().parse_args(["plan", "--cluster", "tpu:8"])
    with pytest.raises(ValueError, match="--cluster.*allowed"):
        args.func(args)


def test_simulate_command_writes_trace(tmp_path, capsys):
    cfg = tmp_path / "sim.toml"
    cfg.write_text('[simulate]\nmode = "separated"\nmax_staleness = 1\nnum_steps = 3\n')
    args = _parser().parse_args(["simulate", str(cfg), "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert "tokens/s" in capsys.readouterr().out
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])


def test_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import rlfusion.sim, rlfusion.sim.cli, "
            "rlfusion.sim.report, rlfusion.sim.cpu_bench; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ok"


def test_plan_measures_this_machine_and_plans_on_it(tmp_path, capsys):
    """`rlfusion plan --measure-cpu PATH`: the machine's spec is measured, written, and planned on."""
    from rlfusion.sim.hardware import load_cluster

    parser = argparse.ArgumentParser()
    register_plan_command(parser.add_subparsers())
    path = tmp_path / "cpu.json"
    args = parser.parse_args(["plan", "--model", "tiny", "--measure-cpu", str(path), "--seq", "256",
                              "--global-batch", "8", "--top", "1"])
    args.func(args)
    assert load_cluster(path).kind == "cpu" and "cpu" in capsys.readouterr().out
