"""The end of a run: PNG plots, `summary.json` and the summary table printed to the terminal."""

from __future__ import annotations

import dataclasses

from rlfusion.obs.metrics import read_metrics
from rlfusion.obs.plots import plot_metrics, plot_panels_grid
from rlfusion.obs.summary import format_table, write_summary


def finish_run(trainer, result) -> str:
    """Write plots and summary.json into the run folder; returns the table to print."""
    rows = read_metrics(trainer.run_dir / "metrics.jsonl")
    plot_metrics(rows, trainer.run_dir / "plots")
    plot_panels_grid(rows, trainer.run_dir / "plots" / "overview.png")
    steps = [r for r in rows if "generated_tokens" in r]
    gen_tokens = sum(r["generated_tokens"] for r in steps)
    rollout_s = sum(r["time_rollout_s"] for r in steps)
    summary = {
        "base_accuracy": result.base_accuracy,
        "final_accuracy": result.final_accuracy,
        "accuracy_gain_points": 100 * (result.final_accuracy - result.base_accuracy),
        "updates": result.steps,
        "wall_time_s": result.seconds,
        "stopped": result.stopped,
        "generated_tokens": gen_tokens,
        "tokens_per_s": gen_tokens / result.seconds if result.seconds else 0.0,
        "rollout_tokens_per_s": gen_tokens / rollout_s if rollout_s else 0.0,
        "final_reward_mean": _tail_mean(steps, "reward_mean"),
        "final_response_length_mean": _tail_mean(steps, "response_length_mean"),
        "eval_problems": trainer.cfg.eval_problems,
        "run_dir": str(trainer.run_dir),
        "config": dataclasses.asdict(trainer.cfg),
    }
    write_summary(trainer.run_dir, summary)
    return format_table([
        ("held-out accuracy, base", f"{result.base_accuracy:.1%}"),
        ("held-out accuracy, final", f"{result.final_accuracy:.1%}"),
        ("gain", f"{summary['accuracy_gain_points']:+.1f} points"),
        ("updates", str(result.steps)),
        ("RL wall time", f"{result.seconds:.0f} s"),
        ("generated tokens/s (whole loop)", f"{summary['tokens_per_s']:,.0f}"),
        ("generated tokens/s (rollout)", f"{summary['rollout_tokens_per_s']:,.0f}"),
        ("reward, last 10 steps", f"{summary['final_reward_mean']:.3f}"),
        ("stopped", result.stopped),
        ("run folder", str(trainer.run_dir)),
    ], title="rlfusion train: summary")


def _tail_mean(rows: list[dict], key: str, n: int = 10) -> float:
    values = [r[key] for r in rows[-n:] if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")
