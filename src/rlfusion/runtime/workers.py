"""Device workers: one process per device (or one object in the driver's process, the local
backend) hosting the RL roles its `DeploymentPlan` gives it. The controller reaches them only
through `devices.Devices`, with commands and row ids; samples move between the devices through
the DistQueue (`dataflow.py` lists the columns each stage reads and writes):

    generate(group ids) rollout devices: sample each group's problem, generate, score and add
                        reference logprobs when reward and reference live here, put the rows
    score(count)        reward / reference devices (separated mode): read rows, write columns
    update(count)       train devices: the first runs the advantage stage and splits the kept
                        rows over the data-parallel ranks; each reads its rows (one reader per
                        tensor-parallel group, broadcast to the others), critic + GAE for PPO,
                        one full-batch step; the first retires the rows
    evaluate(indices)   rollout devices: greedy held-out accuracy on their share
    sync_weights()      separated mode: bucketed broadcast of the new weights

Where the actor trains in a layout (`deploy.train_tp` / `train_ep` / `train_pp` / `train_fsdp`)
`parallel.parallelize` applies it here (`_apply_layout`); everything that moves between training and generation
(optimizer offload, KV cache, the replica, the reference weights, the weight broadcast) is
`fusion.switch.DeviceSwitch`, which also keeps the device's memory ledger.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.errors import RunError
from rlfusion.engine.runner import autocast
from rlfusion.evaluate import greedy_completions
from rlfusion.fusion.reshard import build_inference_model, release
from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.model.checkpoint import load_base
from rlfusion.model.flops import causal_positions, forward_flops
from rlfusion.model.hf import is_hf_checkpoint
from rlfusion.obs.metrics import NumberPacker
from rlfusion.obs.peak import matmul_peak_flops
from rlfusion.obs.timeline import pack_spans
from rlfusion.parallel.api import ParallelModel, parallelize
from rlfusion.parallel.mesh import build_mesh
from rlfusion.parallel.seq_balance import SeqCost
from rlfusion.parallel.state import LayoutState
from rlfusion.queue.hierarchical import GroupQueue
from rlfusion.rl.kl import kl_estimate
from rlfusion.rl.rewards import load_reward_fn
from rlfusion.rl.tasks import make_task
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import dataflow
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.device_binding import bind_device, listening_store, on_host
from rlfusion.runtime.finished_pool import FinishedPool
from rlfusion.runtime.heap import freeze_long_lived
from rlfusion.runtime.partial_rollout import PartialRollout
from rlfusion.stalesync.rules import unpack_items
from rlfusion.runtime.stop_sums import StopSums, no_stop_sync
from rlfusion.runtime.stages import (CriticStage, ReferenceStage, RewardStage, RolloutStage, advantage_stage,
                                     gae_advantages)
from rlfusion.runtime.train_config import TrainConfig

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # `deploy.precision` → autocast dtype (None: off)
A2A_WAIT = "a2a wait"  # timeline phase: a train device waiting on its expert all-to-all (inside "train")
SCORE_CHUNK_TOKENS = 1024  # a device scores its pool this many tokens at a time (a peer may take the rest)


class DeviceWorker:
    """The roles of one device. Every span of work is recorded as (phase, wall start, wall end).
    `queue` is the run's DistQueue client (the in-process queue for the local backend; Ray
    workers get theirs in `connect`)."""

    def __init__(self, device: int, plan: DeploymentPlan, cfg: TrainConfig, base_path: str, queue: Any = None):
        torch.set_num_threads(cfg.deploy.threads_per_device if cfg.deploy.backend == "ray" else cfg.threads)
        torch.manual_seed(cfg.seed)
        self.device, self.plan, self.cfg = device, plan, cfg
        self.where = bind_device(plan.device, device)  # this device's torch device
        roles = plan.roles(device)
        model, tokenizer, _ = load_base(base_path, device=self.where, max_seq_len=cfg.context_len or None)
        # `train_model` is what the optimizer updates, `policy` what the engine generates from:
        # one model, unless the actor trains in a layout: then its shards (applied in `connect`)
        # and a full replica, filled from them before every rollout
        self.layout = plan.parallel_layout() if plan.train_layout and device in plan.train else None
        # a checkpoint's optimizer state is keyed by the plain model's parameter order
        self._param_index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        # how the update's rows are split over data-parallel ranks (`optim.dp_balance`)
        self._split_cost = SeqCost.from_config(model.config) if cfg.optim.dp_balance == "cost" else None
        self.train_model = model
        self.model_config = model.config
        self.policy = model if self.layout is None else build_inference_model(model.config, device=self.where)
        self.pm: ParallelModel | None = None
        self.layout_state: LayoutState | None = None  # the layout's shards ↔ whole tensors (checkpoints)
        self.spans: list[tuple[str, float, float]] = []
        hf_base = base_path if is_hf_checkpoint(base_path) else None  # what vLLM can serve as it is
        # `deploy.precision`: every role's passes under autocast; the weights stay fp32 (the master copy)
        self.compute_dtype = COMPUTE_DTYPES[cfg.deploy.precision]
        # this device's compute peak at its thread count and precision, what the step metrics'
        # achieved FLOP/s of its decode passes and updates are compared with
        self.matmul_peak_flops = matmul_peak_flops(repeats=3, device=self.where, dtype=self.compute_dtype)
        self.rollout = (RolloutStage(self.policy, tokenizer, cfg.rollout, cfg.seed + 1000 * device, hf_base,
                                     self.compute_dtype) if "rollout" in roles else None)
        if self.layout is not None:
            release(self.policy)  # resident only while generating
        self.tokenizer = tokenizer
        self.task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
        reward_fn = self.task.reward if cfg.reward == "task" else load_reward_fn(cfg.reward)
        self.reward = (RewardStage(reward_fn, tokenizer, cfg.algo, cfg.rollout.max_new_tokens,
                                   name=cfg.reward, timeout_s=cfg.reward_timeout_s,
                                   reward_range=(cfg.reward_min, cfg.reward_max),
                                   failure_limit=cfg.reward_failure_limit)
                       if "reward" in roles else None)
        self.reference = (ReferenceStage(copy.deepcopy(model), cfg.rollout.temperature, cfg.optim.microbatch_tokens)
                          if "reference" in roles and cfg.algo.kl_coef else None)
        self.actor: ActorStage | None = None
        self.critic: CriticStage | None = None  # PPO's value model, next to the actor
        self.dp_group: Any = None
        self.train_group: Any = None  # every train device (more than one): the update's split goes over it
        self.switch = DeviceSwitch(device, self.policy, self.train_model,
                                   self.rollout.engine if self.rollout is not None else None,
                                   int(cfg.deploy.bucket_mb * 2**20), plan.mode == "fully_shared", self._span,
                                   self.where)
        if self.reference is not None:
            self.switch.attach(reference=self.reference.model)
        self.queue = queue
        self.reads: Any = queue  # where `update` reads its rows: the queue, or its TP group's reader
        self.sync_group = self.rollout_group = None
        # finished samples a peer may score (`generate(share=True)`, `take_finished`)
        self.pool = FinishedPool()
        self.partial: PartialRollout | None = None  # StaleSync: the held samples of unfinished groups
        self._stop_sync = no_stop_sync()
        self._store = None  # device 0: the rendezvous store of the device world
        self._queue_bytes = 0  # bytes this device's queue client had moved at the last report
        self._packers = {"update": NumberPacker(), "report": NumberPacker()}  # answers that recur each step

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

    def connect(self, address: tuple[str, int] | None, queue: Any = None) -> None:
        """Join the device world through the rendezvous store at `address` (device 0's
        `address()`; None: a world of one, no process group), take the run's queue client and
        build the actor."""
        if queue is not None:
            self.queue = self.reads = queue
        train_group = None
        if address is not None:
            # on GPUs: NCCL for device tensors, gloo for the host tensors (counts, flags, objects)
            backend = "cpu:gloo,cuda:nccl" if self.where.type == "cuda" else "gloo"
            store = self._store if self.device == 0 else dist.TCPStore(
                address[0], address[1], self.plan.num_devices, is_master=False)
            dist.init_process_group(backend, store=store, rank=self.device, world_size=self.plan.num_devices)
            # every rank creates every group, in the same order
            train_group = dist.new_group(list(self.plan.train))
            self.sync_group = dist.new_group(sorted({self.plan.train[0], *self.plan.rollout}))
            self.rollout_group = dist.new_group(list(self.plan.rollout), backend="gloo")  # CPU counts
            if self.plan.train_layout and self.device not in self.plan.train:
                self._layout_groups()  # the layout's groups are created by every device
        if self.rollout is not None:
            self.partial = PartialRollout(self.plan.rollout.index(self.device), self.queue, self._problem,
                                          self.cfg.deploy.queue_timeout_s)
        if self.device in self.plan.train:
            self.train_group = self.dp_group = train_group if len(self.plan.train) > 1 else None
            if self.layout is not None:
                self.dp_group = self._apply_layout()
            if self.cfg.algo.advantage == "gae":  # from the base weights, before any update
                if self.layout is not None:  # the driver refuses this first (trainer._check_train_layout)
                    raise ValueError("algo.advantage=gae needs full replicas: the critic sums its gradients "
                                     "over the data-parallel group itself, not over a training layout's")
                self.critic = CriticStage(self.train_model, self.cfg.algo, self.cfg.optim, dp_group=self.dp_group)
            self.actor = ActorStage(self.train_model, self.cfg.algo, self.cfg.optim, self.cfg.rollout.temperature,
                                    total_updates=self.cfg.max_steps, dp_group=self.dp_group, layout=self.pm,
                                    dp_sharded=self.plan.train_fsdp)
            self.switch.attach(optimizer=self.actor.optimizer, pm=self.pm,
                               critic=(self.critic.model, self.critic.optimizer) if self.critic else None)

    def settle(self) -> None:
        """Setup is over (called once in the worker's own process, after `connect`): full garbage
        collections no longer walk the imports, model and task (`runtime/heap.py`)."""
        freeze_long_lived()

    def _apply_layout(self) -> Any:
        """Split the actor over its training layout with `parallel.parallelize`: pipeline stages
        over `train_pp` groups of train devices (1F1B, or interleaved with `train_vpp` chunks
        each), TP over `train_tp` consecutive devices of a stage (attention heads, dense and
        shared-expert FFN columns), routed experts over `train_ep` devices, data parallel
        across the rest. Data parallel keeps a replica of the rest on each (`ActorStage` sums
        the replicas' gradients), or with `train_fsdp` shards it over them (FSDP2: parameters
        gathered per block for each pass, gradients reduce-scattered as sums, since the loss is
        normalized by the global batch); expert shards are summed over their expert-data-
        parallel group either way. Every device of a model-parallel group (the stages and TP
        ranks of one data-parallel rank) trains on the same rows — the last stage needs the
        loss's per-token inputs, the first the tokens; with `deploy.hierarchical_reads` its
        first device reads them and broadcasts them to the others. Returns the data-parallel
        group (None with one). Collective: every device joins."""
        self.pm = parallelize(self.train_model, self.layout, n_microbatches=self.layout.pp, device_type=self.where.type,
                              fsdp=self.plan.train_fsdp, sum_gradients=True, ranks=list(self.plan.train))
        if self.layout.pp > 1:  # this device's stages are all it keeps of the model
            self.train_model = self.switch.train_model = None
        self.layout_state = LayoutState(self.pm, self._param_index)
        for experts in self.pm.experts:  # the update's waits on expert all-to-all, in the timeline
            experts.counter.on_wait = self._a2a_wait
        groups = self._read_groups()
        if groups:
            plan = self.plan
            mine = plan.model_parallel_group(plan.dp_index(self.device))
            self.reads = GroupQueue(self.queue if self.device == mine[0] else None, self.queue.schema,
                                    groups[plan.dp_index(self.device)], reader=mine[0], writer=mine[0])
        return self.pm.mesh.group("dp") if self.layout.dp > 1 else None

    def _layout_groups(self) -> None:
        """On a device outside the training layout (a rollout device in separated mode): join
        the creation of the layout's process groups, in the order the train devices create them."""
        build_mesh(self.plan.parallel_layout(), self.policy.config, ranks=list(self.plan.train))
        self._read_groups()

    def _read_groups(self) -> list:
        """With `deploy.hierarchical_reads`, a process group per model-parallel group of the
        layout (created on every device); none when each such group is one device."""
        mp = [self.plan.model_parallel_group(d) for d in range(self.plan.train_dp)]
        if len(mp[0]) == 1 or not self.cfg.deploy.hierarchical_reads:
            return []
        return [dist.new_group(ranks) for ranks in mp]

    def ping(self) -> int:
        return self.device

    # ---- rollout ----

    def generate(self, group_ids: list[int], version: int, score_here: bool = False,
                share: bool = False) -> dict[str, int]:
        """Generate `group_size` samples for each group's problem and put them in the queue as
        rows; with `score_here` (reward and reference live on this device too) the rows carry
        their reward and reference logprobs when they go in. Returns counts only.

        With `share`, finished samples wait in a pool that `take_finished` (served on its own
        thread while this call runs) hands out, a chunk at a time, to an idle peer running
        `score_from`, which scores and puts them; this device scores the rest,
        `SCORE_CHUNK_TOKENS` at a time, so a peer that runs out of work shares that too and
        the two finish together. Each side puts its rows in one write at the end: a put costs
        a few queue round trips, and no stage reads these rows before the rollout ends."""
        if share and not score_here:
            raise ValueError("generate(share=True) needs score_here=True: the samples a peer takes are "
                             "scored there, the rest here")
        problems = [self._problem(g) for g in group_ids]
        if not share:
            with self.switch.rollout():
                trajs = self.rollout.generate(problems, group_ids, version)
            if score_here:
                self.score_and_reference(trajs)
            self._put(trajs, scored=score_here)
            return {"rows": len(trajs), "generated_tokens": sum(len(t.response_ids) for t in trajs)}
        self.pool.open()
        mine = generated = 0
        try:
            with self.switch.rollout():
                trajs = self.rollout.generate(problems, group_ids, version, on_finish=self.pool.offer)
            generated = sum(len(t.response_ids) for t in trajs)
            self.pool.decoding_done()
            scored: list[Trajectory] = []  # one put for all: nothing reads these rows before the rollout ends
            while chunk := self.pool.take(SCORE_CHUNK_TOKENS):
                scored += self.score_and_reference(chunk)
            self._put(scored, scored=True)
            mine = len(scored)
        finally:
            self.pool.close()
        return {"rows": mine, "generated_tokens": generated}

    def _put(self, trajs: list[Trajectory], scored: bool) -> list[int]:
        """The samples as new queue rows (with their reward and reference columns when `scored`);
        their row ids."""
        if not trajs:
            return []
        names = dataflow.ROLLOUT.writes + (self._score_columns() if scored else ())
        with self._span("queue"):
            return self.queue.put(dataflow.trajectory_columns(trajs, names), group_ids=[t.group_id for t in trajs],
                                  versions=[min(t.versions, default=0) for t in trajs])

    def _score_columns(self) -> tuple[str, ...]:
        return dataflow.REWARD.writes + (dataflow.REFERENCE.writes if self.reference is not None else ())

    def take_finished(self, min_count: int = 1, max_tokens: int = SCORE_CHUNK_TOKENS,
                      wait_s: float = 0.0) -> tuple[list[Trajectory], bool]:
        """Finished, not yet scored samples of the running `generate(share=True)`, up to
        `max_tokens` tokens, which are the caller's to score and put from now on, and whether
        its pool is still open (more may come). While this device still decodes, none unless
        `min_count` wait (more will come); once it scores its own, any that wait. With `wait_s`,
        an open pool with too few samples is waited on for up to that long: the answer comes as
        soon as enough are offered or the pool closes."""
        return self.pool.take_waiting(min_count, max_tokens, wait_s)

    def score_from(self, peer: Any, wait_s: float, min_count: int) -> int:
        """Score `peer`'s finished samples (another device's worker, inside `generate(share=True)`)
        a chunk at a time until its pool closes, then put them; returns how many. While
        it has fewer than `min_count` waiting, the peer holds each request up to `wait_s` and
        answers as soon as that changes, so this call ends the moment the pool closes."""
        import ray

        scored: list[Trajectory] = []  # put once at the end, as the peer puts its own
        while True:
            taken, open_ = ray.get(peer.take_finished.options(concurrency_group="pool").remote(
                min_count, SCORE_CHUNK_TOKENS, wait_s))
            if taken:
                scored += self.score_and_reference(taken)
            elif not open_:
                self._put(scored, scored=True)
                return len(scored)

    def score_and_reference(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Reward and (if this device holds one) reference logprobs, written into `trajs`."""
        if trajs:
            self._reward(trajs)
            if self.reference is not None:
                self._reference(trajs)
        return trajs

    def rollout_groups(self, items: tuple[list[int], ...], version: int, quota: int, must_finish: set[int],
                       drop_overdue: bool, score_here: bool = False) -> dict[str, Any]:
        """StaleSync's partial rollout of the groups `items` (`stalesync.GroupItem`s, packed) inside the
        same switch as `generate` (`partial_rollout.PartialRollout`): the samples of unfinished
        groups stay here (hybrid placement's train devices hand them over through the queue, as
        they join the next rollout late), finished groups go into the queue, scored here when
        reward and reference live here. Answers the groups' reports (ids and versions)."""
        sync = (StopSums(self.rollout_group, self._stop_sync, polled=self.plan.mode == "hybrid")
                if len(self.plan.rollout) > 1 else None)
        keep = self.cfg.stalesync.resume_kv == "keep"

        def run(groups: list) -> dict[str, Any]:
            with self.switch.rollout():
                return self.rollout.run_groups(groups, version, quota, must_finish, drop_overdue, sync, keep_cache=keep)

        def put(trajs: list[Trajectory]) -> list[int]:
            return self._put(self.score_and_reference(trajs) if score_here else trajs, scored=score_here)

        return self.partial.run(unpack_items(items), run, put, hand_over=self.plan.mode == "hybrid" and self.device in self.plan.train)

    def _problem(self, problem_id: int) -> Any:
        return dataflow.group_problem(self.task, self.cfg.seed, problem_id)

    # ---- scoring (reward and reference on devices other than the rollout's) ----

    def score(self, reward_rows: int | list[int], reference_rows: int | list[int]) -> None:
        """Read rows as they become ready — `reward_rows` for the reward, `reference_rows` for
        the reference: a count (the first that many, a synchronous step's) or the row ids
        (StaleSync's batch) — and write those columns back. Each role reads as its own
        consumer, so a row is scored by exactly one device per role."""
        for stage, rows in ((dataflow.REWARD, reward_rows), (dataflow.REFERENCE, reference_rows)):
            if not rows:
                continue
            timeout = self.cfg.deploy.queue_timeout_s
            count = rows if isinstance(rows, int) else len(rows)
            with self._span("queue"):
                try:
                    batch = (self.queue.get(stage.name, stage.reads, rows, block=True, timeout=timeout)
                             if isinstance(rows, int) else self.queue.get_rows(stage.name, rows, stage.reads, timeout))
                except TimeoutError:
                    batch = ()
            if len(batch) != count:
                raise RunError(f"stage {stage.name!r} on device {self.device} waited {timeout:g} s for "
                               f"{count} rows and got {len(batch)} (deploy.queue_timeout_s)")
            trajs = dataflow.to_trajectories(batch)
            (self._reward if stage is dataflow.REWARD else self._reference)(trajs)
            with self._span("queue"):
                self.queue.put(dataflow.trajectory_columns(trajs, stage.writes), row_ids=batch.row_ids)

    def _reward(self, trajs: list[Trajectory]) -> None:
        with self._span("reward"):
            self.reward.score(trajs)

    def _reference(self, trajs: list[Trajectory]) -> None:
        with self.switch.reference_pass(), autocast(self.where, self.compute_dtype):
            self.reference.logprobs(trajs)
        kind = self.cfg.algo.kl_kind
        for t in trajs:  # the summed estimate KL reward shaping subtracts (metadata-sized)
            kl = kl_estimate(torch.tensor(t.behaviour_logprobs), torch.tensor(t.ref_logprobs), kind)
            t.kl = float(kl.sum())

    # ---- training ----

    def update(self, rows: int | list[int], version: int) -> Any:
        """One synchronous update from scored rows in the queue — a count (the first that many)
        or the row ids (StaleSync's batch) — from policy
        `version` (the controller's count of updates, which the actor follows: its learning-rate
        schedule reads it). The first train device runs the advantage stage (`stages.
        advantage_stage`) and splits the kept rows over the data-parallel ranks (by tokens, or
        by cost with `optim.dp_balance=cost`); the
        split goes to the other train devices over their group, each reads its rows by id (one
        reader per tensor-parallel group) and trains, then the first retires the rows. With no
        row kept the policy is unchanged and its version moves on. The first device answers the
        batch's aggregates with the update's metrics (`trained`: whether the weights changed),
        packed (`NumberPacker`); the others answer None."""
        self.actor.version = version
        lead = self.device == self.plan.train[0]
        summary: dict[str, float] = {}
        shards: list[list[int]] | None = None
        try:
            if lead:
                with self._span("advantage"):
                    start = time.perf_counter()
                    numbers, shards, summary = advantage_stage(self.queue, self.cfg, rows, self.plan.train_dp,
                                                               self._split_cost)
                    summary["time_advantage_s"] = time.perf_counter() - start
        finally:  # the split goes to the other train devices; None tells them the stage failed
            if self.train_group is not None:
                box = [shards]
                dist.broadcast_object_list(box, src=self.plan.train[0], group=self.train_group)
                shards = box[0]
        if shards is None:  # (not the first: it raised) the first train device's error says why
            return None
        trained = any(shards)
        metrics = self._train_on(shards[self.plan.dp_index(self.device)]) if trained else {}
        if not trained:
            self.actor.skip_update()
        if not lead:
            return None  # the first train device answers for all
        with self._span("queue"):
            self.queue.retire([r.row_id for r in numbers])
        return self._packers["update"].pack({**summary, **metrics, "trained": float(trained)})

    def _train_on(self, row_ids: list[int]) -> dict[str, float]:
        """One full-batch step of the actor (and the critic, with GAE advantages) on this data-
        parallel rank's rows, read from the queue by id."""
        consumer = "actor"
        position = self.plan.model_parallel_group(self.plan.dp_index(self.device)).index(self.device)
        if position and not isinstance(self.reads, GroupQueue):
            consumer = f"actor/mp{position}"  # each device of a model-parallel group reads its rows: a reader of its own
        with self._span("queue"):
            try:
                batch = self.reads.get_rows(consumer, row_ids, dataflow.actor_reads(self.cfg),
                                            timeout=self.cfg.deploy.queue_timeout_s)
            except TimeoutError as e:
                raise RunError(f"the update on device {self.device}: {e} (deploy.queue_timeout_s)") from None
        trajs = dataflow.to_trajectories(batch)
        metrics: dict[str, float] = {}
        experts = self.pm is not None and self.pm.experts
        if experts:
            self.pm.reset_comm_counters()
        with self.switch.train(), autocast(self.where, self.compute_dtype):
            if self.critic is not None:
                with self._span("critic"):
                    self.critic.values(trajs)
                    gae_advantages(trajs, self.cfg.algo, self.dp_group)
                    metrics.update(self.critic.update(trajs))
            start = time.perf_counter()
            metrics.update(self.actor.update(trajs))
            metrics.update(self._update_rate(trajs, time.perf_counter() - start))
        if experts:
            metrics.update(self._expert_comm())
        return metrics

    def _update_rate(self, trajs: list[Trajectory], seconds: float) -> dict[str, float]:
        """The useful FLOP/s of this device's share of the actor update — 3 forwards of its rows
        per epoch (`model.flops.forward_flops`), split over the devices that hold one model copy —
        and its share of the device's matmul peak."""
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
        holders = len(self.plan.model_parallel_group(self.plan.dp_index(self.device)))
        flops = (3 * self.cfg.algo.ppo_epochs * forward_flops(self.model_config, sum(lengths),
                                                              causal_positions(lengths)) / holders)
        rate = flops / max(seconds, 1e-9)
        return {"update_gflop_per_s": rate / 1e9, "update_peak_share": rate / self.matmul_peak_flops}

    def _a2a_wait(self, start: float, end: float) -> None:
        self.spans.append((A2A_WAIT, start, end))

    def _expert_comm(self) -> dict[str, float]:
        """The update's expert all-to-all on the train devices (a collective over them): the
        longest any device waited on it (its exposed communication, `deploy.train_a2a_chunks`
        hides it behind computation) and the megabytes the devices sent."""
        c = self.pm.comm_counter()
        waited, sent = torch.tensor([c.wait_s]), torch.tensor([float(c.sent_bytes)])
        if self.train_group is not None:
            dist.all_reduce(waited, op=dist.ReduceOp.MAX, group=self.train_group)
            dist.all_reduce(sent, group=self.train_group)
        return {"ep_a2a_exposed_s": float(waited), "ep_a2a_mb": float(sent) / 1e6}

    def sync_weights(self) -> int:
        """Separated mode: the first train device broadcasts the new weights to the rollout
        devices (`DeviceSwitch.broadcast_weights`). In a training layout the train devices first
        gather the whole weights from their shards and stages onto the first (collective over
        the train devices). Returns bytes sent or received."""
        lead = self.device == self.plan.train[0]
        state = None
        if self.pm is not None:
            whole = self.pm.full_state_dict(keep=lead)
            if lead:  # in the order the rollout devices' replicas list them
                state = {name: whole[name] for name in self.policy.state_dict()}
        joins = self.device in self.plan.rollout or lead
        return self.switch.broadcast_weights(self.plan.train[0], self.sync_group, joins, state)

    # ---- evaluation ----

    def evaluate(self, indices: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        """Greedy (reward, response length) of held-out problems `indices`, generated by this
        device's rollout engine from the current policy."""
        heldout = self.task.heldout()
        problems = [heldout[i] for i in indices]
        if not problems and self.pm is None:  # (a layout's switch is collective: join it anyway)
            return []
        model = self.rollout.model
        was_training = model.training
        model.eval()
        try:
            with self.switch.rollout("eval"):
                completions = greedy_completions(self.rollout.engine, self.tokenizer, problems, max_new_tokens)
        finally:
            model.train(was_training)
            self.rollout.engine.take_stats()  # the step's engine counts are the rollout's only
        return [(float(self.task.reward(self.tokenizer.decode(c.output_ids), p)), len(c.output_ids))
                for c, p in zip(completions, problems)]

    # ---- state ----

    def weights(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The policy's full weights (in a training layout: gathered, collective over the train
        devices; with `keep=False` this device only joins the gathers and returns None)."""
        if self.pm is not None:
            return self.pm.full_state_dict(keep=keep)
        return on_host(self.policy.state_dict()) if keep else None

    def state(self, keep: bool = True) -> dict[str, Any] | None:
        """The policy weights, optimizer state and version, whole (train devices hold identical
        replicas; in a training layout the shards are gathered: every train device must call
        this, and one with `keep=False` drops each gathered tensor at once and returns None)."""
        self.switch.enter_train()  # offloaded for a rollout whose update was skipped
        optimizer = self.actor.optimizer.state_dict()
        if self.pm is not None:  # keyed by the plain model's parameter order, as a replica's
            optimizer = self.layout_state.optimizer_whole(optimizer, keep)
        weights = self.weights(keep)
        return {"model": weights, "optimizer": on_host(optimizer), "version": self.actor.version} if keep else None

    def load_state(self, state: dict[str, Any]) -> None:
        if self.pm is None:
            self.policy.load_state_dict(state["model"])
        else:  # each device keeps its shard (its stages) of the whole tensors; the replica is filled per rollout
            self.layout_state.load_weights(state["model"])
        self.switch.policy_changed()
        if self.actor is not None:
            self.switch.enter_train()
            optimizer = state["optimizer"]
            if self.pm is not None:  # whole optimizer states → this device's shards and stages
                optimizer = self.layout_state.optimizer_part(optimizer, self.actor.optimizer.state_dict()["param_groups"])
            # own storages (a state read from disk may not be resizable, and offloading resizes them)
            optimizer = {**optimizer, "state": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                    for k, v in st.items()} for i, st in optimizer["state"].items()}}
            self.actor.optimizer.load_state_dict(optimizer)
            self.actor.version = state["version"]

    def critic_state(self) -> dict[str, Any]:
        return on_host({"model": self.critic.model.state_dict(), "optimizer": self.critic.optimizer.state_dict()})

    def load_critic_state(self, state: dict[str, Any]) -> None:
        self.critic.model.load_state_dict(state["model"])
        self.critic.optimizer.load_state_dict(state["optimizer"])

    def rng_state(self) -> torch.Tensor:
        return self.rollout.rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.rollout.set_rng_state(state)

    def paused(self) -> dict[str, Any]:
        """StaleSync's paused requests on this rollout device: the samples it holds and, with
        `resume_kv=keep`, their cache rows."""
        return {"samples": self.partial.state(),
                "cache_rows": self.rollout.saved_rows()}

    def load_paused(self, state: dict[str, Any]) -> None:
        self.partial.load_state(state["samples"])
        if self.cfg.stalesync.resume_kv == "keep":  # else the paused samples recompute theirs
            self.rollout.load_saved_rows(state["cache_rows"])

    # ---- what the controller records per step ----

    def report(self) -> tuple[Any, Any]:
        """Since the last call: spans (phase, wall start, wall end), the rollout engine's pass
        counts and seconds with the partial rollouts' stop-rule sums, the memory ledger's
        per-phase peaks and zero-redundancy check, and the bytes this device moved through the
        queue — packed: the spans by `timeline.pack_spans`, the numbers by `NumberPacker` under
        '/'-joined names (`devices.unpack_report` restores the nested form)."""
        spans, self.spans = self.spans, []
        numbers: dict[str, float] = {}
        if self.rollout is not None:
            engine, self._stop_sync = {**self.rollout.engine.take_stats(), **self._stop_sync}, no_stop_sync()
            numbers.update({f"engine/{k}": v for k, v in engine.items()})
        memory = self.switch.memory()
        numbers.update({f"memory/peaks/{phase}": v for phase, v in memory.pop("peaks").items()})
        numbers.update({f"memory/allocator_peaks/{phase}": v for phase, v in memory.pop("allocator_peaks").items()})
        numbers.update({f"memory/{k}": v for k, v in memory.items()})
        numbers["matmul_peak_gflop_per_s"] = self.matmul_peak_flops / 1e9
        moved = getattr(self.queue, "wire_bytes", 0)
        numbers["queue_bytes"], self._queue_bytes = moved - self._queue_bytes, moved
        return pack_spans(spans), self._packers["report"].pack(numbers)

    @contextmanager
    def _span(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.spans.append((phase, start, time.time()))
