"""`StorageHost`: one storage shard of the Ray DistQueue, served by the process that hosts it.

    device worker d (a StorageHost)                         a peer's queue client
      main thread: generate / train ── its queue client ──► shard d: plain calls (no Ray, no pickling)
      "storage" thread ◄── shard_read / shard_write ──────── (Ray calls on the storage group)

A device worker (`runtime/workers.DeviceWorker`) is a host: the rows a device creates live in
its own process, its queue client reads and writes them in process (`RayDistQueue.attach`), and
its peers reach them through the `shard_*` methods, which the Ray backend calls on the actor's
"storage" concurrency group so that they are answered while the device's main thread generates
or trains. A queue without devices starts standalone actors of this class with the same group
(`RayDistQueue(cfg, num_shards=N)`). Both threads touch the cells, so every access holds a lock.

Cells are kept packed: a variable-length cell is a 1-D tensor slice of the flat tensor it
arrived in, so a read only concatenates slices and never goes through Python lists.

Not here: Ray (the host is a plain class the backend makes an actor of), and which rows live
where (the controller records each row's shard).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlfusion.queue.packing import WireBatch, narrowest_int_dtype, pack_column, pack_columns
from rlfusion.queue.schema import Schema
from rlfusion.queue.storage import StorageShard

STORAGE_GROUP = "storage"  # the concurrency group a host serves its peers on


class StorageHost:
    """Shard `index` of `queue`'s storage. `queue`: the host process's queue client — a Ray
    client attaches the host as its own shard (`attach`); another (the in-process queue) only
    lends its schema — or, for a standalone shard actor, the queue's `Schema` itself."""

    def __init__(self, queue: Any, index: int = 0):
        self._shard_schema: Schema | None = queue if isinstance(queue, Schema) else getattr(queue, "schema", None)
        self._shard = StorageShard()
        self._shard_lock = threading.Lock()  # the host's main thread (local rows) and its storage thread (peers)
        self._shard_served = 0
        attach = getattr(queue, "attach", None)
        if attach is not None:
            attach(self, index)

    def shard_write(self, row_ids: list[int], wire: WireBatch) -> None:
        cells: dict[str, list[Any]] = dict(wire.objects)
        for name, (values, lengths) in wire.tensors.items():
            cells[name] = values.tolist() if lengths is None else list(torch.split(values, lengths.tolist()))
        with self._shard_lock:
            self._shard.write(row_ids, cells)

    def shard_read(self, row_ids: list[int], columns: list[str]) -> WireBatch:
        with self._shard_lock:
            cells = self._shard.read(row_ids, columns)
        wire = WireBatch(len(row_ids))
        for name in columns:
            spec = self._shard_schema.spec(name)
            if spec.dtype == "object":
                wire.objects[name] = cells[name]
            elif spec.variable_length:  # slices of different puts may differ in width: cat promotes
                parts = cells[name]
                flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int8)
                sizes = [p.numel() for p in parts]
                wire.tensors[name] = (flat, torch.tensor(sizes, dtype=narrowest_int_dtype(0, max(sizes, default=0))))
            else:
                wire.tensors[name] = pack_columns(self._shard_schema, {name: cells[name]}, len(row_ids)).tensors[name]
        with self._shard_lock:
            self._shard_served += wire.nbytes
        return wire

    def shard_drop(self, row_ids: list[int]) -> None:
        with self._shard_lock:
            self._shard.drop(row_ids)

    def shard_bytes_served(self) -> int:
        return self._shard_served

    def shard_state_dict(self) -> dict[str, Any]:
        """This shard's cells in the in-process (list) form, for interchangeable checkpoints."""
        with self._shard_lock:
            rows = {r: dict(row) for r, row in self._shard.cells.items()}
        return {"cells": {r: {c: v.tolist() if isinstance(v, torch.Tensor) else v for c, v in row.items()}
                          for r, row in rows.items()}}

    def shard_load_state_dict(self, state: dict[str, Any]) -> None:
        def cell(name: str, value: Any) -> Any:
            spec = self._shard_schema.spec(name)
            if not spec.variable_length or spec.dtype == "object":
                return value
            return pack_column([value], torch.float64 if spec.dtype == "float64" else torch.float32,
                               is_float=spec.dtype.startswith("float"))[0]

        cells = {int(r): {c: cell(c, v) for c, v in row.items()} for r, row in state["cells"].items()}
        with self._shard_lock:
            self._shard.cells = cells
