"""Device workers: one process per device hosting the RL roles its `DeploymentPlan` gives it.
The driver reaches them through `ray_devices.RayDevices` and its stage-shaped proxies.

    driver (RLTrainer + DistQueue)
      │ generate(problems) ─► rollout devices   (engine over the policy weights)
      │ score(trajs)       ─► reward device      (rule or reward model)
      │ ref_logprobs(...)  ─► reference devices  (frozen base, split by tokens)
      │ update(shards)     ─► train devices      (full replica each, or the actor's shards in a
      │                                           training layout; gradients summed over the
      │                                           train group: one full-batch step)
      └ sync_weights()     ─► separated mode: train device 0 broadcasts the new weights to the
                              rollout devices in contiguous buckets of `deploy.bucket_mb`

In colocated and fully-shared modes the engine generates from the very tensors the optimizer
updates, so the switch to rollout moves no weights: it offloads the optimizer state to host and
frees the gradients, and allocates the KV cache; the switch back releases the KV cache and
restores the optimizer state. With a training layout (`deploy.train_tp` / `train_ep` /
`train_fsdp`) the actor trains on its shards instead (`train_model`: attention heads and dense
FFN columns over TP, routed experts over EP, data parallel across the TP groups, replicated or
FSDP-sharded), and the engine generates
from a full replica per device (`policy`): the switch to rollout fills the replica from the
shards in buckets of `deploy.bucket_mb` (`fusion/reshard.py`, collective over the devices), the
switch back frees it. In fully-shared mode the reference weights also live on host except
while the reference runs. Every device keeps a `MemoryLedger` (bytes per category and
phase) and checks the zero-redundancy rule: peak during a switch ≤ max(train, rollout peak).
`ray_devices.RayDevices` starts one Ray actor per device in a placement group and joins them in
one gloo (CPU) / nccl (CUDA) world; `deploy.backend=local` keeps the stages in the driver instead.

Not here: the driver side (`ray_devices.py`), the order of stages (the trainer) and which
columns flow (`dataflow.py`).
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from rlfusion.fusion.memory import MemoryLedger
from rlfusion.fusion.offload import HostPool, local_tensor, optimizer_tensors
from rlfusion.fusion.reshard import build_inference_model, infer_to_train, release, train_to_infer
from rlfusion.model.checkpoint import load_base
from rlfusion.parallel.api import ParallelModel, lm_loss
from rlfusion.parallel.data_parallel import apply_fsdp
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.layout import ParallelLayout
from rlfusion.parallel.mesh import build_mesh
from rlfusion.parallel.tensor_parallel import apply_tensor_parallel
from rlfusion.rl.problem import Problem
from rlfusion.rl.rewards import load_reward_fn
from rlfusion.rl.tasks import make_task
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.stages import CriticStage, ReferenceStage, RewardStage, RolloutStage
from rlfusion.runtime.heap import freeze_long_lived
from rlfusion.runtime.train_config import TrainConfig

SCORE_CHUNK_TOKENS = 1024  # a device scores its pool this many tokens at a time (a peer may take the rest)


def _no_stop_sync() -> dict[str, float]:
    return {"stop_sync_calls": 0.0, "stop_sync_s": 0.0}


def listening_store(host: str, world_size: int) -> dist.TCPStore:
    """The rendezvous store's server, listening on `host` alone. torch binds every interface
    whatever host it is given, so the socket is bound here and handed over as the listen fd."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # the store owns the socket from here (detach: Python's socket object must not close it)
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


class DeviceWorker:
    """The roles of one device. Every span of work is recorded as (phase, wall start, wall end)."""

    def __init__(self, device: int, plan: DeploymentPlan, cfg: TrainConfig, base_path: str):
        torch.set_num_threads(cfg.deploy.threads_per_device if cfg.deploy.backend == "ray" else cfg.threads)
        torch.manual_seed(cfg.seed)
        self.device, self.plan, self.cfg = device, plan, cfg
        roles = plan.roles(device)
        model, tokenizer, _ = load_base(base_path)
        # `train_model` is what the optimizer updates, `policy` what the engine generates from:
        # one model, unless the actor trains in a layout (`train_tp` / `train_ep` / `train_fsdp`):
        # then its shards (applied in `connect`) and a full replica, filled from them before every
        # rollout
        self.layout = (ParallelLayout(dp=plan.train_dp, tp=plan.train_tp, ep=plan.train_ep)
                       if plan.train_layout and device in plan.train else None)
        self.train_model = model
        self.policy = model if self.layout is None else build_inference_model(model.config)
        self.pm: ParallelModel | None = None
        self._experts_of: dict[int, ExpertParallelExperts] = {}  # expert-parallel parameter → its module
        self.rollout = (RolloutStage(self.policy, tokenizer, cfg.rollout, cfg.seed + 1000 * device)
                        if "rollout" in roles else None)
        if self.layout is not None:
            release(self.policy)  # resident only while generating
        task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
        reward_fn = task.reward if cfg.reward == "task" else load_reward_fn(cfg.reward)
        self.reward = (RewardStage(reward_fn, tokenizer, cfg.algo, cfg.rollout.max_new_tokens,
                                   name=cfg.reward, timeout_s=cfg.reward_timeout_s)
                       if "reward" in roles else None)
        self.reference = (ReferenceStage(copy.deepcopy(model), cfg.rollout.temperature, cfg.optim.microbatch_tokens)
                          if "reference" in roles and cfg.algo.kl_coef else None)
        self.actor: ActorStage | None = None
        self.critic: CriticStage | None = None  # PPO's value model, next to the actor
        self.spans: list[tuple[str, float, float]] = []
        self.sync_group = self.rollout_group = None
        self.ledger = MemoryLedger(f"device{device}")
        # finished samples a peer may score (`generate(share=True)`, `take_finished`)
        self._pool: list[Trajectory] = []
        self._pooling = self._decoding = False
        self._stop_sync = _no_stop_sync()
        self._pool_lock = threading.Lock()
        self._pool_changed = threading.Condition(self._pool_lock)  # an offer, or the pool's state moved on
        self._store = None  # device 0: the rendezvous store of the device world
        self.optimizer_pool, self.reference_pool = HostPool(), HostPool()
        if self.rollout is not None:
            self.rollout.engine.runner.cache.release()  # allocated only while generating
        if self.reference is not None and plan.mode == "fully_shared":
            self.reference_pool.offload(self.reference.model.parameters())
        self._account()

    # ---- wiring ----

    def address(self) -> tuple[str, int]:
        """Start the rendezvous of the device world here: a store listening on a port the OS
        picks (held from now on, so no other process can take it first), on this node's
        address in the Ray cluster only (loopback on a single-node run). Returns that address
        and port."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store = listening_store(host, self.plan.num_devices)
        return host, self._store.port

    def connect(self, address: tuple[str, int] | None) -> None:
        """Join the device world through the rendezvous store at `address` (device 0's
        `address()`; None: a world of one, no process group) and build the actor."""
        train_group = None
        if address is not None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            store = self._store if self.device == 0 else dist.TCPStore(
                address[0], address[1], self.plan.num_devices, is_master=False)
            dist.init_process_group(backend, store=store, rank=self.device, world_size=self.plan.num_devices)
            # every rank creates every group, in the same order
            train_group = dist.new_group(list(self.plan.train))
            self.sync_group = dist.new_group(sorted({self.plan.train[0], *self.plan.rollout}))
            self.rollout_group = dist.new_group(list(self.plan.rollout), backend="gloo")  # CPU counts
        if self.device in self.plan.train:
            dp_group = train_group if len(self.plan.train) > 1 else None
            if self.layout is not None:
                dp_group = self._apply_layout()
            if self.cfg.algo.advantage == "gae":  # from the base weights, before any update
                if self.layout is not None:  # the driver refuses this first (trainer._check_train_layout)
                    raise ValueError("algo.advantage=gae needs full replicas: the critic sums its gradients "
                                     "over the data-parallel group itself, not over a training layout's")
                self.critic = CriticStage(self.train_model, self.cfg.algo, self.cfg.optim, dp_group=dp_group)
            self.actor = ActorStage(self.train_model, self.cfg.algo, self.cfg.optim, self.cfg.rollout.temperature,
                                    total_updates=self.cfg.max_steps, dp_group=dp_group, layout=self.pm,
                                    dp_sharded=self.plan.train_fsdp)
            self._account()

    def settle(self) -> None:
        """Setup is over (called once in the worker's own process, after `connect`): full garbage
        collections no longer walk the imports, model and task (`runtime/heap.py`)."""
        freeze_long_lived()

    def _apply_layout(self) -> Any:
        """Split the actor over its training layout: TP over `train_tp` consecutive train devices
        (attention heads, dense and shared-expert FFN columns), routed experts over `train_ep`
        devices, data parallel across the TP groups. Data parallel keeps a replica of the rest on
        each (`ActorStage` sums the replicas' gradients), or with `train_fsdp` shards it over them
        (FSDP2: parameters gathered per block for each pass, gradients reduce-scattered as sums,
        since the loss is normalized by the global batch); expert shards are summed over their
        expert-data-parallel group either way. Returns the data-parallel group (None with one TP
        group). Collective: every device joins."""
        mesh = build_mesh(self.layout, self.train_model.config)
        for block in self.train_model.layers:
            if self.layout.tp > 1:
                apply_tensor_parallel(block, mesh.device_mesh["tp"])
            if block.is_moe and self.layout.ep > 1:
                block.mlp.experts = ExpertParallelExperts(block.mlp.experts, mesh)
        if self.plan.train_fsdp:
            apply_fsdp(self.train_model, mesh.device_mesh["dp"], sum_gradients=True)
        self.pm = ParallelModel(mesh, [self.train_model], self.train_model.config, 1, lm_loss, torch.device("cpu"))
        self._experts_of = {id(p): m for m in self.pm.experts for p in m.parameters(recurse=False)}
        return mesh.group("dp") if self.layout.dp > 1 else None

    def ping(self) -> int:
        return self.device

    # ---- stage work ----

    def generate(self, problems: list[Problem], first_group_id: int, version: int,
                 score_here: bool = False, share: bool = False) -> list[Trajectory]:
        """Rollout; with `score_here` (reward and reference live on this device too) the new
        trajectories are also scored and given reference logprobs before they leave the device.

        With `share`, finished samples wait in a pool that `take_finished` (served on its own
        thread while this call runs) hands out, a chunk at a time, to an idle peer running
        `score_from`; this call then returns only the samples nobody took, scored here. The pool
        stays open while this device scores its own samples, `SCORE_CHUNK_TOKENS` at a time, so a peer
        that runs out of work shares that too and the two finish together."""
        if share and not score_here:
            raise ValueError("generate(share=True) needs score_here=True: the samples a peer takes are "
                             "scored there, the rest here")
        if not share:
            trajs = self._generate(problems, first_group_id, version)
            if score_here:
                self.score_and_reference(trajs)
            return trajs
        with self._pool_lock:
            self._pool, self._pooling, self._decoding = [], True, True
        mine: list[Trajectory] = []
        try:
            self._switched(lambda: self.rollout.generate(problems, first_group_id, version, on_finish=self._offer))
            with self._pool_changed:
                self._decoding = False  # from now on a helper takes even the last few samples
                self._pool_changed.notify_all()
            while chunk := self._take(SCORE_CHUNK_TOKENS):
                mine += self.score_and_reference(chunk)
        finally:
            with self._pool_changed:
                self._pool, self._pooling, self._decoding = [], False, False
                self._pool_changed.notify_all()  # a waiting helper learns at once that the pool closed
        return mine

    def _offer(self, traj: Trajectory) -> None:
        with self._pool_changed:
            self._pool.append(traj)
            self._pool_changed.notify_all()

    def _take(self, max_tokens: int, min_count: int = 1) -> list[Trajectory]:
        """The oldest pooled samples up to `max_tokens` tokens (at least one), if `min_count` wait."""
        with self._pool_lock:
            if len(self._pool) < min_count:
                return []
            n, tokens = 0, 0
            while n < len(self._pool) and (n == 0 or tokens + self._pool[n].num_tokens <= max_tokens):
                tokens += self._pool[n].num_tokens
                n += 1
            out, self._pool = self._pool[:n], self._pool[n:]
        return out

    def take_finished(self, min_count: int = 1, max_tokens: int = SCORE_CHUNK_TOKENS,
                      wait_s: float = 0.0) -> tuple[list[Trajectory], bool]:
        """Finished, not yet scored samples of the running `generate(share=True)`, up to
        `max_tokens` tokens, which are the caller's to score from now on, and whether its pool is
        still open (more may come). While this device still decodes, none unless `min_count`
        wait (more will come); once it scores its own, any that wait. With `wait_s`, an open pool
        with too few samples is waited on for up to that long: the answer comes as soon as
        enough are offered or the pool closes."""
        deadline = time.monotonic() + wait_s
        with self._pool_changed:
            while True:
                if not self._pooling:
                    return [], False
                if len(self._pool) >= (min_count if self._decoding else 1):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return [], True
                self._pool_changed.wait(left)
            decoding = self._decoding
        return self._take(max_tokens, min_count if decoding else 1), True

    def score_from(self, peer: Any, wait_s: float, min_count: int) -> list[Trajectory]:
        """Score `peer`'s finished samples (another device's worker, inside `generate(share=True)`)
        a chunk at a time until its pool closes. While it has fewer than `min_count` waiting, the
        peer holds each request up to `wait_s` and answers as soon as that changes, so this
        call ends the moment the pool closes."""
        import ray

        out: list[Trajectory] = []
        while True:
            taken, open_ = ray.get(peer.take_finished.options(concurrency_group="pool").remote(
                min_count, SCORE_CHUNK_TOKENS, wait_s))
            if taken:
                out += self.score_and_reference(taken)
            elif not open_:
                return out

    def score_and_reference(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Reward and (if this device holds one) reference logprobs, written into `trajs`."""
        if trajs:
            self.score(trajs)
            if self.reference is not None:
                self.reference_logprobs(trajs)
        return trajs

    def rollout_groups(self, groups: list, version: int, quota: int, must_finish: set[int],
                       drop_overdue: bool, score_here: bool = False) -> dict[str, Any]:
        """StaleSync's partial rollout (`RolloutStage.run_groups`) inside the same switch as
        `generate`; finished samples are scored here when reward and reference live here."""
        sync = self._sum_over_rollout_devices if len(self.plan.rollout) > 1 else None
        out = self._switched(lambda: self.rollout.run_groups(groups, version, quota, must_finish, drop_overdue, sync))
        if score_here:
            self.score_and_reference(out["finished"])
        return out

    def _sum_over_rollout_devices(self, *counts: int) -> list[int]:
        start = time.perf_counter()
        t = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(t, group=self.rollout_group)
        self._stop_sync["stop_sync_calls"] += 1
        self._stop_sync["stop_sync_s"] += time.perf_counter() - start  # waiting for the peers included
        return t.tolist()

    def _generate(self, problems: list[Problem], first_group_id: int, version: int) -> list[Trajectory]:
        return self._switched(lambda: self.rollout.generate(problems, first_group_id, version))

    def _switched(self, rollout):
        """Run `rollout()` in the inference layout: optimizer state to host and grads freed, KV
        cache in; the cache goes again afterwards, even if the rollout fails."""
        with self._span("switch"), self.ledger.phase("switch"):
            if self.pm is not None:  # train layout → replica, bucket by bucket (collective)
                self.actor.optimizer.zero_grad(set_to_none=True)
                offload = not self.optimizer_pool.entries  # not already on host (no update since)
                stats = train_to_infer(self.pm, self.policy, int(self.cfg.deploy.bucket_mb * 2**20),
                                       optimizer=self.actor.optimizer if offload else None,
                                       pool=self.optimizer_pool if offload else None)
                self.ledger.set("buckets", stats.peak_extra_bytes)  # the largest bucket in flight
                self._account()
                self.ledger.set("buckets", 0)
            elif self.actor is not None and not self.optimizer_pool.entries:  # train → rollout
                self.actor.optimizer.zero_grad(set_to_none=True)  # stale after the step
                self.optimizer_pool.offload(optimizer_tensors(self.actor.optimizer))
                self._account()
            self.rollout.engine.runner.cache.restore()
            self._account()
        try:
            with self._span("rollout"), self.ledger.phase("rollout"):
                trajs = rollout()
        finally:  # the cache (and a replica) never outlive the rollout, even a failed one
            with self._span("switch"), self.ledger.phase("switch"):
                self.rollout.engine.runner.cache.release()
                if self.pm is not None:  # the optimizer state comes back for the update
                    infer_to_train(self.pm, self.policy)
                self._account()
        return trajs

    def score(self, trajs: list[Trajectory]) -> list[tuple[float, float]]:
        with self._span("reward"):
            self.reward.score(trajs)
            return [(t.reward, t.metrics["correct"]) for t in trajs]

    def reference_logprobs(self, trajs: list[Trajectory]) -> list[list[float]]:
        with self._span("reference"), self.ledger.phase("reference"):
            if self.reference_pool.entries:  # fully shared: the reference weights come in for this
                self.reference_pool.restore()
                self._account()
            self.reference.logprobs(trajs)
            if self.plan.mode == "fully_shared":
                self.reference_pool.offload(self.reference.model.parameters())
                self._account()
            return [t.ref_logprobs for t in trajs]

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        if self.optimizer_pool.entries:
            with self._span("switch"), self.ledger.phase("switch"):
                self.optimizer_pool.restore()
                self._account()
        with self._span("train"), self.ledger.phase("train"):
            metrics = self.actor.update(trajs)
            self._account()
        return metrics

    def critic_values(self, trajs: list[Trajectory]) -> list[list[float]]:
        with self._span("critic"):
            self.critic.values(trajs)
            return [t.values for t in trajs]

    def critic_update(self, trajs: list[Trajectory]) -> dict[str, float]:
        with self._span("critic"), self.ledger.phase("train"):
            return self.critic.update(trajs)

    def critic_state(self) -> dict[str, Any]:
        return {"model": self.critic.model.state_dict(), "optimizer": self.critic.optimizer.state_dict()}

    def load_critic_state(self, part: str, state: dict[str, Any]) -> None:
        """`part` "model" or "optimizer" of the critic (every train device holds the same)."""
        getattr(self.critic, part).load_state_dict(state)

    def memory(self) -> dict[str, Any]:
        """Per-phase device peaks (bytes) since the last call, and the zero-redundancy check
        (one bucket allowed: a training layout's reshard fills the replica through one)."""
        peaks = self.ledger.peaks()
        ok = True
        if {"switch", "train", "rollout"} <= set(peaks):
            bucket = int(self.cfg.deploy.bucket_mb * 2**20) if self.pm is not None else 0
            ok, _ = self.ledger.check_zero_redundancy(bucket_bytes=bucket)
        self.ledger = _fresh_ledger(self.ledger)
        return {"peaks": peaks, "zero_redundancy": ok}

    def _account(self) -> None:
        """Tracked tensor bytes per category (CPU has no allocator to ask; activations are not
        counted)."""
        led = self.ledger
        led.track("weights", list(self.policy.parameters()))
        if self.train_model is not self.policy:  # the actor's shards in its training layout
            led.track("weights", list(self.train_model.parameters()), name="train")
        if self.actor is not None:
            led.track("optimizer", optimizer_tensors(self.actor.optimizer))
            led.track("grads", [p.grad for p in self.train_model.parameters() if p.grad is not None])
            led.set("optimizer", self.optimizer_pool.host_bytes, location="host")
        if self.rollout is not None:
            led.set("kv_cache", self.rollout.engine.runner.cache.nbytes)
        if self.critic is not None:  # resident in every phase
            led.track("weights", list(self.critic.model.parameters()), name="critic")
            led.track("optimizer", optimizer_tensors(self.critic.optimizer), name="critic")
        if self.reference is not None:
            led.track("weights", list(self.reference.model.parameters()), name="reference")
            led.set("weights", self.reference_pool.host_bytes, location="host", name="reference")

    def sync_weights(self) -> int:
        """Separated mode: train device 0 broadcasts every parameter and persistent buffer (the
        routers' expert biases) to the rollout devices, packed into contiguous buckets of
        `deploy.bucket_mb`. Returns bytes sent or received."""
        if self.device not in self.plan.rollout and self.device != self.plan.train[0]:
            return 0
        # meet first, outside the span: with StaleSync's overlap the train device gets here while
        # the rollout device is still generating, and waiting is idle time, not transfer
        dist.barrier(group=self.sync_group)
        with self._span("transfer"):
            params = list(self.policy.state_dict().values())
            limit = int(self.cfg.deploy.bucket_mb * 2**20)
            moved = 0
            for bucket in _buckets(params, limit):
                flat = torch.cat([p.reshape(-1) for p in bucket])
                dist.broadcast(flat, src=self.plan.train[0], group=self.sync_group)
                offset = 0
                for p in bucket:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                moved += flat.numel() * flat.element_size()
            return moved

    # ---- state ----

    def weights(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The policy's full weights (in a training layout: gathered, collective over the train
        devices; with `keep=False` this device only joins the gathers and returns None)."""
        if self.pm is not None:
            return self.pm.full_state_dict(keep=keep)
        return self.policy.state_dict() if keep else None

    def state(self, keep: bool = True) -> dict[str, Any] | None:
        """The policy weights and optimizer state, whole (train devices hold identical replicas;
        in a training layout the shards are gathered: every train device must call this, and
        one with `keep=False` drops each gathered tensor at once and returns None)."""
        if self.optimizer_pool.entries:  # offloaded for a rollout whose update was skipped
            self.optimizer_pool.restore()
            self._account()
        optimizer = self.actor.optimizer.state_dict()
        if self.pm is not None:
            params = [p for group in self.actor.optimizer.param_groups for p in group["params"]]
            whole = {}
            for i, st in sorted(optimizer["state"].items()):
                gathered = {k: self._whole(v, params[i]) for k, v in st.items()}  # collective
                if keep:
                    whole[i] = gathered
            optimizer = {**optimizer, "state": whole}
        weights = self.weights(keep)
        return {"model": weights, "optimizer": optimizer, "version": self.actor.version} if keep else None

    def _whole(self, t: Any, param: torch.Tensor) -> Any:
        """A parameter's (or its optimizer state's) whole tensor from this device's shard:
        TP shards gathered over their mesh, expert shards over their expert-parallel group
        (collective: every train device calls it in the same order)."""
        if isinstance(t, DTensor):
            return t.full_tensor()
        experts = self._experts_of.get(id(param))
        if experts is not None and isinstance(t, torch.Tensor) and t.shape == param.shape:
            return experts.gather_full(t)
        return t

    def _part(self, whole: Any, param: torch.Tensor) -> Any:
        """This device's part of a whole tensor, laid out like `param` (the inverse of `_whole`)."""
        if not isinstance(whole, torch.Tensor):
            return whole
        if isinstance(param, DTensor):
            return distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        experts = self._experts_of.get(id(param))
        if experts is not None and whole.shape[1:] == param.shape[1:] and whole.shape[0] != param.shape[0]:
            assert experts.expert_to_slot_E is None, "expert placement moved: experts are not in logical order"
            return whole[experts.first_expert:experts.first_expert + experts.num_local]
        return whole

    def load_state(self, state: dict[str, Any]) -> None:
        if self.pm is None:
            self.policy.load_state_dict(state["model"])
        else:  # each device keeps its shard of the whole tensors; the replica is filled per rollout
            with torch.no_grad():
                for name, t in self.train_model.state_dict(keep_vars=True).items():
                    local_tensor(t).copy_(local_tensor(self._part(state["model"][name], t)))
        if self.actor is not None:
            optimizer = state["optimizer"]
            if self.pm is not None:  # whole optimizer states → this device's shards
                params = [p for group in self.actor.optimizer.param_groups for p in group["params"]]
                optimizer = {**optimizer, "state": {
                    i: {k: self._part(v, params[int(i)]) if k != "step" else v for k, v in st.items()}
                    for i, st in optimizer["state"].items()}}
            self.actor.optimizer.load_state_dict(optimizer)
            self.actor.version = state["version"]

    def skip_update(self) -> None:
        """No sample carried signal this step: the policy is unchanged, its version moves on."""
        self.actor.skip_update()

    def rng_state(self) -> torch.Tensor:
        return self.rollout.rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.rollout.set_rng_state(state)

    def engine_stats(self) -> dict[str, float]:
        """The rollout engine's pass counts and seconds since the last call, and the partial
        rollouts' stop-rule sums (calls and seconds, waiting for the other devices included)."""
        if self.rollout is None:
            return {}
        out, self._stop_sync = {**self.rollout.engine.runner.take_stats(), **self._stop_sync}, _no_stop_sync()
        return out

    def take_spans(self) -> list[tuple[str, float, float]]:
        out, self.spans = self.spans, []
        return out

    @contextmanager
    def _span(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.spans.append((phase, start, time.time()))


def _fresh_ledger(old: MemoryLedger) -> MemoryLedger:
    """A ledger with the same current bytes and no phase peaks yet (peaks are per step)."""
    new = MemoryLedger(old.device)
    for location, cats in old.snapshot().items():
        for category, nbytes in cats.items():
            if nbytes:
                new.set(category, nbytes, location=location)
    return new


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of at most `limit` bytes (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and size + nbytes <= limit and out[-1][0].dtype == t.dtype:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out
