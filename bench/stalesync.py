"""StaleSync vs synchronous RL on 2 devices: tokens/s, utilization, staleness and held-out accuracy
after the same number of updates.

Every variant runs the default task (its response lengths have a long tail: median ~24 tokens,
p99 ~100) from the shipped base, 32 prompts x 8 samples per update, on its own 2 Ray device
workers (1 thread each). One update of each variant runs in turn (interleaved, never
concurrently), so all variants share the machine's load; after `--updates` updates each variant
is evaluated greedily on the same held-out problems. Tokens/s = generated tokens / step wall time
summed over the updates after the first two (the separated pipeline fills in its first step).

Held-out accuracy after 30 updates moves by several points with the seed alone (two synchronous
runs of the same algorithm that differ only in their random streams have differed by 3.8
points), so the whole interleaved run repeats for `--seeds` seeds and the accuracy gap is taken
between the variants' mean accuracies; every seed's accuracy is printed. Tokens/s pools all seeds.

The run ends with a ceiling: the most tokens/s *any* schedule of this work could reach on these
2 devices — a work-conserving bound from the synchronous colocated run's own device-seconds. Its
reference, reward, update and switch work stays (StaleSync trains the same samples with the
same models); its rollout is replaced by every generated token decoded at the engine's best
per-token cost over batch sizes up to 4x the engine's slots (timed here, single process, no
prefill, no growth of the context); the devices never idle. StaleSync can only move work in
time and fill decode batches, so its tokens/s cannot exceed this.

    python bench/stalesync.py            # 3 seeds x 30 updates per variant, 500 held-out problems (~17 min)
    python bench/stalesync.py --quick    # 1 seed, 8 updates, 100 held-out problems
    python bench/stalesync.py --seeds 1 --seed 1 --variants "sync colocated,stalesync s=1 colocated"
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rlfusion.cli import find_base
from rlfusion.config import load_config
from rlfusion.obs.timeline import plot_gantt
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

THRESHOLD = 0.75  # partial rollout: an update goes ahead once 3/4 of its prompt groups finished

VARIANTS = {  # name: (deploy.mode, stalesync overrides)
    "sync colocated": ("colocated", []),
    "sync separated": ("separated", []),
    "stalesync s=1 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=1",
                                              f"stalesync.rollout_finish_threshold={THRESHOLD}"]),
    "stalesync s=2 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=2",
                                              f"stalesync.rollout_finish_threshold={THRESHOLD}"]),
    "stalesync s=1 separated": ("separated", ["stalesync.enabled=true", "stalesync.max_staleness=1"]),
    "stalesync s=2 separated": ("separated", ["stalesync.enabled=true", "stalesync.max_staleness=2",
                                              f"stalesync.rollout_finish_threshold={THRESHOLD}"]),
}
BASELINE = "sync colocated"


def make_trainer(name: str, out: Path, eval_problems: int, updates: int, seed: int) -> RLTrainer:
    mode, extra = VARIANTS[name]
    cfg = load_config(TrainConfig, None, [f"seed={seed}",
        f"deploy.mode={mode}", "deploy.backend=ray", "deploy.num_devices=2", "deploy.threads_per_device=1",
        f"out_dir=\"{out}\"", f"eval_problems={eval_problems}", f"max_steps={updates}", *extra])
    return RLTrainer(cfg, out / name.replace(" ", "_").replace("=", ""), find_base())


def decode_floor_s_per_token(max_num_seqs: int) -> tuple[float, int]:
    """The engine's lowest decode cost per generated token over batch sizes of 1/2 to 4x
    `max_num_seqs` rows (the shipped base, 1 thread, the default task's prompts, 24 new tokens
    each; median step after the prefill steps). Returns (seconds per token, rows)."""
    import torch

    from rlfusion.model.checkpoint import load_checkpoint
    from rlfusion.sim.measure import engine_step_times, task_prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer, _ = load_checkpoint(find_base())
    model.eval()
    best = (float("inf"), 0)
    for rows in (max_num_seqs // 2, max_num_seqs, 2 * max_num_seqs, 4 * max_num_seqs):
        times = engine_step_times(model, task_prompts(tokenizer, rows, seed=rows), 24, max_num_seqs=rows)
        best = min(best, (statistics.median(times[2:]) / rows, rows))
    torch.set_num_threads(threads)
    return best


def ceiling(timed: list[dict], spans: list, per_token_s: float, devices: int) -> float:
    """Tokens/s no schedule of the synchronous run's work can beat on `devices` devices: its
    non-rollout device-seconds plus every generated token at `per_token_s`, spread over the
    devices with no idle time."""
    other = sum(sp.duration_s for sp in spans if sp.phase not in ("rollout", "idle"))
    tokens = sum(m["generated_tokens"] for m in timed)
    return tokens / ((other + tokens * per_token_s) / devices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=None, help="seeds to run (default 3; --quick 1)")
    parser.add_argument("--gantt", default="", help="folder for one Gantt PNG per variant (its last update); "
                                                   "default: docs/img for the full default run")
    parser.add_argument("--variants", default="", help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    updates = args.updates or (8 if args.quick else 30)
    seeds = list(range(args.seed, args.seed + (args.seeds or (1 if args.quick else 3))))
    eval_problems = 100 if args.quick else 500
    names = [n.strip() for n in args.variants.split(",") if n.strip()] or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or BASELINE not in names:
        raise SystemExit(f"--variants: unknown {unknown} or missing {BASELINE!r}; allowed: {', '.join(VARIANTS)}")
    if updates < 4 or not seeds:
        raise SystemExit(f"--updates={updates} --seeds={len(seeds)}: need >= 4 updates (the first two are not "
                         "timed) and >= 1 seed")
    floor_s, floor_rows = decode_floor_s_per_token(TrainConfig().rollout.max_num_seqs)
    print(f"engine decode floor: {floor_s * 1e6:.1f} us per token (at {floor_rows} rows)", flush=True)
    ray.init(num_cpus=2 * len(names), include_dashboard=False, log_to_driver=False, configure_logging=False)
    baseline_spans = []  # the timed updates' device spans of synchronous colocated, every seed
    timed: dict[str, list[dict]] = {n: [] for n in names}  # timed updates, every seed
    every: dict[str, list[dict]] = {n: [] for n in names}  # all updates, every seed
    accs: dict[str, list[float]] = {n: [] for n in names}
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {n: make_trainer(n, Path(tmp), eval_problems, updates, seed) for n in names}
            base_acc = trainers[BASELINE].evaluate().accuracy
            print(f"seed {seed}: base held-out accuracy ({eval_problems} problems): {base_acc:.1%}", flush=True)
            for u in range(updates):
                for n in names:
                    m = trainers[n].train_step()
                    every[n].append(m)
                    if u >= 2:
                        timed[n].append(m)
                print(f"seed {seed} update {u + 1}: " + ", ".join(
                    f"{n} {every[n][-1]['generated_tokens'] / every[n][-1]['time_step_s']:.0f}" for n in names)
                      + " tok/s", flush=True)
            baseline_spans += [sp for sp in trainers[BASELINE].timeline.spans if (sp.step or 0) >= 2]
            for n in names:
                accs[n].append(trainers[n].evaluate().accuracy)
                gantt = args.gantt or ("" if (args.variants or args.quick or args.seed) else "docs/img")
                if gantt and seed == seeds[-1]:
                    png = Path(gantt) / f"stalesync_{n.replace(' ', '_').replace('=', '')}.png"
                    last = [sp for sp in trainers[n].timeline.spans if sp.step == updates - 1]  # one whole step
                    plot_gantt(last, png, title=f"{n}: device timeline of update {updates}")
            for t in trainers.values():
                t.close()
    ray.shutdown()

    acc = {n: statistics.mean(a) for n, a in accs.items()}
    tok_s = {n: sum(m["generated_tokens"] for m in r) / sum(m["time_step_s"] for m in r) for n, r in timed.items()}
    print(f"\n## 2 devices, 32 prompts x 8 samples per update, {updates} updates per variant, interleaved, "
          f"seeds {', '.join(map(str, seeds))}")
    print(f"(partial-rollout threshold {THRESHOLD}; held-out accuracy: greedy, {eval_problems} problems, mean over "
          f"seeds, each seed's in brackets)")
    print("| variant | tokens/s | vs sync colocated | util mean | staleness mean | staleness max | "
          "dropped groups | held-out acc |")
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        r = timed[n]
        st_mean = statistics.mean(m.get("staleness_mean", 0.0) for m in every[n])
        st_max = max(m.get("staleness_max", 0.0) for m in every[n])
        print(f"| {n} | {tok_s[n]:.0f} | {tok_s[n] / tok_s[BASELINE]:.2f}x | "
              f"{statistics.mean(m['utilization_mean'] for m in r):.0%} | {st_mean:.2f} | {st_max:.0f} | "
              f"{sum(m.get('dropped_groups', 0) for m in every[n]):.0f} | {acc[n]:.1%} "
              f"({', '.join(f'{a:.1%}' for a in accs[n])}) |")
    top = ceiling(timed[BASELINE], baseline_spans, floor_s, 2)
    print(f"\nceiling of any schedule of this work on 2 devices: {top:.0f} tokens/s = "
          f"{top / tok_s[BASELINE]:.2f}x sync colocated (its reference, reward, update and switch "
          f"device-seconds; every generated token at the decode floor, {floor_s * 1e6:.1f} us; no idle)")
    stale = [n for n in names if n.startswith("stalesync")]
    if stale:
        best = max(stale, key=lambda n: tok_s[n])
        print(f"\nbest StaleSync variant by tokens/s: {best}")
        print(f"target stalesync_vs_sync_colocated: {tok_s[best] / tok_s[BASELINE]:.2f} (goal >= 1.4)")
        print(f"target accuracy_gap_points: {100 * (acc[BASELINE] - acc[best]):.1f} (goal <= 3.0)")
        print(f"target max_staleness_violations: "
              f"{sum(m.get('staleness_max', 0) > int(VARIANTS[n][1][1].split('=')[1]) for n in stale for m in every[n])} (goal <= 0)")


if __name__ == "__main__":
    main()
