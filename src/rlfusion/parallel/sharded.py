"""Is this a DTensor (a TP or FSDP shard) or an FSDP module, without importing
`torch.distributed.tensor` or `torch.distributed.fsdp` (about 0.5 s of CPU in every process
that imports them: each device worker, rank and CLI run). Only the layouts that shard build
DTensors, and they import those modules first; a process that never did holds none."""

from __future__ import annotations

import sys
from typing import Any


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_fsdp_module(m: Any) -> bool:
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(m, module.FSDPModule)
