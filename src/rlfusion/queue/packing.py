"""Zero-redundancy wire format for variable-length columns, and the byte counters that show it.

A column of S sequences travels as one flat tensor of all N values concatenated (no padding)
plus S lengths; the receiver splits it back. Integer columns use the narrowest dtype that
holds every value, so token ids under 32,768 go as int16. A padded transfer would instead send
S × max_len values in the column's full dtype, which on long-tailed lengths is mostly padding.

Legend: N concatenated values, S sequences.
This module does not know about readiness, ranks or how tensors are sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfusion.queue.schema import Schema

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def narrowest_int_dtype(lo: int, hi: int) -> torch.dtype:
    """The smallest signed integer dtype holding every value in [lo, hi]."""
    for dt in _INT_DTYPES:
        info = torch.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    raise ValueError(f"values in [{lo}, {hi}] do not fit int64")


def _all_ints(values: Sequence[Sequence[int | float]]) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for seq in values for x in seq)


def pack_column(values: Sequence[Sequence[int | float]], float_dtype: torch.dtype = torch.float32,
                is_float: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences → (flat_N, lengths_S). Integer columns take the narrowest safe integer dtype,
    float columns `float_dtype` (`is_float` None: a column with any float is a float column).
    Lengths take the narrowest int too."""
    lengths = [len(seq) for seq in values]
    flat = [x for seq in values for x in seq]
    if is_float is None:
        is_float = not _all_ints(values)
    if is_float:
        flat_N = torch.tensor(flat, dtype=float_dtype)
    else:
        flat_N = torch.tensor(flat, dtype=narrowest_int_dtype(min(flat), max(flat)) if flat else torch.int8)
    lengths_S = torch.tensor(lengths, dtype=narrowest_int_dtype(0, max(lengths, default=0)))
    return flat_N, lengths_S


def unpack_column(flat_N: torch.Tensor, lengths_S: torch.Tensor) -> list[list[int | float]]:
    """Inverse of `pack_column`: the S sequences as Python lists."""
    if flat_N.dim() != 1 or lengths_S.dim() != 1:
        raise ValueError(f"expected 1-D tensors, got shapes {tuple(flat_N.shape)} and {tuple(lengths_S.shape)}")
    lengths = [int(n) for n in lengths_S.tolist()]
    if any(n < 0 for n in lengths) or sum(lengths) != flat_N.numel():
        raise ValueError(f"lengths sum to {sum(lengths)} but the flat tensor has {flat_N.numel()} values")
    return [chunk.tolist() for chunk in torch.split(flat_N, lengths)] if lengths else []


def packed_bytes(values: Sequence[Sequence[int | float]], float_dtype: torch.dtype = torch.float32) -> int:
    """Bytes `pack_column` puts on the wire: the flat values plus the lengths."""
    flat_N, lengths_S = pack_column(values, float_dtype)
    return flat_N.numel() * flat_N.element_size() + lengths_S.numel() * lengths_S.element_size()


def padded_bytes(values: Sequence[Sequence[int | float]], float_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the padded alternative: S × max_len in the column's full dtype (int64 for
    ints, `float_dtype` for floats). The padding mask it would also need is not counted."""
    max_len = max((len(seq) for seq in values), default=0)
    itemsize = 8 if _all_ints(values) else torch.empty(0, dtype=float_dtype).element_size()
    return len(values) * max_len * itemsize


def split_balanced(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Indices of `lengths` split across `num_ranks` so total tokens per rank are near equal
    (longest first onto the lightest rank). Each rank's indices come back in ascending order."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(num_ranks), key=lambda k: (loads[k], len(parts[k]), k))
        parts[k].append(i)
        loads[k] += lengths[i]
    return [sorted(p) for p in parts]


# ---- whole batches: what a storage shard or a broadcasting reader puts on the wire ----

_FLOAT_TORCH = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class WireBatch:
    """Column values of some rows as tensors: a variable-length column is `(flat_N, lengths_S)`,
    a scalar column `(values_S, None)`; `object` columns stay Python lists (pickled)."""

    num_rows: int
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    objects: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Tensor bytes on the wire (object columns are not counted)."""
        return sum(t.numel() * t.element_size() for pair in self.tensors.values() for t in pair if t is not None)


def pack_columns(schema: Schema, columns: Mapping[str, Sequence[Any]], num_rows: int) -> WireBatch:
    """Stored column values (see `Schema.normalize_columns`) → `WireBatch`. Float columns keep
    their declared width, so float32 values are rounded to float32 on the wire."""
    wire = WireBatch(num_rows)
    for name, values in columns.items():
        spec = schema.spec(name)
        if spec.dtype == "object":
            wire.objects[name] = list(values)
            continue
        float_dtype = _FLOAT_TORCH.get(spec.dtype, torch.float32)
        if spec.variable_length:
            wire.tensors[name] = pack_column(values, float_dtype, is_float=spec.dtype in _FLOAT_TORCH)
        elif spec.dtype in _FLOAT_TORCH:
            wire.tensors[name] = (torch.tensor(values, dtype=float_dtype), None)
        else:
            dt = narrowest_int_dtype(min(values), max(values)) if values else torch.int8
            wire.tensors[name] = (torch.tensor(values, dtype=dt), None)
    return wire


def unpack_columns(wire: WireBatch) -> dict[str, list[Any]]:
    """Inverse of `pack_columns`: column -> one Python value (or list) per row."""
    out: dict[str, list[Any]] = dict(wire.objects)
    for name, (values, lengths) in wire.tensors.items():
        out[name] = values.tolist() if lengths is None else unpack_column(values, lengths)
    return out
