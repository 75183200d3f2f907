"""`rlfusion plan` and `rlfusion simulate`: argparse subcommands over the planner/simulator.

`register_plan_command(subparsers)` / `register_simulate_command(subparsers)` add the
subcommands and set `func` to a handler `(args) -> int` that prints tables. User mistakes
surface as `ValueError` naming the flag and what is allowed (the top-level CLI prints them as
one line), or as argparse errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlfusion.model.config import PRESETS, get_preset
from rlfusion.sim.hardware import ChipSpec, parse_cluster
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.search import SearchResult, search_plans
from rlfusion.sim.step import StepEstimate, estimate_step, plan_problem


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def register_plan_command(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="rank parallel layouts (TP/PP/VPP/EP/DP, micro-batch, recompute) by "
                     "simulated step time")
    parser.add_argument("--model", default="pangu-ultra-moe-718b", choices=sorted(PRESETS),
                        help="model preset")
    parser.add_argument("--cluster", default="910b:6144",
                        help="KIND:NUM_CHIPS, KIND in 910b, cm384, h100, h200, cpu, or a "
                             "spec .json written by --measure-cpu")
    parser.add_argument("--measure-cpu", metavar="PATH", default=None,
                        help="time this machine's matmuls and memory bandwidth (about a second), "
                             "write its cluster spec to PATH and plan on it (instead of --cluster)")
    parser.add_argument("--seq", type=_positive_int, default=8192, help="sequence length")
    parser.add_argument("--global-batch", type=_batches, default=(1536,),
                        help="sequences per optimizer step; a comma-separated list searches each and "
                             "reports the one with the shortest time per sequence")
    parser.add_argument("--top", type=_positive_int, default=10, help="plans to print")
    parser.add_argument("--layout", default=None, metavar="SPEC",
                        help="also score this layout and show where it ranks: comma-separated tpN, ppN, "
                             "vppN, epN, mbN (micro-batch), recompute=none|selective|full|planned, swap; "
                             "DP is the chips left (e.g. tp8,pp16,ep32,vpp2)")
    parser.add_argument("--emit-config", metavar="FILE", default=None,
                        help="write the best plan (or the --layout one) as a run config for "
                             "`rlfusion train FILE` (a new file: an existing one is refused)")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    if args.emit_config and Path(args.emit_config).exists():  # before the search, not after it
        raise ValueError(f"--emit-config {args.emit_config} already exists; pick another path (a config is "
                         "never overwritten)")
    if args.measure_cpu:
        from rlfusion.sim.cpu_bench import measure_cpu

        cluster = measure_cpu(args.measure_cpu)
    else:
        cluster = parse_cluster(args.cluster, flag="--cluster")
    named = parse_layout(args.layout, cluster.num_chips) if args.layout else None
    searched = []
    for batch in args.global_batch:
        job = TrainJob(get_preset(args.model), seq_len=args.seq, global_batch=batch)
        searched.append((job, search_plans(job, cluster)))
    if len(searched) > 1:
        print(format_batches(searched) + "\n")
        fitting = [(j, r) for j, r in searched if r.ranked]
        job, result = min(fitting, key=lambda jr: jr[1].best.step_s / jr[0].global_batch) if fitting else searched[0]
    else:
        job, result = searched[0]
    print(format_plan_report(job, cluster.kind, cluster.num_chips, result, args.top,
                             chip=cluster.chip))
    if named is not None:
        print("\n" + score_layout(job, named, cluster, result))
    if args.emit_config:
        from rlfusion.sim.emit_config import emit_plan_config

        print("\n" + emit_plan_config(args.emit_config, job, cluster, args.model, result, named))
    return 0 if result.ranked else 1


def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or a comma-separated list of them")
    return values


def format_batches(searched: list[tuple[TrainJob, SearchResult]]) -> str:
    """One line per searched global batch: its best plan, the step, the time per sequence and
    the pipeline bubble's share (more micro-batches per step shrink it)."""
    lines = ["global batch search (ranked by seconds per sequence):",
             f"{'batch':>7}  {'best layout':<42} {'step s':>7} {'ms/seq':>7} {'MFU':>6} {'bubble':>7}"]
    rows = sorted(((j, r) for j, r in searched if r.ranked), key=lambda jr: jr[1].best.step_s / jr[0].global_batch)
    for job, result in rows:
        best = result.best
        lines.append(f"{job.global_batch:>7}  {best.plan.label():<42} {best.step_s:>7.2f} "
                     f"{best.step_s / job.global_batch * 1e3:>7.2f} {best.mfu:>6.1%} {best.bubble_s / best.step_s:>7.1%}")
    lines += [f"{job.global_batch:>7}  no plan fits memory" for job, r in searched if not r.ranked]
    return "\n".join(lines)


def parse_layout(text: str, chips: int) -> ParallelPlan:
    """`--layout tp8,pp16,ep32,vpp2[,mb1][,recompute=selective][,swap]` as a plan on `chips`."""
    values = {"tp": 1, "pp": 1, "vpp": 1, "ep": 1, "mb": 1}
    recompute, swap = "selective", False
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        if part == "swap":
            swap = True
        elif key == "recompute":
            recompute = value
        else:
            name = part.rstrip("0123456789")
            digits = part[len(name):]
            if name not in values or not digits or int(digits) < 1:
                raise ValueError(f"--layout={text!r}: {part!r} is not one of tpN, ppN, vppN, epN, mbN, "
                                 "recompute=none|selective|full|planned, swap")
            values[name] = int(digits)
    if chips % (values["tp"] * values["pp"]):
        raise ValueError(f"--layout={text!r}: TP{values['tp']} x PP{values['pp']} does not divide {chips} chips")
    try:
        return ParallelPlan(tp=values["tp"], pp=values["pp"], vpp=values["vpp"], ep=values["ep"],
                            dp=chips // (values["tp"] * values["pp"]), micro_batch=values["mb"],
                            recompute=recompute, swap=swap)
    except ValueError as e:
        raise ValueError(f"--layout={text!r}: {e}") from None


def score_layout(job: TrainJob, plan: ParallelPlan, cluster, result: SearchResult) -> str:
    """The named layout's estimate and its rank among the searched plans that fit."""
    head = f"named layout {plan.label()}:"
    problem = plan_problem(job, plan, cluster)
    if problem:
        return f"{head} invalid ({problem})"
    est = estimate_step(job, plan, cluster)
    if not est.fits:
        return (f"{head} does not fit: {est.memory.total_GB:.1f} GB per chip of {cluster.chip.memory_GB:.0f} "
                f"(step would be {est.step_s:.2f} s, MFU {est.mfu:.1%})")
    rank = 1 + sum(e.step_s < est.step_s for e in result.ranked)
    best = result.ranked[0]
    return "\n".join([f"{head} rank {rank} of {len(result.ranked)} plans that fit, step {est.step_s:.2f} s "
                      f"({est.step_s / best.step_s - 1:+.1%} against the top pick), MFU {est.mfu:.1%}",
                      _HEADER, _row(rank, est),
                      "  breakdown (s): " + ", ".join(f"{name} {getattr(est, name + '_s'):.2f}" for name in
                                                   ("compute", "recompute", "bubble", "tp_comm", "ep_comm_exposed",
                                                    "pp_comm", "dp_comm_exposed", "swap_exposed", "optimizer",
                                                    "link_wait"))])


_HEADER = (f"{'#':>3}  {'layout':<42} {'step s':>7} {'MFU':>6} {'mem GB':>7} {'comm':>6} "
           f"{'bubble':>7} {'EP a2a exposed':>16} {'link':>6}  recompute/swap")
_KINDS = ("layer", "attn", "mlp", "attn_norm", "mlp_norm")


def _kind_counts(names) -> str:
    counts = {k: 0 for k in _KINDS}
    for name in names:
        counts["layer" if name.count(".") == 1 else name.rsplit(".", 1)[1]] += 1
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


def memory_choice(est: StepEstimate) -> str:
    """Which recompute/swap the plan uses; for `planned`, module counts over all stages."""
    plan = est.plan
    if plan.recompute != "planned":
        choice = {"none": "keep all", "selective": "selective recompute",
                  "full": "full recompute"}[plan.recompute]
        return choice + (" + swap experts" if plan.swap else "")
    rec = sum(len(m.recompute) for m in est.memory_plans)
    swap = sum(len(m.swap) for m in est.memory_plans)
    return f"planned: {rec} recompute / {swap} swap modules"


def planned_details(est: StepEstimate) -> str:
    """One line: what the planner chose for a `planned` estimate, by module kind."""
    rec = [n for m in est.memory_plans for n in m.recompute]
    swap = [n for m in est.memory_plans for n in m.swap]
    return (f"{est.plan.label()}: recompute {len(rec)} modules ({_kind_counts(rec)}), "
            f"swap {len(swap)} ({_kind_counts(swap)}); +{est.recompute_s:.2f}s recompute, "
            f"+{est.swap_exposed_s:.2f}s swap per step, activations "
            f"{est.memory.activations_GB:.1f} GB of {est.memory.total_GB:.1f} GB")


def _row(rank: int, est: StepEstimate) -> str:
    hidden = (1.0 - est.ep_comm_exposed_s / est.ep_comm_total_s) if est.ep_comm_total_s else 1.0
    return (f"{rank:>3}  {est.plan.label():<42} {est.step_s:>7.2f} {est.mfu:>6.1%} "
            f"{est.memory.total_GB:>7.1f} {est.comm_share:>6.1%} "
            f"{est.bubble_s / est.step_s:>7.1%} {est.ep_comm_exposed_s:>6.2f}s ({1 - hidden:>4.0%}) "
            f"{est.link_busy_s / est.step_s:>6.0%}  "
            f"{memory_choice(est)}")


def format_plan_report(job: TrainJob, kind: str, chips: int, result: SearchResult,
                       top: int, chip: ChipSpec | None = None) -> str:
    lines = [f"plan: {kind}:{chips}, seq {job.seq_len}, global batch {job.global_batch} "
             f"sequences; {result.num_candidates} candidates, {result.num_invalid} invalid, "
             f"{result.num_oom} over memory, {len(result.ranked)} fit "
             f"({result.seconds:.1f}s)"]
    if not result.ranked:
        lines.append("no plan fits memory: add chips, shorten --seq or lower --global-batch")
        return "\n".join(lines)
    lines += ["", _HEADER]
    lines += [_row(i + 1, est) for i, est in enumerate(result.ranked[:top])]
    best = result.best
    lines += ["", "why the best plan wins:"] + [f"  {r}" for r in result.reasons]
    lines += ["", "best plan breakdown (s): " + ", ".join(
        f"{name} {getattr(best, name + '_s'):.2f}" for name in
        ("compute", "recompute", "bubble", "tp_comm", "ep_comm_exposed", "pp_comm",
         "dp_comm_exposed", "swap_exposed", "optimizer", "link_wait"))]
    mem = best.memory
    lines.append(f"best plan memory (GB): weights {mem.weights_GB:.1f}, grads {mem.grads_GB:.1f}, "
                 f"optimizer {mem.optimizer_GB:.1f}, activations {mem.activations_GB:.1f}, "
                 f"buffers {mem.buffers_GB:.1f}, reserved {mem.reserved_GB:.1f}")
    planned = [(i + 1, e) for i, e in enumerate(result.ranked) if e.plan.recompute == "planned"]
    acting = [(i, e) for i, e in planned if any(m.recompute or m.swap for m in e.memory_plans)]
    if planned:  # the fastest planned layout that recomputes or swaps something, if any
        rank, planned = (acting or planned)[0]
        lines.append(f"best planned recompute/swap (#{rank}): {planned_details(planned)}")
    if chip is not None:
        lines += ["", "assumptions:"] + [f"  {x}" for x in plan_assumptions(job, result, chip)]
    return "\n".join(lines)


def plan_assumptions(job: TrainJob, result: SearchResult, chip: ChipSpec) -> list[str]:
    """Every constant the ranking rests on that is not a property of the plan itself."""
    from rlfusion.sim.memory import COMM_BUFFER_GB, FRAGMENTATION, RESERVED_GB
    from rlfusion.sim.step import OPTIMIZER_STEP_BYTES, ep_overlap_measurement

    overlap = ep_overlap_measurement()

    best = result.best
    return [
        f"chip {chip.name}: {chip.peak_tflops:.0f} TFLOPS dense bf16 peak (vendor figure, the "
        f"MFU denominator), {chip.memory_GB:.0f} GB at {chip.memory_bandwidth_GBps:.0f} GB/s",
        f"efficiency (assumed, not measured): large GEMMs {chip.matmul_efficiency:.0%} of peak, "
        f"falling as rows/(rows+{chip.half_efficiency_rows}); flash attention "
        f"{chip.attention_efficiency:.0%}",
        "FLOPs: 2 per multiply-add; causal attention counts s/2 keys per token; backward 2x "
        "forward (2.5x for the attention core); MFU counts 3x forward, no recompute",
        f"expert load: per-expert token-load cv {job.expert_load_cv} after balancing; busiest "
        f"EP rank carries 1 + cv/sqrt(E/EP) * sqrt(2 ln EP) x the mean "
        f"({job.expert_imbalance(best.plan.ep):.3f} at EP{best.plan.ep})",
        "memory: bf16 weights 2 B, fp32 grads 4 B, fp32 master + Adam 12 B per parameter "
        f"(sharded over DP/EDP with the distributed optimizer), {RESERVED_GB:.0f} GB framework workspace, "
        f"{FRAGMENTATION:.0%} of the allocation for fragmentation, {COMM_BUFFER_GB:g} GB of collective buffers, "
        "MoE dispatch buffers, fp32 logits of one micro-batch and their gradient, one staging layer",
        "communication: alpha-beta ring collectives; TP all-gather/reduce-scatter exposed; EP "
        "all-to-all hierarchical, overlapped with "
        + ("the paired micro-batch's whole layers (Adaptive Pipe: forward of one micro-batch against the backward of "
           "another)" if overlap.get("mechanism") == "overlap_fb" else
           "the layer's MoE compute (router, shared and routed experts; the chunked overlap)")
        + f" at the measured efficiency {overlap['efficiency']:.0%} ({overlap['source']}); PP sends "
        "exposed; DP reduce-scatter/all-gather hidden behind backward/forward when shorter",
        f"pipeline: 1F1B bubble (PP-1) stage times, / VPP when interleaved; optimizer step "
        f"{OPTIMIZER_STEP_BYTES} B per local parameter at memory bandwidth",
        "links: one traffic budget per link of a chip (scale-up inside the fast domain, scale-out "
        "beyond it): every collective on a link, hidden or exposed, shares it, and a step is never "
        "shorter than its busiest link",
        "not modelled: congestion inside the network beyond one link per chip, stragglers, kernel "
        "launch overheads, sequence-length imbalance across DP",
    ]


def register_simulate_command(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="discrete-event simulation of RL post-training throughput")
    parser.add_argument("config", type=Path, nargs="?", default=None,
                        help="simulation TOML file")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for trace.json and PNG plots (default: no files)")
    parser.add_argument("--calibrate", type=Path, default=None, metavar="PATH",
                        help="run the microbenchmarks of this machine and write a calibration "
                             "JSON (use it with calibration = \"PATH\" in a config)")
    parser.add_argument("--quick", action="store_true", help="--calibrate: fewer repetitions")
    parser.add_argument("--project", action="store_true",
                        help="project RL throughput of --model on 1..--supernodes supernodes "
                             "(sync vs StaleSync, colocated vs separated), with assumptions")
    parser.add_argument("--model", default="pangu-ultra-moe-718b", choices=sorted(PRESETS),
                        help="--project: model preset")
    parser.add_argument("--cluster-kind", default="cm384",
                        help="--project: hardware kind of one supernode (cm384, 910b, h100, h200)")
    parser.add_argument("--supernodes", type=_positive_int, default=4,
                        help="--project: largest number of supernodes")
    parser.add_argument("--max-staleness", type=_positive_int, default=1,
                        help="--project: staleness bound of the StaleSync variant "
                             "(stalesync.max_staleness)")
    parser.set_defaults(func=run_simulate)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    if args.calibrate is None and not args.project and args.config is None:
        raise ValueError("simulate needs a CONFIG file, --calibrate PATH or --project")
    if args.calibrate is not None:
        from rlfusion.measure.calibrate_all import measure_calibration  # torch, only when asked

        measure_calibration(args.calibrate, quick=args.quick)
        print(f"wrote {args.calibrate}")
    if args.project:
        from rlfusion.sim.hardware import CLUSTER_KINDS
        from rlfusion.sim.projection import run_projection

        if args.cluster_kind not in CLUSTER_KINDS or args.cluster_kind == "cpu":
            raise ValueError(f"--cluster-kind={args.cluster_kind!r}; allowed: "
                             f"{', '.join(k for k in CLUSTER_KINDS if k != 'cpu')}")
        print(run_projection(args.model, args.cluster_kind, args.supernodes, args.max_staleness))
    if args.config is not None:
        from rlfusion.sim.report import simulate_and_report  # keeps `plan` imports small

        print(simulate_and_report(args.config, args.out))
    return 0
