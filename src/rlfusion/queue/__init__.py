"""DistQueue: the data queue between RL stages (MISSION.md §3). In-process backend only so far."""

from rlfusion.queue.client import Batch, DistQueue, QueueConfig, QueueFullError
from rlfusion.queue.controller import POLICIES, Policy, QueueController
from rlfusion.queue.packing import (narrowest_int_dtype, pack_column, packed_bytes, padded_bytes,
                                    split_balanced, unpack_column)
from rlfusion.queue.schema import ColumnSpec, Schema
from rlfusion.queue.storage import StorageShard

__all__ = ["Batch", "ColumnSpec", "DistQueue", "POLICIES", "Policy", "QueueConfig", "QueueController",
           "QueueFullError", "Schema", "StorageShard", "narrowest_int_dtype", "pack_column", "packed_bytes",
           "padded_bytes", "split_balanced", "unpack_column"]
