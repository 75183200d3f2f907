"""Microbenchmark of this machine: writes a `ClusterSpec` JSON for the `cpu` cluster kind.

Times fp32 matmuls (a large one for the peak rate, small-row ones for how efficiency falls
with the number of rows) and a large memcpy (memory bandwidth). torch is imported inside the
function so that `rlfusion.sim` stays importable without torch. Runs in about a second.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rlfusion.sim.hardware import ClusterSpec, get_cluster, save_cluster


def _best_time_s(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_tflops(torch, rows: int, dim: int, threads: int) -> float:
    a, b = torch.randn(rows, dim), torch.randn(dim, dim)
    seconds = _best_time_s(lambda: a @ b, repeats=5)
    return 2.0 * rows * dim * dim / seconds / 1e12


def measure_cpu(path: str | Path, threads: int = 2, num_workers: int = 1) -> ClusterSpec:
    """Measure one worker with `threads` threads; save and return the spec for `num_workers`."""
    import torch  # lazy: only this function needs it

    torch.set_num_threads(threads)
    dim = 1024
    peak = _matmul_tflops(torch, 1024, dim, threads)
    small_rows = 8
    small = _matmul_tflops(torch, small_rows, dim, threads)
    efficiency_small = min(small / peak, 0.99)
    # eff(m) = m / (m + h)  =>  h = m (1/eff - 1), relative to the large-GEMM rate.
    half_rows = max(1, round(small_rows * (1.0 / efficiency_small - 1.0)))
    src = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    copy_s = _best_time_s(lambda: dst.copy_(src), repeats=5)
    bandwidth = 2 * src.numel() * 4 / copy_s / 1e9  # read + write

    base = get_cluster("cpu", num_workers)
    chip = dataclasses.replace(
        base.chip, name=f"cpu-{threads}thread-measured", peak_tflops=peak,
        memory_bandwidth_GBps=bandwidth, matmul_efficiency=1.0,
        attention_efficiency=0.5, half_efficiency_rows=half_rows,
    )
    spec = dataclasses.replace(base, chip=chip,
                               host=dataclasses.replace(base.host, bandwidth_GBps=bandwidth))
    save_cluster(spec, path)
    return spec
