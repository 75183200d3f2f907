"""Whether a run's base fits this machine and each device's memory budget, from its config files
alone, before any copy is built; and how many KV-cache rows a rollout engine gets under the budget.

What a run holds of its base, by device and phase (`fusion/memory.py`'s categories; every copy
float32: under bf16 autocast the weights stay the fp32 master copy):

    controller    a full copy in the driver process (host memory), checkpoints are written from it
    train         a train device's shard of the weights (all of them on a full replica; in a
                  training layout the routed experts / train_ep, the rest / train_tp, both cut by
                  layer ranges over train_pp, and with FSDP what is not expert-parallel over the
                  data-parallel devices), with fp32 gradients and AdamW's two moments of it
    rollout       the replica a rollout device generates from: the dense weights whole and the
                  routed experts / infer_ep (with no training layout and infer_ep=1, the trained
                  model itself), one weight-sync bucket and the KV cache; a train device that
                  generates frees its gradients and sets its moments (and a layout's shards)
                  aside in host memory
    switch        in a training layout the replica fills from the shards while they are still in:
                  both, and one bucket
    reference     a full copy where `algo.kl_coef` > 0 (in host memory when fully shared); with LoRA
                  none where the device holds the policy whole (its frozen base is the reference)
    LoRA          gradients and AdamW moments of the adapters only (`optim.lora_rank`)
    critic        `algo.advantage=gae`: a full copy with its gradients and moments per train device
    vLLM engine   a bf16 copy of the replica on each rollout device while it generates
    scorer        a device that only scores holds the full copy it loaded

Machine memory: on CPU every device is a process of this machine, so the sum over devices (and
the controller) must fit its RAM; on GPUs the fullest device must fit one GPU and the host must
hold the controller's copy and what the devices set aside. Activations, buckets and KV caches
come on top: that estimate is a lower bound, so a run it refuses could not have run, while one
it passes may still run out of memory at a long context.

Device budget (`deploy.device_memory_mb`; 0 = one GPU's memory on CUDA, none on CPU): every phase
of every device must fit it with one bucket (`deploy.bucket_mb`, or the largest tensor where that
is larger) in the switch and rollout phases and, in the rollout, at least `MIN_KV_ROWS` KV-cache
row of the engine's context (`max_seq_len` tokens). The KV cache then takes what the rollout
leaves (`rollout_kv_rows`). These are the tensors the device's ledger counts while the run goes
(`fusion/switch.py`), which stops the run if a phase goes above the budget after all.

A refusal names the bytes, the memory or budget and the layout (`deploy.train_tp` / `train_ep` /
`train_pp` / `train_fsdp` / `infer_ep`) over the same devices that would fit, where one would.
Devices of a Ray cluster (`deploy.ray_address`) are other machines: only the controller's copy
and an explicit budget are checked here, and `load_hf` checks each device's copy where it loads.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from rlfusion.fusion.memory import MemoryLedger
from rlfusion.model.base_info import FP32_BYTES, base_config, base_tokenizer, billions, cuda_memory, gib, host_memory
from rlfusion.model.config import ModelConfig
from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan, lora_merged, lora_reference_shares_policy
from rlfusion.runtime.train_config import TrainConfig

ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, fp32 like the weights
BF16_BYTES = 2
MIN_KV_ROWS = 1  # the rollout must hold at least one sequence of the engine's whole context


@dataclass(frozen=True)
class Need:
    """Bytes a run holds at its fullest: in host memory (the controller's copy and what the
    devices offload; on CPU the devices themselves) and on its fullest device."""

    host: int
    device: int


@dataclass(frozen=True)
class PhaseBytes:
    """What one device holds in one phase: on the device (what its budget bounds; buckets and
    the KV cache left out) and in host memory on its behalf."""

    device: int
    host: int
    parts: tuple[tuple[str, int], ...] = ()  # the device bytes by category (`fusion/memory.py`)


def check_base(cfg: TrainConfig, base_path: str | Path, overlap: bool) -> None:
    """Refuse a base this run cannot use, from its config files alone: one too large for the
    machine or a device's budget, or a tokenizer / chat template that does not load. `overlap`:
    StaleSync runs rollout and update at once (it places the scorers; `trainer.stalesync_overlaps`)."""
    found = base_config(base_path, cfg.context_len or None)
    if found is None:
        return  # no config.json: the loader names what is missing
    model_cfg, config = found
    check_fits(cfg, model_cfg, config, overlap)
    base_tokenizer(base_path)


def check_fits(cfg: TrainConfig, model_cfg: ModelConfig, config: Path, overlap: bool) -> None:
    """`ValueError` naming the bytes, the memory or budget and a layout that fits, if the run cannot."""
    plan = DeploymentPlan.build(cfg.deploy, overlap=overlap)
    on_gpu = _on_gpu(cfg)
    short = _shortfall(cfg, plan, model_cfg, on_gpu)
    if short is None:
        return
    problem, budget = short
    params = model_cfg.param_counts()["total"]
    raise ValueError(f"{config}: {billions(params)} parameters, {gib(FP32_BYTES * params)} per float32 copy: "
                     f"{problem}; {_advice(cfg, model_cfg, overlap, on_gpu, budget)}")


def device_budget(cfg: TrainConfig) -> int:
    """Bytes one device may hold: `deploy.device_memory_mb`; with 0, one GPU's memory where this
    process's devices are GPUs (the smallest it sees), else 0 = no budget."""
    return _budget(cfg, _on_gpu(cfg))


def rollout_kv_rows(cfg: TrainConfig, model_cfg: ModelConfig, plan: DeploymentPlan, device: int | None = None) -> int:
    """The KV-cache rows (sequences of `model_cfg.max_seq_len` tokens) a rollout engine gets:
    `rollout.max_num_seqs`, or where the device's budget leaves less, floor((budget - the rollout
    phase's resident bytes - one bucket) / the bytes of a row), on `device` (default: the fullest
    rollout device). `ValueError` naming the budget where not even `MIN_KV_ROWS` fit (`check_fits`
    refuses such a run before it starts)."""
    budget = device_budget(cfg)
    if not budget:
        return cfg.rollout.max_num_seqs
    devices = [device] if device is not None else list(plan.rollout)
    assert set(devices) <= set(plan.rollout), f"device {device} does not generate in {plan.describe()}"
    resident = max(_device_phases(d, cfg, plan, model_cfg)["rollout"].device for d in devices)
    left = budget - resident - _bucket_bytes(cfg, model_cfg)
    rows = max(0, left) // kv_row_bytes(model_cfg)
    if rows < MIN_KV_ROWS:
        raise ValueError(f"deploy.device_memory_mb={cfg.deploy.device_memory_mb:g}: the rollout holds "
                         f"{_mib(resident)} and one bucket ({_mib(_bucket_bytes(cfg, model_cfg))}), which leaves "
                         f"{_mib(max(0, left))}, less than one KV-cache row of {model_cfg.max_seq_len} tokens "
                         f"({_mib(kv_row_bytes(model_cfg))})")
    return min(cfg.rollout.max_num_seqs, rows)


def kv_row_bytes(model_cfg: ModelConfig) -> int:
    """Bytes of one KV-cache row of `max_seq_len` tokens (`MoETransformer.new_kv_cache`: per
    layer, keys and values of the KV heads, or MLA's latent and shared RoPE key; float32, the
    weights' dtype)."""
    if model_cfg.attention == "mla":
        per_token = model_cfg.mla.kv_lora_rank + model_cfg.mla.qk_rope_head_dim
    else:
        per_token = 2 * model_cfg.num_kv_heads * model_cfg.head_dim
    return FP32_BYTES * model_cfg.num_layers * per_token * model_cfg.max_seq_len


def _on_gpu(cfg: TrainConfig) -> bool:
    """The devices are GPUs this process can see (`deploy.device`, "auto" resolved here)."""
    import torch

    return cfg.deploy.device != "cpu" and torch.cuda.is_available()


def _budget(cfg: TrainConfig, on_gpu: bool) -> int:
    if cfg.deploy.device_memory_mb:
        return int(cfg.deploy.device_memory_mb * 2**20)
    return cuda_memory()[0] if on_gpu else 0


def _shortfall(cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig,
               on_gpu: bool) -> tuple[str, bool] | None:
    """What does not fit, in words, and whether it is a device's budget; None when the run fits."""
    need = run_need(cfg, plan, model_cfg, on_gpu)
    host, host_what = host_memory()
    if need.host > host:
        parts = _host_parts(cfg, plan, need, on_gpu)
        return f"this run holds at least {gib(need.host)} in host memory ({parts}), more than {host_what}", False
    local_gpus = on_gpu and not cfg.deploy.ray_address
    if local_gpus:
        gpu, gpu_what = cuda_memory()
        if need.device > gpu:
            return f"its fullest device holds at least {gib(need.device)}, more than {gpu_what}", False
    over = _over_budget(cfg, plan, model_cfg, _budget(cfg, on_gpu)) if cfg.deploy.device_memory_mb or local_gpus else None
    return None if over is None else (over, True)


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
    fullest = on_host = 0
    for phases in _phases_by_device(cfg, plan, model_cfg):
        if on_gpu:
            fullest = max(fullest, *(p.device for p in phases.values()))
            on_host += max(p.host for p in phases.values())
        else:  # on CPU what a device sets aside stays in the same RAM
            held = max(p.device + p.host for p in phases.values())
            fullest, on_host = max(fullest, held), on_host + held
    return Need(host=full + on_host, device=fullest)


def _phases_by_device(cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig) -> list[dict[str, PhaseBytes]]:
    """`_device_phases` of every device (computed once per kind of device)."""
    seen: dict[tuple, dict[str, PhaseBytes]] = {}
    out = []
    for d in range(plan.num_devices):
        kind = (plan.roles(d), d in plan.train, d in plan.rollout)
        if kind not in seen:
            seen[kind] = _device_phases(d, cfg, plan, model_cfg)
        out.append(seen[kind])
    return out


def _device_phases(device: int, cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig) -> dict[str, PhaseBytes]:
    """What `device` holds in each of its phases, "rollout" (or "score" where it only scores),
    "switch" (a training layout filling its replica) and "train", where it really is: what waits
    in host memory counts there. Buckets and KV cache left out (`_phase_extra`)."""
    full = FP32_BYTES * model_cfg.param_counts()["total"]
    roles, trains, generates = plan.roles(device), device in plan.train, device in plan.rollout
    shard = FP32_BYTES * _trained_params(model_cfg, plan) if trains else 0  # all of it on a full replica
    trained = round(shard * _adapter_share(cfg, model_cfg))  # what has gradients and moments (LoRA: the adapters)
    ledger, phases = MemoryLedger(), {}

    def held() -> PhaseBytes:
        on_device = tuple((cat, n) for cat, n in ledger.snapshot()["device"].items() if n)
        return PhaseBytes(ledger.total("device"), ledger.total("host"), on_device)

    # (LoRA: the base under the policy's adapters, no copy, where the device holds it whole)
    shared_base = cfg.optim.lora_rank and lora_reference_shares_policy(
        plan, device, lora_merged(plan, device, cfg.optim.lora_rollout))
    if cfg.algo.kl_coef > 0 and "reference" in roles and not shared_base:
        ledger.set("weights", full, name="reference", location="host" if plan.mode == "fully_shared" else "device")
    if trains and cfg.algo.advantage == "gae":
        ledger.set("weights", full * (2 + ADAM_MOMENTS), name="critic")  # its weights, grads, moments
    if generates or not trains:
        replica = FP32_BYTES * _replica_params(model_cfg, plan) if generates else full  # (a scorer's: what it loaded)
        if not trains or plan.train_layout:  # a replica of its own (co-located infer_ep > 1: a layout)
            ledger.set("weights", replica, name="replica")
        if trains:  # the moments wait on the host; a full replica's weights are the model that trains
            ledger.set("optimizer", ADAM_MOMENTS * trained, location="host")
            ledger.set("weights", shard, name="trained")
        if generates and cfg.rollout.backend == "vllm":
            ledger.set("weights", BF16_BYTES * replica // FP32_BYTES, name="engine")
        if trains and plan.train_layout:  # the replica filled, the shards go to host
            phases["switch"] = held()
            ledger.clear("weights", name="trained")
            ledger.set("weights", shard, name="trained", location="host")
        phases["rollout" if generates else "score"] = held()
    if trains:  # vLLM sleeps, weights dropped; a layout's replica is freed and its shards come back
        for name in ("engine", "replica"):
            ledger.clear("weights", name=name)
        ledger.clear("weights", location="host", name="trained")
        ledger.clear("optimizer", location="host")
        ledger.set("weights", shard, name="trained")
        ledger.set("grads", trained)
        ledger.set("optimizer", ADAM_MOMENTS * trained)
        phases["train"] = held()
    return phases


def _adapter_share(cfg: TrainConfig, model_cfg: ModelConfig) -> float:
    """The share of the weights that has gradients and AdamW moments: 1, or with LoRA its
    adapters' parameters over the base's (counted on a model of meta tensors; the adapters of a
    sharded layer are sharded alike, closely enough for a bound)."""
    spec = cfg.optim.lora_spec(0)
    return 1.0 if spec is None else _share(spec, model_cfg)


@functools.lru_cache(maxsize=8)
def _share(spec, model_cfg: ModelConfig) -> float:
    import torch

    from rlfusion.model import lora
    from rlfusion.model.transformer import MoETransformer

    with torch.device("meta"):
        model = lora.attach(MoETransformer(model_cfg), spec)
    adapters = sum(p.numel() for _, p in lora.trained_parameters(model))
    return adapters / model_cfg.param_counts()["total"]


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


def _replica_params(model_cfg: ModelConfig, plan: DeploymentPlan) -> int:
    """Parameters of one rollout device's replica: the dense weights whole, its infer_ep share
    of the routed experts."""
    counts = model_cfg.param_counts()
    experts = counts["routed_experts"]
    return counts["total"] - experts + -(-experts // plan.infer_ep)


# ---- a device's budget ---------------------------------------------------------------------

def _over_budget(cfg: TrainConfig, plan: DeploymentPlan, model_cfg: ModelConfig, budget: int) -> str | None:
    """The device phase furthest over `budget` with its bucket and least KV rows, in words;
    None when every phase fits."""
    worst = None
    for device, phases in enumerate(_phases_by_device(cfg, plan, model_cfg)):
        for phase, held in phases.items():
            extra = _phase_extra(phase, cfg, model_cfg)
            need = held.device + sum(extra.values())
            if need > budget and (worst is None or need > worst[0]):
                worst = (need, device, phase, [*held.parts, *extra.items()])
    if worst is None:
        return None
    need, device, phase, parts = worst
    parts = " + ".join(f"{what} {_mib(n)}" for what, n in parts)
    limit = (f"deploy.device_memory_mb={cfg.deploy.device_memory_mb:g}" if cfg.deploy.device_memory_mb
             else f"{cuda_memory()[1]} (deploy.device_memory_mb=0)")
    return f"device {device}'s {phase} phase needs at least {_mib(need)} ({parts}), more than its budget {limit}"


def _phase_extra(phase: str, cfg: TrainConfig, model_cfg: ModelConfig) -> dict[str, int]:
    """What a phase needs beyond its resident tensors: a bucket where weights move into a
    replica, the least KV cache a rollout can generate with."""
    extra = {}
    if phase in ("switch", "rollout"):
        extra["one bucket"] = _bucket_bytes(cfg, model_cfg)
    if phase == "rollout":
        extra[f"{MIN_KV_ROWS} KV row of {model_cfg.max_seq_len} tokens"] = MIN_KV_ROWS * kv_row_bytes(model_cfg)
    return extra


def _bucket_bytes(cfg: TrainConfig, model_cfg: ModelConfig) -> int:
    """The largest weight-sync bucket: `deploy.bucket_mb`, or the largest tensor where that is
    larger (`fusion/buckets.plan_buckets` never splits one), at most the whole weights."""
    c = model_cfg
    largest = max(c.vocab_size * c.d_model, c.d_model * c.dense_ffn_dim * (c.num_dense_layers > 0),
                  c.num_experts * c.d_model * c.expert_ffn_dim * (c.num_layers > c.num_dense_layers))
    full = FP32_BYTES * c.param_counts()["total"]
    return min(full, max(int(cfg.deploy.bucket_mb * 2**20), FP32_BYTES * largest))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# ---- what would fit ------------------------------------------------------------------------

def _advice(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, on_gpu: bool, budget: bool) -> str:
    fits = _fitting_layout(cfg, model_cfg, overlap, on_gpu)
    if fits:
        return f"a layout would fit: {fits}"
    layouts = "no layout (deploy.train_tp / train_ep / train_pp / train_fsdp / infer_ep) fits"
    if budget:
        return f"{layouts}; raise deploy.device_memory_mb, lower context_len or use a smaller base"
    full = FP32_BYTES * model_cfg.param_counts()["total"]
    copies = full if on_gpu else full * (1 + cfg.deploy.devices)  # what no layout splits
    memory = cuda_memory()[0] if on_gpu else host_memory()[0]
    if copies > memory:
        who = "every device holds" if on_gpu else "the controller and every device hold"
        layouts += f", since {who} a full float32 copy ({gib(full)})"
    return f"{layouts}; use a smaller base or a machine with more memory"


def _fitting_layout(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, on_gpu: bool) -> str | None:
    """The least split layout over the same devices that fits, as the keys to set."""
    n = cfg.deploy.devices
    degrees = sorted({d for d in (1, 2, 4, 8, 16, 32, 64, n) if d <= n})
    trains = ([(1, 1, 1, False)] if cfg.algo.advantage == "gae"  # its critic trains full replicas only
              else [(tp, ep, pp, fsdp) for tp in degrees for ep in degrees for pp in degrees for fsdp in (False, True)])
    candidates = sorted(((*t, ie) for t in trains for ie in degrees),
                        key=lambda c: (c[0] * c[1] * c[2] * c[4], c[3], c[4]))
    for tp, ep, pp, fsdp, ie in candidates:
        layout = dict(train_tp=tp, train_ep=ep, train_pp=pp, train_fsdp=fsdp, infer_ep=ie)
        plan = _plan(cfg, model_cfg, overlap, layout)
        if plan is not None and _shortfall(cfg, plan, model_cfg, on_gpu) is None:
            return _keys(cfg.deploy, layout)
    return None


def _keys(deploy: DeployConfig, layout: dict) -> str:
    """`layout` as the keys to set: those that differ from the run's, or from their defaults."""
    keys = []
    for key, value in layout.items():
        if value != getattr(deploy, key) or value != (False if key == "train_fsdp" else 1):
            keys.append(f"deploy.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(keys)


def _plan(cfg: TrainConfig, model_cfg: ModelConfig, overlap: bool, layout: dict) -> DeploymentPlan | None:
    """The plan of `cfg.deploy` with `layout`, or None where the layout is not valid there."""
    if layout["infer_ep"] > 1 and cfg.rollout.backend != "native":
        return None  # an expert-parallel rollout runs on the native engine (`trainer._check_train_layout`)
    try:
        plan = DeploymentPlan.build(dataclasses.replace(cfg.deploy, **layout), overlap=overlap)
        plan.parallel_layout().validate(len(plan.train), model_cfg)
        plan.inference_layout().validate(len(plan.rollout), model_cfg)
    except ValueError:
        return None
    return plan
