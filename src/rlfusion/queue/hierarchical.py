"""Hierarchical queue access for one model-parallel group (the TP × PP × CP ranks of one DP replica).

    queue ──get──► reader rank ──broadcast(header, one flat byte buffer)──► the other ranks of the group
    queue ◄─put─── writer rank (the last pipeline stage, which holds the outputs); other ranks skip

Every rank of a model-parallel group needs the same rows, so asking the queue once per group
instead of once per rank cuts queue requests by exactly the group size (t·p·c). On the wire
the batch is the zero-redundancy `WireBatch` (variable-length columns as one concatenated
tensor plus lengths, integers narrowed), sent as a single byte buffer after a small pickled
header; receivers restore the same `Batch`.

Not here: which ranks form a group (the parallel layout decides and passes the process group)
and what the rows mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.queue.client import Batch
from rlfusion.queue.packing import WireBatch, pack_columns, unpack_columns
from rlfusion.queue.schema import Schema


class GroupQueue:
    """A model-parallel group's handle on a queue: `get` on the reader rank then broadcast,
    `put` only on the writer rank. `queue` may be None on ranks that are neither."""

    def __init__(self, queue: Any, schema: Schema, group: dist.ProcessGroup | None, reader: int, writer: int):
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        for role, r in (("reader", reader), ("writer", writer)):
            if r not in members:
                raise ValueError(f"{role} rank {r} is not in the group {members}")
        self.rank = dist.get_rank()
        if self.rank in (reader, writer) and queue is None:
            raise ValueError(f"rank {self.rank} is the group's {'reader' if self.rank == reader else 'writer'} "
                             "and needs a queue handle")
        self.queue, self.schema, self.group = queue, schema, group
        self.reader, self.writer = reader, writer
        self.requests = 0  # queue calls this rank made
        self.bytes_broadcast = 0  # payload bytes this rank sent (reader) or received

    def get(self, consumer: str, columns: Sequence[str], count: int, policy: str = "fifo",
            block: bool = False, timeout: float | None = None) -> Batch:
        """The same `Batch` on every rank of the group, read from the queue once."""
        return self._shared(columns, lambda: self.queue.get(consumer, columns, count, policy,
                                                             block=block, timeout=timeout))

    def get_rows(self, consumer: str, row_ids: Sequence[int], columns: Sequence[str],
                 timeout: float | None = None) -> Batch:
        """The named rows on every rank of the group, read from the queue once (only the
        reader's `row_ids` are used)."""
        return self._shared(columns, lambda: self.queue.get_rows(consumer, row_ids, columns, timeout=timeout))

    def _shared(self, columns: Sequence[str], read: Any) -> Batch:
        header: list[Any] = [None]
        if self.rank == self.reader:
            try:
                batch = read()
                self.requests += 1
                wire = pack_columns(self.schema, batch.columns, len(batch))
                payload, layout = _flatten(wire)
                header[0] = (batch.row_ids, batch.group_ids, batch.versions, batch.shards, wire.objects, layout,
                             payload.numel())
            except Exception as e:  # every rank raises it, rather than the others waiting forever
                header[0] = e
        dist.broadcast_object_list(header, src=self.reader, group=self.group)
        if isinstance(header[0], Exception):
            raise header[0]
        row_ids, group_ids, versions, shards, objects, layout, nbytes = header[0]
        if self.rank != self.reader:
            payload = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            dist.broadcast(payload, src=self.reader, group=self.group)
        self.bytes_broadcast += nbytes
        if self.rank == self.reader:
            return batch
        wire = _unflatten(payload, layout, len(row_ids))
        wire.objects = objects
        cells = unpack_columns(wire)
        return Batch(row_ids, group_ids, versions, {c: cells[c] for c in columns}, shards)

    def put(self, data: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int] | None:
        """Write from the writer rank only (it holds the last stage's outputs); other ranks
        return None without touching the queue."""
        if self.rank != self.writer:
            return None
        self.requests += 1
        return self.queue.put(data, **kwargs)


def _flatten(wire: WireBatch) -> tuple[torch.Tensor, list[tuple[str, int, torch.dtype, int]]]:
    """All tensors of `wire` as one uint8 buffer, and how to cut it back:
    (column, part 0 = values / 1 = lengths, dtype, numel) per tensor."""
    parts, layout = [], []
    for name, pair in wire.tensors.items():
        for which, t in enumerate(pair):
            if t is None:
                continue
            layout.append((name, which, t.dtype, t.numel()))
            parts.append(t.contiguous().view(torch.uint8))
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return payload, layout


def _unflatten(payload: torch.Tensor, layout: list[tuple[str, int, torch.dtype, int]], num_rows: int) -> WireBatch:
    wire = WireBatch(num_rows)
    offset = 0
    for name, which, dtype, numel in layout:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        t = payload[offset:offset + nbytes].clone().view(dtype)  # clone: views need aligned offsets
        offset += nbytes
        values, lengths = wire.tensors.get(name, (None, None))
        wire.tensors[name] = (t, lengths) if which == 0 else (values, t)
    return wire


def requests_per_step(dp: int, tp: int, pp: int, cp: int = 1, *, hierarchical: bool, gets_per_rank: int = 1) -> int:
    """Queue get requests per step for a layout: one per model-parallel group with hierarchical
    reads, one per rank without (so hierarchical reads divide them by exactly tp·pp·cp)."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("gets_per_rank", gets_per_rank)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return dp * gets_per_rank * (1 if hierarchical else tp * pp * cp)
