"""`StorageShard`: holds cell values keyed by (row id, column). Nothing else.

It does not know about readiness, consumers or policies (that is `QueueController`'s), and it
does not validate values (that is `Schema`'s, done before anything is written). A distributed
backend runs several shards, each owning a slice of row ids, and readers fetch from them
directly rather than through the controller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class StorageShard:
    """A dict of rows, each a dict of column -> value."""

    def __init__(self) -> None:
        self.cells: dict[int, dict[str, Any]] = {}

    def write(self, row_ids: Sequence[int], columns: Mapping[str, Sequence[Any]]) -> None:
        for i, r in enumerate(row_ids):
            row = self.cells.setdefault(r, {})
            for name, values in columns.items():
                row[name] = values[i]

    def read(self, row_ids: Sequence[int], columns: Sequence[str]) -> dict[str, list[Any]]:
        return {c: [self.cells[r][c] for r in row_ids] for c in columns}

    def drop(self, row_ids: Sequence[int]) -> None:
        for r in row_ids:
            self.cells.pop(r, None)

    def __len__(self) -> int:
        return len(self.cells)

    def state_dict(self) -> dict[str, Any]:
        return {"cells": {r: dict(row) for r, row in self.cells.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cells = {int(r): dict(row) for r, row in state["cells"].items()}
