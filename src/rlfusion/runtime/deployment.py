"""Deployment: which devices run which RL roles, in which mode (RL Fusion's placements).

    separated     rollout devices ≠ train devices; new weights go rollout-ward after every update
                  (bucketed broadcast). N devices: the first ⌈N/2⌉ generate, the rest train;
                  reference and reward (the scorers) sit next to the rollout (each rollout
                  device scores its own samples) or, with `scorers="train"`, on the train
                  devices — what StaleSync's rollout/update overlap wants, so the rollout
                  devices only generate while the train devices score and update.
    colocated     the actor trains and generates on the same devices, switching layouts;
                  reference and reward get their own device when N ≥ 3, else share the actor's
                  devices with their weights kept resident.
    fully_shared  every role on every device, time-multiplexed: the reference weights are
                  offloaded to host while unused.
    hybrid        StaleSync's placement between the two: every device generates; the last
                  ⌊N/2⌋ also score and train. Once an update's finish threshold is reached the
                  train devices move on to reward, reference and the update while the others
                  keep decoding, then join that rollout with the new weights (colocated switch on
                  their side, bucketed broadcast to the others after it). Needs StaleSync with
                  max_staleness >= 1 and full replicas.

A device is one worker process: on CPU a process with `threads_per_device` threads, on CUDA one
GPU. `DeploymentPlan` is pure data (testable without Ray or torch.distributed); `ray_devices.py`
places one Ray actor per device from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from rlfusion.config import check_fields

MODES = ("separated", "colocated", "fully_shared", "hybrid")
BACKENDS = ("ray", "local")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
ROLES = ("rollout", "train", "reference", "reward")
SCORERS = ("auto", "rollout", "train")
SCHEDULES = ("1f1b", "interleaved", "overlap_fb")  # deploy.train_schedule


@dataclass(frozen=True)
class DeployConfig:
    """`backend="ray"` starts one Ray actor per device (`ray_address` "" = a local cluster, else
    e.g. "auto" or "10.0.0.1:6379" to join one started with `ray start`); `"local"` runs the
    stages in the driver process (one device, for debugging). `num_devices` 0 = every device of
    this machine: its GPUs, else its CPU cores / `threads_per_device`. `device`: what a device
    is — "cpu" (a process of `threads_per_device` threads, gloo between them), "cuda" (one GPU
    each, NCCL between them for GPU tensors and gloo for host ones) or "auto" (cuda when the
    Ray cluster, or with backend "local" this machine, has GPUs)."""

    mode: str = "colocated"
    num_devices: int = 0
    threads_per_device: int = 1
    backend: str = "ray"
    device: str = "auto"
    # the compute precision of every role's passes (rollout engine, reference, actor, critic):
    # "fp32", or "bf16" (autocast: matmuls in bf16; weights, gradients, optimizer state, logits
    # and losses in fp32, so the fp32 weights are the master copy); vLLM computes in bf16 either way
    precision: str = "fp32"
    ray_address: str = ""
    bucket_mb: float = 4.0  # weight-sync bucket size
    # synchronous rollout on several devices that also score: a device that finishes early
    # scores (reward + reference logprobs) samples another device has finished
    share_scoring: bool = True
    # separated mode: where reference and reward run, "rollout" or "train" devices; "auto" =
    # "train" when StaleSync overlaps rollout and update (max_staleness >= 1), else "rollout"
    scorers: str = "auto"
    # the actor's training layout over the train devices: tensor-parallel degree (the rest data
    # parallel) and expert-parallel degree (routed experts split over that many devices, a
    # multiple of train_tp). 1 and 1 (and no train_fsdp) = a full replica per device. Otherwise
    # the actor trains on its shards; colocated / fully shared, every rollout runs on a full
    # replica per device, filled from them in buckets of `bucket_mb` before it
    # (fusion/reshard.py), freed after; separated, the shards are gathered after each update
    # and broadcast to the rollout devices
    train_tp: int = 1
    train_ep: int = 1
    # with train_ep > 1: 0 runs each expert all-to-all of the update blocking; n >= 1 overlaps
    # it with computation (each MoE layer's tokens in n chunks, the shared experts and the other
    # chunks' experts computing while a chunk's tokens travel; parallel/expert_parallel.py)
    train_a2a_chunks: int = 0
    # pipeline stages of the actor's training layout (1F1B; with train_vpp > 1, interleaved
    # 1F1B with that many model chunks per stage): train devices = train_pp x data parallel x
    # train_tp, the pipeline's micro-batches are optim.microbatch_tokens each
    train_pp: int = 1
    train_vpp: int = 1
    # the pipeline's schedule: "1f1b", "interleaved" (train_vpp > 1 chunks per stage) or
    # "overlap_fb", Adaptive Pipe: two stages per pipeline device in a V, each step's forward of
    # one micro-batch paired with the backward of another so each one's expert all-to-alls run
    # under the other's computation (parallel/overlap.py; train_vpp 1 or 2, at least 2 x
    # train_pp micro-batches per pass); "" = 1f1b, or interleaved with train_vpp > 1
    train_schedule: str = ""
    # shard the actor's parameters, gradients and optimizer state over its data-parallel train
    # devices (FSDP2, ZeRO-3; the routed experts of an expert-parallel layout stay out of it)
    # instead of a full replica on each; every rollout still runs on a full replica per device
    train_fsdp: bool = False
    # devices per node: consecutive devices share a node (fast links), nodes hold whole
    # multiples of it; 0 = every device on one node. With a training layout whose
    # expert-parallel group spans several nodes (train_ep > ranks_per_node), the update's expert
    # all-to-all is hierarchical: each token crosses to a node once, whatever number of its
    # experts sit there, then spreads inside the node (parallel/expert_parallel.py)
    ranks_per_node: int = 0
    # the rollout's inference layout over the rollout devices: routed experts split over
    # infer_ep devices (attention and dense weights whole on each, every device decoding its
    # own rows; each MoE layer exchanges tokens with an all-to-all across the group, the group's
    # engines stepping in lock-step), 1 = a full replica per rollout device. infer_tp: tensor
    # parallel degree of the rollout engine, passed to vLLM (the native engine runs tp 1)
    infer_ep: int = 1
    infer_tp: int = 1
    # each device's memory budget in MiB: the run refuses before its first step a layout whose
    # phases cannot fit it, the rollout's KV cache takes what it leaves after the phase's
    # resident tensors, and a phase that exceeds it stops the run (a checkpoint to resume
    # from); 0 = the device's memory on CUDA, unlimited on CPU
    device_memory_mb: float = 0.0
    # a training layout's tensor-parallel group reads the update's rows from the queue once (its
    # first device) and broadcasts them to the others, instead of each device reading them
    hierarchical_reads: bool = True
    # how long a stage waits for the queue rows it was told to read (a producer that died or
    # hangs ends the run with this in the message instead of a silent hang)
    queue_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_fields("deploy", {
            "mode": (self.mode in MODES, f"allowed: {', '.join(MODES)}"),
            "num_devices": (self.num_devices >= 0, "must be >= 0 (0 = every device of this machine)"),
            "threads_per_device": (self.threads_per_device >= 1, "must be >= 1"),
            "backend": (self.backend in BACKENDS, f"allowed: {', '.join(BACKENDS)}"),
            "device": (self.device in DEVICES, f"allowed: {', '.join(DEVICES)}"),
            "precision": (self.precision in PRECISIONS, f"allowed: {', '.join(PRECISIONS)}"),
            "bucket_mb": (self.bucket_mb > 0, "must be > 0"),
            "scorers": (self.scorers in SCORERS, f"allowed: {', '.join(SCORERS)}"),
            "train_tp": (self.train_tp >= 1, "must be >= 1 (1 = a full replica per train device)"),
            "train_ep": (self.train_ep >= 1, "must be >= 1 (1 = every device holds every expert)"),
            "train_a2a_chunks": (self.train_a2a_chunks >= 0 and (self.train_a2a_chunks == 0 or self.train_ep > 1),
                                 "must be >= 0, and 0 unless train_ep > 1 (it overlaps the expert all-to-all)"),
            "train_pp": (self.train_pp >= 1, "must be >= 1 (1 = no pipeline)"),
            "train_vpp": (self.train_vpp >= 1 and (self.train_vpp == 1 or self.train_pp > 1),
                          "must be >= 1, and 1 unless train_pp > 1 (model chunks per pipeline stage)"),
            "train_schedule": self._schedule_ok(),
            "ranks_per_node": (self.ranks_per_node >= 0, "must be >= 0 (0 = every device on one node)"),
            "queue_timeout_s": (self.queue_timeout_s > 0, "must be > 0 (seconds)"),
            "infer_ep": (self.infer_ep >= 1, "must be >= 1 (1 = a full replica per rollout device)"),
            "infer_tp": (self.infer_tp >= 1, "must be >= 1"),
            "device_memory_mb": (self.device_memory_mb >= 0, "must be >= 0 (0 = the device's memory on CUDA, "
                                 "unlimited on CPU)"),
        }, self)
        if self.train_layout and self.backend != "ray":
            raise ValueError(f"{self.layout_name} is invalid with backend '{self.backend}': a training "
                             "layout spans several devices, which needs backend 'ray'")
        if self.scorers != "auto" and self.mode != "separated":
            raise ValueError(f"deploy.scorers={self.scorers} is invalid with mode '{self.mode}': it places "
                             "reference and reward in mode 'separated' only (keep 'auto')")
        if self.backend == "local" and self.num_devices > 1:
            raise ValueError(f"deploy.num_devices={self.num_devices} is invalid: backend 'local' runs "
                             "in one process, so it has exactly 1 device (use backend='ray' for more)")
        if self.mode in ("separated", "hybrid") and self.devices < 2:
            raise ValueError(f"deploy.num_devices={self.devices} is invalid: mode '{self.mode}' "
                             "needs >= 2 (some devices train, the others only generate)")
        if self.mode == "hybrid" and (self.train_layout or self.infer_ep > 1):
            raise ValueError(f"{self.layout_name} is invalid with mode 'hybrid': its train devices "
                             "train as full replicas and join rollouts late, so no group of them generates "
                             "in lock-step (use mode 'colocated' or 'separated' for a layout)")
        if self.infer_tp > 1:
            raise ValueError(f"deploy.infer_tp={self.infer_tp} is invalid: the rollout engines run tensor "
                             "parallel 1 on these devices (one GPU or CPU process each); split a large "
                             "model's experts with deploy.infer_ep instead")

    def _schedule_ok(self) -> tuple[bool, str]:
        s, pp, vpp = self.train_schedule, self.train_pp, self.train_vpp
        if s not in ("", *SCHEDULES):
            return False, f"allowed: {', '.join(SCHEDULES)} ('' = 1f1b, or interleaved with train_vpp > 1)"
        if s == "1f1b":
            return vpp == 1, "needs train_vpp=1 (interleaved runs several chunks per stage)"
        if s == "interleaved":
            return vpp > 1, "needs train_vpp >= 2 (model chunks per pipeline stage)"
        if s == "overlap_fb":
            return pp > 1 and vpp in (1, 2) and self.train_ep > 1, (
                "needs train_pp > 1, train_vpp 1 or 2 (it holds two stages per pipeline device, in a V) and "
                "train_ep > 1 (it overlaps the expert all-to-all)")
        return True, ""

    @property
    def schedule(self) -> str:
        """The pipeline schedule `train_schedule` resolves to."""
        return self.train_schedule or ("interleaved" if self.train_vpp > 1 else "1f1b")

    @property
    def train_layout(self) -> bool:
        """The actor trains split over a layout instead of as full replicas (co-located, an
        inference layout needs one too: the rollout's replica is then filled from the
        training layout's shards, a data-parallel one at least)."""
        return (self.train_tp > 1 or self.train_ep > 1 or self.train_pp > 1 or self.train_fsdp
                or (self.infer_ep > 1 and self.mode != "separated"))

    @property
    def layout_name(self) -> str:
        """The training layout's settings, as a user sets them (for error messages)."""
        return (f"deploy.train_tp={self.train_tp} / train_ep={self.train_ep}"
                + (f" / infer_ep={self.infer_ep}" if self.infer_ep > 1 else "")
                + (f" / train_pp={self.train_pp}" if self.train_pp > 1 else "")
                + (f" / train_vpp={self.train_vpp}" if self.train_vpp > 1 else "")
                + (f" / train_schedule={self.train_schedule}" if self.train_schedule else "")
                + (" / train_fsdp=true" if self.train_fsdp else ""))

    @property
    def devices(self) -> int:
        """`num_devices` with 0 resolved for this machine."""
        if self.num_devices:
            return self.num_devices
        if self.backend == "local":
            return 1
        import torch

        if self.device != "cpu" and torch.cuda.is_available():
            return torch.cuda.device_count()
        return max(1, (os.cpu_count() or 1) // self.threads_per_device)


# CPU devices are processes that may share this machine's cores (the tests run 4 one-thread
# devices on 2 cores); beyond a few per core they only wait on each other's collectives
CPU_DEVICES_PER_CORE = 4


def check_machine(cfg: DeployConfig) -> None:
    """Refuse, before anything starts, a deployment whose devices this machine cannot hold: with
    a local cluster (no `ray_address`) every device runs here, one GPU each (`device` cuda, or
    auto with GPUs) or CPU processes of `threads_per_device` threads. A cluster joined with
    `ray_address` is checked once joined (`ray_devices`)."""
    n = cfg.num_devices
    if cfg.ray_address or n <= 1:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda" or (cfg.device == "auto" and gpus):
        if n > gpus:
            raise ValueError(f"deploy.num_devices={n} needs {n} GPUs (deploy.device={cfg.device}) and this "
                             f"machine has {gpus}; run it on a cluster of that size (deploy.ray_address) or "
                             "lower deploy.num_devices")
        return
    cores = os.cpu_count() or 1
    most = max(1, CPU_DEVICES_PER_CORE * cores // cfg.threads_per_device)
    if n > most:
        raise ValueError(f"deploy.num_devices={n} needs {n} devices and this machine has {cores} CPU cores "
                         f"{'and no GPU ' if not gpus else ''}(at most {most} CPU devices of "
                         f"deploy.threads_per_device={cfg.threads_per_device}); run it on a cluster of "
                         f"{n} devices (deploy.ray_address) or lower deploy.num_devices")


@dataclass(frozen=True)
class DeploymentPlan:
    """Device indices per role. `actor` devices hold trainable weights; in colocated and
    fully-shared modes they are also the rollout devices."""

    mode: str
    num_devices: int
    rollout: tuple[int, ...]
    train: tuple[int, ...]
    reference: tuple[int, ...]
    reward: tuple[int, ...]
    train_tp: int = 1  # the actor's training layout (`deploy.train_tp`, `train_ep`, `train_pp`, ...)
    train_ep: int = 1
    train_a2a_chunks: int = 0
    train_fsdp: bool = False
    train_pp: int = 1
    train_vpp: int = 1
    train_schedule: str = "1f1b"  # `deploy.train_schedule`, resolved ("1f1b", "interleaved", "overlap_fb")
    ranks_per_node: int = 0  # `deploy.ranks_per_node`: consecutive devices per node, 0 = one node
    infer_ep: int = 1  # the rollout's inference layout (`deploy.infer_ep`, `infer_tp`)
    infer_tp: int = 1
    device: str = "auto"  # `deploy.device`; the backend resolves "auto" (`on`) before the workers start

    @classmethod
    def build(cls, cfg: DeployConfig, overlap: bool = False) -> "DeploymentPlan":
        """`overlap`: StaleSync will run rollout and update at once (resolves `scorers="auto"`)."""
        plan = cls._placed(cfg, overlap)
        return dataclasses.replace(plan, device=cfg.device)

    def on(self, device: str) -> "DeploymentPlan":
        """This plan with its device kind resolved ("cpu" or "cuda")."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device kind {device!r} is invalid: allowed: cpu, cuda")
        return dataclasses.replace(self, device=device)

    @classmethod
    def _placed(cls, cfg: DeployConfig, overlap: bool) -> "DeploymentPlan":
        n, devices = cfg.devices, tuple(range(cfg.devices))
        if cfg.mode == "separated":
            k = (n + 1) // 2
            on_train = cfg.scorers == "train" or (cfg.scorers == "auto" and overlap)
            scorers = devices[k:] if on_train else devices[:k]
            plan = cls(cfg.mode, n, rollout=devices[:k], train=devices[k:], reference=scorers, reward=scorers,
                       **_layout_fields(cfg))
            return plan._checked(cfg)
        if cfg.mode == "hybrid":
            train = devices[(n + 1) // 2:]
            return cls(cfg.mode, n, rollout=devices, train=train, reference=train, reward=train,
                       ranks_per_node=cfg.ranks_per_node)._checked(cfg)
        actor, scorers = (devices[:-1], devices[-1:]) if cfg.mode == "colocated" and n >= 3 else (devices, devices)
        plan = cls(cfg.mode, n, rollout=actor, train=actor, reference=scorers, reward=scorers,
                   **_layout_fields(cfg))
        if cfg.train_layout and len(plan.train) != n:
            raise ValueError(f"{cfg.layout_name} is invalid with {n} devices in "
                             f"mode '{cfg.mode}': the training layout spans every device, so reference and reward may "
                             "not have their own (use mode 'fully_shared', or colocated on at most 2 devices)")
        return plan._checked(cfg)

    def _checked(self, cfg: DeployConfig) -> "DeploymentPlan":
        """The training layout fits the train devices."""
        train = len(self.train)
        if train % (cfg.train_tp * cfg.train_pp):
            key, value = ("train_tp", cfg.train_tp) if train % cfg.train_tp else ("train_pp", cfg.train_pp)
            raise ValueError(f"deploy.{key}={value} is invalid: train_pp x train_tp = "
                             f"{cfg.train_pp * cfg.train_tp} must divide the {train} train devices "
                             f"(allowed: {', '.join(str(d) for d in range(1, train + 1) if train % d == 0)})")
        if cfg.train_fsdp and self.train_dp < 2:
            raise ValueError(f"deploy.train_fsdp=true is invalid with {train} train devices and "
                             f"train_tp={cfg.train_tp}: it shards over the data-parallel devices "
                             "(train devices / train_tp), which must be >= 2")
        self._check_nodes(cfg)
        rollout = len(self.rollout)
        if rollout % cfg.infer_ep:
            raise ValueError(f"deploy.infer_ep={cfg.infer_ep} is invalid: it must divide the {rollout} rollout "
                             f"devices (allowed: {', '.join(str(d) for d in range(1, rollout + 1) if rollout % d == 0)})")
        return self

    def _check_nodes(self, cfg: DeployConfig) -> None:
        """`ranks_per_node` cuts the devices into whole nodes with the train devices starting on
        a node's first device, and an expert-parallel group lies inside one node or spans whole
        nodes (what the hierarchical all-to-all's node and rail groups need)."""
        rpn, first, ep = cfg.ranks_per_node, self.train[0], cfg.train_ep
        if not rpn:
            return
        if self.num_devices % rpn or first % rpn:
            span = math.gcd(self.num_devices, first)
            where = f" and the index {first} of the first train device" if first else ""
            raise ValueError(f"deploy.ranks_per_node={rpn} is invalid: must divide the {self.num_devices} "
                             f"devices{where}, so the train devices fill whole nodes (allowed: 0, "
                             f"{', '.join(str(d) for d in range(1, span + 1) if span % d == 0)})")
        if ep > 1 and ep % rpn and rpn % ep:
            allowed = sorted({d for d in range(1, ep + 1) if ep % d == 0}
                             | {m for m in range(ep, len(self.train) + 1, ep) if len(self.train) % m == 0})
            raise ValueError(f"deploy.ranks_per_node={rpn} is invalid with train_ep={ep}: an expert-parallel "
                             "group lies inside one node or spans whole nodes, so it must divide train_ep or be "
                             f"a multiple of it (allowed: 0, {', '.join(map(str, allowed))})")

    def dp_index(self, device: int) -> int:
        """The data-parallel rank of a train device. Train devices are ordered pipeline stage
        first, then data parallel, then tensor parallel (`parallel.layout`), so the devices with
        one data-parallel index, its model-parallel group (the `train_tp` consecutive devices of
        each of the `train_pp` stages), see the same samples."""
        return self.train.index(device) % (self.train_dp * self.train_tp) // self.train_tp

    def model_parallel_group(self, dp_index: int) -> list[int]:
        """The train devices that hold one copy of the model between them (every pipeline stage
        and tensor-parallel rank of data-parallel rank `dp_index`), first the one that reads."""
        dp, tp = self.train_dp, self.train_tp
        return [self.train[(p * dp + dp_index) * tp + t] for p in range(self.train_pp) for t in range(tp)]

    @property
    def train_dp(self) -> int:
        return len(self.train) // (self.train_tp * self.train_pp)

    def parallel_layout(self):
        """The actor's training layout as `parallel.ParallelLayout` (over the train devices)."""
        from rlfusion.parallel.layout import ParallelLayout

        overlap_fb = self.train_schedule == "overlap_fb"
        return ParallelLayout(dp=self.train_dp, tp=self.train_tp, pp=self.train_pp,
                              vpp=2 if overlap_fb else self.train_vpp, ep=self.train_ep,
                              a2a_chunks=self.train_a2a_chunks, ranks_per_node=self.ranks_per_node,
                              hierarchical_a2a=self.hierarchical_a2a, overlap_fb=overlap_fb)

    @property
    def hierarchical_a2a(self) -> bool:
        """The update's expert all-to-all goes node by node: its groups span several nodes."""
        return self.train_ep > self.ranks_per_node > 0

    @property
    def train_layout(self) -> bool:
        return (self.train_tp > 1 or self.train_ep > 1 or self.train_pp > 1 or self.train_fsdp
                or (self.infer_ep > 1 and not self.separated))

    @property
    def separated(self) -> bool:
        return self.mode == "separated"

    def inference_layout(self):
        """The rollout replica's layout over the rollout devices (`parallel.ParallelLayout`):
        routed experts over `infer_ep` consecutive rollout devices, the rest whole on each."""
        from rlfusion.parallel.layout import ParallelLayout

        n, rpn = len(self.rollout), self.ranks_per_node
        return ParallelLayout(dp=n, ep=self.infer_ep, ranks_per_node=rpn if n % max(rpn, 1) == 0 else 0,
                              hierarchical_a2a=self.infer_ep > rpn > 0)

    @property
    def colocated_actor(self) -> bool:
        return self.rollout == self.train

    def roles(self, device: int) -> tuple[str, ...]:
        return tuple(r for r in ROLES if device in getattr(self, r))

    def describe(self) -> str:
        out = f"{self.mode}: " + ", ".join(f"device {d} = {'+'.join(self.roles(d))}"
                                           for d in range(self.num_devices))
        if self.train_layout:
            dp = f"fsdp{self.train_dp}" if self.train_fsdp else f"dp{self.train_dp}"
            pp = (f"pp{self.train_pp}" + (f" (vpp{self.train_vpp})" if self.train_vpp > 1 else "")
                  + (" (Adaptive Pipe: forward/backward-overlapped V schedule)" if self.train_schedule == "overlap_fb"
                     else "") + " x " if self.train_pp > 1 else "")
            out += f"; the actor trains as {pp}tp{self.train_tp} x ep{self.train_ep} x {dp}"
            if self.hierarchical_a2a:
                out += f"; hierarchical expert all-to-all over nodes of {self.ranks_per_node} device(s)"
        if self.infer_ep > 1:
            out += f"; generates with its routed experts split over groups of {self.infer_ep} devices (ep{self.infer_ep})"
        elif self.train_layout:
            out += ", generates on full replicas"
        return out


def _layout_fields(cfg: DeployConfig) -> dict:
    """The `DeploymentPlan` fields of the actor's training layout, as `cfg` sets them."""
    return dict(train_tp=cfg.train_tp, train_ep=cfg.train_ep, train_fsdp=cfg.train_fsdp, train_pp=cfg.train_pp,
                train_vpp=cfg.train_vpp, train_schedule=cfg.schedule, train_a2a_chunks=cfg.train_a2a_chunks,
                ranks_per_node=cfg.ranks_per_node,
                infer_ep=cfg.infer_ep, infer_tp=cfg.infer_tp)


def lora_merged(plan: DeploymentPlan, device: int, lora_rollout: str) -> bool:
    """With LoRA and `optim.lora_rollout`, whether `device` generates with the adapters merged
    into its weights: "merged" wherever it generates; "auto" where it generates from a policy
    it does not train (a rollout device's, or a training layout's replica, refilled each time:
    no rounding reaches the trained base), the trained model itself unmerged; "unmerged" nowhere."""
    if lora_rollout == "merged":
        return device in plan.rollout
    in_layout = plan.train_layout and device in plan.train
    return lora_rollout == "auto" and device in plan.rollout and (in_layout or device not in plan.train)


def lora_reference_shares_policy(plan: DeploymentPlan, device: int, merged: bool) -> bool:
    """With LoRA, whether the device's reference is its policy's frozen base (no copy): where the
    device holds the policy whole and unmerged when it scores — not where it trains in a layout
    (which splits the model into shards and stages), keeps a policy it does not train merged
    (`merged`: `lora_merged`; the trained model is merged only inside its rollouts, and scoring
    runs after them), or splits its replica's experts over an inference EP group (whose forwards
    are collectives in the engine's lock-step, which the reference's own passes would not keep)."""
    return not ((merged and device not in plan.train) or (plan.train_layout and device in plan.train)
                or (plan.infer_ep > 1 and device in plan.rollout))
