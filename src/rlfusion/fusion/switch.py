"""The train↔rollout switch of one device, for every deployment mode: what moves, in which
phase, and what the device's memory ledger sees.

    entering rollout                                     entering training
    colocated / fully shared, plain actor:
      grads freed, optimizer state → host pool             optimizer state ← host pool
      KV cache allocated                                   KV cache released (right after rollout)
    colocated, actor in a training layout (TP / EP / PP / FSDP):
      grads freed, shards → replica in buckets             replica freed, shards back from host,
      (collective; optimizer state → host pool,            optimizer state back before the update
      then the shards → host pool)
    fully shared, reference role:
      reference weights live on host; they come in for the reference pass and go out after it
    separated (rollout devices ≠ train devices):
      after each update every train device sends each rollout device the pieces of its shards
      that device's replica keeps (`shard_sync.ShardSync`, called by the device worker)
    hybrid (full replicas; the train devices generate too):
      after each update the first train device broadcasts every parameter and persistent
      buffer to the rollout devices in buckets of `bucket_bytes` (`buckets.plan_buckets`)

`DeviceSwitch` holds the state that moves (host pools, the engine's KV cache, the replica) and
the device's `MemoryLedger`; the device worker calls it around its roles' work and never moves
optimizer state, caches or weights itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.fusion.buckets import pack, plan_buckets, specs_of, unpack
from rlfusion.fusion.memory import MemoryLedger
from rlfusion.fusion.offload import HostPool, optimizer_tensors
from rlfusion.fusion.reshard import infer_to_train, train_to_infer
from rlfusion.model import lora


class DeviceSwitch:
    """One device's switch. `policy` is what the engine generates from, `train_model` what the
    optimizer updates (the same module unless the actor trains in a layout, `pm`, whose
    parameters are then the trained ones); `engine` is the rollout engine (None on a device
    without rollout): the native one generates from `policy` itself and only its KV cache
    comes and goes; one that holds its own weights (vLLM) also gets the policy's weights loaded
    in buckets whenever they changed, and sleeps at level 2 (weights dropped too) on a device
    whose actor trains, level 1 elsewhere. `where` is the device's torch device: on CUDA the
    ledger also reads the allocator's peaks and every switch hands freed blocks back to the
    driver (`torch.cuda.empty_cache`). `span(phase)` records a span of the device's timeline.
    `budget_bytes`: the device's memory budget (`deploy.device_memory_mb`, resolved by
    `runtime.base_fit.device_budget`; 0 = none): every `account()` that finds the ledger's device
    total above it raises `MemoryBudgetError`, which stops the run."""

    def __init__(self, device: int, policy: torch.nn.Module, train_model: torch.nn.Module, engine: Any,
                 bucket_bytes: int, fully_shared: bool, span: Callable[[str], Any],
                 where: torch.device = torch.device("cpu"), budget_bytes: int = 0, merge_adapters: bool = False):
        self.device, self.policy, self.train_model, self.engine = device, policy, train_model, engine
        # LoRA (`optim.lora_rollout`, `deployment.lora_merged`): the policy generates with its
        # adapters folded into its weights — a replica as it is filled (or a rollout device's,
        # kept merged), the trained model itself for the rollout only
        self.merge_adapters = merge_adapters
        self.bucket_bytes, self.fully_shared, self.span = bucket_bytes, fully_shared, span
        self.where = torch.device(where)
        self.ledger = _ledger(device, self.where, budget_bytes)
        self.optimizer_pool, self.reference_pool = HostPool(), HostPool()
        self.weight_pool = HostPool()  # a training layout's shards while its replica generates
        self.pm: Any = None  # the actor's training layout (ParallelModel), when it has one
        self.optimizer: torch.optim.Optimizer | None = None
        self.critic: Any = None  # (model, optimizer) of PPO's value model: resident in every phase
        self.reference: torch.nn.Module | None = None
        self.offloads = self.restores = 0  # optimizer state moves to host and back (the ledger's count)
        self.loads = 0  # weight loads into an engine that holds its own (the ledger's count)
        self.stale_engine = engine is not None and engine.holds_weights  # its weights lag the policy's
        if engine is not None:
            engine.sleep(1)  # memory only while generating

    def attach(self, *, optimizer: torch.optim.Optimizer | None = None, pm: Any = None,
               reference: torch.nn.Module | None = None, critic: Any = None) -> None:
        """The roles' state this switch moves (set once the roles exist)."""
        if optimizer is not None:
            self.optimizer = optimizer
        if pm is not None:
            self.pm = pm
        if critic is not None:
            self.critic = critic
        if reference is not None:
            self.reference = reference
            if self.fully_shared:
                self.reference_pool.offload(reference.parameters())
        self.account()

    # ---- colocated: rollout ↔ train on the same device ----

    @contextmanager
    def rollout(self, phase: str = "rollout") -> Iterator[None]:
        """The body (a rollout, or an evaluation: `phase` names its timeline span) runs in the
        inference layout (optimizer state on host, grads freed, KV cache in, a full replica in a
        training layout); training state comes back afterwards, even if the body fails."""
        with self.span("switch"), self.ledger.phase("switch"):
            self._enter_rollout()
        try:
            with self.span(phase), self.ledger.phase("rollout"):
                yield
        except BaseException:
            try:  # the body's error is the news: a switch back that fails after it must not hide it
                with self.span("switch"), self.ledger.phase("switch"):
                    self._leave_rollout()
            except Exception:  # noqa: BLE001
                pass
            raise
        with self.span("switch"), self.ledger.phase("switch"):
            self._leave_rollout()

    def _enter_rollout(self) -> None:
        if self.pm is not None:  # train layout → replica, bucket by bucket (collective)
            self.optimizer.zero_grad(set_to_none=True)
            offload = not self.optimizer_pool.entries  # not already on host (no update since)
            stats = train_to_infer(self.pm, self.policy, self.bucket_bytes,
                                   optimizer=self.optimizer if offload else None,
                                   pool=self.optimizer_pool if offload else None)
            if self.merge_adapters:  # folded into the replica, which is refilled for the next rollout
                lora.refilled(self.policy)
                lora.merge(self.policy)
            self.offloads += offload and bool(self.optimizer_pool.entries)
            # the state before the bucket: the optimizer state and grads went to host before the
            # first bucket came (else the peak would count them and the bucket at once)
            self.account()
            self.ledger.set("buckets", stats.peak_extra_bytes)  # the largest bucket in flight
            self.account()
            self.ledger.set("buckets", 0)
            self.weight_pool.offload(self.pm.parameters())  # the shards wait on host: the replica generates
        elif self.optimizer is not None and not self.optimizer_pool.entries:
            self.optimizer.zero_grad(set_to_none=True)  # stale after the step
            moved = self.optimizer_pool.offload(optimizer_tensors(self.optimizer))
            self.offloads += moved.num_storages > 0  # (none before the first update: AdamW's state is lazy)
            self.account()
        if self._merges_trained_model:
            lora.merge(self.policy)  # (out again after the rollout: the optimizer steps the adapters alone)
        self._return_memory()
        self.engine.wake_up()
        if self.stale_engine:
            with torch.no_grad():
                self.engine.load_state(self.policy.state_dict(), self.bucket_bytes)
            self.stale_engine, self.loads = False, self.loads + 1
        self.account()

    def _leave_rollout(self) -> None:
        # an engine with its own weights on a device that trains drops them (they change)
        level = 2 if self.engine.holds_weights and self.optimizer is not None else 1
        self.engine.sleep(level)
        self.stale_engine = self.stale_engine or (self.engine.holds_weights and level == 2)
        if self.pm is not None:  # the replica never outlives the rollout; the shards come back
            infer_to_train(self.pm, self.policy, pool=self.weight_pool)
        if self._merges_trained_model and lora.is_merged(self.policy):
            lora.unmerge(self.policy)
        self._return_memory()
        self.account()

    @property
    def _merges_trained_model(self) -> bool:
        """LoRA, merged rollout on a device whose policy is the model it trains (no layout): the
        adapters go into its weights for each rollout and out after it; each merge and unmerge
        rounds the frozen base by up to an ulp (logits ~1e-6 after 1000 rollouts, fp32)."""
        return self.merge_adapters and self.pm is None and self.optimizer is not None

    def policy_changed(self) -> None:
        """The policy's weights changed outside an update (a checkpoint loaded): an engine
        holding its own loads them before it next generates."""
        self.stale_engine = self.engine is not None and self.engine.holds_weights

    def _return_memory(self) -> None:
        """On CUDA, hand the blocks the switch freed back to the driver, so the next phase (or
        another process on the GPU, such as vLLM's engine core) can take them."""
        if self.where.type == "cuda":
            torch.cuda.empty_cache()

    def enter_train(self) -> None:
        """Optimizer state back on the device before an update (or a checkpoint of it)."""
        if self.optimizer_pool.entries:
            with self.span("switch"), self.ledger.phase("switch"):
                self.optimizer_pool.restore()
                self.restores += 1
                self.account()

    @contextmanager
    def train(self) -> Iterator[None]:
        self.enter_train()
        with self.span("train"), self.ledger.phase("train"):
            yield
            self.account()
        self.policy_changed()

    @contextmanager
    def reference_pass(self) -> Iterator[None]:
        """Fully shared: the reference weights come in from host for the pass and go back."""
        with self.span("reference"), self.ledger.phase("reference"):
            if self.reference_pool.entries:
                self.reference_pool.restore()
                self.account()
            try:
                yield
            finally:
                if self.fully_shared and self.reference is not None:  # (None: LoRA's reference is the policy's base)
                    self.reference_pool.offload(self.reference.parameters())
                    self.account()

    # ---- separated: the new weights go from the train devices to the rollout devices ----

    def broadcast_weights(self, src: int, group: Any, joins: bool) -> int:
        """Hybrid mode (full replicas): every parameter and persistent buffer (the routers'
        expert biases), or with LoRA only the adapters (the base is frozen and every device
        loaded it), from global rank `src` to the other members of `group`, packed into
        buckets of `bucket_bytes`; returns bytes sent or received (0 on a device that is not a
        member: `joins` False)."""
        if not joins:
            return 0
        # meet first, outside the span: with StaleSync's overlap the train device gets here while
        # the rollout device is still generating, and waiting is idle time, not transfer
        dist.barrier(group=group)
        with self.span("transfer"), lora.taken_out(self.policy):
            state = lora.trained_state(self.policy)  # every tensor, or with LoRA the adapters only
            moved = 0
            with torch.no_grad():
                for bucket in plan_buckets(specs_of(state), self.bucket_bytes):
                    # on this device on every member (on GPUs the sender's bucket must travel
                    # where the receivers' wait: NCCL)
                    flat = pack(bucket, state).to(self.where)
                    dist.broadcast(flat, src=src, group=group)
                    for name, view in unpack(bucket, flat).items():
                        state[name].copy_(view)
                    moved += flat.numel() * flat.element_size()
            self.policy_changed()
            return moved

    # ---- the ledger ----

    def account(self) -> None:
        """Tracked tensor bytes per category (CPU has no allocator to ask; activations are not
        counted); `MemoryBudgetError` if the device now holds more than its budget."""
        led = self.ledger
        led.track("weights", list(self.policy.parameters()))
        train = list(self.pm.parameters() if self.pm is not None else self.train_model.parameters())
        if self.pm is not None:  # the actor's shards (its stages) in its training layout
            led.track("weights", train, name="train")
            led.set("weights", self.weight_pool.host_bytes, location="host", name="train")
        if self.optimizer is not None:
            led.track("optimizer", optimizer_tensors(self.optimizer))
            led.track("grads", [p.grad for p in train if p.grad is not None])
            led.set("optimizer", self.optimizer_pool.host_bytes, location="host")
        if self.engine is not None:
            led.set("kv_cache", self.engine.cache_bytes)
            led.set("kv_cache", self.engine.saved_bytes, location="host", name="paused")  # rows kept for resumption
        if self.critic is not None:
            model, optimizer = self.critic
            led.track("weights", list(model.parameters()), name="critic")
            led.track("optimizer", optimizer_tensors(optimizer), name="critic")
        if self.reference is not None:
            led.track("weights", list(self.reference.parameters()), name="reference")
            led.set("weights", self.reference_pool.host_bytes, location="host", name="reference")
        led.check_budget(f"device {self.device}")

    def memory(self) -> dict[str, Any]:
        """Per-phase peaks (bytes) since the last call ("peaks/PHASE", and the allocator's
        "allocator_peaks/PHASE"; "actor_weight_peaks/PHASE": the actor's weights alone, the most
        of the policy or replica plus the most of its training shards), the device's budget ("budget_bytes", 0 = none), the zero-redundancy check (one bucket allowed: a training
        layout's reshard fills the replica through one) and how often the optimizer state went to
        host and came back, since the last call."""
        peaks = self.ledger.peaks()
        ok = True
        if {"switch", "train", "rollout"} <= set(peaks):
            ok, _ = self.ledger.check_zero_redundancy(bucket_bytes=self.bucket_bytes if self.pm is not None else 0)
        allocator = self.ledger.allocator_peaks()
        # the actor's weights on the device per phase: the policy (or its rollout replica) and a
        # training layout's shards (the reference's and critic's copies not counted)
        policy, shards = self.ledger.part_peaks("weights"), self.ledger.part_peaks("weights", "train")
        self.ledger = self.ledger.fresh()
        out = {**{f"peaks/{phase}": v for phase, v in peaks.items()},
               **{f"actor_weight_peaks/{phase}": v + shards.get(phase, 0) for phase, v in policy.items()},
               **{f"allocator_peaks/{phase}": v for phase, v in allocator.items()},
               "budget_bytes": self.ledger.budget_bytes, "zero_redundancy": ok, "offloads": self.offloads, "restores": self.restores, "engine_loads": self.loads}
        self.offloads = self.restores = self.loads = 0
        return out


def _ledger(device: int, where: torch.device, budget_bytes: int) -> MemoryLedger:
    if where.type == "cuda":  # the allocator's peaks per phase beside the tracked tensors
        return MemoryLedger(f"cuda:{where.index or 0}", read_allocator=True, budget_bytes=budget_bytes)
    return MemoryLedger(f"device{device}", budget_bytes=budget_bytes)
