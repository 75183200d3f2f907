"""Per-device timelines of an RL run: who did what, on which device, when.

Owns the span record (`Span`), the recorder (`Timeline`), the busy/wall utilization of each
device, and two renderings: a Chrome trace (chrome://tracing, ui.perfetto.dev) and a Gantt PNG.
It does not know what a phase means or who schedules it: phases are free strings, and the
usual ones (`PHASES`) only get fixed colors.

Clocks. Inside one process a span is timed with `time.perf_counter` (monotonic, fine-grained)
and stored as seconds since the timeline's origin. Each timeline anchors its origin to the
wall clock (`time.time()`) once, when it is created. Spans cross process boundaries in wall-clock
seconds (`to_dicts` / `from_dicts` / `merge` / `add_wall`), so timelines recorded by worker
processes line up as well as their wall clocks agree (exactly on one host; NTP across hosts).
"""

from __future__ import annotations

import json
import threading
from array import array
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfusion.obs.files import atomic_write_text, save_figure

PHASES = (
    "rollout", "train", "reference", "reward", "advantage", "switch", "transfer", "idle", "eval", "env",
)
# the device's own compute is idle in these ("env": an environment call in flight, computed by
# the environment's worker processes; it overlaps the rollout that decodes meanwhile)
IDLE_PHASES = frozenset({"idle", "env"})
_PHASE_COLORS = {
    "rollout": "#1f77b4", "train": "#d62728", "reference": "#9467bd", "reward": "#2ca02c",
    "advantage": "#bcbd22", "switch": "#ff7f0e", "transfer": "#8c564b", "idle": "#d9d9d9",
    "eval": "#17becf", "env": "#f7b6d2",
}
_OTHER_COLORS = ("#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5")
_SPAN_KEYS = ("device", "phase", "start_wall_s", "end_wall_s", "role", "step")


@dataclass(frozen=True)
class Span:
    """One interval of work on one device, in seconds since the owning timeline's origin."""

    device: str  # e.g. "cpu:0", "cuda:3"
    phase: str  # e.g. "rollout", "train", "switch"; any non-empty string
    start_s: float
    end_s: float
    role: str = ""  # e.g. "actor", "reference", "reward"; one trace thread per role
    step: int | None = None  # RL step (policy version) the work belongs to

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class DeviceUtilization:
    """`busy_s` / `wall_s` of one device; `phase_s` is the union length of each phase's spans."""

    busy_s: float
    wall_s: float
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


class Timeline:
    """Records spans of many devices; thread-safe (stage threads may share one timeline)."""

    def __init__(self, origin_wall_s: float | None = None) -> None:
        self._t0 = time.perf_counter()
        self.origin_wall_s = time.time() if origin_wall_s is None else float(origin_wall_s)
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    @property
    def spans(self) -> list[Span]:
        """All spans, ordered by start time."""
        with self._lock:
            return sorted(self._spans, key=lambda s: (s.start_s, s.end_s))

    def now(self) -> float:
        """Seconds since this timeline's origin, on the monotonic clock."""
        return time.perf_counter() - self._t0

    @contextmanager
    def span(
        self, device: str, phase: str, *, role: str = "", step: int | None = None
    ) -> Iterator[None]:
        """Time the body as one span; it is recorded even if the body raises."""
        start_s = self.now()
        try:
            yield
        finally:
            self.add(device, phase, start_s, self.now(), role=role, step=step)

    def add(
        self, device: str, phase: str, start_s: float, end_s: float,
        *, role: str = "", step: int | None = None,
    ) -> Span:
        """Record a span measured elsewhere, in seconds since this timeline's origin (`now()`)."""
        span = _checked_span(device, phase, float(start_s), float(end_s), role, step)
        with self._lock:
            self._spans.append(span)
        return span

    def add_wall(
        self, device: str, phase: str, start_wall_s: float, end_wall_s: float,
        *, role: str = "", step: int | None = None,
    ) -> Span:
        """Record a span given in absolute wall-clock seconds (`time.time()`), e.g. by a worker."""
        start_s, end_s = start_wall_s - self.origin_wall_s, end_wall_s - self.origin_wall_s
        return self.add(device, phase, start_s, end_s, role=role, step=step)

    def to_dicts(self) -> list[dict[str, Any]]:
        """Spans as JSON-able dicts with wall-clock times, for shipping to another process."""
        rows = []
        for s in self.spans:
            row = asdict(s)
            row["start_wall_s"] = row.pop("start_s") + self.origin_wall_s
            row["end_wall_s"] = row.pop("end_s") + self.origin_wall_s
            rows.append(row)
        return rows

    def add_dicts(self, rows: Iterable[dict[str, Any]]) -> None:
        """Record spans in the `to_dicts` format (wall-clock times)."""
        for i, row in enumerate(rows):
            missing = [k for k in _SPAN_KEYS[:4] if k not in row]
            if missing:
                raise ValueError(f"span row {i} lacks {missing}; expected keys {list(_SPAN_KEYS)}")
            self.add_wall(
                row["device"], row["phase"], row["start_wall_s"], row["end_wall_s"],
                role=row.get("role", ""), step=row.get("step"),
            )

    @classmethod
    def from_dicts(cls, rows: list[dict[str, Any]]) -> Timeline:
        """A timeline holding `rows`; its origin is the earliest start (or now, if no rows)."""
        origin = min((float(r["start_wall_s"]) for r in rows if "start_wall_s" in r), default=None)
        timeline = cls(origin_wall_s=origin)
        timeline.add_dicts(rows)
        return timeline

    def merge(self, other: Timeline) -> None:
        """Add every span of `other`, shifted onto this timeline's origin via the wall clock."""
        self.add_dicts(other.to_dicts())

    def utilization(
        self, idle_phases: frozenset[str] = IDLE_PHASES
    ) -> dict[str, DeviceUtilization]:
        """Per device: busy = length of the union of its non-idle spans; wall = timeline span.

        Overlapping spans on one device (two roles sharing it) count once. `wall_s` is the
        same for every device: from the first span start to the last span end over the whole
        timeline, so a device that starts late or finishes early shows that as idle time.
        """
        spans = self.spans
        if not spans:
            return {}
        wall_s = max(s.end_s for s in spans) - min(s.start_s for s in spans)
        out = {}
        for device in _devices(spans):
            mine = [s for s in spans if s.device == device]
            busy = _union_length([(s.start_s, s.end_s) for s in mine if s.phase not in idle_phases])
            phase_s = {
                phase: _union_length([(s.start_s, s.end_s) for s in mine if s.phase == phase])
                for phase in dict.fromkeys(s.phase for s in mine)
            }
            out[device] = DeviceUtilization(busy_s=busy, wall_s=wall_s, phase_s=phase_s)
        return out

    def write_chrome_trace(self, path: Path) -> Path:
        """Write Chrome trace-event JSON: one process per device, one thread per role."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        trace = {"traceEvents": chrome_trace_events(self.spans), "displayTimeUnit": "ms"}
        atomic_write_text(path, json.dumps(trace))
        return path

    def plot_gantt(self, path: Path, title: str = "Device timeline") -> Path:
        """Write a Gantt PNG: a row per device (a lane per role), bars colored by phase."""
        return plot_gantt(self.spans, path, title)


def pack_spans(spans: list[tuple[str, float, float]]) -> tuple[tuple[str, ...], float, bytes, bytes] | None:
    """(phase, wall start, wall end) spans in a compact form for crossing processes: each phase
    as one byte (its index in `PHASES`, or after them among the names this call adds), starts and
    ends as float32 seconds after the first start (sub-millisecond within an hour). None: no spans."""
    if not spans:
        return None
    names = list(PHASES)
    codes = bytearray()
    for phase, _, _ in spans:
        if phase not in names:
            names.append(phase)
        codes.append(names.index(phase))
    base = spans[0][1]
    times = array("f", (t - base for _, start, end in spans for t in (start, end)))
    return tuple(names[len(PHASES):]), base, bytes(codes), times.tobytes()


def unpack_spans(packed: tuple[tuple[str, ...], float, bytes, bytes] | None) -> list[tuple[str, float, float]]:
    """The spans `pack_spans` packed."""
    if packed is None:
        return []
    extra, base, codes, data = packed
    names = PHASES + extra
    times = array("f")
    times.frombytes(data)
    return [(names[c], base + times[2 * i], base + times[2 * i + 1]) for i, c in enumerate(codes)]


def chrome_trace_events(spans: list[Span]) -> list[dict[str, Any]]:
    """Name metadata plus one complete ("X") event per span; times in microseconds."""
    pids = {device: i for i, device in enumerate(_devices(spans))}
    tids: dict[tuple[str, str], int] = {}
    for device in pids:
        roles = dict.fromkeys(s.role for s in spans if s.device == device)
        tids.update({(device, role): tid for tid, role in enumerate(roles)})
    events: list[dict[str, Any]] = []
    for device, pid in pids.items():
        events.append(_meta("process_name", pid, 0, {"name": device}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
    for (device, role), tid in tids.items():
        events.append(_meta("thread_name", pids[device], tid, {"name": role or "main"}))
    for s in spans:
        args: dict[str, Any] = {"role": s.role}
        if s.step is not None:
            args["step"] = s.step
        events.append({
            "ph": "X", "name": s.phase, "cat": s.role or "main",
            "pid": pids[s.device], "tid": tids[(s.device, s.role)],
            "ts": s.start_s * 1e6, "dur": s.duration_s * 1e6, "args": args,
        })
    return events


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def plot_gantt(spans: list[Span], path: Path, title: str = "Device timeline") -> Path:
    """Gantt chart of `spans` as a PNG; x axis in seconds from the first span start."""
    plt = _pyplot()
    devices = _devices(spans)
    t_min = min((s.start_s for s in spans), default=0.0)
    colors = _phase_colors(spans)
    fig, ax = plt.subplots(figsize=(10.0, 1.0 + 0.6 * max(1, len(devices))), layout="constrained")
    for row, device in enumerate(devices):
        _draw_device_row(ax, row, [s for s in spans if s.device == device], t_min, colors)
    ax.set_yticks(range(len(devices)), devices)
    ax.set_ylim(len(devices) - 0.5, -0.5)  # first device on top
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    if handles:
        ax.legend(handles, list(colors), loc="upper left", bbox_to_anchor=(1, 1), fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def _draw_device_row(
    ax: Any, row: int, spans: list[Span], t_min: float, colors: dict[str, str]
) -> None:
    """Split the row into one lane per role so concurrent roles on a device do not overdraw."""
    roles = list(dict.fromkeys(s.role for s in spans))
    lane_h = 0.8 / len(roles)
    for lane, role in enumerate(roles):
        y = row - 0.4 + lane * lane_h
        bars = [(s.start_s - t_min, s.duration_s) for s in spans if s.role == role]
        faces = [colors[s.phase] for s in spans if s.role == role]
        ax.broken_barh(bars, (y, lane_h * 0.9), facecolors=faces, edgecolor="none")
        if len(roles) > 1 and role:
            ax.text(0, y + lane_h * 0.45, f" {role}", va="center", fontsize=6, color="black")


def _phase_colors(spans: list[Span]) -> dict[str, str]:
    """Known phases keep fixed colors (in `PHASES` order); others cycle through a spare palette."""
    present = set(s.phase for s in spans)
    colors = {p: _PHASE_COLORS[p] for p in PHASES if p in present}
    others = sorted(present - set(PHASES))
    colors.update({p: _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, p in enumerate(others)})
    return colors


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals`, overlaps counted once."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _devices(spans: list[Span]) -> list[str]:
    """Device names in order of their first span."""
    return list(dict.fromkeys(s.device for s in sorted(spans, key=lambda s: s.start_s)))


def _checked_span(
    device: str, phase: str, start_s: float, end_s: float, role: str, step: int | None
) -> Span:
    if not isinstance(device, str) or not device:
        raise ValueError(f"span device must be a non-empty string, got {device!r}")
    if not isinstance(phase, str) or not phase:
        raise ValueError(f"span phase must be a non-empty string (e.g. 'train'), got {phase!r}")
    if not isinstance(role, str):
        raise ValueError(f"span role must be a string, got {role!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"span step must be an int or None, got {step!r}")
    if not end_s >= start_s:  # also rejects NaN
        raise ValueError(f"span {device}/{phase} ends before it starts: {start_s} > {end_s}")
    return Span(device, phase, start_s, end_s, role, step)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: training machines have no display
    import matplotlib.pyplot as plt

    return plt
