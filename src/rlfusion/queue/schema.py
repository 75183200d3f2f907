"""Column specs and cell validation: what a queue row may hold.

A queue row is one sample; its cells are named columns declared up front as `ColumnSpec`s.
A fixed column holds one scalar per row (reward, advantage); a variable-length column holds
one sequence per row (response ids, log-probs). `object` columns hold any Python value (a
`Problem`, a finish reason) and are never packed on the wire.

This module only says whether a value fits its column. It knows nothing about readiness,
consumers or where cells are stored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

Dtype = Literal["int64", "int32", "int16", "int8", "float32", "float64", "object"]
INT_RANGES: dict[str, tuple[int, int]] = {
    "int8": (-2**7, 2**7 - 1), "int16": (-2**15, 2**15 - 1),
    "int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1),
}
FLOAT_DTYPES = ("float32", "float64")
ALL_DTYPES = (*INT_RANGES, *FLOAT_DTYPES, "object")


@dataclass(frozen=True)
class ColumnSpec:
    """One named column. `variable_length` columns hold a sequence (list or 1-D tensor) per row."""

    name: str
    dtype: Dtype
    variable_length: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"column name must be a non-empty string, got {self.name!r}")
        if self.dtype not in ALL_DTYPES:
            raise ValueError(f"column {self.name!r}: dtype {self.dtype!r} is not one of {ALL_DTYPES}")

    def normalize(self, value: Any) -> Any:
        """`value` in its stored form (a 1-D tensor becomes a list, a list is copied), or a
        one-line ValueError naming this column if it does not fit."""
        if self.dtype == "object":
            return value
        if not self.variable_length:
            return self._check_scalars([value])[0]
        return self._check_scalars(self._sequence(value))

    def normalize_many(self, values: Sequence[Any]) -> list[Any]:
        """`normalize` of each of a column's `values`, checked and rounded as one flat list (a
        scalar column costs one check, not one per row)."""
        if self.dtype == "object":
            return list(values)
        if not self.variable_length:
            return self._check_scalars(list(values))
        rows = [self._sequence(v) for v in values]
        flat = self._check_scalars([x for row in rows for x in row])
        out, start = [], 0
        for row in rows:
            out.append(flat[start:start + len(row)])
            start += len(row)
        return out

    def _sequence(self, value: Any) -> list[Any]:
        """A variable-length cell as a new list, or a one-line ValueError if it is not a 1-D
        sequence of the column's kind."""
        if isinstance(value, torch.Tensor):
            if value.dim() != 1:
                raise ValueError(f"column {self.name!r}: expected a 1-D sequence, got a tensor of shape {tuple(value.shape)}")
            want_int = self.dtype in INT_RANGES
            if want_int != (not value.dtype.is_floating_point and value.dtype != torch.bool):
                raise ValueError(f"column {self.name!r}: expected {self.dtype} values, got a {value.dtype} tensor")
            return value.tolist()
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"column {self.name!r}: expected a sequence of {self.dtype}, got {type(value).__name__}")
        return list(value)

    def _check_scalars(self, xs: list[Any]) -> list[Any]:
        """`xs` checked against the dtype; ints in a float column become floats, and float32
        values are rounded to float32 (what the wire format carries)."""
        types = set(map(type, xs))  # exact types: bool is not accepted as a number
        if self.dtype in INT_RANGES:
            if not types <= {int}:
                bad = next(x for x in xs if type(x) is not int)
                raise ValueError(f"column {self.name!r}: expected {self.dtype}, got {type(bad).__name__} {bad!r}")
            lo, hi = INT_RANGES[self.dtype]
            if xs and not (lo <= min(xs) and max(xs) <= hi):
                x = min(xs) if min(xs) < lo else max(xs)
                raise ValueError(f"column {self.name!r}: value {x} is outside the {self.dtype} range [{lo}, {hi}]")
            return xs
        if not types <= {float, int}:
            bad = next(x for x in xs if type(x) not in (float, int))
            raise ValueError(f"column {self.name!r}: expected {self.dtype}, got {type(bad).__name__} {bad!r}")
        if self.dtype == "float32":  # stored as it travels, so every backend returns equal values
            return torch.tensor(xs, dtype=torch.float32).tolist()
        return xs if types <= {float} else [float(x) for x in xs]


@dataclass(frozen=True)
class Schema:
    """The columns of one queue, by name."""

    columns: tuple[ColumnSpec, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate column names: {sorted(dup)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def spec(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise ValueError(f"unknown column {name!r}; the queue has {list(self.names)}")

    def check_names(self, names: Sequence[str]) -> None:
        for n in names:
            self.spec(n)

    def normalize_columns(self, columns: Mapping[str, Sequence[Any]], num_rows: int) -> dict[str, list[Any]]:
        """Every column named, `num_rows` values long, every value fitting its column; returns
        the values in stored form (see `ColumnSpec.normalize`)."""
        out = {}
        for name, values in columns.items():
            spec = self.spec(name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
                raise ValueError(f"column {name!r}: expected one value per row (a list), got {type(values).__name__}")
            if len(values) != num_rows:
                raise ValueError(f"column {name!r}: {len(values)} values for {num_rows} rows")
            out[name] = spec.normalize_many(values)
        return out

    def to_list(self) -> list[tuple[str, str, bool]]:
        return [(c.name, c.dtype, c.variable_length) for c in self.columns]


def rows_to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Row dicts → column lists; every row must name the same columns."""
    if not rows:
        return {}
    names = list(rows[0])
    for i, r in enumerate(rows):
        if set(r) != set(names):
            raise ValueError(f"row {i}: columns {sorted(r)} differ from row 0's {sorted(names)}")
    return {n: [r[n] for r in rows] for n in names}
