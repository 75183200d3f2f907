"""This machine's compute peak, the denominator of every achieved-FLOP/s share a run reports.

- `matmul_peak_flops`: the rate of a large square matmul at the current thread count (fp32
  on the CPU) — the machine's compute peak as the model's passes can reach it. Every device
  worker measures its own once (`matmul_peak_gflop_per_s` in its report); a pass's useful
  FLOPs are `rlfusion.model.flops.forward_flops` (a training step: 3x its forward).

torch is imported inside the function, so importing `rlfusion.obs` stays torch-free.
"""

from __future__ import annotations

import statistics
import time


def matmul_peak_flops(dim: int = 512, repeats: int = 7, device=None, dtype=None) -> float:
    """FLOP/s of a `dim` x `dim` matmul at the current thread count (median of `repeats`
    timings of a few back-to-back products), on `device` (default: the CPU) in `dtype` (default:
    float32). On a CUDA device each timing waits for its kernels."""
    import torch

    device = torch.device(device or "cpu")
    a = torch.randn(dim, dim, device=device, dtype=dtype or torch.float32)
    b = torch.randn(dim, dim, device=device, dtype=dtype or torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inner = 8
    for _ in range(2):
        a @ b
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync()
        times.append((time.perf_counter() - start) / inner)
    return 2.0 * dim ** 3 / statistics.median(times)
