"""End-of-run summary: a plain-text table for the terminal and `summary.json` in the run folder.

Owns the layout of the printed table and the JSON encoding of the summary (non-finite floats
become null so the file is strict JSON). It does not decide which figures a run reports.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlfusion.obs.files import atomic_write_text

SUMMARY_FILE = "summary.json"


def format_table(rows: list[tuple[str, str]], title: str) -> str:
    """An ASCII table: the title on top, names left-aligned, values right-aligned.

    Alignment counts characters, so East Asian wide characters will not line up.
    """
    for i, row in enumerate(rows):
        if len(row) != 2 or not all(isinstance(cell, str) for cell in row):
            raise ValueError(f"table row {i} must be a (name, value) pair of strings, got {row!r}")
        if any("\n" in cell for cell in row):
            raise ValueError(f"table row {i} has a line break in a cell: {row!r}")
    name_w = max((len(name) for name, _ in rows), default=0)
    value_w = max((len(value) for _, value in rows), default=0)
    # Widen the value column when the title is longer than both columns together.
    value_w = max(value_w, len(title) - name_w - 3)
    rule = f"+-{'-' * name_w}-+-{'-' * value_w}-+"
    lines = [f"+{'-' * (len(rule) - 2)}+", f"| {title.ljust(len(rule) - 4)} |", rule]
    lines += [f"| {name.ljust(name_w)} | {value.rjust(value_w)} |" for name, value in rows]
    if rows:
        lines.append(rule)
    return "\n".join(lines)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write `summary` to `run_dir/summary.json` atomically (indent 2, NaN/inf as null).

    Dataclasses (e.g. the resolved config) become objects, paths strings, tuples lists, and
    numpy / 0-d torch scalars plain numbers.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SUMMARY_FILE
    text = json.dumps(_to_json(summary, "summary"), indent=2, allow_nan=False)
    atomic_write_text(path, text + "\n")
    return path


def _to_json(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if callable(getattr(value, "item", None)):  # numpy scalar, 0-d tensor
        return _to_json(value.item(), where)
    raise TypeError(f"{where} is a {type(value).__name__}, which summary.json cannot hold")
