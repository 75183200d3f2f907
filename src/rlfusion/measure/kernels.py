"""How much of a pass's wall time is spent outside compute kernels (the host-bound share).

The machine's compute peak is `rlfusion.obs.peak.matmul_peak_flops` (every device worker
measures it for its run's metrics) and the useful FLOPs of a pass are
`rlfusion.model.flops.forward_flops` (a training step: 3x its forward).

- `host_bound_share`: the share of a pass's wall time not spent computing inside a kernel. On
  a CPU the host *is* the device, so "kernel time" is the self time of the ATen operators that
  read or write tensor data (the profiler's per-operator self CPU time; views, metadata and
  allocation excluded), less the dispatch every call pays inside that time (`dispatch_floor_s`:
  what a one-element add books per call); what is left is Python, dispatch, and the
  scheduler's and sampler's bookkeeping — the time a GPU would wait on its host. Wall time is
  timed without the profiler (its per-operator overhead would count as host time).

torch is imported inside the functions.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


# ATen operators that do not read or write tensor data: views, shape and stride metadata,
# allocation. Everything else under `aten::` counts as kernel time.
NON_KERNEL_OPS = frozenset({
    "aten::alias", "aten::as_strided", "aten::detach", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::expand", "aten::expand_as", "aten::lift_fresh", "aten::narrow",
    "aten::permute", "aten::reshape", "aten::resize_", "aten::select", "aten::slice", "aten::split",
    "aten::split_with_sizes", "aten::squeeze", "aten::t", "aten::transpose", "aten::unbind",
    "aten::unflatten", "aten::unsqueeze", "aten::view", "aten::view_as", "aten::chunk",
    "aten::_unsafe_view", "aten::_reshape_alias", "aten::contiguous", "aten::matmul", "aten::linear",
    "aten::to", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::numpy_T", "aten::dim", "aten::size", "aten::stride",
})
# `aten::matmul` / `linear` / `to` / `contiguous` are wrappers: their kernels (mm, addmm, copy_)
# are counted on their own; their self time is dispatch.


def wall_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _profiled(fn: Callable[[], object], repeats: int):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    return [e for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in NON_KERNEL_OPS]


def dispatch_floor_s() -> float:
    """Self seconds the profiler books for an operator that computes nothing worth the name (an
    add of two one-element tensors): the dispatch every operator call pays inside its own time."""
    import torch

    a, b = torch.ones(1), torch.ones(1)
    calls = 2000
    events = _profiled(lambda: [torch.add(a, b) for _ in range(calls)], 1)
    add = next(e for e in events if e.key == "aten::add")
    return add.self_cpu_time_total / 1e6 / add.count


def kernel_seconds(fn: Callable[[], object], repeats: int, floor_s: float) -> float:
    """Mean seconds per `fn()` spent computing inside kernels: the self time of the ATen
    operators outside `NON_KERNEL_OPS`, less `floor_s` of dispatch per call, under the profiler."""
    events = _profiled(fn, repeats)
    total = sum(max(0.0, e.self_cpu_time_total / 1e6 - e.count * floor_s) for e in events)
    return total / repeats


def host_bound_share(fn: Callable[[], object], repeats: int = 20, floor_s: float | None = None,
                     rounds: int = 3) -> tuple[float, float, float]:
    """(host-bound share, wall seconds, kernel seconds) of one `fn()`: the share of its wall
    time not spent computing inside kernels, at least 0 (`floor_s`: the per-call dispatch floor,
    measured when not given). Unprofiled and profiled runs of `repeats` calls alternate for
    `rounds` rounds, each round pairing its own two, so a noisy machine slows both alike; the
    medians over rounds."""
    floor_s = dispatch_floor_s() if floor_s is None else floor_s
    shares, walls, kernels = [], [], []
    for _ in range(rounds):
        walls.append(wall_seconds(fn, repeats))
        kernels.append(kernel_seconds(fn, repeats, floor_s))
        shares.append(max(0.0, 1.0 - kernels[-1] / walls[-1]))
    return statistics.median(shares), statistics.median(walls), statistics.median(kernels)
