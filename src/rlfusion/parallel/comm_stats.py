"""Count the bytes a rank hands to collectives, by operation, without touching the code that
calls them: a dispatch mode sees every c10d / functional-collective op (FSDP2 all-gathers and
reduce-scatters, DTensor TP all-reduces, pipeline send, expert all-to-all).

Counted per call: the tensor this rank contributes (all-reduce buffer, all-gather input,
reduce-scatter input, all-to-all input including the part kept locally, sent tensor). Receives
and waits are not counted, so summing over ranks does not double count a transfer. Owns only
the counting; it knows nothing about layouts.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# c10d ops whose first argument is the output buffer; the contribution is the second.
_INPUT_SECOND = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                 "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                 "alltoall_", "alltoall_base_"}
_SKIP = {"recv", "recv_any_source", "barrier", "wait_tensor", "monitored_barrier",
         "wrap_tensor_autograd"}  # the last re-wraps an all-reduce result already counted


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class CollectiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name, key = func._opname, func._opname.strip("_")
            if key not in _SKIP and args:
                arg = args[1] if func.namespace == "c10d" and name in _INPUT_SECOND else args[0]
                self.bytes[key] += _nbytes(arg)
                self.calls[key] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
