"""Whether a run's base fits this machine, from its config files alone, before any copy is built.

What a run holds of its base, by device and phase (`fusion/memory.py`'s categories; every copy
float32: under bf16 autocast the weights stay the fp32 master copy):

    controller    a full copy in the driver process (host memory), checkpoints are written from it
    every device  a full copy (`load_base`): the model it generates from; a train device in a
                  training layout keeps only its shard between rollouts and fills a full replica
                  from the shards for each rollout
    train device  while training: fp32 gradients and Adam's two moments of what it trains (its
                  shard in a layout); generating on the same device (colocated, fully shared),
                  the gradients are freed and the moments wait in host memory
    reference     a full copy where `algo.kl_coef` > 0 (in host memory when fully shared)
    critic        `algo.advantage=gae`: a full copy with its gradients and moments per train device
    vLLM engine   a bf16 copy of the weights on each rollout device while it generates

On CPU every device is a process of this machine, so the sum over devices (and the controller)
must fit its RAM; on GPUs the fullest device must fit one GPU and the host must hold the
controller's copy and the offloaded moments. Activations, KV caches and buffers come on top:
the estimate is a lower bound, so a run it refuses could not have run, while one it passes may
still run out of memory at a long context. A refusal names the bytes, the machine's memory and
the training layout (`deploy.train_tp` / `train_ep` / `train_pp` / `train_fsdp`) that would fit,
where one would. Devices of a Ray cluster (`deploy.ray_address`) are other machines: only the
controller's copy is checked here, and `load_hf` checks each device's copy where it loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rlfusion.fusion.memory import MemoryLedger
from rlfusion.model.base_info import FP32_BYTES, base_config, base_tokenizer, billions, cuda_memory, gib, host_memory
from rlfusion.model.config import ModelConfig
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.train_config import TrainConfig

ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, fp32 like the weights
BF16_BYTES = 2


@dataclass(frozen=True)
class Need:
    """Bytes a run holds at its fullest: in host memory (the controller's copy and what the
    devices offload; on CPU the devices themselves) and on its fullest device."""

    host: int
    device: int


def check_base(cfg: TrainConfig, base_path: str | Path, overlap: bool) -> None:
    """Refuse a base this run cannot use, from its config files alone: one too large for the
    machine, or a tokenizer / chat template that does not load. `overlap`: StaleSync runs
    rollout and update at once (it places the scorers; `trainer.stalesync_overlaps`)."""
    found = base_config(base_path, cfg.context_len or None)
    if found is None:
        return  # no config.json: the loader names what is missing
    model_cfg, config = found
    check_fits(cfg, model_cfg, config, overlap)
    base_tokenizer(base_path)


def check_fits(cfg: TrainConfig, model_cfg: ModelConfig, config: Path, overlap: bool) -> None:
    """`ValueError` naming the bytes, the memory and a layout that fits, if the run cannot."""
    plan = DeploymentPlan.build(cfg.deploy, overlap=overlap)
    on_gpu = _on_gpu(cfg)
    problem = _shortfall(cfg, plan, model_cfg, on_gpu)
    if problem is None:
        return
    params = model_cfg.param_counts()["total"]
    raise ValueError(f"{config}: {billions(params)} parameters, {gib(FP32_BYTES * params)} per float32 copy: "
                     f"{problem}; {_advice(cfg, model_cfg, overlap, on_gpu)}")


def _on_gpu(cfg: TrainConfig) -> bool:
    """The devices are GPUs this process can see (`deploy.device`, "auto" resolved here)."""
    import torch

    return cfg.deploy.device != "cpu" and torch.cuda.is_available()


def _shortfall(cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig, on_gpu: bool) -> str | None:
    """What does not fit, in words; None when the run fits."""
    need = run_need(cfg, plan, model_cfg, on_gpu)
    host, host_what = host_memory()
    if need.host > host:
        parts = _host_parts(cfg, plan, need, on_gpu)
        return f"this run holds at least {gib(need.host)} in host memory ({parts}), more than {host_what}"
    if on_gpu and not cfg.deploy.ray_address:
        gpu, gpu_what = cuda_memory()
        if need.device > gpu:
            return f"its fullest device holds at least {gib(need.device)}, more than {gpu_what}"
    return None


def _host_parts(cfg: TrainConfig, plan: DeploymentPlan, need: Need, on_gpu: bool) -> str:
    if cfg.deploy.ray_address:
        return "the controller's copy"
    if on_gpu:
        return "the controller's copy and the optimizer state the devices offload"
    return f"the controller's copy + {plan.num_devices} device(s) x up to {gib(need.device)}"


def run_need(cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig, on_gpu: bool) -> Need:
    """The bytes of the run's copies of the base (see the module docstring)."""
    full = FP32_BYTES * model_cfg.param_counts()["total"]
    if cfg.deploy.ray_address:  # the devices are other machines
        return Need(host=full, device=0)
    phases = [_device_phases(d, cfg, plan, model_cfg, on_gpu) for d in range(plan.num_devices)]
    fullest = [max(device for device, _ in p) for p in phases]
    offloaded = [max(host for _, host in p) for p in phases]
    on_host = sum(offloaded) if on_gpu else sum(fullest)  # on CPU every device is this machine's RAM
    return Need(host=full + on_host, device=max(fullest))


def _device_phases(device: int, cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig,
                   on_gpu: bool) -> list[tuple[int, int]]:
    """`(device bytes, host bytes)` one device holds in each of its phases (rollout, train). On
    CPU, host memory is the same RAM: what a GPU device offloads stays in its device total."""
    full = FP32_BYTES * model_cfg.param_counts()["total"]
    roles, trains = plan.roles(device), device in plan.train
    shard = FP32_BYTES * _trained_params(model_cfg, plan) if trains else 0
    offload = "host" if on_gpu else "device"  # where state set aside waits
    ledger, phases = MemoryLedger(), []
    if cfg.algo.kl_coef > 0 and "reference" in roles:
        ledger.set("weights", full, name="reference", location=offload if plan.mode == "fully_shared" else "device")
    if trains and cfg.algo.advantage == "gae":
        ledger.set("weights", full * (2 + ADAM_MOMENTS), name="critic")  # its weights, grads, moments
    if "rollout" in roles or not trains:  # (a device that only scores holds the copy it loaded)
        ledger.set("weights", full, name="replica")
        if trains:  # generating where it trains: the moments wait on the host, the shard stays
            ledger.set("optimizer", ADAM_MOMENTS * shard, location=offload)
            if plan.train_layout:
                ledger.set("weights", shard, name="shard")
        if cfg.rollout.backend == "vllm" and "rollout" in roles:
            ledger.set("weights", BF16_BYTES * full // FP32_BYTES, name="engine")
        phases.append((ledger.total("device"), ledger.total("host")))
    if trains:
        ledger.clear("weights", name="engine")  # vLLM sleeps, weights dropped, where its device trains
        ledger.clear("optimizer", location="host")
        if plan.train_layout:  # the replica is freed; the shard trains
            ledger.clear("weights", name="replica")
            ledger.set("weights", shard, name="shard")
        else:  # the replica is the model that trains
            ledger.set("weights", full, name="replica")
        ledger.set("grads", shard)
        ledger.set("optimizer", ADAM_MOMENTS * shard)
        phases.append((ledger.total("device"), ledger.total("host")))
    return phases


def _trained_params(model_cfg: ModelConfig, plan: DeploymentPlan) -> int:
    """Parameters one train device trains: all of them on a full replica; in a layout, its
    tensor- and pipeline-parallel share of the rest, its expert-parallel share of the routed
    experts, and with FSDP the data-parallel share of what is not expert-parallel."""
    counts = model_cfg.param_counts()
    experts, rest = counts["routed_experts"], counts["total"] - counts["routed_experts"]
    if not plan.train_layout:
        return counts["total"]
    fsdp = plan.train_dp if plan.train_fsdp else 1
    rest_shards = plan.train_tp * plan.train_pp * fsdp
    expert_shards = plan.train_ep * plan.train_pp * (fsdp if plan.train_ep == 1 else 1)
    return -(-rest // rest_shards) + -(-experts // expert_shards)


# ---- what would fit ------------------------------------------------------------------------

def _advice(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, on_gpu: bool) -> str:
    fits = _fitting_layout(cfg, model_cfg, overlap, on_gpu)
    if fits:
        return f"a training layout would fit: {fits}"
    layouts = "no training layout (deploy.train_tp / train_ep / train_pp / train_fsdp) fits"
    full = FP32_BYTES * model_cfg.param_counts()["total"]
    copies = full if on_gpu else full * (1 + cfg.deploy.devices)  # what no layout splits
    memory = cuda_memory()[0] if on_gpu else host_memory()[0]
    if copies > memory:
        who = "every device holds" if on_gpu else "the controller and every device hold"
        layouts += f", since {who} a full float32 copy ({gib(full)})"
    return f"{layouts}; use a smaller base or a machine with more memory"


def _fitting_layout(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, on_gpu: bool) -> str | None:
    """The least split training layout over the same devices that fits, as the keys to set."""
    if cfg.algo.advantage == "gae":
        return None  # its critic trains full replicas only (trainer._check_train_layout)
    n = cfg.deploy.devices
    degrees = sorted({d for d in (1, 2, 4, 8, 16, 32, 64, n) if d <= n})
    candidates = sorted(((tp, ep, pp, fsdp) for tp in degrees for ep in degrees for pp in degrees
                         for fsdp in (False, True)), key=lambda c: (c[0] * c[1] * c[2], c[3]))
    for tp, ep, pp, fsdp in candidates:
        plan = _plan(cfg, model_cfg, overlap, train_tp=tp, train_ep=ep, train_pp=pp, train_fsdp=fsdp)
        if plan is not None and plan.train_layout and _shortfall(cfg, plan, model_cfg, on_gpu) is None:
            keys = [f"deploy.train_{k}={v}" for k, v in (("tp", tp), ("ep", ep), ("pp", pp)) if v > 1]
            return " ".join(keys + (["deploy.train_fsdp=true"] if fsdp else []))
    return None


def _plan(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, **layout) -> DeploymentPlan | None:
    """The plan of `cfg.deploy` with `layout`, or None where the layout is not valid there."""
    try:
        plan = DeploymentPlan.build(dataclasses.replace(cfg.deploy, **layout), overlap=overlap)
        plan.parallel_layout().validate(len(plan.train), model_cfg)
    except ValueError:
        return None
    return plan
