"""Per-step scalar metrics of a run: `metrics.jsonl` (always) and TensorBoard events (optional).

Owns the metrics file format — one JSON object per line, `{"step", "time", **scalars}` — its
writer (`MetricsWriter`), its reader (`read_metrics`) and the rewind used on resume
(`truncate_metrics`). It does not know which scalars a run logs or how they are computed.

`NumberPacker` / `NumberUnpacker` carry a dict of named numbers between processes compactly:
the values as float64, the names only when they change.

Non-finite values (NaN, inf) are written as `null`, so every line stays strict JSON that any
tool can parse, and are skipped in TensorBoard, whose charts would otherwise lose their scale.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Mapping
import os
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any

from rlfusion.obs.files import atomic_write_text, open_append

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
_RESERVED_KEYS = ("step", "time")


class MetricsWriter:
    """Appends one row of scalars per `log` call to `run_dir/metrics.jsonl` (and `run_dir/tb/`).

    `time` in each row is seconds since this writer was opened, so after a resume it restarts
    from zero. `purge_step`, when resuming from a checkpoint at step k, should be k + 1: it hides
    TensorBoard events at steps >= k + 1 left by the killed run (call `truncate_metrics` on the
    JSONL before opening the writer for the same reason).
    """

    def __init__(
        self, run_dir: Path, tensorboard: bool = True, *, purge_step: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        _drop_partial_last_line(self.path)
        # Line-buffered so a killed run loses at most the line being written.
        self._file = open_append(self.path, encoding="utf-8", buffering=1)
        self._start = time.monotonic()
        tb_dir = self.run_dir / TENSORBOARD_DIR
        self._tb = _open_tensorboard(tb_dir, purge_step) if tensorboard else None

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Write `scalars` for `step`; NaN/inf: null in the JSON, not sent to TensorBoard."""
        if self._file.closed:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed; cannot log step {step}")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}: {step!r}")
        values = {key: _to_float(key, value) for key, value in scalars.items()}
        row: dict[str, Any] = {"step": step, "time": round(time.monotonic() - self._start, 6)}
        row.update({key: v if math.isfinite(v) else None for key, v in values.items()})
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        if self._tb is not None:
            for key, v in values.items():
                if math.isfinite(v):
                    self._tb.add_scalar(key, v, global_step=step)

    def close(self) -> None:
        """Flush and close both outputs; calling it twice is harmless."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NumberPacker:
    """One sender's named numbers (a report, an update's metrics) as (names, float64 values):
    the names go only when they differ from the previous call's, so a stream of dicts with the
    same keys costs 8 bytes per number. Its `NumberUnpacker` must see every packed call, in order."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] | None = None

    def pack(self, values: Mapping[str, float]) -> tuple[tuple[str, ...] | None, bytes]:
        names = tuple(values)
        header = None if names == self.names else names
        self.names = names
        return header, array("d", (float(v) for v in values.values())).tobytes()


class NumberUnpacker:
    """The receiving end of one `NumberPacker`."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()

    def unpack(self, packed: tuple[tuple[str, ...] | None, bytes]) -> dict[str, float]:
        header, data = packed
        if header is not None:
            self.names = header
        values = array("d")
        values.frombytes(data)
        if len(values) != len(self.names):
            raise ValueError(f"{len(values)} packed numbers for {len(self.names)} names: a packed call was lost")
        return dict(zip(self.names, values.tolist()))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl in file order; a truncated last line (killed run) is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                break  # a killed run leaves at most its last line half-written
            raise ValueError(f"{path}:{i + 1}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def truncate_metrics(path: Path, after_step: int) -> int:
    """Rewrite `path` keeping only rows with step <= `after_step`; returns the rows kept.

    Used when resuming from a checkpoint at step `after_step`, so the steps the killed run
    logged after that checkpoint are not duplicated. The rewrite is atomic.
    """
    path = Path(path)
    kept = []
    for row in read_metrics(path):
        if not isinstance(row.get("step"), int):
            raise ValueError(f"{path}: row without an integer 'step': {row!r}")
        if row["step"] <= after_step:
            kept.append(row)
    atomic_write_text(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))
    return len(kept)


def _drop_partial_last_line(path: Path) -> None:
    """Cut a half-written last line left by a killed run, so appended rows start on a new line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def _to_float(key: str, value: Any) -> float:
    if not isinstance(key, str) or key in _RESERVED_KEYS:
        raise ValueError(f"metric name {key!r} is not allowed: use a string but not 'step'/'time'")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None


def _open_tensorboard(log_dir: Path, purge_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            "tensorboard is not installed; writing metrics.jsonl only (pip install tensorboard)",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step, flush_secs=30)
