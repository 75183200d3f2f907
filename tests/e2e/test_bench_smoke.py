"""Every `bench/` script runs end to end at its smallest sizes (`--smoke`): the same sections and
functions as its full run, so a benchmark cannot break silently between the runs that record its
figures. Each must exit 0, say first that it is a smoke run, and print its `target` lines in the
form the recorded figures are read from. The scripts run one after another in one process
(tests/bench_runner.py), as each would run on its own, started beside the session once it is
collected."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from bench_runner import Background

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.name for path in (ROOT / "bench").glob("*.py"))  # a new bench is covered as it lands
# `target NAME: VALUE (goal >= GOAL)` or `<=`, a note after the goal allowed ("(goal >= 2.00, published 2.66)")
TARGET = re.compile(r"target (?P<name>\w+): (?P<value>\S+) \(goal (?:>=|<=) (?P<goal>[^,)\s]+)(?:, [^)]*)?\)")


def _number(text: str) -> float | None:
    """The value of a figure, or None where it is not a finite number (nan, inf, text)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@pytest.fixture(scope="module")
def smoke_runs(request) -> dict[str, dict]:
    """The smoke runs of the benches this session selected: started once the session was
    collected (tests/conftest.py), read back here."""
    return request.session.bench_smoke.collect()


def test_the_benches_are_found():
    assert {"engine.py", "fusion.py", "simulator.py"} <= set(BENCHES)


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script, smoke_runs, record_property):
    run = smoke_runs[script]
    record_property("bench_seconds", round(run.get("seconds", 0.0), 1))  # its share of the one runner process
    if run.get("timed_out"):
        pytest.fail(f"bench/{script} --smoke still running after {Background.TIMEOUT_S} s\n{run['missing']}")
    if "missing" in run:
        pytest.fail(f"bench/{script} --smoke did not run: {run['missing']}")
    code, out, err = run["code"], run["out"], run["err"]
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
