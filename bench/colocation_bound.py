"""What colocated / separated can reach on this machine: the simulator's answer for the default
workload at several device concurrencies and decode step costs.

Colocated splits a synchronous step's work over two devices that each generate, score and train;
separated gives one device the rollout and the other the update, one after the other. The ratio
of their step times is therefore about twice the per-device speed two busy devices keep, less
the rollout's tail: each device decodes until its longest response ends, and a decode step has a
fixed cost whatever its rows. This bench measures this machine's calibration
(`rlfusion.measure.calibrate`), generates the default run's response lengths from the shipped
base model (3 steps of 32 prompts x 8 samples), and simulates both modes with the measured
concurrency and with better ones, and with the decode step's fixed cost as measured, halved and
cut by 90%.

    python bench/colocation_bound.py           # full calibration (~3 min)
    python bench/colocation_bound.py --quick   # quick calibration
    python bench/colocation_bound.py --smoke   # quick calibration, 1 rollout of 2 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from rlfusion.config import load_config
from rlfusion.measure.calibrate_all import measure_calibration
from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.rl.tasks import make_task
from rlfusion.runtime import dataflow
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.sim.calibration import KIND_SPEEDS, Calibration
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate

FIXED_COST_SCALES = (1.0, 0.5, 0.1)
# --smoke: the response lengths of one rollout of 2 prompts x 2 samples, at most 8 tokens each
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8"]


def default_lengths(cfg: TrainConfig, steps: int = 3) -> tuple[list[int], list[int]]:
    """Response and prompt lengths of `steps` default rollouts from the shipped base model."""
    torch.set_num_threads(1)
    model, tokenizer, _ = load_base(find_base())
    task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
    stage = RolloutStage(model, tokenizer, cfg.rollout, seed=7)
    P = cfg.rollout.prompts_per_step
    responses, prompts = [], []
    for step in range(steps):
        groups = list(range(step * P, (step + 1) * P))
        for t in stage.generate([dataflow.group_problem(task, cfg.seed, g) for g in groups], groups, 0):
            responses.append(len(t.response_ids))
            prompts.append(len(t.prompt_ids))
    return responses, prompts


def step_s(sim: RLSimConfig, cal: Calibration) -> float:
    ends = simulate(sim, cal).update_end_s
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def with_fixed_cost(cal: Calibration, scale: float) -> Calibration:
    """The decode table with `scale` x the one-row step time's fixed part (95% of it) left."""
    fixed = 0.95 * cal.decode_step_ms[0]
    return cal.replace(decode_step_ms=tuple(t - (1 - scale) * fixed for t in cal.decode_step_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes (quick calibration), to check it runs")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    cal = measure_calibration(None, threads=1, quick=args.quick or args.smoke, smoke=args.smoke)
    cfg = load_config(TrainConfig, None, SMOKE_ROLLOUT if args.smoke else [])
    responses, prompts = default_lengths(cfg, steps=1 if args.smoke else 3)
    print(f"response lengths: {len(responses)} samples, mean {statistics.mean(responses):.1f}, "
          f"median {statistics.median(responses)}, max {max(responses)}; decode "
          f"{cal.decode_step_ms[0]:.2f} ms at {cal.decode_batch_sizes[0]} row(s), {cal.decode_step_ms[-1]:.2f} ms at "
          f"{cal.decode_batch_sizes[-1]}")
    sim = RLSimConfig(devices_per_supernode=2, prompts_per_step=cfg.rollout.prompts_per_step,
                      group_size=cfg.rollout.group_size, max_staleness=0, max_num_seqs=cfg.rollout.max_num_seqs,
                      max_new_tokens=cfg.rollout.max_new_tokens, response_lengths=tuple(responses),
                      prompt_len=round(statistics.mean(prompts)), num_steps=3)
    speeds = [(cal.concurrent_speed, cal.lockstep, "measured; simulated with each kind of work's own")] + [(c, c, "") for c in (0.9, 1.0)]
    print("\n| concurrent / lock-step speed | " + " | ".join(f"decode fixed cost x{s:g}" for s in FIXED_COST_SCALES)
          + " |")
    print("|---|" + "---|" * len(FIXED_COST_SCALES))
    for conc, lock, note in speeds:
        # one speed for every kind of work in the rows after the measured one
        at = cal if note else cal.replace(concurrent_speed=conc, lockstep_speed=lock, **dict.fromkeys(KIND_SPEEDS, 0.0))
        ratios = []
        for scale in FIXED_COST_SCALES:
            c = with_fixed_cost(at, scale)
            ratios.append(step_s(sim.replace(mode="separated"), c) / step_s(sim.replace(mode="colocated"), c))
        label = f"{conc:.2f} / {lock:.2f}" + (f" ({note})" if note else "")
        print(f"| {label} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    print("\n(colocated / separated step-time ratio predicted by the simulator; bench/fusion.py's "
          "target colocated_vs_separated measures the real one)")


if __name__ == "__main__":
    main()
