"""Runs several `bench/` scripts with `--smoke` one after another in this one process, as
`python bench/NAME.py --smoke` would run each, and writes one JSON line per script to OUT:
{"script", "code", "out", "err", "seconds"}. One process pays the interpreter's start and the
imports (torch, Ray, rlfusion) once instead of once per script.

    python tests/bench_runner.py OUT.jsonl SCRIPT.py ...

`Background` starts it as a process of its own beside the test session (tests/conftest.py does
so once the session is collected: the scripts keep about one core busy while the in-process
tests leave the second one mostly idle) and reads its results back.

Between scripts it puts back what one could leave behind for the next: the working folder,
the environment, sys.path, torch's thread count and determinism, a Ray it left running and
the garbage collector's frozen objects. A script's own child processes (gloo ranks, Ray
workers, subprocesses) are its own, as in a run of its own.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_script(script: str) -> dict:
    """`bench/{script} --smoke` as `__main__`: exit code, stdout, stderr, seconds."""
    import torch

    path = BENCH / script
    cwd, environ, path_before, argv = os.getcwd(), dict(os.environ), list(sys.path), sys.argv
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    sys.argv, sys.path = [str(path), "--smoke"], [str(BENCH), *path_before]  # as `python bench/x.py`
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as e:  # as the interpreter reads `sys.exit(...)`
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - a script's failure is its result, not the runner's
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
    seconds = time.perf_counter() - start
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv, sys.path[:] = argv, path_before
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    gc.unfreeze()
    gc.collect()
    return {"script": script, "code": code, "out": out.getvalue(), "err": err.getvalue(), "seconds": seconds}


class Background:
    """This file run on `scripts` in a process of its own (one thread per process, its own
    session so a hung script's Ray and gloo processes can be killed with it), started now."""

    TIMEOUT_S = 420  # per script; the slowest smoke run (simulator.py) takes ~1.5 min on 2 busy cores

    def __init__(self, scripts: list[str]):
        self.scripts = scripts
        self.folder = Path(tempfile.mkdtemp(prefix="bench_smoke_"))
        self.results = self.folder / "runs.jsonl"
        self.results.touch()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with (self.folder / "stdout").open("w") as out, (self.folder / "stderr").open("w") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, str(self.results), *scripts],
                                         cwd=BENCH.parent, env=env, stdout=out, stderr=err, text=True,
                                         start_new_session=True)

    def _lines(self) -> list[str]:
        return self.results.read_text().splitlines()

    def collect(self) -> dict[str, dict]:
        """Each script's result once the process ends: {"code", "out", "err", "seconds"}; one
        still running TIMEOUT_S after the previous one finished (or the start) has the whole
        process session killed and "timed_out" set, and a script never reached has "missing"
        with the runner's own output."""
        while self.proc.poll() is None:
            time.sleep(0.5)
            if time.time() - self.results.stat().st_mtime > self.TIMEOUT_S:  # written at each script's end
                self.stop()
        lines = self._lines()
        runs = {run["script"]: run for run in map(json.loads, lines)}
        tail = f"--- runner stdout (end) ---\n{(self.folder / 'stdout').read_text()[-4000:]}\n" \
               f"--- runner stderr (end) ---\n{(self.folder / 'stderr').read_text()[-4000:]}"
        for i, script in enumerate(self.scripts):
            if script not in runs:
                reached = i == len(lines)  # the one that was running when the runner ended
                runs[script] = {"timed_out": reached and self.proc.returncode == -signal.SIGKILL,
                                "missing": f"the runner exited {self.proc.returncode} "
                                           f"{'while running it' if reached else 'before it'}\n{tail}"}
        return runs

    def stop(self) -> None:
        """Kill the runner and everything it started (a no-op once it ended)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    out_path, scripts = Path(sys.argv[1]), sys.argv[2:]
    with out_path.open("w") as f:
        for script in scripts:
            f.write(json.dumps(run_script(script)) + "\n")
            f.flush()  # what finished is read back even if a later script takes the process down


if __name__ == "__main__":
    main()
