"""PNG charts of a run's per-step metrics: one file per panel, plus an all-panels overview.

Owns which metrics are drawn together (`DEFAULT_PANELS`) and how a panel looks. It reads the
rows `read_metrics` returns and does not know how they were produced. Matplotlib is imported
inside the functions, with the headless Agg backend, so importing this module is cheap and
plotting works on machines without a display.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from rlfusion.obs.files import save_figure

DEFAULT_PANELS: dict[str, list[str]] = {
    "reward": ["reward_mean"],
    "accuracy": ["heldout_accuracy"],
    "kl": ["kl"],
    "response_length": ["response_length_mean", "response_length_max"],
    # the rollout's policy against the trainer's on the same tokens (rl/mismatch.py); drawn where
    # a run reports them
    "mismatch": ["mismatch_kl", "mismatch_kl_lag0", "mismatch_kl_lag1"],
    "routing": ["router_agreement", "routed_differently_share"],
    # multi-turn episodes (`env.name`): what the environment saw and how much of it was hidden
    "episodes": ["env_turns_per_episode", "env_hidden_share", "env_info_tool_call_correct_per_call"],
}
# (title, y-axis label) of the default panels; other panels use their name for both.
_LABELS = {
    "reward": ("Reward", "mean reward per sample"),
    "accuracy": ("Held-out accuracy", "accuracy"),
    "kl": ("KL to reference", "KL estimate"),
    "response_length": ("Response length", "tokens"),
    "mismatch": ("Rollout vs trainer", "token KL(rollout || train)"),
    "routing": ("MoE routing, rollout vs trainer", "share"),
    "episodes": ("Episodes", "turns / share"),
}
_MAX_POINTS_WITH_MARKERS = 40  # sparse series (e.g. eval every N steps) need visible points
_PANEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")

Series = tuple[list[int], list[float]]


def plot_metrics(
    rows: list[dict[str, Any]], out_dir: Path, keys: dict[str, list[str]] | None = None
) -> list[Path]:
    """Write `out_dir/<panel>.png` for each panel with data; returns the paths written.

    `keys` maps panel name -> metric names drawn against step (default `DEFAULT_PANELS`).
    Metrics absent from every row are skipped, and a panel left with none is not written.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, series in _panels_with_data(rows, keys).items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
        _draw_panel(ax, panel, series)
        path = out_dir / f"{panel}.png"
        save_figure(fig, path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_panels_grid(
    rows: list[dict[str, Any]], path: Path, keys: dict[str, list[str]] | None = None
) -> Path | None:
    """Draw every panel with data into one PNG at `path` (e.g. `overview.png`).

    Returns `path`, or None (writing nothing) when no panel has data.
    """
    panels = _panels_with_data(rows, keys)
    if not panels:
        return None
    plt = _pyplot()
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(6.0 * ncols, 3.6 * nrows), squeeze=False, layout="constrained"
    )
    flat = axes.ravel()
    for ax, (panel, series) in zip(flat, panels.items()):
        _draw_panel(ax, panel, series)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: training machines have no display
    import matplotlib.pyplot as plt

    return plt


def _panels_with_data(
    rows: list[dict[str, Any]], keys: dict[str, list[str]] | None
) -> dict[str, dict[str, Series]]:
    panels = DEFAULT_PANELS if keys is None else keys
    out = {}
    for panel, metric_names in panels.items():
        if not _PANEL_NAME.fullmatch(panel):
            raise ValueError(f"panel name {panel!r} must match [A-Za-z0-9_.-]+ (it names a file)")
        series = {name: s for name in metric_names if (s := _series(rows, name)) is not None}
        if series:
            out[panel] = series
    return out


def _series(rows: list[dict[str, Any]], name: str) -> Series | None:
    """(steps, values) of metric `name`, or None if it has no finite value in any row."""
    steps, values = [], []
    for row in rows:
        if name not in row:
            continue
        value = row[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            step = row.get("step")
            raise ValueError(f"metric {name!r} at step {step} is not a number: {value!r}")
        if not isinstance(row.get("step"), int):
            raise ValueError(f"metric row without an integer 'step': {row!r}")
        steps.append(row["step"])
        # null (a non-finite value when logged) becomes NaN, which matplotlib draws as a gap.
        values.append(math.nan if value is None else float(value))
    if not any(math.isfinite(v) for v in values):
        return None
    return steps, values


def _draw_panel(ax: Any, panel: str, series: dict[str, Series]) -> None:
    for name, (steps, values) in series.items():
        marker = "o" if len(steps) <= _MAX_POINTS_WITH_MARKERS else None
        ax.plot(steps, values, label=name, marker=marker, markersize=3, linewidth=1.5)
    default = panel.replace("_", " ")
    title, y_label = _LABELS.get(panel, (default, default))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="best", fontsize="small")
