"""The actor's training options in RL runs on 2 devices: what recompute/swap saves and costs,
and what expert balancing does to a skewed router.

1. Recompute (`optim.recompute`): one colocated run per mode (none, selective, full, swap), the
   same batches (same seed). Each step of every mode runs in turn after a warm-up step (rounds
   interleave the modes, so they share the machine's load); per update, the actor's tracked
   activation memory per device (`activation_mb`: bytes the largest micro-batch keeps for
   backward on the device; swap's host copies are `activation_host_mb`) and the update's time.
   Saving = 1 - activation_mb / none's; cost = update time / none's, the median of the rounds'
   ratios.
2. Expert balancing (`optim.expert_balance`): the shipped base with its routers' expert bias
   raised by `HOT_BIAS` on experts 0-3, all of which sit on expert-parallel device 0 of
   `deploy.train_ep=2` (the balance bench's hot-experts trace, in a real RL run). Per update,
   the measured max/mean routed-token load per device in the placement the update ran with
   (`expert_load_max_over_mean`), with balancing on and off (off: margin 0.99, so the load is
   measured but no layer ever migrates); the first update runs in the built placement either
   way, later ones, with balancing, in the migrated one. A third run predicts the load from the
   experts the rollout engine recorded for the update's tokens (`optim.expert_balance_source=
   rollout`) instead of the trainer's own counts.

    python bench/rl_options.py           # 5 rounds, 8 balancing updates (~6 min)
    python bench/rl_options.py --quick   # 2 rounds, 4 updates
    python bench/rl_options.py --smoke   # none and full, 1 round, 2 updates of 2 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import ray
import torch

from rlfusion.config import load_config
from rlfusion.model.checkpoint import find_base, load_checkpoint, save_checkpoint
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

RECOMPUTE = ("none", "selective", "full", "swap")
HOT_BIAS = 0.1  # added to the routing score (softmax probability ~1/8) of each hot expert
# --smoke: the two recompute modes the target compares (each run starts 2 Ray workers, ~3 s each on
# 2 cores; the others differ only in the config the library runs), at the smallest step (1 prompt
# group per device); responses this short rarely score, so dynamic sampling would drop every group
# and skip the update the bench measures
SMOKE_RECOMPUTE = ("none", "full")
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "algo.dynamic_sampling=false"]
SIZES: list[str] = []  # config items every run gets (--smoke: SMOKE_ROLLOUT)


def trainer(out: Path, name: str, base: Path, *items: str) -> RLTrainer:
    cfg = load_config(TrainConfig, None, ["deploy.mode=colocated", "deploy.backend=ray", "deploy.num_devices=2",
                                          "deploy.threads_per_device=1", f"out_dir=\"{out}\"", *SIZES, *items])
    return RLTrainer(cfg, out / name, base)


def skewed_base(out: Path) -> Path:
    model, tokenizer, extra = load_checkpoint(find_base())
    with torch.no_grad():
        for router in model.routers():
            router.expert_bias[:4] += HOT_BIAS
    return save_checkpoint(out / "skewed-base", model, tokenizer, extra)


def recompute(out: Path, rounds: int, modes: tuple[str, ...] = RECOMPUTE) -> dict[str, dict[str, float]]:
    runs = {m: trainer(out, f"recompute_{m}", find_base(), f"optim.recompute={m}") for m in modes}
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for m in modes:
            runs[m].train_step()  # warm-up
        for r in range(rounds):
            for m in modes:
                x = runs[m].train_step()
                rows[m].append({"act": x["activation_mb"], "host": x.get("activation_host_mb", 0.0),
                                "update_s": x["time_update_s"]})
            print(f"round {r + 1}: " + ", ".join(f"{m} {rows[m][-1]['act']:.1f} MB {rows[m][-1]['update_s']:.2f} s"
                                                 for m in modes), flush=True)
    finally:
        for t in runs.values():
            t.close()
    out_rows = {}
    for m in modes:
        out_rows[m] = {
            "act": statistics.median(x["act"] for x in rows[m]),
            "host": statistics.median(x["host"] for x in rows[m]),
            "saving": statistics.median(1 - x["act"] / n["act"] for x, n in zip(rows[m], rows["none"])),
            "cost": statistics.median(x["update_s"] / n["update_s"] for x, n in zip(rows[m], rows["none"])),
        }
    return out_rows


BALANCING = (False, True, "rollout")  # off, on with the trainer's counts, on with the rollout's routes


def balancing(out: Path, updates: int) -> dict:
    base = skewed_base(out)
    loads: dict = {}
    for on in BALANCING:
        # off: the balancer measures and predicts but never migrates (no improvement reaches the margin)
        source = ["optim.expert_balance_source=rollout"] if on == "rollout" else []
        t = trainer(out, f"balance_{on}", base, "deploy.train_ep=2", "optim.expert_balance=true",
                    f"optim.expert_balance_margin={0.05 if on else 0.99}", *source)
        try:
            loads[on] = []
            for _ in range(updates):
                x = t.train_step()
                loads[on].append(x.get("expert_load_max_over_mean", float("nan")))
        finally:
            t.close()
        print(f"expert_balance={on}: measured max/mean per update " + ", ".join(f"{v:.2f}" for v in loads[on]),
              flush=True)
    return loads


def measured_imbalance(loads: list[float]) -> float:
    """The median over the updates after the first (the first always runs in the built placement)."""
    return statistics.median(loads[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
        SIZES.extend(SMOKE_ROLLOUT)
    # updates: the first runs in the built placement, so >= 2
    rounds, updates = (1, 2) if args.smoke else (2, 4) if args.quick else (5, 8)
    modes = SMOKE_RECOMPUTE if args.smoke else RECOMPUTE
    ray.init(address="local", num_cpus=2 * (len(modes) + 3), include_dashboard=False, log_to_driver=False, configure_logging=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rc = recompute(out, rounds, modes)
        loads = balancing(out, updates)
    ray.shutdown()
    batch = "2 prompts x 2 samples" if args.smoke else "default batch"
    print(f"\n## recompute / swap: 2 devices colocated, {batch}, median of {rounds} interleaved rounds")
    print("| optim.recompute | activation MB / device | host MB | saving vs none | update time vs none |")
    print("|---|---|---|---|---|")
    for m in modes:
        x = rc[m]
        print(f"| {m} | {x['act']:.1f} | {x['host']:.1f} | {x['saving']:.0%} | {x['cost']:.2f}x |")
    print(f"\n## expert balancing, deploy.train_ep=2, experts 0-3 hot (bias +{HOT_BIAS}), {updates} updates")
    for on in BALANCING:
        name = "true, the rollout's routes" if on == "rollout" else str(on).lower()
        print(f"expert_balance={name}: first update {loads[on][0]:.2f}, later median "
              f"{measured_imbalance(loads[on]):.2f}")
    print()
    print(f"target recompute_full_activation_saving: {rc['full']['saving']:.2f} (goal >= 0.70)")
    print(f"target expert_balance_max_over_mean: {measured_imbalance(loads[True]):.2f} (goal <= 1.10)")
    print(f"target expert_balance_rollout_source_max_over_mean: {measured_imbalance(loads['rollout']):.2f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
