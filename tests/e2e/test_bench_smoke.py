"""Every `bench/` script runs end to end at its smallest sizes (`--smoke`): the same sections and
functions as its full run, so a benchmark cannot break silently between the runs that record its
figures. Each must exit 0, say first that it is a smoke run, and print its `target` lines in the
form the recorded figures are read from. The scripts run one after another in one process
(tests/bench_runner.py), as each would run on its own."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "bench_runner.py"
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


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _run_all(scripts: list[str], folder: Path) -> dict[str, dict]:
    """`bench/{script} --smoke` of each script, one after another in one process
    (tests/bench_runner.py: the interpreter and the imports once, not once per script). Each
    script's result is {"code", "out", "err"}; one still running after TIMEOUT_S has its whole
    session (Ray's processes, gloo ranks) killed and "timed_out" set, and a script the runner
    never reached has "missing" and the runner's own output."""
    # one thread per process: the benches start several (Ray workers, gloo ranks) on 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = folder / "runs.jsonl"
    with (folder / "stdout").open("w") as out, (folder / "stderr").open("w") as err:
        proc = subprocess.Popen([sys.executable, str(RUNNER), str(results), *scripts], cwd=ROOT, env=env,
                                stdout=out, stderr=err, text=True, start_new_session=True)
        done, since = 0, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            if len(_lines(results)) > done:  # the next script started
                done, since = len(_lines(results)), time.monotonic()
            elif time.monotonic() - since > TIMEOUT_S:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
    runs = {run["script"]: run for run in map(json.loads, _lines(results))}
    tail = f"--- runner stdout (end) ---\n{(folder / 'stdout').read_text()[-4000:]}\n" \
           f"--- runner stderr (end) ---\n{(folder / 'stderr').read_text()[-4000:]}"
    for i, script in enumerate(scripts):
        if script not in runs:
            reached = i == len(runs)  # the one that was running when the runner ended
            runs[script] = {"timed_out": reached and proc.returncode == -signal.SIGKILL,
                            "missing": f"the runner exited {proc.returncode} "
                                       f"{'while running it' if reached else 'before it'}\n{tail}"}
    return runs


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> dict[str, dict]:
    """The smoke runs of the benches this session selected, in one runner process."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if getattr(item, "originalname", None) == "test_bench_smoke"]
    return _run_all(scripts, tmp_path_factory.mktemp("bench_smoke"))


def test_the_benches_are_found():
    assert {"engine.py", "fusion.py", "simulator.py"} <= set(BENCHES)


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke(script, smoke_runs, record_property):
    run = smoke_runs[script]
    record_property("bench_seconds", round(run.get("seconds", 0.0), 1))  # its share of the one runner process
    if run.get("timed_out"):
        pytest.fail(f"bench/{script} --smoke still running after {TIMEOUT_S} s\n{run['missing']}")
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
