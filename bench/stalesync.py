"""StaleSync vs synchronous RL on 2 devices: a feature ladder of tokens/s, generation share, tail
amplification, decode occupancy, utilization and staleness (and, on the built-in task, held-out
accuracy after the same number of updates).

The default workload is the replay workload of `configs/replay.toml` (`--workload replay`): 8
prompts x 8 samples per update, every response forced to a length drawn per prompt group and
sample from a capped log-normal (median 150 tokens, cap 1,000, ~9% at the cap, 90% of the
variance between prompts), no KL term — a generation-dominated reasoning-shaped step whose cost
does not depend on what the policy learns, so it reports no accuracy. `--workload task` runs the
built-in arithmetic task at the default batch (32 x 8; natural lengths, median ~24 tokens) and
evaluates every variant greedily on the same held-out problems after `--updates` updates.
`--workload learn` runs `configs/learn.toml` — the long-reasoning variant of the task (3-20
terms, median response ~67 tokens, p99 ~215) from its shipped base `tiny-long` — at the default
batch, synchronous co-located against StaleSync s=1 co-located, with held-out accuracy.

Every variant starts from the shipped base on its own 2 Ray device workers (1 thread each). One
update of each variant runs in turn (interleaved, never concurrently), so all variants share the
machine's load. The updates after the first two are timed (the separated pipeline fills in its
first step, StaleSync's pool in its first two). Over a short run StaleSync's pool of groups in
flight fills and drains, so the tokens it generates and the tokens its updates train differ
(s=4 generated 1.38x what it trained in 8 timed updates): generated tokens/s overstates the
long-run rate while the pool fills (the training of what it generated is not yet paid), trained
tokens/s understates it. Tokens/s, the figure the targets compare, holds the pool level: the
timed updates' rollout device-seconds per generated token plus their other busy device-seconds
(reference, reward, update, switch, transfers) per trained token, at the run's busy
device-seconds per wall second; for a synchronous run it is generated tokens / step time.
Generated and trained tokens/s are printed beside it.
Per row: the generation share of device time (rollout device-seconds / busy device-seconds of
the step), the tail amplification (rollout wall time / the time its tokens would take with every
decode pass full at the step's mean pass cost, plus prefill), mean decode-batch occupancy and
response length (medians over the timed updates), and device utilization.

The ladder (`--variants` picks a subset, `--add` adds one):
  sync colocated → stalesync s=0 colocated (the StaleSync machinery, synchronous schedule) →
  s=1 no partial (up to 2 x the batch in flight, every rollout runs its due groups to the end) →
  s=1 (+ partial rollout: an update goes ahead once 3/4 of its groups finished, the rest resume
  under the next weights) → s=2 → s=1 separated (one device generates, one trains, overlapped) and
  sync separated → s=1 hybrid (as separated, but the train device joins each rollout once its
  update is done, with the new weights; `deploy.mode=hybrid`), s=2 hybrid (with partial
  rollout) and s=4 hybrid (the best configuration `bench/simulator.py`'s simulated reach finds on
  the replay workload, ~1.4x). Hybrid's train device switches between training and generation as co-located ones
  do (RL Fusion's switch), so it counts as keeping co-location in the second target.

Held-out accuracy after 30 updates moves by several points with the seed alone (two synchronous
runs of the same algorithm that differ only in their random streams have differed by 3.8
points), so the whole interleaved run repeats for `--seeds` seeds and the accuracy gap is taken
between the variants' mean accuracies; every seed's accuracy is printed. Tokens/s pools all seeds.

The run ends with a ceiling: the most tokens/s *any* schedule of the synchronous work could
reach on these 2 devices, a work-conserving bound. Its non-generation work — reference, reward,
update — stays (StaleSync trains the same samples with the same models), at the least
device-seconds per generated token either synchronous variant measured (separated: single
devices, mostly one at a time, no data-parallel all-reduce; switches and weight transfers left
out); every generated token is decoded at the engine's best per-token cost over batch sizes up
to 4x the engine's slots (single process, short contexts) plus the cache reads of its own
context (the workload's mean context per generated token — a decode pass reads every row's
cached keys and values, which no batching shares — at the measured cost per position) and every
sample's prompt
is prefilled once at the engine's best packed-prefill cost (this engine prefills each sample of
a group on its own; prefix sharing would cut that for synchronous and StaleSync alike); the two
devices never idle, each at the speed two independent busy processes keep here (the
contention probe's most favourable: its whole workload's or one part's, decode, long-context
reads or update). StaleSync can only move work in time and fill decode
batches, so its tokens/s cannot exceed this. Floor and speed are measured before and after every
seed; each seed's ceiling pairs their means with that seed's own synchronous runs (the
conditions the baseline ran in), and the run also prints the loosest form: every seed's runs
with the most favourable floor and speed of any measurement, the largest.

    python bench/stalesync.py            # replay workload, 3 seeds x 12 updates per variant (~50 min)
    python bench/stalesync.py --quick    # 1 seed, 5 updates
    python bench/stalesync.py --smoke    # sync and s=1 co-located, 1 seed, 4 updates of 2 prompts x 2 samples
                                         # (a test runs it; Gantt charts to a temporary folder)
    python bench/stalesync.py --workload task   # the built-in task, 3 seeds x 30 updates, 500 held-out problems
    python bench/stalesync.py --seeds 1 --seed 1 --variants "sync colocated,stalesync s=1 colocated"
    python bench/stalesync.py --workload task --prompts 8  # every variant at 8 prompts per update
    python bench/stalesync.py --seeds 1 --updates 14 --variants "sync colocated,stalesync s=1 separated" \
        --add "s1 sep 256=separated|stalesync.enabled=true|stalesync.max_staleness=1|rollout.max_num_seqs=256"
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import tempfile
from pathlib import Path

import ray

from rlfusion.model.checkpoint import resolve_base
from rlfusion.config import load_config
from rlfusion.obs.timeline import plot_gantt
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer
from rlfusion.measure.calibrate import default_setup
from rlfusion.measure.contention import measure_contention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import DEVICES, REPLAY, step_row  # noqa: E402  (bench/workload.py: the replay config, a step's figures)

THRESHOLD = 0.75  # partial rollout: an update goes ahead once 3/4 of its prompt groups finished

_PARTIAL = f"stalesync.rollout_finish_threshold={THRESHOLD}"
VARIANTS = {  # name: (deploy.mode, stalesync overrides), in ladder order
    "sync colocated": ("colocated", []),
    "stalesync s=0 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=0"]),
    "stalesync s=1 colocated no partial": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=1"]),
    "stalesync s=1 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=1", _PARTIAL]),
    "stalesync s=2 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=2", _PARTIAL]),
    "stalesync s=2 colocated recompute": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=2", _PARTIAL,
                                                        "stalesync.resume_kv=\"recompute\""]),
    "stalesync s=3 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=3", _PARTIAL]),
    "stalesync s=4 colocated": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=4", _PARTIAL]),
    # the simulator's best threshold for s=4 co-located on the replay workload (bench/simulator.py's reach)
    "stalesync s=4 colocated threshold 0.25": ("colocated", ["stalesync.enabled=true", "stalesync.max_staleness=4",
                                                             "stalesync.rollout_finish_threshold=0.25"]),
    "sync separated": ("separated", []),
    "stalesync s=1 separated": ("separated", ["stalesync.enabled=true", "stalesync.max_staleness=1"]),
    "stalesync s=2 separated": ("separated", ["stalesync.enabled=true", "stalesync.max_staleness=2", _PARTIAL]),
    "stalesync s=1 hybrid": ("hybrid", ["stalesync.enabled=true", "stalesync.max_staleness=1"]),
    "stalesync s=2 hybrid": ("hybrid", ["stalesync.enabled=true", "stalesync.max_staleness=2", _PARTIAL]),
    "stalesync s=3 hybrid": ("hybrid", ["stalesync.enabled=true", "stalesync.max_staleness=3", _PARTIAL]),
    "stalesync s=4 hybrid": ("hybrid", ["stalesync.enabled=true", "stalesync.max_staleness=4", _PARTIAL]),
}
CO_LOCATED = ("colocated", "hybrid")  # modes whose train devices also generate (RL Fusion's switch)
BASELINE = "sync colocated"
LEARN = Path(__file__).resolve().parents[1] / "configs" / "learn.toml"
WORKLOADS = {"replay": REPLAY, "task": None, "learn": LEARN}  # --workload: its config file (None: the defaults)
LADDER = {  # the variants each workload runs by default
    "replay": [n for n in VARIANTS if n not in ("stalesync s=2 separated", "stalesync s=1 hybrid", "stalesync s=3 colocated",
                                                "stalesync s=3 hybrid")],
    "task": [n for n in VARIANTS if n not in ("stalesync s=0 colocated", "stalesync s=1 colocated no partial",
                                              "stalesync s=2 colocated recompute", "stalesync s=3 colocated",
                                              "stalesync s=4 colocated", "stalesync s=4 colocated threshold 0.25",
                                              "stalesync s=3 hybrid", "stalesync s=4 hybrid")],
    "learn": ["sync colocated", "stalesync s=1 colocated"],
}
WORKLOAD = {"file": REPLAY}  # set by --workload


FIXED = ["deploy.backend=ray", "deploy.num_devices=2", "deploy.threads_per_device=1"]  # every variant
# --smoke: a synchronous and a co-located StaleSync variant (every branch of the report; each
# variant starts 2 Ray workers, ~3 s each on 2 cores) at the smallest step: 1 prompt group per
# device, 2 engine slots (the floors decode 1-8 rows), the replay lengths' median below the cap;
# responses this short rarely score, so dynamic sampling would drop every group and the update
SMOKE_VARIANTS = ["sync colocated", "stalesync s=1 colocated"]
SMOKE_ROLLOUT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
                 "rollout.max_num_seqs=2", "rollout.replay_median=4", "algo.dynamic_sampling=false"]


def run_config() -> TrainConfig:
    """The settings every variant shares: the workload's file with `FIXED` over it."""
    return load_config(TrainConfig, WORKLOAD["file"], FIXED)


def rollout_config():
    """The rollout settings every variant shares."""
    return run_config().rollout


def make_trainer(name: str, out: Path, eval_problems: int, updates: int, seed: int,
                 config: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RLTrainer:
    """Variant `name` over the workload of `config` (a run config file; None: the built-in task);
    `overrides`: config items over the variant's (e.g. sizes)."""
    mode, extra = VARIANTS[name]
    cfg = load_config(TrainConfig, config, [f"seed={seed}", f"deploy.mode={mode}", *FIXED,
        f"out_dir=\"{out}\"", f"eval_problems={eval_problems}", f"max_steps={updates}", *extra, *overrides])
    return RLTrainer(cfg, out / _folder(name), resolve_base(cfg.base))


FLOOR_NEW_TOKENS = 24  # tokens each row of the floor's runs generates


def engine_floors(max_num_seqs: int, context_len: int | None) -> dict[str, float]:
    """The engine's lowest costs on the default task's prompts (the shipped base, 1 thread,
    `FLOOR_NEW_TOKENS` new tokens per row, no stop): decode per generated token over batch sizes
    of 1/2 to 4x `max_num_seqs` rows (median step after the prefill steps), and packed prefill
    per prompt token (the first step of the runs whose prompts fit one step). Also the prompts'
    mean length, the mean context of the floor's decoded tokens, and what each further position
    of context adds to a row's decode (`decode_context_ms` at `max_num_seqs` rows, the model
    built at `context_len` positions): a token decoded at a longer context reads more cache."""
    import torch

    from rlfusion.engine.engine import EngineConfig
    from rlfusion.model.checkpoint import load_base
    from rlfusion.measure.calibrate import decode_context_ms, engine_step_times, task_prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer, _ = load_base(resolve_base(run_config().base), max_seq_len=context_len)
        model.eval()
        decode, prefill, lengths = (float("inf"), 0), float("inf"), []
        for rows in (max_num_seqs // 2, max_num_seqs, 2 * max_num_seqs, 4 * max_num_seqs):
            prompts = task_prompts(tokenizer, rows, seed=rows)
            lengths += [len(p) for p in prompts]
            times = engine_step_times(model, prompts, FLOOR_NEW_TOKENS, max_num_seqs=rows)
            decode = min(decode, (statistics.median(times[2:]) / rows, rows))
            tokens = sum(len(p) for p in prompts)
            if tokens <= EngineConfig().max_num_batched_tokens:  # all prefilled in the first step
                prefill = min(prefill, times[0] / tokens)
        floor_context = statistics.mean(lengths) + FLOOR_NEW_TOKENS / 2
        per_position = decode_context_ms(model, round(floor_context), quick=True, rows=max_num_seqs) / 1e3
    finally:
        torch.set_num_threads(threads)
    return {"decode_s_per_token": decode[0], "decode_rows": decode[1], "prefill_s_per_token": prefill,
            "prompt_tokens": statistics.mean(lengths), "floor_context": floor_context,
            "context_s_per_position": per_position}


def mean_context(rollout, prompt_tokens: float, mean_length: float) -> float:
    """The mean context a generated token of the workload is decoded at: a response of L tokens
    after a p-token prompt decodes at p, p + 1, ..., p + L - 1. The replay workload's lengths are
    drawn as its runs draw them; otherwise its measured mean length gives a lower bound (every
    response at the mean), which keeps the ceiling an upper bound."""
    if rollout.lengths == "replay":
        return prompt_tokens + _replay_context(rollout.replay_median, rollout.replay_sigma, rollout.replay_between,
                                               rollout.max_new_tokens, rollout.group_size)
    n = max(1, round(mean_length))
    return prompt_tokens + (n - 1) / 2


@functools.cache
def _replay_context(median: float, sigma: float, between: float, cap: int, group_size: int) -> float:
    """Mean position within its response of a replayed token, over 2,000 groups' drawn lengths."""
    from rlfusion.rl.replay import replay_length

    lengths = [replay_length(g, i, median, sigma, between, cap) for g in range(2000) for i in range(group_size)]
    return sum(n * (n - 1) / 2 for n in lengths) / sum(lengths)


def ceiling(work_s_per_token: float, floors: dict[str, float], prompts_per_token: float,
            context: float, devices: int, speed: float) -> float:
    """Tokens/s no schedule can beat on `devices` devices that each run at `speed` (relative to
    one busy process alone) with no idle time: every generated token costs its decoding at the
    floor plus the cache reads of its longer context (the workload's mean `context` beyond the
    floor's), its share of prompt prefill (`prompts_per_token` prompt tokens, each prefilled
    once) and `work_s_per_token` of the rest of the step (device-seconds)."""
    per_token = (work_s_per_token + floors["decode_s_per_token"]
                 + max(0.0, context - floors["floor_context"]) * floors["context_s_per_position"]
                 + prompts_per_token * floors["prefill_s_per_token"])
    return devices * speed / per_token


def trained_tokens_per_s(updates: list[dict]) -> float:
    """Response tokens the updates trained on / step time: in a short run StaleSync's pool fills
    (generation ahead of training) and drains, so generated and trained tokens differ; in the
    long run they are equal."""
    return sum(m["response_tokens"] for m in updates) / sum(m["time_step_s"] for m in updates)


def steady_tokens_per_s(updates: list[dict], spans: list) -> float:
    """Tokens/s with the pool of groups in flight held level: what the timed updates' devices
    spend per generated token on rollout (rollout device-seconds / generated tokens) plus per
    trained token on everything else (the other busy device-seconds / trained tokens), at the
    busy device-seconds per wall second the run had. A pool that fills during the run (more
    generated than trained) has not yet paid to train what it generated; generated tokens/s then
    overstates the long-run rate, trained tokens/s understates it while the pool drains. For a
    synchronous run (generated = trained) it is generated tokens/s."""
    generated = sum(m["generated_tokens"] for m in updates)
    trained = sum(m["response_tokens"] for m in updates)
    wall = sum(m["time_step_s"] for m in updates)
    device = [sp for sp in spans if sp.device in DEVICES]
    rollout = sum(sp.duration_s for sp in device if sp.phase == "rollout")
    rest = sum(sp.duration_s for sp in device if sp.phase not in ("rollout", "idle"))
    if not generated or not trained or not wall:
        return 0.0
    return (rollout + rest) / wall / (rollout / generated + rest / trained)


def tokens_per_s(updates: list[dict]) -> float:
    """Generated tokens / step time, summed over `updates` (a StaleSync step's tokens vary a lot,
    so a per-step median would say little)."""
    return sum(m["generated_tokens"] for m in updates) / sum(m["time_step_s"] for m in updates)


def non_generation_s_per_token(timed: list[dict], spans: list) -> float:
    """Device-seconds of reference, reward and update (and critic) per generated token of the
    timed updates; generation, idle time, layout switches and weight transfers left out."""
    work = sum(sp.duration_s for sp in spans if sp.phase not in ("rollout", "idle", "switch", "transfer"))
    return work / sum(m["generated_tokens"] for m in timed)


def measure_conditions(smoke: bool = False) -> tuple[dict, float]:
    """The engine floors and the concurrent speed of two busy processes, measured now (`smoke`:
    the probe's workload once)."""
    cfg = run_config()
    floors = engine_floors(cfg.rollout.max_num_seqs, cfg.context_len or None)
    # the most favourable speed the probe measured (its parts: decode, long-context reads, update,
    # and the whole): a ceiling must hold for any mix of work
    probe = measure_contention(default_setup(threads=1, smoke=smoke))
    speed = max(probe[k] for k in ("concurrent_speed", "decode_speed", "context_speed", "train_speed"))
    print(f"engine floors: decode {floors['decode_s_per_token'] * 1e6:.1f} us per token (at "
          f"{floors['decode_rows']} rows), prefill {floors['prefill_s_per_token'] * 1e6:.1f} us per "
          f"prompt token; concurrent speed of two busy processes {speed:.2f}", flush=True)
    return floors, speed


def ceiling_of(timed: dict[str, list[dict]], spans: dict[str, list], floor: dict, speed: float) -> dict:
    """The ceiling for synchronous runs `timed` / `spans` (variant → timed updates / device
    spans) under engine `floor` and concurrent `speed`: tokens/s and its ratio to the baseline."""
    work = {n: non_generation_s_per_token(timed[n], spans[n]) for n in spans}
    least = min(work, key=work.get)
    rollout = rollout_config()
    samples = rollout.prompts_per_step * rollout.group_size
    base = timed[BASELINE]
    prompts_per_token = samples * floor["prompt_tokens"] / statistics.mean(m["generated_tokens"] for m in base)
    context = mean_context(rollout, floor["prompt_tokens"], statistics.mean(m["response_length_mean"] for m in base))
    top = ceiling(work[least], floor, prompts_per_token, context, 2, speed)
    return {"tok_s": top, "ratio": top / tokens_per_s(base), "work": work, "least": least,
            "prompts_per_token": prompts_per_token, "context": context, "floor": floor, "speed": speed}


def print_ceilings(per_seed: list[dict], conditions: list[list[tuple[dict, float]]]) -> None:
    """Each seed's ceiling (floor and speed: the means of its before/after measurements, against
    its own synchronous runs), their median, and the loosest form: the most favourable floor and
    speed of any measurement, with each seed's runs, the largest."""
    ratios, loosest = [], []
    every = [m for measured in conditions for m in measured]
    best = {**min((f for f, _ in every), key=lambda f: f["decode_s_per_token"]),
            "prefill_s_per_token": min(f["prefill_s_per_token"] for f, _ in every),
            "context_s_per_position": min(f["context_s_per_position"] for f, _ in every)}
    for run, measured in zip(per_seed, conditions):
        floor = {k: statistics.mean(f[k] for f, _ in measured)
                 for k in ("decode_s_per_token", "prefill_s_per_token", "prompt_tokens", "floor_context",
                           "context_s_per_position")}
        floor["decode_rows"] = "/".join(str(f["decode_rows"]) for f, _ in measured)
        c = ceiling_of(run["timed"], run["spans"], floor, statistics.mean(sp for _, sp in measured))
        ratios.append(c["ratio"])
        loosest.append(ceiling_of(run["timed"], run["spans"], best, max(sp for _, sp in every))["ratio"])
        print(f"\nseed {run['seed']}: ceiling {c['tok_s']:.0f} tokens/s = {c['ratio']:.2f}x its sync colocated (per "
              f"generated token: reference, reward and training {c['work'][c['least']] * 1e6:.0f} us as {c['least']} "
              f"measured them ({', '.join(f'{n} {w * 1e6:.0f}' for n, w in c['work'].items())}); decoding "
              f"{floor['decode_s_per_token'] * 1e6:.1f} us (rows {floor['decode_rows']}, context "
              f"{floor['floor_context']:.0f}) + {floor['context_s_per_position'] * 1e9:.0f} ns per position of "
              f"the workload's mean context {c['context']:.0f} beyond it; prompt prefill "
              f"{c['prompts_per_token']:.2f} tokens x {floor['prefill_s_per_token'] * 1e6:.1f} us; 2 devices never "
              f"idle, each at {c['speed']:.2f})")
    print(f"\nceiling of any schedule of this work on 2 devices: median of the seeds "
          f"{statistics.median(ratios):.2f}x sync colocated (seeds: {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"loosest form {max(loosest):.2f}x (every seed at the best floor of any measurement, decoding "
          f"{best['decode_s_per_token'] * 1e6:.1f} us, prefill {best['prefill_s_per_token'] * 1e6:.1f} us, and the "
          f"best speed, {max(sp for _, sp in every):.2f})")


# the StaleSync variant of each placement whose controller traffic `stalesync_driver_bytes_share` sums
DRIVER_BYTES_VARIANTS = ("stalesync s=2 colocated", "stalesync s=1 separated", "stalesync s=2 hybrid")


def _driver_share(updates: list[dict]) -> float:
    """Bytes across the controller over those plus the bytes through the queue, summed."""
    driver = sum(m.get("driver_bytes", 0.0) for m in updates)
    moved = driver + sum(m.get("queue_bytes", 0.0) for m in updates)
    return driver / moved if moved else 0.0


def is_stalesync(name: str) -> bool:
    """Whether the variant runs StaleSync (`stalesync.enabled=true`), else it is synchronous."""
    return "stalesync.enabled=true" in VARIANTS[name][1]


def bound(name: str) -> int:
    """The variant's `stalesync.max_staleness` (its override, else the default)."""
    from rlfusion.stalesync.rules import StaleSyncConfig

    given = [o.split("=", 1)[1] for o in VARIANTS[name][1] if o.startswith("stalesync.max_staleness=")]
    return int(given[-1]) if given else StaleSyncConfig().max_staleness


def add_variant(spec: str) -> str:
    """Register `--add NAME=MODE|KEY=VALUE|...` in VARIANTS; returns NAME. The variant is
    StaleSync if its overrides set `stalesync.enabled=true`, else synchronous (then its work
    counts for the ceiling)."""
    head, *overrides = spec.split("|")
    name, _, mode = (part.strip() for part in head.rpartition("="))
    modes = ("colocated", "separated", "fully_shared")
    checks = [(not name, "no NAME before '=MODE'"),
              (mode not in modes, f"MODE {mode!r} is not one of {', '.join(modes)}"),
              ("/" in name, "NAME may not contain '/'"),
              (name in VARIANTS, f"NAME {name!r} is taken"),
              (_folder(name) in {_folder(n) for n in VARIANTS}, f"NAME {name!r} maps to another variant's folder"),
              *((not o.partition("=")[0].strip() or "=" not in o, f"override {o!r} is not KEY=VALUE")
                for o in overrides)]
    why = next((message for failed, message in checks if failed), None)
    if why is None:
        try:  # a bad key or value fails now, not after Ray and the first probes started
            load_config(TrainConfig, WORKLOAD["file"], [f"deploy.mode={mode}", *FIXED, *overrides])
        except (ValueError, KeyError, TypeError) as e:
            why = f"invalid overrides: {e}"
    if why is not None:
        raise SystemExit(f"--add {spec!r}: {why} (expected NAME=MODE|KEY=VALUE|...)")
    VARIANTS[name] = (mode, overrides)
    return name


def _folder(name: str) -> str:
    """A variant's name in file and folder names (its run folder, its Gantt PNG)."""
    return name.replace(" ", "_").replace("=", "")


def row_figures(rows: list[dict]) -> dict[str, float]:
    """Medians over a variant's timed updates of `workload.step_row`'s figures: generation share,
    tail amplification, occupancy, length. An update that decoded nothing (StaleSync: the pool
    already held its groups) has no amplification and is left out of that median."""
    def median(key: str) -> float:
        values = [r[key] for r in rows if not math.isnan(r[key])]
        return statistics.median(values) if values else float("nan")
    return {k: median(k) for k in ("share", "amplification", "occupancy", "length_mean")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    parser.add_argument("--workload", default="replay", choices=list(WORKLOADS),
                        help="replay (configs/replay.toml, the default), task (the built-in task, with "
                             "accuracy) or learn (configs/learn.toml: the long-reasoning task, with accuracy)")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=None, help="seeds to run (default 3; --quick 1)")
    parser.add_argument("--gantt", default="", help="folder for one Gantt PNG per variant (its last update); "
                                                   "default: docs/img for the full default run")
    parser.add_argument("--variants", default="", help="comma-separated subset of: " + ", ".join(VARIANTS))
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per update for every variant (default: the workload's)")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=MODE|KEY=VALUE|...",
                        help="an extra variant (run after the listed ones): deploy.mode MODE with these config "
                             "overrides, e.g. 'sep 256=separated|stalesync.enabled=true|rollout.max_num_seqs=256'")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    WORKLOAD["file"] = WORKLOADS[args.workload]
    accuracy = args.workload != "replay"  # the replay workload forces lengths: its accuracy means nothing
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
        FIXED.extend(SMOKE_ROLLOUT)
        args.variants = args.variants or ",".join(SMOKE_VARIANTS)
        if not args.gantt:  # the charts too, where they overwrite nothing (removed at exit)
            plots = tempfile.TemporaryDirectory(prefix="stalesync-smoke-")
            args.gantt = plots.name
    if args.prompts is not None:
        if args.prompts < 1:
            raise SystemExit(f"--prompts={args.prompts}: must be >= 1")
        FIXED.append(f"rollout.prompts_per_step={args.prompts}")
    added = [add_variant(spec) for spec in args.add]
    # replay: 12 updates, so the 10 timed ones hold whole cycles of s=1 and s=4 (a bound of s runs the tail
    # out every s+1 updates)
    updates = args.updates or (4 if args.smoke else (8 if args.quick else 30) if accuracy
                               else (5 if args.quick else 12))
    seeds = list(range(args.seed, args.seed + (args.seeds or (1 if args.quick or args.smoke else 3))))
    eval_problems = 4 if args.smoke else 100 if args.quick else 500
    names = [n.strip() for n in args.variants.split(",") if n.strip()] or list(LADDER[args.workload])
    names += [n for n in added if n not in names]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or BASELINE not in names:
        raise SystemExit(f"--variants: unknown {unknown} or missing {BASELINE!r}; allowed: {', '.join(VARIANTS)}")
    if updates < 4 or not seeds:
        raise SystemExit(f"--updates={updates} --seeds={len(seeds)}: need >= 4 updates (the first two are not "
                         "timed) and >= 1 seed")
    # 2 CPUs per variant, and 2 for the contention probe that runs beside a seed's (idle) trainers
    ray.init(address="local", num_cpus=2 * len(names) + 2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    sync_names = [n for n in names if not is_stalesync(n)]
    sync_spans: dict[str, list] = {n: [] for n in sync_names}  # their timed updates' device spans
    timed_spans: dict[str, list] = {n: [] for n in names}  # every variant's, for its steady tokens/s
    seed_conditions: list[list[tuple[dict, float]]] = []  # per seed: (floors, speed) before and after
    timed: dict[str, list[dict]] = {n: [] for n in names}  # timed updates, every seed
    every: dict[str, list[dict]] = {n: [] for n in names}  # all updates, every seed
    figures: dict[str, list[dict]] = {n: [] for n in names}  # timed updates' step_row figures
    accs: dict[str, list[float]] = {n: [] for n in names}
    per_seed: list[dict] = []  # each seed's timed updates and synchronous spans, for its ceiling
    for seed in seeds:
        seed_conditions.append([measure_conditions(args.smoke)])
        seed_timed, seed_spans = {n: len(timed[n]) for n in names}, {n: len(sync_spans[n]) for n in sync_names}
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {n: make_trainer(n, Path(tmp), eval_problems, updates, seed, WORKLOAD["file"])
                        for n in names}
            if accuracy:
                base_acc = trainers[BASELINE].evaluate().accuracy
                print(f"seed {seed}: base held-out accuracy ({eval_problems} problems): {base_acc:.1%}", flush=True)
            for u in range(updates):
                for n in names:
                    start = len(trainers[n].timeline.spans)
                    m = trainers[n].train_step()
                    every[n].append(m)
                    if u >= 2:
                        timed[n].append(m)
                        figures[n].append(step_row(trainers[n], m, trainers[n].timeline.spans[start:]))
                print(f"seed {seed} update {u + 1}: " + ", ".join(
                    f"{n} {every[n][-1]['generated_tokens'] / every[n][-1]['time_step_s']:.0f}" for n in names)
                      + " tok/s", flush=True)
            for n in names:
                timed_spans[n] += [sp for sp in trainers[n].timeline.spans if (sp.step or 0) >= 2]
            for n in sync_names:
                sync_spans[n] += [sp for sp in trainers[n].timeline.spans if (sp.step or 0) >= 2]
            for n in names:
                if accuracy:
                    accs[n].append(trainers[n].evaluate().accuracy)
                ad_hoc = args.variants or args.add or args.quick or args.smoke or args.seed or args.prompts or accuracy
                gantt = args.gantt or ("" if ad_hoc else "docs/img")
                if gantt and seed == seeds[-1]:
                    png = Path(gantt) / f"stalesync_{_folder(n)}.png"
                    last = [sp for sp in trainers[n].timeline.spans if sp.step == updates - 1]  # one whole step
                    plot_gantt(last, png, title=f"{n}: device timeline of update {updates}")
            seed_conditions[-1].append(measure_conditions(args.smoke))  # the seed's idle workers still alive
            for t in trainers.values():
                t.close()
        per_seed.append({"seed": seed, "timed": {n: timed[n][seed_timed[n]:] for n in names},
                         "spans": {n: sync_spans[n][seed_spans[n]:] for n in sync_names}})
    ray.shutdown()

    generated = {n: tokens_per_s(r) for n, r in timed.items()}
    tok_s = {n: steady_tokens_per_s(timed[n], timed_spans[n]) for n in names}  # what the targets compare
    batch = rollout_config()
    print(f"\n## {args.workload} workload, 2 devices, {batch.prompts_per_step} prompts x {batch.group_size} samples "
          f"per update, {updates} updates per variant ({updates - 2} timed), interleaved, "
          f"seeds {', '.join(map(str, seeds))}")
    print(f"(partial-rollout threshold {THRESHOLD}; generation share, tail amplification, occupancy and length: "
          f"medians over the timed updates" + (f"; held-out accuracy: greedy, {eval_problems} problems, mean over "
                                               "seeds, each seed's in brackets)" if accuracy else ")"))
    print("(tokens/s: steady, with the pool of groups in flight held level — rollout device-seconds per generated "
          "token plus the other busy device-seconds per trained token; generated and trained tokens/s beside it)")
    print("| variant | generation share | tail amplification | decode occupancy | mean response length | tokens/s "
          "| vs sync colocated | generated tokens/s | trained tokens/s | util mean | staleness mean | staleness max "
          "| dropped groups |" + (" held-out acc |" if accuracy else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if accuracy else ""))
    for n in names:
        r, f = timed[n], row_figures(figures[n])
        st_mean = statistics.mean(m.get("staleness_mean", 0.0) for m in every[n])
        st_max = max(m.get("staleness_max", 0.0) for m in every[n])
        acc_cell = (f" {statistics.mean(accs[n]):.1%} ({', '.join(f'{a:.1%}' for a in accs[n])}) |"
                    if accuracy else "")
        print(f"| {n} | {f['share']:.2f} | {f['amplification']:.2f} | {f['occupancy']:.2f} | {f['length_mean']:.0f} | "
              f"{tok_s[n]:.0f} | {tok_s[n] / tok_s[BASELINE]:.2f}x | {generated[n]:.0f} | {trained_tokens_per_s(r):.0f} | "
              f"{statistics.mean(m['utilization_mean'] for m in r):.0%} | {st_mean:.2f} | {st_max:.0f} | "
              f"{sum(m.get('dropped_groups', 0) for m in every[n]):.0f} |{acc_cell}")
    print_ceilings(per_seed, seed_conditions)
    print(f"\ntarget {args.workload}_sync_generation_share: {row_figures(figures[BASELINE])['share']:.2f}"
          f" (goal >= 0.70)")
    stale = [n for n in names if is_stalesync(n)]
    if stale:
        best = max(stale, key=lambda n: tok_s[n])
        colocated = [n for n in stale if VARIANTS[n][0] in CO_LOCATED]
        print(f"best StaleSync variant by tokens/s: {best}")
        print(f"target stalesync_vs_sync_colocated: {tok_s[best] / tok_s[BASELINE]:.2f} (goal >= 1.4)")
        if colocated:
            best_co = max(colocated, key=lambda n: tok_s[n])
            print(f"best co-located StaleSync variant: {best_co}")
            print(f"target stalesync_colocated_vs_sync_colocated: {tok_s[best_co] / tok_s[BASELINE]:.2f} "
                  f"(goal >= 1.25)")
        if accuracy:
            acc = {n: statistics.mean(a) for n, a in accs.items()}
            print(f"target accuracy_gap_points: {100 * (acc[BASELINE] - acc[best]):.1f} (goal <= 3.0)")
        # what crossed the controller (commands, answers, reports) against what moved between the
        # devices through the queue, over the timed updates of the StaleSync variants of each mode
        shares = {n: _driver_share(timed[n]) for n in names}
        print("bytes across the controller / (those + queue bytes), timed updates: " +
              ", ".join(f"{n} {v:.4f}" for n, v in shares.items()))
        measured = [n for n in DRIVER_BYTES_VARIANTS if n in names] or stale
        print(f"stalesync_driver_bytes_share sums the timed updates of: {', '.join(measured)}")
        print(f"target stalesync_driver_bytes_share: {_driver_share([m for n in measured for m in timed[n]]):.4f} "
              f"(goal <= 0.01)")
        print(f"target max_staleness_violations: "
              f"{sum(m.get('staleness_max', 0) > bound(n) for n in stale for m in every[n])} (goal <= 0)")


if __name__ == "__main__":
    main()
