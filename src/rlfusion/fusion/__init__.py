"""RL Fusion: training and inference on the same devices (state switching, memory accounting)."""

from rlfusion.fusion.memory import (
    CATEGORIES,
    LOCATIONS,
    MemoryLedger,
    ZeroRedundancyReport,
    check_zero_redundancy,
    grad_bytes,
    optimizer_bytes,
    param_bytes,
    tensor_bytes,
)

__all__ = [
    "CATEGORIES", "LOCATIONS", "MemoryLedger", "ZeroRedundancyReport", "check_zero_redundancy",
    "grad_bytes", "optimizer_bytes", "param_bytes", "tensor_bytes",
]
