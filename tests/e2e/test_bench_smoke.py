"""Every `bench/` script runs end to end at its smallest sizes (`--smoke`): the same sections and
functions as its full run, so a benchmark cannot break silently between the runs that record its
figures. Each must exit 0, say first that it is a smoke run, and print its `target` lines in the
form the recorded figures are read from."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.name for path in (ROOT / "bench").glob("*.py"))  # a new bench is covered as it lands
# `target NAME: VALUE (goal >= GOAL)` or `<=`, a note after the goal allowed ("(goal >= 2.00, published 2.66)")
TARGET = re.compile(r"target (?P<name>\w+): (?P<value>\S+) \(goal (?:>=|<=) (?P<goal>[^,)\s]+)(?:, [^)]*)?\)")
TIMEOUT_S = 420  # the slowest smoke run (simulator.py: calibration, 2 Ray clusters) takes ~1.5 min on 2 busy cores


def _number(text: str) -> float | None:
    """The value of a figure, or None where it is not a finite number (nan, inf, text)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _run(script: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `bench/{script} --smoke`; past the timeout its whole session
    (Ray's processes, gloo ranks) is killed and the test fails."""
    # one thread per process: the benches start several (Ray workers, gloo ranks) on 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / script), "--smoke"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the session still holds the pipes
            out, err = "", ""
        pytest.fail(f"bench/{script} --smoke still running after {TIMEOUT_S} s\n{out[-4000:]}\n{err[-4000:]}")
    return proc.returncode, out, err


def test_the_benches_are_found():
    assert {"engine.py", "fusion.py", "simulator.py"} <= set(BENCHES)


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script):
    code, out, err = _run(script)
    output = f"--- stdout (end) ---\n{out[-4000:]}\n--- stderr (end) ---\n{err[-4000:]}"
    assert code == 0, f"bench/{script} --smoke exited {code}\n{output}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("smoke run"), f"bench/{script} --smoke does not say so first\n{output}"
    for line in lines:
        if not line.startswith("target "):
            continue
        match = TARGET.fullmatch(line.strip())
        assert match, f"bench/{script}: malformed target line {line!r}"
        assert _number(match["value"]) is not None, f"bench/{script}: target value is not a number: {line!r}"
        assert _number(match["goal"]) is not None, f"bench/{script}: target goal is not a number: {line!r}"
