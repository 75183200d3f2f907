"""Runs several `bench/` scripts with `--smoke` one after another in this one process, as
`python bench/NAME.py --smoke` would run each, and writes one JSON line per script to OUT:
{"script", "code", "out", "err", "seconds"}. One process pays the interpreter's start and the
imports (torch, Ray, rlfusion) once instead of once per script. Each script's output also goes
to `SCRIPT.out` / `SCRIPT.err` beside OUT as it is printed, and SIGUSR1 writes every thread's
stack to `stacks` there: what a script that hangs or takes the process down leaves behind.

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
import faulthandler
import gc
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


def run_script(script: str, folder: Path) -> dict:
    """`bench/{script} --smoke` as `__main__`: exit code, stdout, stderr, seconds. Its output
    goes to files in `folder` as it is written, so a script that hangs or takes the process down
    leaves what it printed so far (`Background.collect` reads it back)."""
    import torch

    path = BENCH / script
    cwd, environ, path_before, argv = os.getcwd(), dict(os.environ), list(sys.path), sys.argv
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out_path, err_path = folder / f"{script}.out", folder / f"{script}.err"
    start = time.perf_counter()
    sys.argv, sys.path = [str(path), "--smoke"], [str(BENCH), *path_before]  # as `python bench/x.py`
    code = 0
    with out_path.open("w", buffering=1) as out, err_path.open("w", buffering=1) as err, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
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
    return {"script": script, "code": code, "out": out_path.read_text(), "err": err_path.read_text(),
            "seconds": seconds}


class Background:
    """This file run on `scripts` in a process of its own (one thread per process, its own
    session so a hung script's Ray and gloo processes can be killed with it), started now."""

    TIMEOUT_S = 420  # per script; the slowest smoke run (simulator.py) takes ~1.5 min on 2 busy cores

    def __init__(self, scripts: list[str]):
        self.scripts = scripts
        self.folder = Path(tempfile.mkdtemp(prefix="bench_smoke_"))
        self.results = self.folder / "runs.jsonl"
        self.results.touch()
        self.timed_out = False
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with (self.folder / "stdout").open("w") as out, (self.folder / "stderr").open("w") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, str(self.results), *scripts],
                                         cwd=BENCH.parent, env=env, stdout=out, stderr=err, text=True,
                                         start_new_session=True)

    def _lines(self) -> list[str]:
        return self.results.read_text().splitlines()

    def _tail(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def collect(self) -> dict[str, dict]:
        """Each script's result once the process ends: {"code", "out", "err", "seconds"}; one
        still running TIMEOUT_S after the previous one finished (or the start) has its stacks
        dumped, the whole process session killed and "timed_out" set; a script never reached,
        or running when the process died of something else, has "missing" with the output so
        far."""
        while self.proc.poll() is None:
            time.sleep(0.5)
            if time.time() - self.results.stat().st_mtime > self.TIMEOUT_S:  # written at each script's end
                self.timed_out = True
                self.stop()
        lines = self._lines()
        runs = {run["script"]: run for run in map(json.loads, lines)}
        code = self.proc.returncode
        why = f"was killed after {self.TIMEOUT_S} s without a script ending" if self.timed_out else \
            f"died of signal {_signal_name(-code)}, not sent by the tests (the kernel's OOM killer?)" \
            if code < 0 else f"exited {code}"
        tail = f"--- runner stdout (end) ---\n{self._tail('stdout')}\n--- runner stderr (end) ---\n{self._tail('stderr')}"
        for i, script in enumerate(self.scripts):
            if script not in runs:
                reached = i == len(lines)  # the one that was running when the runner ended
                here = f"--- its stdout so far ---\n{self._tail(script + '.out')}\n--- its stderr so far ---\n" \
                       f"{self._tail(script + '.err')}\n--- the runner's threads when it was killed ---\n" \
                       f"{self._tail('stacks')}\n" if reached else ""
                runs[script] = {"timed_out": reached and self.timed_out,
                                "missing": f"the runner {why} {'while running it' if reached else 'before it'}\n"
                                           f"{here}{tail}"}
        return runs

    def stop(self) -> None:
        """Kill the runner and everything it started (a no-op once it ended), its threads'
        stacks written to `stacks` first."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)  # faulthandler: every thread's stack
            time.sleep(2.0)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # (a real-time signal has no name)
        return str(number)


def main() -> None:
    out_path, scripts = Path(sys.argv[1]), sys.argv[2:]
    stacks = (out_path.parent / "stacks").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # Background.stop asks before a kill
    with out_path.open("w") as f:
        for script in scripts:
            f.write(json.dumps(run_script(script, out_path.parent)) + "\n")
            f.flush()  # what finished is read back even if a later script takes the process down


if __name__ == "__main__":
    main()
