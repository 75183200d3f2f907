"""The replay workload against the built-in task: response lengths and the share of a synchronous
colocated step's device time that goes to generation.

Two synchronous colocated runs on 2 devices from the shipped base: the built-in task as the
policy answers it at the default batch (32 prompts x 8 samples, `rollout.lengths=natural`), and
the replay workload of `configs/replay.toml` (8 prompts x 8 samples, every response forced to
its drawn long-tailed length, median 150 and cap 1,000 tokens, no KL term: `rl/replay.py`). One
step of each runs in turn (interleaved) after a warm-up step. From the devices' spans:
generation share = rollout (decode + prefill) device-seconds / all busy device-seconds of the
step (reference, reward, update, queue reads and writes and switch the rest); tail
amplification = the rollout phase's wall time / the time its tokens would take with every decode
pass full (`rollout.max_num_seqs` rows) at the step's own mean pass time, plus its prefill time
— a pass costs more with more rows, so this overstates the amplification of a perfect schedule;
it is comparable between the workloads. Decode occupancy = mean rows per decode pass / slots.

    python bench/workload.py            # 6 timed steps each (~8 min)
    python bench/workload.py --quick    # 3 timed steps each
    python bench/workload.py --smoke    # 1 timed step each of 2 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import ray

from rlfusion.config import load_config
from rlfusion.model.checkpoint import find_base
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

REPLAY = Path(__file__).resolve().parents[1] / "configs" / "replay.toml"
WORKLOADS = {"task": None, "replay": REPLAY}  # name: config file (None: the defaults)
DEVICES = ("device0", "device1")
# --smoke: the smallest step (1 prompt group per device, over either workload's own sizes; the
# replay lengths' median must stay below the cap); responses this short rarely score, so dynamic
# sampling would drop every group and the update with them
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "rollout.replay_median=4", "algo.dynamic_sampling=false"]


def make_trainer(name: str, out: Path, overrides: list[str] | tuple[str, ...] = ()) -> RLTrainer:
    """Workload `name` on 2 Ray devices, colocated; `overrides`: config items over its file's."""
    cfg = load_config(TrainConfig, WORKLOADS[name], ["deploy.mode=colocated", "deploy.backend=ray",
                                                     "deploy.num_devices=2", "deploy.threads_per_device=1",
                                                     f"out_dir=\"{out}\"", *overrides])
    return RLTrainer(cfg, out / name, find_base())


def step_row(trainer: RLTrainer, metrics: dict, spans: list) -> dict:
    busy = {ph: sum(s.duration_s for s in spans if s.phase == ph and s.device in DEVICES)
            for ph in {s.phase for s in spans}}
    total = sum(busy.values())
    passes = metrics["engine_decode_passes"]
    slots = trainer.cfg.rollout.max_num_seqs
    occupancy = metrics["engine_decode_rows_mean"]
    # the decode seconds of the busiest engine at full slots: the same tokens in fewer passes
    full_decode_s = metrics["time_decode_s"] * occupancy / slots if passes else 0.0
    ideal_s = full_decode_s + metrics["time_prefill_s"]
    return {"share": busy.get("rollout", 0.0) / total if total else 0.0,
            "amplification": metrics["time_rollout_s"] / ideal_s if ideal_s else float("nan"),
            "occupancy": occupancy / slots, "length_mean": metrics["response_length_mean"],
            "tok_s": metrics["generated_tokens"] / metrics["time_step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    steps = 1 if args.smoke else 3 if args.quick else 6
    ray.init(address="local", num_cpus=2 * len(WORKLOADS), include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows: dict[str, list[dict]] = {n: [] for n in WORKLOADS}
    lengths: dict[str, list[int]] = {n: [] for n in WORKLOADS}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {n: make_trainer(n, Path(tmp), SMOKE_ROLLOUT if args.smoke else ()) for n in WORKLOADS}
        caps = {n: t.cfg.rollout.max_new_tokens for n, t in trainers.items()}
        try:
            for t in trainers.values():
                t.train_step()  # warm-up
            for i in range(steps):
                for n, t in trainers.items():
                    start = len(t.timeline.spans)
                    m = t.train_step()
                    rows[n].append(step_row(t, m, t.timeline.spans[start:]))
                    lengths[n].append(int(m["response_length_max"]))
                print(f"step {i + 1}: " + ", ".join(f"{n} share {rows[n][-1]['share']:.2f}" for n in WORKLOADS),
                      flush=True)
        finally:
            for t in trainers.values():
                t.close()
    ray.shutdown()
    print(f"\n## synchronous colocated, 2 devices, median of {steps} interleaved steps")
    print("| workload | generation share of device time | tail amplification | decode occupancy "
          "| mean response length | longest response | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    med = {n: {k: statistics.median(r[k] for r in rows[n]) for k in rows[n][0]} for n in WORKLOADS}
    for n in WORKLOADS:
        x = med[n]
        print(f"| {n} | {x['share']:.2f} | {x['amplification']:.2f} | {x['occupancy']:.2f} | "
              f"{x['length_mean']:.0f} | {max(lengths[n])} (cap {caps[n]}) | {x['tok_s']:.0f} |")
    print()
    print(f"target replay_generation_share: {med['replay']['share']:.2f} (goal >= 0.70)")


if __name__ == "__main__":
    main()
