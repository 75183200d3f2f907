"""Outputs of the RL simulator: tables, Chrome trace JSON, scaling curves and PNG plots.

Owns `scaling_curve()`, `to_chrome_trace()` and `simulate_and_report()` (the body of
`rlfusion simulate`). Plots need matplotlib and are skipped without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlfusion.sim.calibration import Calibration, cpu_default, load_calibration
from rlfusion.sim.rl_config import RLSimConfig, load_rl_config
from rlfusion.sim.rl_sim import device_utilization, simulate
from rlfusion.sim.rl_state import SimResult, TimelineEvent


@dataclass(frozen=True)
class ScalingPoint:
    variant: str  # "sync" (s=0) or "stalesync" (s>=1 + partial rollout)
    num_supernodes: int
    tokens_per_s: float
    linearity: float  # tokens/s / (num_supernodes * tokens/s at 1 supernode)


def calibration_for(cfg: RLSimConfig) -> Calibration:
    return cpu_default() if cfg.calibration == "cpu-default" else load_calibration(
        cfg.calibration)


def scaling_curve(cfg: RLSimConfig, cal: Calibration, supernodes: tuple[int, ...] = (1, 2, 4)
                  ) -> list[ScalingPoint]:
    """Weak scaling: prompts per step grow with the number of supernodes."""
    variants = {"sync": cfg.replace(max_staleness=0, partial_rollout=False),
                "stalesync": cfg.replace(max_staleness=max(cfg.max_staleness, 1), partial_rollout=True)}
    points = []
    for name, base in variants.items():
        first = None
        for n in supernodes:
            tput = simulate(base.replace(num_supernodes=n), cal).tokens_per_s
            first = first or tput
            points.append(ScalingPoint(name, n, tput, tput / (n * first)))
    return points


def to_chrome_trace(events: list[TimelineEvent]) -> dict:
    """Chrome trace ('X' complete events, microseconds); one row per lane."""
    lanes = sorted({e.device for e in events})
    tid = {lane: i for i, lane in enumerate(lanes)}
    trace = [{"name": e.role, "cat": e.role, "ph": "X", "pid": 0, "tid": tid[e.device],
              "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
              "args": {"version": e.version}} for e in events]
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
              for lane, i in tid.items()]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def format_result(cfg: RLSimConfig, result: SimResult) -> str:
    lines = [f"mode {cfg.mode}, max_staleness {cfg.max_staleness}, partial rollout "
             f"{cfg.partial_rollout}, {cfg.num_devices} devices, {result.updates} updates",
             f"tokens/s {result.tokens_per_s:,.0f}   samples/s {result.samples_per_s:,.1f}   "
             f"makespan {result.makespan_s:.2f}s   device utilization "
             f"{device_utilization(result):.1%}   dropped {result.dropped_samples}   "
             f"staleness_max {result.staleness_max}", "", f"{'lane':<12}{'devices':>8}"
             f"{'util':>8}"]
    for lane, util in result.utilization.items():
        lines.append(f"{lane:<12}{result.lane_devices[lane]:>8}{util:>8.1%}")
    return "\n".join(lines)


def format_scaling(points: list[ScalingPoint]) -> str:
    lines = [f"{'variant':<10}{'supernodes':>11}{'tokens/s':>12}{'linearity':>10}"]
    lines += [f"{p.variant:<10}{p.num_supernodes:>11}{p.tokens_per_s:>12,.0f}"
              f"{p.linearity:>10.1%}" for p in points]
    return "\n".join(lines)


def _plots(result: SimResult, points: list[ScalingPoint], out: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    colors = {"rollout": "tab:blue", "prefill": "tab:cyan", "train": "tab:red",
              "ref": "tab:orange", "reward": "tab:purple", "switch": "tab:gray",
              "queue": "tab:olive", "weight_sync": "tab:brown"}
    lanes = sorted({e.device for e in result.timeline})
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(lanes) + 1.5))
    for e in result.timeline:
        ax.barh(lanes.index(e.device), e.end - e.start, left=e.start,
                color=colors.get(e.role, "black"))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    fig.tight_layout()
    gantt = out / "timeline.png"
    fig.savefig(gantt)
    fig2, ax2 = plt.subplots(figsize=(5, 4))
    for variant in ("sync", "stalesync"):
        pts = [p for p in points if p.variant == variant]
        ax2.plot([p.num_supernodes for p in pts], [p.tokens_per_s for p in pts], "o-",
                 label=variant)
    ax2.set_xlabel("supernodes")
    ax2.set_ylabel("tokens/s")
    ax2.legend()
    fig2.tight_layout()
    scaling = out / "scaling.png"
    fig2.savefig(scaling)
    plt.close("all")
    return [gantt, scaling]


def simulate_and_report(config_path: Path, out: Path | None) -> str:
    cfg = load_rl_config(config_path)
    cal = calibration_for(cfg)
    result = simulate(cfg, cal)
    points = scaling_curve(cfg, cal)
    text = [f"calibration: {cal.source}", *[f"  {n}" for n in cal.source_notes], "",
            format_result(cfg, result), "", "scaling (weak: prompts per step x supernodes):",
            format_scaling(points)]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "trace.json").write_text(json.dumps(to_chrome_trace(result.timeline)))
        written = [out / "trace.json"] + _plots(result, points, out)
        text += ["", "wrote " + ", ".join(str(p) for p in written)]
    return "\n".join(text)
