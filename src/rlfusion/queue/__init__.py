"""DistQueue: the data queue between RL stages.

Backends: `DistQueue` (in-process) here; `ray_backend.RayDistQueue` (controller actor + storage
shards) and `hierarchical.GroupQueue` (one reader per model-parallel group) are imported from
their modules so that importing the queue does not start Ray or torch.distributed.
"""

from rlfusion.queue.client import Batch, DistQueue, QueueConfig, QueueFullError, QueueStats
from rlfusion.queue.controller import POLICIES, Policy, QueueController
from rlfusion.queue.packing import (WireBatch, narrowest_int_dtype, pack_column, pack_columns, packed_bytes,
                                    padded_bytes, split_balanced, unpack_column, unpack_columns)
from rlfusion.queue.schema import ColumnSpec, Schema
from rlfusion.queue.storage import StorageShard

__all__ = ["Batch", "ColumnSpec", "DistQueue", "POLICIES", "Policy", "QueueConfig", "QueueController",
           "QueueFullError", "QueueStats", "Schema", "StorageShard", "WireBatch", "narrowest_int_dtype",
           "pack_column", "pack_columns", "packed_bytes", "padded_bytes", "split_balanced", "unpack_column",
           "unpack_columns"]
