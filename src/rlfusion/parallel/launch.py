"""Run a function on a local multi-process world: the tiny CPU path for parallel layouts.

`run_world(fn, world, *args)` spawns `world` processes, joins them into a gloo process group on
127.0.0.1 through a rendezvous store the caller holds on a port the OS picked (so no other process
can take the port between choosing it and the ranks' start, as a port probed free and released
could; one CPU thread each, so 4 ranks on 2 cores stay oversubscribed rather than thrashing),
runs `fn(*args)` on every rank and returns the per-rank results. Used by the tests and by
`bench/parallel.py`; multi-node runs use Ray and their own rendezvous, not this.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    result = None
    try:
        result = fn(*args)
    except Exception:
        result = {"error": traceback.format_exc()}
        raise
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 600) -> list:
    """`fn` must be importable by name (module level). Raises if any rank fails."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)  # held until the end
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, store.port, out_dir, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):  # one exit at a time
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"world of {world} ranks still running after {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]
