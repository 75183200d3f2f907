"""The co-located update against one device alone on half the batch: what part of the gap is the
project's and what part the machine's.

`bench/fusion.py` read the colocated update's per-device speed at 0.64 of one device alone (the
separated train device's update time, halved, over the colocated device's), where the lock-step
probe (`measure/contention.py`, in a quieter hour) read 0.84 for two processes that meet as
colocated devices do. This bench profiles the update itself — the real `ActorStage.update`, built
as `Learner` builds it for `rlfusion train`'s colocated run on 2 devices (the default config,
`dp_group` over both ranks, gloo, 1 thread per process, the run's autocast) — on one fixed batch:
the default task's samples from the shipped base (32 prompts x 8 samples, generated once by
`RolloutStage` as the two devices of a colocated step would, rewarded by the task's verifier,
reference logprobs from `ReferenceStage`, advantages and the dynamic-sampling filter by
`advantage_stage.compute_advantages`) and split over the two ranks by `shard_rows` as the
advantage stage splits it (each row preferring the rank whose device generated it, where the
split supports that). Every repetition restores the same weights and optimizer state first
(outside the timing), so each one trains the same rows from the same state.

Each round runs these, in an order rotated from round to round (interleaved), in two worker
processes that stay up for the whole run:

    A  lone        one process, one thread, the update on one half, the other process idle
                   (each half in turn, on the rank that trains it in B)
    E  lone full   one process on the whole batch (what separated mode's train device does)
    C  independent both processes at once, each updating its half, no communication (the
                   machine's contention alone)
    D  lock-step   as C, but the ranks meet at a barrier where B's ranks meet: before the step
                   (B's token-count all-reduce) and after the backward passes (B's any-rank
                   loss check, right before the gradient all-reduce); no data exchanged
    B  co-located  both processes, each its half, the real data-parallel update (`dp_group`):
                   global counts, gradients summed in one flat all-reduce, metrics gathered
    A0p, A1p, Bp   where the run's split (rows preferring their home rank) differs from the
                   plain one (`shard_rows` by the same weights, no homes): A and B on the plain
                   split's halves, what balancing the halves would give

C, D and B start together (a barrier outside the timing). Inside every update the bench times,
by wrapping the calls in its own processes (nothing in src/ changes): the forward passes
(`_micro_loss`), backward (`torch.autograd.backward`), the rest of the micro-batch loop (loss
bookkeeping), every collective (`all_reduce`, `all_gather_object`, D's barriers) with its entry
and exit, the gradient sum (`sum_over_replicas`), `clip_grad_norm` and the optimizer step. The
two ranks' clocks are one clock (`perf_counter` is CLOCK_MONOTONIC), so at each collective a
rank's wait for the slower one is the last entry less its own, and the collective's own time is
its exit less the last entry. Each update's process CPU time (`process_time`: every thread,
gloo's included) is taken too: unlike wall time it barely moves with other load on the machine,
so the halves' cost ratio and what the same work costs with both processes busy (cache and
memory-bus sharing) read the same on a loaded machine as on a quiet one; a wait that spun
would show as CPU time in the collectives (gloo's do not).

Per round, with L the mean of A's two halves' times and C, D, B each the mean of the two ranks'
update times: per-device speed = L / time (B's is the target), and in units of L the gap of B
splits exactly into

    machine   C - L          contention of two busy processes
    machine   D - C - imb    lock-step waits beyond the halves' own imbalance (jitter from other
                             load: the slower rank at each meeting)
    project   imb            the split's imbalance: (slower half's lone CPU time / the halves'
                             mean - 1) x C / L (from the median ratio of the halves' CPU times)
    project   B - D          what B does beyond meeting: the all-reduces, the gradient flatten /
                             copy, the metrics gather, the extra meetings

(medians over rounds of each time over L, so the parts add up to the median gap); B - Bp
measures the split's part directly. The same split in process CPU time (the slower rank of B
over the lone halves' mean CPU time: what a lock-step update would cost with an idle core per
process) reads the update's own costs apart from the other load of the moment: the same work
with both processes busy (D's mean), B's communication (B's mean over D's) and the imbalance
(B's slower rank over its mean). E / 2 over L shows what data parallelism itself repeats per
device (the optimizer step, fixed costs): the speed against the separated train device
(`bench/fusion.py`'s train figure) is (E / 2) / B.

    python bench/update_profile.py           # 21 rounds (~2 min on a quiet machine)
    python bench/update_profile.py --quick   # 6 rounds
    python bench/update_profile.py --smoke   # 1 round of 2 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

# --smoke: the smallest batch (1 prompt group per device); responses this short rarely score, so
# dynamic sampling would drop every group and leave nothing to update on
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "algo.dynamic_sampling=false"]
VERSION = 10  # the policy version every timed update runs at (past the warm-up: the lr is fixed)
# the runs of a round: (name, {rank: (what, split, half)}) — what: lone | indep | lockstep | dp;
# split: "run" (the advantage stage's) or "plain" (by tokens alone); half None: the whole batch
RUNS = (("A0", {0: ("lone", "run", 0)}), ("A1", {1: ("lone", "run", 1)}), ("E", {0: ("lone", "run", None)}),
        ("C", {0: ("indep", "run", 0), 1: ("indep", "run", 1)}),
        ("D", {0: ("lockstep", "run", 0), 1: ("lockstep", "run", 1)}),
        ("B", {0: ("dp", "run", 0), 1: ("dp", "run", 1)}))
# where the run's split prefers home rows and so differs from the plain one: the plain split's
# lone halves and co-located update too (what balancing the halves would give)
PLAIN_RUNS = (("A0p", {0: ("lone", "plain", 0)}), ("A1p", {1: ("lone", "plain", 1)}),
              ("Bp", {0: ("dp", "plain", 0), 1: ("dp", "plain", 1)}))
# the parts of one update, in the breakdown table's order
PARTS = (("fwd", "forward (pack, forward, loss)"), ("bwd", "backward"),
         ("book", "loss bookkeeping (item, activation meter, metrics)"),
         ("wait", "waiting for the other rank"), ("grad_ar", "gradient all-reduce (its own time)"),
         ("coll", "other collectives / barriers (own time)"), ("flat", "gradient flatten + copy back"),
         ("clip", "clip_grad_norm"), ("opt", "optimizer step"), ("other", "other (lr, zero_grad, metrics)"))


# ---- the batch (driver) ----

def build_batch(items: list[str]):
    """The default run's config (with `items` over it) and one scored step of its task from the
    shipped base: the kept samples in (group, sample) order, each one's generating device, and
    the model config."""
    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import find_base, load_base
    from rlfusion.rl.tasks import make_task
    from rlfusion.runtime import dataflow
    from rlfusion.runtime.advantage_stage import compute_advantages
    from rlfusion.runtime.reference_stage import ReferenceStage
    from rlfusion.runtime.reward_stage import RewardStage
    from rlfusion.runtime.rollout_stage import RolloutStage
    from rlfusion.runtime.train_config import TrainConfig
    from rlfusion.stalesync.rules import contiguous_parts

    cfg = load_config(TrainConfig, None, items)
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model, tokenizer, _ = load_base(find_base(), max_seq_len=cfg.context_len or None)
    task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
    trajs, home = [], {}
    # as a colocated step's two devices generate: contiguous parts of the groups, seed per device
    for device, groups in enumerate(contiguous_parts(list(range(cfg.rollout.prompts_per_step)), 2)):
        stage = RolloutStage(model, tokenizer, cfg.rollout, cfg.seed + 1000 * device)
        trajs += stage.generate([dataflow.group_problem(task, cfg.seed, g) for g in groups], groups, 0)
        home.update(dict.fromkeys(groups, device))
    reward = RewardStage(task.reward, tokenizer, cfg.algo, cfg.rollout.max_new_tokens, name=cfg.reward,
                         timeout_s=cfg.reward_timeout_s, reward_range=(cfg.reward_min, cfg.reward_max),
                         failure_limit=cfg.reward_failure_limit)
    reward.score(trajs)
    if cfg.algo.kl_coef:
        reference = ReferenceStage(copy.deepcopy(model), cfg.rollout.temperature, cfg.optim.microbatch_tokens)
        reference.logprobs(trajs)
    kept = compute_advantages(trajs, cfg.algo, cfg.rollout.group_size)
    kept.sort(key=lambda t: (t.group_id, t.sample))
    return cfg, kept, [home[t.group_id] for t in kept], model.config


def split_halves(cfg, model_config, kept, homes) -> dict[str, list[list]]:
    """The two ranks' rows as the advantage stage splits them ("run": `shard_rows` by tokens, or
    by cost with `optim.dp_balance=cost`, rows preferring their home rank where `shard_rows`
    takes `homes`) and by the same weights alone ("plain")."""
    from rlfusion.parallel.data_parallel import shard_rows
    from rlfusion.parallel.seq_balance import SeqCost

    cost = SeqCost.from_config(model_config) if cfg.optim.dp_balance == "cost" else None
    lengths = [t.num_tokens for t in kept]
    plain = shard_rows(lengths, 2, cost)
    run = shard_rows(lengths, 2, cost, homes) if "homes" in inspect.signature(shard_rows).parameters else plain
    return {name: [[kept[i] for i in part] for part in parts] for name, parts in (("run", run), ("plain", plain))}


# ---- the worker processes ----

class _Probe:
    """What one worker records inside an update: seconds per part, and the collectives in order
    as (label, entry, exit, process CPU seconds)."""

    def __init__(self):
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.colls: list[tuple[str, float, float, float]] = []

    def reset(self) -> None:
        self.seconds, self.colls = defaultdict(float), []

    def add(self, key: str, dt: float) -> None:
        if self.on:
            self.seconds[key] += dt


def _timed(probe: _Probe, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            probe.add(key, time.perf_counter() - start)
    return wrapper


def _install(probe: _Probe) -> None:
    """Wrap, in this process only, the calls the breakdown needs: the collectives (labelled by
    the function that calls them), backward, the gradient sum and the clip."""
    import torch.distributed as dist

    import rlfusion.runtime.actor as actor_mod

    def collective(fn):
        def wrapper(*args, **kwargs):
            label = f"{sys._getframe(1).f_code.co_name}.{fn.__name__}"
            cpu, start = time.process_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            if probe.on:
                probe.colls.append((label, start, time.perf_counter(), time.process_time() - cpu))
            return out
        return wrapper

    dist.all_reduce = collective(dist.all_reduce)
    dist.all_gather_object = collective(dist.all_gather_object)
    torch.autograd.backward = _timed(probe, "bwd", torch.autograd.backward)
    actor_mod.sum_over_replicas = _timed(probe, "sync", actor_mod.sum_over_replicas)
    actor_mod.clip_grad_norm = _timed(probe, "clip", actor_mod.clip_grad_norm)


class _Worker:
    """One device: the base model, a lone `ActorStage` and a data-parallel one over both ranks
    (as `Learner` builds it), this rank's half and the whole batch."""

    def __init__(self, rank: int, cfg, splits: dict[str, list[list]], full: list):
        import torch.distributed as dist

        from rlfusion.engine.runner import autocast
        from rlfusion.model.checkpoint import find_base, load_base
        from rlfusion.runtime.actor import ActorStage
        from rlfusion.runtime.role_context import COMPUTE_DTYPES

        self.rank, self.cfg, self.splits, self.full = rank, cfg, splits, full
        torch.manual_seed(cfg.seed)
        self.model, _, _ = load_base(find_base(), max_seq_len=cfg.context_len or None)
        self.autocast = lambda: autocast(torch.device("cpu"), COMPUTE_DTYPES[cfg.deploy.precision])
        self.weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        train_group = dist.new_group([0, 1])  # the Learner's train group (every train device)
        self.actors = {
            "lone": ActorStage(self.model, cfg.algo, cfg.optim, cfg.rollout.temperature, total_updates=cfg.max_steps),
            "dp": ActorStage(self.model, cfg.algo, cfg.optim, cfg.rollout.temperature, total_updates=cfg.max_steps,
                             dp_group=train_group)}
        self.probe = _Probe()
        _install(self.probe)
        self.meet = False  # D: the lone actor meets the other rank where B's ranks meet
        for actor in self.actors.values():
            self._wrap(actor)
        self.opt_state: dict[str, dict] = {}

    def _wrap(self, actor) -> None:
        import torch.distributed as dist

        probe = self.probe

        def barrier(label: str) -> None:
            cpu, start = time.process_time(), time.perf_counter()
            dist.barrier()
            if probe.on:
                probe.colls.append((label, start, time.perf_counter(), time.process_time() - cpu))

        counts, packed = actor._global_counts, actor._packed_backward

        def global_counts(*args, **kwargs):
            if self.meet:
                barrier("meet.before_step")
            return counts(*args, **kwargs)

        def packed_backward(*args, **kwargs):
            out = packed(*args, **kwargs)
            if self.meet:
                barrier("meet.after_backward")
            return out

        actor._global_counts = global_counts
        actor._packed_backward = _timed(probe, "fb", packed_backward)
        actor._micro_loss = _timed(probe, "fwd", actor._micro_loss)
        actor.optimizer.register_step_pre_hook(lambda *_: probe.add("opt", -time.perf_counter()))
        actor.optimizer.register_step_post_hook(lambda *_: probe.add("opt", time.perf_counter()))

    def _restore(self, name: str) -> None:
        """The same weights and (after the first update) optimizer state before every update."""
        actor = self.actors[name]
        self.model.load_state_dict(self.weights)
        saved = self.opt_state.get(name)
        if saved is not None:
            for p in list(actor.optimizer.state):
                if p not in saved:  # a parameter first trained after the snapshot: its state starts afresh
                    del actor.optimizer.state[p]
                    continue
                state = actor.optimizer.state[p]
                for k, v in saved[p].items():
                    if isinstance(v, torch.Tensor):
                        state[k].copy_(v)
                    else:
                        state[k] = v
        actor.version = VERSION

    def run(self, what: str, split: str, half: int | None) -> dict:
        """One update on `half` of `split` (None: the whole batch); `what`: lone (alone), indep /
        lockstep (both ranks at once, lock-step meeting at barriers) or dp (the data-parallel
        update). Seconds per part and the collectives."""
        import torch.distributed as dist

        name = "dp" if what == "dp" else "lone"
        actor, trajs = self.actors[name], self.full if half is None else self.splits[split][half]
        self._restore(name)
        self.meet = what == "lockstep"
        if what != "lone":
            dist.barrier()  # start together (untimed)
        probe = self.probe
        probe.reset()
        probe.on = True
        cpu, start = time.process_time(), time.perf_counter()
        with self.autocast():
            actor.update(trajs)
        end, cpu = time.perf_counter(), time.process_time() - cpu
        probe.on = self.meet = False
        if name not in self.opt_state:  # the state after the warm-up update, restored from now on
            self.opt_state[name] = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                        for k, v in st.items()} for p, st in actor.optimizer.state.items()}
        return {"start": start, "end": end, "cpu": cpu, "seconds": dict(probe.seconds), "colls": list(probe.colls),
                "tokens": sum(t.num_tokens for t in trajs), "rows": len(trajs)}


def _worker_main(rank: int, conn, cfg, splits: dict[str, list[list]], full: list) -> None:
    import torch.distributed as dist

    from rlfusion.runtime.heap import freeze_long_lived

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        conn.send(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", conn.recv(), 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    worker = _Worker(rank, cfg, splits, full)
    freeze_long_lived()  # as a device worker settles after its setup
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        conn.send(worker.run(*msg))
    dist.destroy_process_group()


# ---- the analysis (driver) ----

def breakdown(runs: dict[int, dict]) -> dict[int, dict[str, float]]:
    """Seconds of each part (`PARTS`) of one update per rank, the ranks' collectives aligned by
    order: a rank waits from its entry to the last entry, then the collective takes its own
    time to its exit."""
    out = {}
    colls = {r: x["colls"] for r, x in runs.items()}
    aligned = len(runs) == 2 and [c[0] for c in colls[0]] == [c[0] for c in colls[1]]
    for r, x in runs.items():
        s = x["seconds"]
        parts = dict.fromkeys((k for k, _ in PARTS), 0.0)
        parts["fwd"], parts["bwd"] = s.get("fwd", 0.0), s.get("bwd", 0.0)
        parts["book"] = s.get("fb", 0.0) - parts["fwd"] - parts["bwd"] - _meet_s(x["colls"], "after_backward")
        in_sync = coll_cpu = grad_cpu = 0.0
        for k, (label, entry, exit_, cpu) in enumerate(colls[r]):
            coll_cpu += cpu
            grad_cpu += cpu if label == "sum_over_replicas.all_reduce" else 0.0
            last = max(colls[q][k][1] for q in colls) if aligned else entry
            wait, own = max(0.0, last - entry), max(0.0, exit_ - max(last, entry))
            parts["wait"] += wait
            parts["grad_ar" if label == "sum_over_replicas.all_reduce" else "coll"] += own
            if label.startswith("sum_over_replicas."):
                in_sync += wait + own
        parts["flat"] = s.get("sync", 0.0) - in_sync
        parts["clip"], parts["opt"] = s.get("clip", 0.0), s.get("opt", 0.0)
        total = x["end"] - x["start"]
        parts["other"] = total - sum(v for k, v in parts.items() if k != "other")
        out[r] = {**parts, "total": total, "cpu": x["cpu"], "coll_cpu": coll_cpu, "grad_cpu": grad_cpu}
    return out


def _meet_s(colls, name: str) -> float:
    """Seconds inside D's barrier after the backward passes (it runs inside the timed loop)."""
    return sum(end - start for label, start, end, _ in colls if label == f"meet.{name}")


def _total(runs: dict[int, dict], rank: int) -> float:
    return runs[rank]["end"] - runs[rank]["start"]


def summarize(rounds: list[dict[str, dict[int, dict]]]) -> dict:
    """Per round: L (the mean of the two halves' lone times), and each run's per-device time
    (the mean over its ranks) over L; medians over rounds of those, of each speed (L / time) and
    of each part of each rank's update over L. The slower half's lone time over the mean comes
    from the median of the halves' ratio (a max per round would read noise as imbalance)."""
    per = []
    for rnd in rounds:
        bd = {name: breakdown(runs) for name, runs in rnd.items()}
        a0, a1 = bd["A0"][0]["total"], bd["A1"][1]["total"]
        L = (a0 + a1) / 2
        c0, c1 = bd["A0"][0]["cpu"], bd["A1"][1]["cpu"]
        mean = {m: statistics.mean(bd[m][r]["total"] for r in (0, 1)) for m in ("C", "D", "B", "Bp") if m in bd}
        cpu = {f"cpu_{m}": statistics.mean(bd[m][r]["cpu"] for r in (0, 1)) / ((c0 + c1) / 2) for m in mean}
        # the slower rank's CPU time: the pace of a lock-step update on an otherwise idle machine
        cpu.update({f"cpu_max_{m}": max(bd[m][r]["cpu"] for r in (0, 1)) / ((c0 + c1) / 2) for m in mean})
        row = {"L": L, "Lc": (c0 + c1) / 2, "A1/A0": a1 / a0, "cpu A1/A0": c1 / c0, **cpu,
               "E": bd["E"][0]["total"] / L, "cpu_E": bd["E"][0]["cpu"] / ((c0 + c1) / 2),
               **{m: v / L for m, v in mean.items()}, **{f"speed_{m}": L / v for m, v in mean.items()},
               "speed_sep": bd["E"][0]["total"] / 2 / mean["B"]}
        if "Bp" in bd:
            row["Lp"] = (bd["A0p"][0]["total"] + bd["A1p"][1]["total"]) / 2 / L
            row["A1p/A0p"] = bd["A1p"][1]["total"] / bd["A0p"][0]["total"]
            row["cpu A1p/A0p"] = bd["A1p"][1]["cpu"] / bd["A0p"][0]["cpu"]
            row["B-Bp"] = row["B"] - row["Bp"]
        per.append((row, bd))
    med = {k: statistics.median(row[k] for row, _ in per) for k in per[0][0]}
    for ratio, name in (("A1/A0", "slow"), ("A1p/A0p", "slow_p"), ("cpu A1/A0", "cpu_slow"),
                        ("cpu A1p/A0p", "cpu_slow_p")):
        if ratio in med:
            q = max(med[ratio], 1 / med[ratio])
            med[name] = 2 * q / (1 + q)  # the slower half's lone time over the two halves' mean
    columns = {"A0": ("A0", 0), "A1": ("A1", 1), **{f"{m}{r}": (m, r) for m in ("C", "D", "B", "Bp")
                                                     for r in (0, 1) if m in per[0][1]}}
    keys = (*dict(PARTS), "total", "cpu", "coll_cpu", "grad_cpu")
    # wall-clock parts over the round's L; CPU time over the round's lone CPU time
    parts = {c: {k: statistics.median(bd[m][r][k] / row["Lc" if "cpu" in k else "L"] for row, bd in per)
                 for k in keys} for c, (m, r) in columns.items()}
    return {"med": med, "parts": parts, "rounds": [row for row, _ in per]}


def split_line(name: str, halves: list[list]) -> str:
    tokens = [sum(t.num_tokens for t in h) for h in halves]
    squares = [sum(t.num_tokens ** 2 for t in h) for h in halves]
    return (f"{name}: rank 0 {len(halves[0])} rows, {tokens[0]} tokens; rank 1 {len(halves[1])} rows, {tokens[1]} "
            f"tokens (larger / mean: tokens {max(tokens) / statistics.mean(tokens):.3f}, sum of squared lengths "
            f"{max(squares) / statistics.mean(squares):.3f})")


def report(summary: dict, splits: dict[str, list[list]], note: str, rounds: int) -> None:
    med, parts = summary["med"], summary["parts"]
    L_ms = med["L"] * 1e3
    print(f"\nbatch: {sum(len(h) for h in splits['run'])} kept samples; {note}")
    print(split_line("the run's split", splits["run"]))
    if "Bp" in med:
        print(split_line("plain split (by the same weights alone)", splits["plain"]))
    Lc_ms = med["Lc"] * 1e3
    print(f"lone half-time L (median over rounds of the two halves' mean): {L_ms:.1f} ms wall, {Lc_ms:.1f} ms "
          f"process CPU; slower half / mean: wall {med['slow']:.3f}, CPU {med['cpu_slow']:.3f}"
          + (f" (plain split: wall {med['slow_p']:.3f}, CPU {med['cpu_slow_p']:.3f})" if "slow_p" in med else ""))
    print(f"\n## one update, per rank: median over {rounds} interleaved rounds, ms at the median L (each part's "
          f"median of part / L, times L)")
    cols = list(parts)
    names = {"A": "A lone", "C": "C indep.", "D": "D lock-step", "B": "B co-located", "Bp": "B plain split"}
    print("| part | " + " | ".join(f"{names[c[:-1]]} r{c[-1]}" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key, label in (*PARTS, ("total", "update, in all")):
        print(f"| {label} | " + " | ".join(f"{parts[c][key] * L_ms:.1f}" for c in cols) + " |")
    print("| process CPU time (at the median lone CPU time) | "
          + " | ".join(f"{parts[c]['cpu'] * Lc_ms:.1f}" for c in cols) + " |")
    print("| of which in collectives / barriers | "
          + " | ".join(f"{parts[c]['coll_cpu'] * Lc_ms:.1f}" for c in cols) + " |")
    print("| of which in the gradient all-reduce | "
          + " | ".join(f"{parts[c]['grad_cpu'] * Lc_ms:.1f}" for c in cols) + " |")
    speeds = ", ".join(f"{names[m]} {med[f'speed_{m}']:.2f}" for m in ("C", "D", "B", "Bp") if f"speed_{m}" in med)
    print(f"\nper-device speed relative to one device alone on its half (L / time; median of per-round ratios): "
          f"{speeds}")
    print("per round, B: " + ", ".join(f"{row['speed_B']:.2f}" for row in summary["rounds"]))
    print("process CPU time per update and device over the lone halves' (median; > 1: the same work cost more "
          "CPU, or waits spun): " + ", ".join(f"{names[m]} {med[f'cpu_{m}']:.3f}" for m in ("C", "D", "B", "Bp")
                                               if f"cpu_{m}" in med) + f", lone full batch / 2 {med['cpu_E'] / 2:.3f}")
    gap = med["B"] - 1
    imb = (med["cpu_slow"] - 1) * med["C"]  # from CPU times: the halves' cost, whatever the load
    pieces = [("machine", "contention of two busy processes (C - L)", med["C"] - 1),
              ("machine", "lock-step waits beyond the halves' imbalance (D - C - imbalance)",
               med["D"] - med["C"] - imb),
              ("project", "the split's imbalance ((slower half's lone CPU time / mean - 1) x C / L)", imb),
              ("project", "B's communication and syncs beyond meeting (B - D)", med["B"] - med["D"])]
    print(f"\ngap of B to a lone device: B / L = {med['B']:.3f} (per-device speed {1 / med['B']:.2f}); "
          f"the gap, {gap:+.3f} L, splits into:")
    for who, what, x in pieces:
        print(f"  {who}: {what}: {x:+.3f} L = {x * L_ms:+.1f} ms, {x / gap if gap else 0:.0%} of the gap")
    machine = sum(x for who, _, x in pieces if who == "machine")
    print(f"machine's part {machine / gap if gap else 0:.0%}, project's part {1 - machine / gap if gap else 0:.0%}")
    if "Bp" in med:
        print(f"measured directly: B - B with the plain split = {med['B-Bp']:+.3f} L ({med['B-Bp'] * L_ms:+.1f} ms, "
              f"{med['B-Bp'] / gap if gap else 0:.0%} of the gap); plain split's lone halves' mean / L "
              f"{med['Lp']:.3f}")
    b = {k: statistics.mean(parts[f"B{r}"][k] for r in (0, 1)) for k in dict(PARTS)}
    d = {k: statistics.mean(parts[f"D{r}"][k] for r in (0, 1)) for k in dict(PARTS)}
    print("B - D by part, per device (ms): " + ", ".join(f"{k} {(b[k] - d[k]) * L_ms:+.1f}" for k in dict(PARTS)))
    print(f"B per device (ms): waiting {b['wait'] * L_ms:.1f}, gradient all-reduce {b['grad_ar'] * L_ms:.1f}, "
          f"flatten + copy {b['flat'] * L_ms:.1f}, other collectives {b['coll'] * L_ms:.1f}, optimizer "
          f"{b['opt'] * L_ms:.1f}, clip {b['clip'] * L_ms:.1f}")
    # the same in process CPU time, which other load barely moves: with each process on an idle
    # core, a lock-step update runs at its slower rank's CPU time (gloo's waits do not spin)
    dm, bm, bc = med["cpu_D"], med["cpu_B"], med["cpu_max_B"]
    cgap = bc - 1
    print(f"\nCPU-time view (other load barely moves it; with an idle core per process a lock-step update runs at "
          f"its slower rank's CPU time): slower rank of B / lone halves' mean CPU = {bc:.3f} (speed {1 / bc:.2f} on "
          f"an idle machine); the gap, {cgap:+.3f}, splits into:")
    for who, what, x in (("machine", "the same work with both processes busy (caches, memory bus: D's mean; "
                                     f"C's {med['cpu_C'] - 1:+.3f})", dm - 1),
                         ("project", "B's communication, flatten and syncs (B's mean over D's)", bm - dm),
                         ("project", "the split's imbalance (B's slower rank over B's mean)", bc - bm)):
        print(f"  {who}: {what}: {x:+.3f} = {x * Lc_ms:+.1f} ms CPU, {x / cgap if cgap else 0:.0%} of the gap")
    if "cpu_max_Bp" in med:
        print(f"  with the plain split: slower rank of B / lone mean CPU = {med['cpu_max_Bp']:.3f} "
              f"(speed {1 / med['cpu_max_Bp']:.2f} on an idle machine)")
    print(f"\ndata parallelism's repeated work: lone full batch / (2 L) = {med['E'] / 2:.2f} (1.00: nothing fixed per "
          f"update); per-device speed of B against the separated train device ((full / 2) / B, bench/fusion.py's "
          f"train figure): {med['speed_sep']:.2f}")
    print(f"\ncolocated update speed, independent (C): {med['speed_C']:.2f}; lock-step (D): {med['speed_D']:.2f}")
    print(f"target colocated_update_speed_vs_lone: {med['speed_B']:.2f} (goal >= 0.84)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    rounds = 1 if args.smoke else 6 if args.quick else 21
    cfg, kept, homes, model_config = build_batch(SMOKE_ROLLOUT if args.smoke else [])
    splits = split_halves(cfg, model_config, kept, homes)
    differ = [[id(t) for t in h] for h in splits["run"]] != [[id(t) for t in h] for h in splits["plain"]]
    runs = RUNS + (PLAIN_RUNS if differ else ())
    note = (f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples, split by "
            f"{cfg.optim.dp_balance}" + (", rows preferring the rank whose device generated them" if differ else ""))
    print(f"{len(kept)} samples kept of {cfg.rollout.prompts_per_step} x {cfg.rollout.group_size}; {rounds} rounds "
          f"of {len(runs)} runs", flush=True)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # the children's, from the start
    procs = [ctx.Process(target=_worker_main, args=(r, child, cfg, splits, kept), daemon=True)
             for r, (_, child) in enumerate(pipes)]
    try:
        for proc in procs:
            proc.start()
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    conns = [parent for parent, _ in pipes]
    rows = []
    try:
        conns[1].send(conns[0].recv())  # rank 0's store port
        for conn in conns:
            if conn.recv() != "ready":
                raise RuntimeError("a worker failed to start")

        def run(plan: dict[int, tuple]) -> dict[int, dict]:
            for r, msg in plan.items():
                conns[r].send(msg)
            return {r: conns[r].recv() for r in plan}

        for _, plan in runs:  # warm-up: every kind of update once
            run(plan)
        for i in range(rounds):
            order = runs[i % len(runs):] + runs[:i % len(runs)]  # interleaved, the order rotating
            rows.append({name: run(plan) for name, plan in order})
            x = rows[-1]
            a = (_total(x["A0"], 0), _total(x["A1"], 1))
            L = sum(a) / 2
            speeds = ", ".join(f"{m} {L / statistics.mean(_total(x[m], r) for r in (0, 1)):.2f}"
                               for m in ("C", "D", "B", "Bp") if m in x)
            print(f"round {i + 1}: lone halves {a[0] * 1e3:.0f} / {a[1] * 1e3:.0f} ms; speed {speeds}", flush=True)
        for conn in conns:
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    report(summarize(rows), splits, note, rounds)


if __name__ == "__main__":
    main()
