"""Runs several `bench/` scripts with `--smoke` one after another in this one process, as
`python bench/NAME.py --smoke` would run each, and writes one JSON line per script to OUT:
{"script", "code", "out", "err", "seconds"}. One process pays the interpreter's start and the
imports (torch, Ray, rlfusion) once instead of once per script.

    python tests/bench_runner.py OUT.jsonl SCRIPT.py ...

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
import sys
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


def main() -> None:
    out_path, scripts = Path(sys.argv[1]), sys.argv[2:]
    with out_path.open("w") as f:
        for script in scripts:
            f.write(json.dumps(run_script(script)) + "\n")
            f.flush()  # what finished is read back even if a later script takes the process down


if __name__ == "__main__":
    main()
