"""Deployment modes on 2 devices, synchronous on-policy GRPO: separated vs colocated vs fully shared.

Same task, same base model, same batch (32 prompts x 8 samples); each mode gets its own Ray
device workers (2 processes, 1 thread each). One step of each mode runs in turn (interleaved,
never concurrently), after a warm-up step each; tokens/s is generated tokens / step wall time.
The colocated-vs-separated target is the median over rounds of each round's ratio (the two
steps of a round run back to back, so they share the machine's load at the time). Utilization is busy / wall per device within each step (from the workers'
spans). In separated mode the "switch" is the bucketed weight broadcast after each update; in
the colocated modes the engine generates from the very tensors the optimizer updates, so no
weights move: the switch offloads the optimizer state and allocates the KV cache (and back).
Switch time counts both kinds (transfer and switch spans, the busier device).

Five more colocated runs train the actor in a parallel layout (`deploy.train_tp=2`: TP shards;
`deploy.train_ep=2`: routed experts split over the two devices; `deploy.train_fsdp=true`:
parameters, gradients and optimizer state sharded over them, FSDP2; `deploy.train_pp=2`: two
pipeline stages, 1F1B over padded micro-batches of `optim.microbatch_tokens`): their switch gathers the
shards into a full replica per device in buckets before every rollout (fusion/reshard.py) and
frees it after; the fifth (`deploy.train_ep=2 deploy.infer_ep=2`) generates with its routed
experts split over the two devices too (each decodes its own rows, every MoE layer exchanges
tokens between them), filled from the expert shards with no whole copy on either. They run after
the three modes in each round; the last has its own targets: the actor's weights on a device
while it generates over the model's weights (the routed experts are 68% of the shipped base, so
ep2 leaves ~0.66), its rollout tokens/s against the same training layout's replica rollout (EP
decode pays three all-to-alls per MoE layer on a CPU; reported as it is), and its switch's share.
Every mode's tracked memory peak per device (weights, gradients, optimizer state, KV cache; the
larger device) is printed for the train and rollout phases, and the bytes per step that crossed
the controller (commands, answers, per-device reports, the advantage stage's per-row numbers)
against the bytes that moved between the devices through the queue (`driver_bytes_share` =
controller / (controller + queue)). Last, the per-device speed two busy devices get relative to
one alone (each phase's separated time, halved, over its colocated time per device): colocated
splits the same work over two devices, so colocated / separated approaches about twice that speed.
Scoring: the busier device's reward spans per colocated step over the step
(`reward_scoring_share_of_step`; the default run's task verifier), and what the math verifier
(math-verify behind it) takes for a step's 256 samples, timed on GSM8K test solutions here.

    python bench/fusion.py            # 9 rounds (~2 min)
    python bench/fusion.py --quick    # 3 rounds
    python bench/fusion.py --smoke    # separated and colocated, 1 round of 2 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rlfusion.model.checkpoint import find_base
from rlfusion.config import load_config
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

DEPLOY_MODES = ("separated", "colocated", "fully_shared")
MODES = DEPLOY_MODES + ("colocated_tp2", "colocated_ep2", "colocated_fsdp2", "colocated_pp2", "colocated_ep2_infer_ep2")
LAYOUTS = {"colocated_tp2": ("colocated", ["deploy.train_tp=2"]), "colocated_ep2": ("colocated", ["deploy.train_ep=2"]),
           "colocated_fsdp2": ("colocated", ["deploy.train_fsdp=true"]),
           "colocated_pp2": ("colocated", ["deploy.train_pp=2"]),
           "colocated_ep2_infer_ep2": ("colocated", ["deploy.train_ep=2", "deploy.infer_ep=2"])}
# the inference layout's targets compare its rollout with the same training layout's replica rollout
INFER_EP2, REPLICA = "colocated_ep2_infer_ep2", "colocated_ep2"
PHASES = ("rollout", "reference", "reward", "train", "switch", "transfer")
# --smoke: the smallest step each mode can run (1 prompt group per device); responses this short
# rarely score, so dynamic sampling would drop every group and skip the update the bench reports on
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "algo.dynamic_sampling=false"]
# --smoke runs the two modes the targets compare: every mode's trainer starts 2 Ray workers (~3 s
# each on 2 cores), and the others differ from these only in the config the library runs
SMOKE_MODES = ("separated", "colocated", REPLICA, INFER_EP2)


def make_trainer(mode: str, out: Path, overrides: list[str] | tuple[str, ...] = ()) -> RLTrainer:
    """Mode `mode` on 2 Ray devices; `overrides`: config items over the default run's (e.g. sizes)."""
    deploy_mode, layout = LAYOUTS.get(mode, (mode, []))
    cfg = load_config(TrainConfig, None, [f"deploy.mode={deploy_mode}", "deploy.backend=ray", "deploy.num_devices=2",
                                          "deploy.threads_per_device=1", f"out_dir=\"{out}\"", *layout, *overrides])
    return RLTrainer(cfg, out / mode, find_base())


def _matmul_seconds(products: int) -> float:
    import torch

    x, w = torch.randn(512, 512), torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(products):
        x @ w
    return time.perf_counter() - start


def _timer_loop(conn) -> None:
    import torch

    torch.set_num_threads(1)
    while products := conn.recv():  # 0: stop
        conn.send(_matmul_seconds(products))


def two_process_ceiling(reps: int, products: int = 600) -> float:
    """Throughput of two concurrent 1-thread processes over one alone (2.0 = perfect scaling):
    the most any 2-device mode can gain over a mode that keeps one device busy at a time."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_timer_loop, args=(child,), daemon=True) for _, child in pipes]
    for proc in procs:
        proc.start()
    ends = [parent for parent, _ in pipes]

    def run(which: list) -> float:
        for conn in which:
            conn.send(products)
        return max(conn.recv() for conn in which)

    run(ends)  # warm-up
    ratios = [2 * run(ends[:1]) / run(ends) for _ in range(reps)]
    for conn in ends:
        conn.send(0)
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    rounds = 1 if args.smoke else 3 if args.quick else 9
    modes = SMOKE_MODES if args.smoke else MODES
    ceiling = two_process_ceiling(1, 20) if args.smoke else two_process_ceiling(5)
    print(f"two-process throughput ceiling on this machine: {ceiling:.2f}x (2.00 = two independent cores)", flush=True)
    # logical CPUs for one 2-device placement group per mode; only one mode runs at a time
    ray.init(address="local", num_cpus=2 * len(modes), include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {m: make_trainer(m, Path(tmp), SMOKE_ROLLOUT if args.smoke else ()) for m in modes}
        batch = trainers["colocated"].cfg.rollout
        for m in modes:
            trainers[m].train_step()  # warm-up
        for r in range(rounds):
            for m in modes:
                t = trainers[m]
                start = len(t.timeline.spans)
                metrics = t.train_step()
                new = t.timeline.spans[start:]
                switch = max(sum(s.duration_s for s in new if s.phase in ("transfer", "switch") and s.device == d)
                             for d in ("device0", "device1"))
                rows[m].append({"tok_s": metrics["generated_tokens"] / metrics["time_step_s"],
                                "util": metrics["utilization_mean"],
                                "util0": metrics["utilization_device0"], "util1": metrics["utilization_device1"],
                                "step_s": metrics["time_step_s"], "switch_s": switch,
                                "tokens": metrics["generated_tokens"],
                                "rollout_tok_s": metrics["rollout_tokens_per_s"],
                                # the actor's weights on the fullest device while it generates
                                "actor_rollout_mb": metrics["memory_actor_weights_rollout_mb"],
                                "kv_rows": metrics["engine_kv_rows"],
                                "train_mb": metrics["memory_peak_train_mb"],
                                "rollout_mb": metrics["memory_peak_rollout_mb"],
                                # samples scored by a device other than the one that generated them
                                "peer_scored": t.devices.peer_scored,
                                # bytes across the controller / (that + bytes through the queue)
                                "driver_share": metrics["driver_bytes_share"],
                                "driver_kb": metrics["driver_bytes"] / 1024, "queue_kb": metrics["queue_bytes"] / 1024,
                                **{f"{d}/{ph}": sum(s.duration_s for s in new if s.device == d and s.phase == ph)
                                   for d in ("device0", "device1") for ph in PHASES}})
            print(f"round {r + 1}: " + ", ".join(f"{m} {rows[m][-1]['tok_s']:.0f} tok/s" for m in modes), flush=True)
        model_mb = sum(t.nbytes for t in trainers["colocated"].model.state_dict().values()) / 2**20
        for t in trainers.values():
            t.close()
    ray.shutdown()
    med = {m: {k: statistics.median(x[k] for x in rows[m]) for k in rows[m][0]} for m in modes}
    samples = batch.prompts_per_step * batch.group_size
    print(f"\n## 2 devices, {batch.prompts_per_step} prompts x {batch.group_size} samples, synchronous on-policy, "
          f"median of {rounds} interleaved rounds")
    print("| mode | tokens/s | step s | util device 0 | util device 1 | util mean | switch s | switch share "
          "| train peak MB | rollout peak MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in modes:
        x = med[m]
        print(f"| {m} | {x['tok_s']:.0f} | {x['step_s']:.2f} | {x['util0']:.0%} | {x['util1']:.0%} | "
              f"{x['util']:.0%} | {x['switch_s']:.3f} | {x['switch_s'] / x['step_s']:.1%} "
              f"| {x['train_mb']:.1f} | {x['rollout_mb']:.1f} |")
    print(f"\ntwo-process throughput ceiling (measured before the rounds): {ceiling:.2f}x")
    print("\nseconds per step by phase (median): device0 | device1")
    for m in modes:
        print(f"  {m}: " + "; ".join(f"{ph} {med[m][f'device0/{ph}']:.2f} | {med[m][f'device1/{ph}']:.2f}"
                                     for ph in PHASES))
    print(f"samples (of {samples}) scored by the device that did not generate them, per step (mean, max): " +
          ", ".join(f"{m} {statistics.mean(x['peer_scored'] for x in rows[m]):.0f}, "
                    f"{max(x['peer_scored'] for x in rows[m])}" for m in modes))
    print("KB per step across the controller | through the queue (median): " +
          "; ".join(f"{m} {med[m]['driver_kb']:.1f} | {med[m]['queue_kb']:.1f}" for m in modes))
    # what bounds colocated / separated here: the same work split over two devices runs at the
    # per-device speed two busy processes get on this machine, not at the speed of one alone
    speed = {ph: sum(med["separated"][f"{d}/{ph}"] for d in ("device0", "device1")) / 2 /
             (sum(med["colocated"][f"{d}/{ph}"] for d in ("device0", "device1")) / 2)
             for ph in ("rollout", "reference", "train")}
    busy = {m: sum(med[m][f"{d}/{ph}"] for d in ("device0", "device1") for ph in PHASES) for m in ("separated", "colocated")}
    print("per-device speed while both devices work, relative to one alone (separated phase time / 2 over "
          "colocated): " + ", ".join(f"{ph} {v:.2f}" for ph, v in speed.items()))
    print(f"busy seconds, separated (one device at a time) / colocated (per device): "
          f"{busy['separated'] / (busy['colocated'] / 2):.2f} (colocated_vs_separated at full utilization, "
          f"no overhead; 2.0 at speed 1)")
    print()
    total = {m: sum(x["tokens"] for x in rows[m]) / sum(x["step_s"] for x in rows[m]) for m in modes}
    print(f"sum of tokens / sum of step times: colocated / separated {total['colocated'] / total['separated']:.2f}")
    ratios = [c["tok_s"] / s["tok_s"] for c, s in zip(rows["colocated"], rows["separated"])]
    print("colocated / separated tokens/s per round: " + ", ".join(f"{r:.2f}" for r in ratios))
    print(f"ratio of the medians: {med['colocated']['tok_s'] / med['separated']['tok_s']:.2f}")
    print(f"target colocated_vs_separated: {statistics.median(ratios):.2f} (goal >= 1.6)")
    print(f"target colocated_utilization: {med['colocated']['util']:.2f} (goal >= 0.9)")
    print(f"target driver_bytes_share: {med['colocated']['driver_share']:.3f} (goal <= 0.01)")
    print(f"target switch_share_of_step_colocated: {med['colocated']['switch_s'] / med['colocated']['step_s']:.3f} (goal <= 0.05)")
    # scoring: the busier device's reward spans per colocated step (the task's verifier), and
    # what the math verifier takes for as many GSM8K-style responses on this process
    reward_s = statistics.median(max(x["device0/reward"], x["device1/reward"]) for x in rows["colocated"])
    math_s = math_verifier_seconds(samples, passes=1 if args.smoke else 3)
    print(f"scoring a step's {samples} samples: the task's verifier {reward_s * 1e3:.1f} ms on the busier device; the "
          f"math verifier on {samples} GSM8K solutions {math_s * 1e3:.1f} ms in one process "
          f"({math_s / med['colocated']['step_s']:.1%} of the colocated step)")
    print(f"target reward_scoring_share_of_step: {reward_s / med['colocated']['step_s']:.3f} (goal <= 0.05)")
    # the inference layout: routed experts split over both devices while they generate
    ep2, replica = med[INFER_EP2], med[REPLICA]
    speed = [a["rollout_tok_s"] / b["rollout_tok_s"] for a, b in zip(rows[INFER_EP2], rows[REPLICA])]
    print(f"\ninference layout ep2 (train_ep=2): the actor's weights on the fullest device while generating "
          f"{ep2['actor_rollout_mb']:.2f} MB of the model's {model_mb:.2f} MB (a replica: {replica['actor_rollout_mb']:.2f} MB); "
          f"rollout tokens/s {ep2['rollout_tok_s']:.0f} vs the replica's {replica['rollout_tok_s']:.0f} "
          f"(per round: {', '.join(f'{r:.2f}' for r in speed)}); switch {ep2['switch_s']:.3f} s of a "
          f"{ep2['step_s']:.2f} s step")
    print(f"target max_device_weight_bytes_over_model_weight_bytes: {ep2['actor_rollout_mb'] / model_mb:.2f} (goal <= 0.70)")
    print(f"target rollout_ep2_vs_replica_tokens_per_s: {statistics.median(speed):.2f} (goal >= 0)")
    print(f"target switch_share_of_step_infer_ep2: {ep2['switch_s'] / ep2['step_s']:.3f} (goal <= 0.05)")


def math_verifier_seconds(samples: int, passes: int = 3) -> float:
    """Seconds the math verifier (`rl/verifiers.math_reward`, math-verify behind it) takes to
    score `samples` GSM8K test solutions against their answers (median of `passes` passes)."""
    import json

    from rlfusion.rl.verifiers import math_reward

    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k_test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:samples]]
    pairs = [(r["answer"], r["answer"].rsplit("####", 1)[1].strip()) for r in rows]
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        for solution, answer in pairs:
            math_reward(solution, answer)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
