"""A planned layout as a run config: `rlfusion plan --emit-config FILE` writes the chosen plan's
settings as the `[deploy]` and `[optim]` keys of `rlfusion train`, so the run uses the layout the
planner scored.

Owns the mapping from `ParallelPlan` (and the cluster it was planned for) to those keys and the
TOML text, written once: an existing file is never overwritten. It does not import the run's
config classes (the simulator stays apart from the runtime); the tests load what it writes with
the run's loader. Planner settings with no run key are named in comments, not dropped silently.
"""

from __future__ import annotations

from pathlib import Path

from rlfusion.sim.costs import model_layers
from rlfusion.sim.hardware import ClusterSpec
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.search import SearchResult
from rlfusion.sim.step import estimate_step, plan_problem

GPU_KINDS = ("h100", "h200", "h20")  # cluster kinds whose chips the run drives as deploy.device=cuda
RUN_RECOMPUTE = ("none", "selective", "full")  # the planner's choices optim.recompute has as well
MIN_MICROBATCH_TOKENS = 64  # optim.microbatch_tokens' smallest allowed value
REPLICA_SHARE = 0.75  # of a chip's memory the rollout replica may take (the rest: KV cache, activations)
BF16_BYTES = 2


def ranks_per_node(plan: ParallelPlan, cluster: ClusterSpec) -> tuple[int, str]:
    """`deploy.ranks_per_node` for `plan` on `cluster` (its fast domain is a node; 0 when one
    domain holds every chip), and why it is 0 otherwise ("" when it is not)."""
    node = cluster.chips_per_domain
    if node >= cluster.num_chips:
        return 0, ""
    if cluster.num_chips % node:
        return 0, f"{cluster.num_chips} chips are not whole domains of {node}"
    if plan.ep > 1 and plan.ep % node and node % plan.ep:
        return 0, f"EP{plan.ep} neither fits in nor spans whole domains of {node} chips"
    return node, ""


def plan_config(plan: ParallelPlan, job: TrainJob, cluster: ClusterSpec, model: str,
                summary: str = "") -> str:
    """The TOML text of a run config for `plan`. `model`: the preset it was planned for (the run
    trains the checkpoint its `base` names); `summary`: a comment line on the estimate."""
    rpn, no_rpn = ranks_per_node(plan, cluster)
    lines = [f"# rlfusion plan --model {model} --cluster {cluster.kind}:{cluster.num_chips} --seq {job.seq_len} "
             f"--global-batch {job.global_batch}: {plan.label()}"]
    lines += [f"# {summary}"] if summary else []
    lines += [f"# planned for {model}: the run trains the checkpoint `base` names, so point it at one of that model",
              "# every role on every device, the actor's layout over all of them, as planned",
              "", "[deploy]", f"num_devices = {plan.num_devices}", 'mode = "fully_shared"']
    if cluster.kind in GPU_KINDS:
        lines.append('device = "cuda"')
    elif cluster.kind == "cpu":
        lines.append('device = "cpu"')
    else:
        lines.append(f"# {cluster.kind} chips: deploy.device has no kind for them (cpu, cuda); left at auto")
    lines += [f"train_tp = {plan.tp}", f"train_pp = {plan.pp}", f"train_vpp = {plan.vpp}", f"train_ep = {plan.ep}"]
    if plan.distributed_optimizer and plan.dp >= 2:
        lines += ["# the planner shards optimizer state over data parallel; train_fsdp shards parameters and",
                  "# gradients too (the routed experts of an expert-parallel layout stay whole)",
                  "train_fsdp = true"]
    lines.append(f"ranks_per_node = {rpn}" + (f"  # {no_rpn}" if no_rpn else ""))
    lines += _inference_lines(plan, job, cluster)
    lines += ["", "[optim]"] + _optim_lines(plan, job)
    return "\n".join(lines) + "\n"


def inference_ep(job: TrainJob, num_devices: int, chip_bytes: float) -> tuple[int, float]:
    """The rollout's expert-parallel degree (`deploy.infer_ep`): the smallest that divides the
    routed experts and the devices and leaves the replica (bf16: the dense weights whole, the
    routed experts split) within `REPLICA_SHARE` of a chip, the rest for the KV cache; with its
    replica bytes. (0, bytes at the largest degree) where none does."""
    layers = model_layers(job.model, job.seq_len)
    dense = sum(x.dense_params for x in layers) + job.model.vocab_size * job.model.d_model
    experts = sum(x.expert_params for x in layers)
    degrees = [e for e in range(1, num_devices + 1)
               if num_devices % e == 0 and (job.model.num_experts % e == 0 or not experts)]
    for ep in degrees:
        replica = BF16_BYTES * (dense + experts / ep)
        if replica <= REPLICA_SHARE * chip_bytes:
            return ep, replica
    return 0, BF16_BYTES * (dense + experts / degrees[-1])


def _inference_lines(plan: ParallelPlan, job: TrainJob, cluster: ClusterSpec) -> list[str]:
    chip = cluster.chip.memory_GB * 1e9
    ep, replica = inference_ep(job, plan.num_devices, chip)
    if not ep:
        return [f"# no inference layout keeps the rollout replica within {REPLICA_SHARE:.0%} of a chip "
                f"({replica / 1e9:.1f} GB at the largest expert-parallel degree): infer_ep left at 1"]
    return [f"infer_ep = {ep}  # the rollout replica: dense weights whole, routed experts over {ep} devices, "
            f"{replica / 1e9:.1f} GB in bf16 of the chip's {cluster.chip.memory_GB:.0f} GB"]


def _optim_lines(plan: ParallelPlan, job: TrainJob) -> list[str]:
    tokens = plan.micro_batch * job.seq_len
    lines = [f"microbatch_tokens = {max(tokens, MIN_MICROBATCH_TOKENS)}"
             + (f"  # mb{plan.micro_batch} x seq {job.seq_len}" if tokens >= MIN_MICROBATCH_TOKENS
                else f"  # mb{plan.micro_batch} x seq {job.seq_len} = {tokens}, below the run's smallest")]
    if plan.recompute in RUN_RECOMPUTE:
        lines.append(f'recompute = "{plan.recompute}"')
    else:
        lines.append("# the planner's per-module recompute/swap choice has no run key (optim.recompute=plan "
                     "measures its own under optim.activation_budget_mb)")
    if plan.swap:
        lines.append("# the planner swaps MoE expert activations to host: no run key does only that")
    return lines


def emit_plan_config(path: str | Path, job: TrainJob, cluster: ClusterSpec, model: str,
                     result: SearchResult, named: ParallelPlan | None) -> str:
    """Write the run config of the `--layout`-named plan, else of the best one, to the new file
    `path`; returns a line saying what was written. A named plan the planner finds invalid or
    over memory, or no plan that fits, writes nothing (`ValueError`)."""
    if named is None:
        if not result.ranked:
            raise ValueError(f"--emit-config {path}: no plan fits memory, nothing written")
        plan, est = result.best.plan, result.best
    else:
        problem = plan_problem(job, named, cluster)
        if problem:
            raise ValueError(f"--emit-config {path}: the named layout {named.label()} is invalid ({problem}), "
                             "nothing written")
        plan, est = named, estimate_step(job, named, cluster)
        if not est.fits:
            raise ValueError(f"--emit-config {path}: the named layout {named.label()} does not fit memory "
                             f"({est.memory.total_GB:.1f} GB per chip of {cluster.chip.memory_GB:.0f}), nothing written")
    summary = f"simulated step {est.step_s:.2f} s, MFU {est.mfu:.1%}, {est.memory.total_GB:.1f} GB per chip"
    written = write_config(path, plan_config(plan, job, cluster, model, summary))
    return f"wrote {written}: {plan.label()} as deploy/optim keys for `rlfusion train {written}`"


def write_config(path: str | Path, text: str) -> Path:
    """Write `text` to a new file at `path`; an existing file is refused, never overwritten."""
    path = Path(path)
    try:
        with path.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise ValueError(f"--emit-config {path} already exists; pick another path (a config is never "
                         "overwritten)") from None
    return path
