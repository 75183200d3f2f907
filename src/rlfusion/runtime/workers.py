"""`DeviceWorker`: one device — a Ray actor, or an object in the driver's process (the local
backend) — hosting the roles its `DeploymentPlan` gives it around one `DeviceSwitch`, one queue
client and one span log (`role_context.py`): the generator (rollouts, evaluation), the scorer
(reward, reference, shared scoring) and the learner (advantages, update, weight sync, state). It
loads the base, builds the roles, joins the device world, holds the device's queue shard
(`queue.shard_host`), answers `report`, and hands each controller command to its role.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.fusion.reshard import build_inference_model, load_whole, release, split_experts
from rlfusion.fusion.shard_sync import ShardSync
from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.model import lora
from rlfusion.model.checkpoint import load_base
from rlfusion.model.hf import is_hf_checkpoint
from rlfusion.obs.metrics import NumberPacker
from rlfusion.obs.peak import matmul_peak_flops
from rlfusion.obs.timeline import pack_spans
from rlfusion.queue.shard_host import StorageHost
from rlfusion.rl.tasks import make_task
from rlfusion.runtime.base_fit import device_budget, rollout_kv_rows
from rlfusion.runtime.dataflow import records_routes
from rlfusion.runtime.deployment import DeploymentPlan, lora_merged
from rlfusion.runtime.device_binding import bind_device, join_world, listening_store, on_host
from rlfusion.runtime.generator import Generator
from rlfusion.runtime.heap import freeze_long_lived
from rlfusion.runtime.learner import Learner
from rlfusion.runtime.role_context import COMPUTE_DTYPES, RoleContext, SpanLog
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.scorer import Scorer
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.train_layout import join_layout_groups


class DeviceWorker(StorageHost):
    """Device `device` of `plan`; `queue`: the run's DistQueue client. A role the device lacks is None."""

    def __init__(self, device: int, plan: DeploymentPlan, cfg: TrainConfig, base_path: str, queue: Any = None):
        torch.set_num_threads(cfg.deploy.threads_per_device if cfg.deploy.backend == "ray" else cfg.threads)
        torch.manual_seed(cfg.seed)
        self.device, self.plan, self.cfg = device, plan, cfg
        StorageHost.__init__(self, queue, device)  # the device's rows live here, served to peers (`shard_host`)
        where = bind_device(plan.device, device)  # this device's torch device
        roles = plan.roles(device)
        model, tokenizer, _ = load_base(base_path, device=where, max_seq_len=cfg.context_len or None)
        spec = cfg.optim.lora_spec(cfg.seed)
        if spec is not None:  # LoRA: adapters on the frozen base (drawn alike on every device)
            lora.attach(model, spec)
        # the engine's `policy`: the model, or in a training layout a replica filled for each rollout only
        in_layout = plan.train_layout and device in plan.train
        self.policy = build_inference_model(model.config, device=where) if in_layout else model
        if spec is not None and in_layout:
            lora.attach(self.policy, spec)
        # a policy this device does not train (a rollout device's, or a training layout's replica)
        # may generate with the adapters folded into its weights
        merged = spec is not None and lora_merged(plan, device, cfg.optim.lora_rollout)
        if merged and device not in plan.train:
            lora.merge(self.policy)  # (kept merged: each sync takes the old adapters out, puts the new in)
        dtype = COMPUTE_DTYPES[cfg.deploy.precision]
        self.matmul_peak_flops = matmul_peak_flops(repeats=3, device=where, dtype=dtype)  # rates' yardstick
        hf_base = base_path if is_hf_checkpoint(base_path) else None  # what vLLM can serve as it is
        stage = None
        if "rollout" in roles:  # its KV cache takes what the device's memory budget leaves (`deploy.device_memory_mb`)
            rows = rollout_kv_rows(cfg, model.config, plan, device)
            stage = RolloutStage(self.policy, tokenizer, dataclasses.replace(cfg.rollout, max_num_seqs=rows),
                                 cfg.seed + 1000 * device, hf_base,
                                 COMPUTE_DTYPES[cfg.rollout.precision or cfg.deploy.precision], records_routes(cfg),
                                 cfg.env, cfg.reward_failure_limit, cfg.deterministic)
        if in_layout and plan.infer_ep == 1:
            release(self.policy)  # resident only while generating (split first with infer_ep: `connect`)
        spans = SpanLog()
        switch = DeviceSwitch(device, self.policy, model, stage.engine if stage is not None else None,
                              int(cfg.deploy.bucket_mb * 2**20), plan.mode == "fully_shared", spans.span, where,
                              budget_bytes=device_budget(cfg), merge_adapters=merged)
        self.ctx = RoleContext(device, plan, cfg, where, dtype, switch, queue, spans)
        task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
        scores = {"reward", "reference"} & set(roles)
        self.scorer = Scorer.build(self.ctx, roles, model, tokenizer, task) if scores else None
        self.generator = Generator(self.ctx, stage, task, tokenizer, self.scorer) if stage is not None else None
        self.learner: Learner | None = None  # a train device's, built in `connect`
        self._model = model  # the learner's to train, until `connect`
        self.sync_group: Any = None  # hybrid: the first train device and the rollout devices (the weight broadcast)
        # separated: the weight sync, shard to shard
        self.shard_sync = (ShardSync(list(plan.train), list(plan.rollout), int(cfg.deploy.bucket_mb * 2**20),
                                     adapters_only=spec is not None) if plan.separated else None)
        self._store = None  # device 0: the rendezvous store of the device world
        self._packer = NumberPacker()  # the report recurs every step

    # ---- joining the device world ----

    def address(self) -> tuple[str, int]:
        """Start the device world's rendezvous here: a store on a port the OS picks (held from now
        on), on this node's Ray cluster address only (loopback on one node). Returns both."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store = listening_store(host, self.plan.num_devices)
        return host, self._store.port

    def connect(self, address: tuple[str, int] | None) -> None:
        """Join the device world through the rendezvous store at `address` (device 0's
        `address()`; None: a world of one, no process group) and build the learner."""
        plan, train_group = self.plan, None
        if address is not None:
            train_group, self.sync_group, rollout_group = join_world(
                self.device, plan.num_devices, self.ctx.where, address, self._store if self.device == 0 else None,
                [(list(plan.train), None), (sorted({plan.train[0], *plan.rollout}), None),
                 (list(plan.rollout), "gloo")])  # the rollout devices' stop-rule counts: CPU tensors
            if self.generator is not None:
                self.generator.rollout_group = rollout_group
            if plan.train_layout and self.device not in plan.train:
                join_layout_groups(plan, self.cfg, self.policy.config)
        if self.device in plan.train:
            self.learner = Learner(self.ctx, self._model, self.policy, self.matmul_peak_flops, train_group)
        self._model = None
        if plan.infer_ep > 1:
            self._split_replica()

    def _split_replica(self) -> None:
        """The inference layout: the rollout replica keeps only this device's routed experts
        (every device joins the group creation), and its engine steps in lock-step with the
        other devices of its expert-parallel group."""
        plan = self.plan
        mesh = split_experts(self.policy, plan.inference_layout(), ranks=list(plan.rollout))
        if mesh is not None and self.generator is not None:
            self.generator.stage.engine.lockstep = mesh.ep.group
        if plan.train_layout and self.device in plan.train:
            release(self.policy)  # filled from the training shards for each rollout
        self.ctx.switch.account()

    def settle(self) -> None:
        """Setup is over (after `connect`): full collections skip the imports, model and task (`heap.py`)."""
        freeze_long_lived()

    def ping(self) -> int:
        return self.device

    # ---- the controller's commands (`devices.Devices`), each the owning role's ----

    def generate(self, *args, **kw): return self.generator.generate(*args, **kw)
    def rollout_groups(self, *args, **kw): return self.generator.rollout_groups(*args, **kw)
    def evaluate(self, *args, **kw): return self.generator.evaluate(*args, **kw)
    def rng_state(self, *args, **kw): return self.generator.rng_state(*args, **kw)
    def set_rng_state(self, *args, **kw): self.generator.set_rng_state(*args, **kw)
    def paused(self, *args, **kw): return self.generator.paused(*args, **kw)
    def load_paused(self, *args, **kw): self.generator.load_paused(*args, **kw)
    def score(self, *args, **kw): self.scorer.score(*args, **kw)
    def update(self, *args, **kw): return self.learner.update(*args, **kw)
    def state(self, *args, **kw): return self.learner.state(*args, **kw)
    def critic_state(self, *args, **kw): return self.learner.critic_state(*args, **kw)
    def load_critic_state(self, *args, **kw): self.learner.load_critic_state(*args, **kw)

    def weights(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The policy's full weights, or with LoRA its adapters (a train device's: `Learner.weights`)."""
        own = on_host(lora.trained_state(self.policy)) if keep and self.learner is None else None
        return self.learner.weights(keep) if self.learner is not None else own

    def load_state(self, state: dict[str, Any]) -> None:
        """A checkpoint's policy weights, or adapters (and on a train device its optimizer state
        and version)."""
        if self.learner is not None:
            self.learner.load_state(state)
        else:
            with lora.taken_out(self.policy):
                load_whole(self.policy, state["model"], part=lora.trained_part(self.policy))
            self.ctx.switch.policy_changed()

    def sync_weights(self) -> int:
        """The new weights to the rollout devices that do not train. Separated: shard to shard
        (`fusion.shard_sync`: every train device sends each rollout device the pieces of its
        shards that device's replica keeps); hybrid: the first train device broadcasts the full
        replica's weights (`Learner.sync_weights`). Bytes this device sent or received."""
        if self.shard_sync is None:
            return (self.learner.sync_weights(self.sync_group) if self.learner is not None else
                    self.ctx.switch.broadcast_weights(self.plan.train[0], self.sync_group, joins=True))
        # meet first, outside the span: with StaleSync's overlap the train devices get here while the
        # rollout devices are still generating, and waiting is idle time (separated: the world is both)
        dist.barrier()
        with self.ctx.spans.span("transfer"):
            if self.learner is not None:
                return self.shard_sync.sync(self.learner.trained).sent_bytes
            with lora.taken_out(self.policy):
                stats = self.shard_sync.sync(replica=self.policy)
            self.ctx.switch.policy_changed()
            return stats.recv_bytes

    def report(self) -> tuple[Any, Any]:
        """Since the last call: spans, the engine's counts (with the stop-rule sums), the memory
        ledger's peaks and checks, the bytes this device moved through the queue — packed
        (`timeline.pack_spans`; `NumberPacker` under '/'-joined names, `Devices.reports`)."""
        spans = self.ctx.spans.take()
        numbers: dict[str, float] = {}
        if self.generator is not None:
            numbers.update({f"engine/{k}": v for k, v in self.generator.take_stats().items()})
        numbers.update({f"memory/{k}": v for k, v in self.ctx.switch.memory().items()})
        numbers["matmul_peak_gflop_per_s"] = self.matmul_peak_flops / 1e9
        numbers.update(self.ctx.take_queue_bytes())
        return pack_spans(spans), self._packer.pack(numbers)
