"""The driver's side of the device workers: `RayDevices` starts one Ray actor per device
(`workers.DeviceWorker`) in a placement group, joins them in one torch.distributed world, and
hands the trainer stage-shaped proxies (rollout, reward, reference, actor) that fan the work out
to the devices, so the trainer's step is the same code for Ray and in-process stages.

Also here: the dead-worker error (`WorkerDiedError`, naming the device and its roles) and the
shared scoring of synchronous rollouts (`_RolloutProxy._generate_sharing_scoring`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import torch

from rlfusion.errors import RunError
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.workers import DeviceWorker


class RayDevices:
    """One Ray actor per device (placement group, `threads_per_device` CPUs each), joined in
    one process-group world. `rollout`, `reward`, `reference` and `actor` have the methods of
    the in-process stages, so the trainer's step is the same code in both backends."""

    def __init__(self, cfg: TrainConfig, plan: DeploymentPlan, base_path: str):
        if not cfg.deploy.ray_address and "ray" not in sys.modules:
            # a local cluster: Ray puts every server (GCS, raylet, workers, agents) on loopback
            # only when it treats the machine as a lone laptop; read once, when Ray is imported
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray.util.placement_group import placement_group

        self.owns_ray = not ray.is_initialized()  # then `shutdown` stops the Ray it started
        if self.owns_ray:
            _start_ray(ray, cfg.deploy.ray_address, plan.num_devices * cfg.deploy.threads_per_device)
        self.ray, self.plan, self.cfg = ray, plan, cfg
        self.single_node = len(ray.nodes()) == 1
        self.workers: list[Any] = []
        threads = cfg.deploy.threads_per_device
        self.pg = placement_group([{"CPU": threads}] * plan.num_devices, strategy="PACK")
        try:
            self._start(base_path, threads)
        except BaseException as e:  # nothing may outlive a failed start: workers, the group, Ray
            cpus = ray.cluster_resources().get("CPU", 0)
            self.shutdown()
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"the Ray cluster cannot place {plan.num_devices} devices of {threads} CPU(s) each "
                    f"within {PLACEMENT_TIMEOUT_S:.0f} s (deploy.num_devices x deploy.threads_per_device; "
                    f"it has {cpus:g} CPUs)") from e
            raise

    def _start(self, base_path: str, threads: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, plan, cfg = self.ray, self.plan, self.cfg
        ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        env = {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}
        if self.single_node:  # gloo's connections between devices: loopback only, nothing listens outside
            env["env_vars"]["GLOO_SOCKET_IFNAME"] = _loopback_interface()
        # "pool": `take_finished` answers on its own thread while the device generates
        actor_cls = ray.remote(concurrency_groups={"pool": 1})(DeviceWorker)
        self.workers = [actor_cls.options(
            num_cpus=threads, runtime_env=env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=d),
        ).remote(d, plan, cfg, str(base_path)) for d in range(plan.num_devices)]
        address = self.call([self.workers[0].address.remote()])[0] if plan.num_devices > 1 else None
        self.rendezvous = address  # (host, port) of the device world's store, for checks
        self.call([w.connect.remote(address) for w in self.workers])
        self.call([w.settle.remote() for w in self.workers])
        self.scored: dict[tuple, tuple] = {}  # this step's on-device reward / reference results
        self.rollout = _RolloutProxy(self)
        self.reward = _RewardProxy(self)
        self.reference = _ReferenceProxy(self) if cfg.algo.kl_coef else None
        self.actor = _ActorProxy(self)
        self.critic = _CriticProxy(self) if cfg.algo.advantage == "gae" else None

    def call(self, refs: list[Any]) -> list[Any]:
        """`ray.get` that names the role and device of a worker that died. Results are checked
        as they arrive, so a dead worker is reported at once, not after its peers give up
        waiting for it in a collective."""
        try:
            pending = list(refs)
            while pending:
                ready, pending = self.ray.wait(pending, num_returns=1)
                self.ray.get(ready)  # raises if that worker failed
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as e:
            dead = [d for d, w in enumerate(self.workers) if w._actor_id.hex() in str(e)]
            if getattr(e, "actor_init_failed", False):  # it never started: say why, not "died"
                where = f"device {dead[0]}" if dead else "a device worker"
                raise RunError(f"{where} could not start: {_last_line(getattr(e, 'error_msg', str(e)))}") from None
            raise self._died(dead[0] if dead else None, type(e).__name__) from None
        except self.ray.exceptions.RayTaskError as e:
            # a live worker's task failed: if a peer is gone (its collective broke because the
            # peer died), the dead peer is the news, not the survivor's connection error
            dead = self._dead_devices()
            if dead:
                raise self._died(dead[0], f"{type(e).__name__} on a peer") from e
            if isinstance(e.cause, (ValueError, FileNotFoundError, RunError)):
                raise e.cause from None  # a stop the user can act on: its own one-line message
            raise

    def _died(self, device: int | None, why: str) -> "WorkerDiedError":
        where = f"device {device} ({'+'.join(self.plan.roles(device))})" if device is not None else "a device worker"
        return WorkerDiedError(f"{where} died ({why})")

    def _dead_devices(self) -> list[int]:
        """Devices whose worker process is gone (asked on the "pool" thread, which answers even
        while the worker's main thread is busy)."""
        refs = [w.ping.options(concurrency_group="pool").remote() for w in self.workers]
        dead = []
        for device, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=DEAD_CHECK_TIMEOUT_S)
            except self.ray.exceptions.RayActorError:
                dead.append(device)
            except self.ray.exceptions.GetTimeoutError:
                pass  # alive but not answering in time: not known to be dead
        return dead

    def engine_stats(self) -> list[dict[str, float]]:
        """Each rollout device's engine pass counts and seconds since the last call."""
        return self.call([self.workers[d].engine_stats.remote() for d in self.plan.rollout])

    def spans(self) -> dict[int, list[tuple[str, float, float]]]:
        return dict(enumerate(self.call([w.take_spans.remote() for w in self.workers])))

    def memory(self) -> list[dict[str, Any]]:
        return self.call([w.memory.remote() for w in self.workers])

    def pull_weights(self, model: torch.nn.Module) -> None:
        model.load_state_dict(self.on_train_devices("weights"))

    def on_train_devices(self, method: str) -> Any:
        """The first train device's answer to `weights` or `state`, whole tensors that every train
        device could give. In a training layout gathering them is collective, so every train
        device joins, but only the first keeps and returns the whole tensors (`keep=False`
        elsewhere: one gathered tensor at a time, never the whole state on every device)."""
        first, *others = self.plan.train if self.plan.train_layout else self.plan.train[:1]
        calls = [getattr(self.workers[first], method).remote()]
        calls += [getattr(self.workers[d], method).remote(keep=False) for d in others]
        return self.call(calls)[0]

    def shutdown(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.ray.util.remove_placement_group(self.pg)
        if self.owns_ray:
            self.ray.shutdown()


DEAD_CHECK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # how long `deploy.ray_address` may take to accept a connection


def _start_ray(ray, address: str, num_cpus: int) -> None:
    """Join the cluster at `address`, or start a single-node one (on loopback when this process
    had not imported Ray before, see `RayDevices`)."""
    if address:
        _check_reachable(address)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, num_cpus=num_cpus)


def _check_reachable(address: str) -> None:
    """Refuse an address nothing answers on within seconds (`ray.init` would retry for minutes)."""
    if address == "auto":
        return  # Ray finds the cluster of this machine itself, and says so when there is none
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"deploy.ray_address={address!r} is invalid: allowed: '' (a local cluster), 'auto' "
                         f"or HOST:PORT of a cluster started with `ray start --head`")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise RunError(f"deploy.ray_address={address!r}: no Ray cluster answers there ({why} within "
                       f"{CONNECT_TIMEOUT_S:.0f} s); start one with `ray start --head` or leave "
                       f"deploy.ray_address empty for a local cluster") from None


def _loopback_interface() -> str:
    """The name of the loopback network interface (`lo` on Linux, `lo0` on macOS)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def _last_line(text: str) -> str:
    """The exception line that ends a remote traceback (`ValueError: ...`)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
PLACEMENT_TIMEOUT_S = 120.0  # how long the device bundles may wait for free CPUs


class WorkerDiedError(RunError):
    """A device worker process died; the message names its device and roles (the trainer adds
    the checkpoint to resume from)."""


def _split(items: list, num_parts: int) -> list[list]:
    """Contiguous, near-equal parts (order kept, so concatenating the results restores it)."""
    k, r = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + k + (i < r)
        out.append(items[start:end])
        start = end
    return out


SHARE_WAIT_S = 0.2  # how long a generating device holds an idle one's request for finished samples
SHARE_MIN_SAMPLES = 8  # fewer are not worth a scoring call of their own


def _key(t: Trajectory) -> tuple:
    """Identifies a sample's reward and reference logprobs: a group shares one prompt, and equal
    responses to it have equal ones. (The reward stage's rows carry no prompt ids.)"""
    return t.group_id, tuple(t.response_ids)


class _RolloutProxy:
    """When every rollout device also hosts reward and reference, each device scores its own
    samples right after generating them (no trajectories travel for it, and a device that
    finishes its rollout early goes on at once); the reward and reference proxies then hand
    out those results."""

    def __init__(self, devices: RayDevices):
        self.d = devices
        plan = devices.plan
        self.score_here = all(dev in plan.reward and dev in plan.reference for dev in plan.rollout)
        self.peer_scored = 0  # last shared rollout: samples scored by a device that did not generate them

    def generate(self, problems: list[Problem], first_group_id: int, version: int) -> list[Trajectory]:
        parts, refs, offset = _split(problems, len(self.d.plan.rollout)), {}, first_group_id
        share = self.score_here and self.d.cfg.deploy.share_scoring and len(self.d.plan.rollout) > 1
        for dev, part in zip(self.d.plan.rollout, parts):
            if part or self.d.plan.train_layout:  # a layout's switch is collective: every device joins
                refs[dev] = self.d.workers[dev].generate.remote(part, offset, version, self.score_here, share)
            offset += len(part)
        if share:
            trajs = self._generate_sharing_scoring(refs)
        else:
            trajs = [t for chunk in self.d.call(list(refs.values())) for t in chunk]
        self.d.scored = {_key(t): (t.reward, t.metrics.get("correct"), t.ref_logprobs)
                         for t in trajs} if self.score_here else {}
        for t in trajs:  # the queue's reward and reference stages write these fields
            t.reward, t.ref_logprobs = 0.0, None
            t.metrics.pop("correct", None)
        return trajs

    def _generate_sharing_scoring(self, running: dict[int, Any]) -> list[Trajectory]:
        """Wait for the rollouts in `running` (device → its `generate(share=True)`); a device
        whose own work is done helps one still generating or scoring (`score_from`: it takes that
        device's finished samples a chunk at a time and scores them), so one device's long tail
        overlaps the scoring of its finished samples on the other, and both finish scoring
        together. Samples come back in request order."""
        ray, workers = self.d.ray, self.d.workers
        owner = {ref: dev for dev, ref in running.items()}
        running = dict(running)
        helping: dict[Any, int] = {}  # a helper's call → the device it helps
        closed: set[int] = set()  # devices whose pool is closed: nothing left to help with
        self.peer_scored = 0
        out: list[Trajectory] = []
        while owner:
            ready, _ = ray.wait(list(owner), num_returns=1)
            for ref in ready:
                dev = owner.pop(ref)
                got = self.d.call([ref])[0]
                out += got
                if ref in helping:
                    closed.add(helping.pop(ref))
                    self.peer_scored += len(got)
                running.pop(dev, None)
                open_ = [v for v in running if v not in closed]
                if open_:  # the device with the fewest helpers so far
                    victim = min(open_, key=lambda v: sum(h == v for h in helping.values()))
                    call = workers[dev].score_from.remote(workers[victim], SHARE_WAIT_S, SHARE_MIN_SAMPLES)
                    owner[call], helping[call] = dev, victim
        out.sort(key=lambda t: (t.group_id, t.metrics["sample"]))
        return out

    def start_groups(self, parts: list[list], version: int, quota: int, due: set[int], drop_overdue: bool):
        """Launch a partial rollout of `parts[i]` on rollout device i (non-blocking) that stops
        once `quota` groups have finished over all devices and the `due` ones are done; the
        returned function waits for it and merges the devices' results."""
        refs = []
        coordinated = len(self.d.plan.rollout) > 1  # every rollout device joins the stop-rule sums
        for dev, part in zip(self.d.plan.rollout, parts):
            if part or coordinated:
                mine = due & {gid for gid, _, _ in part}
                refs.append(self.d.workers[dev].rollout_groups.remote(part, version, quota, mine, drop_overdue,
                                                                     self.score_here))

        def wait() -> dict[str, Any]:
            outs = self.d.call(refs)
            return {"finished": [t for o in outs for t in o["finished"]],
                    "unfinished": [t for o in outs for t in o["unfinished"]],
                    "dropped": [g for o in outs for g in o["dropped"]],
                    "generated_tokens": sum(o["generated_tokens"] for o in outs)}
        return wait

    def stash_scores(self, trajs: list[Trajectory]) -> None:
        """Samples scored on their device (possibly in an earlier rollout) hand their reward and
        reference logprobs to the reward and reference proxies, like `generate` does."""
        self.d.scored = {_key(t): (t.reward, t.metrics.get("correct"), t.ref_logprobs)
                         for t in trajs} if self.score_here else {}
        for t in trajs:
            t.reward, t.ref_logprobs = 0.0, None
            t.metrics.pop("correct", None)

    def rng_state(self) -> list[torch.Tensor]:
        return self.d.call([self.d.workers[dev].rng_state.remote() for dev in self.d.plan.rollout])

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        self.d.call([self.d.workers[dev].set_rng_state.remote(s) for dev, s in zip(self.d.plan.rollout, states)])


class _RewardProxy:
    def __init__(self, devices: RayDevices):
        self.d = devices

    def score(self, trajs: list[Trajectory]) -> None:
        if all(_key(t) in self.d.scored for t in trajs):
            scores = [self.d.scored[_key(t)][:2] for t in trajs]
        else:
            scores = self.d.call([self.d.workers[self.d.plan.reward[0]].score.remote(trajs)])[0]
        for t, (reward, correct) in zip(trajs, scores):
            t.reward, t.metrics["correct"] = reward, correct


class _ReferenceProxy:
    def __init__(self, devices: RayDevices):
        self.d = devices

    def logprobs(self, trajs: list[Trajectory]) -> None:
        if all(_key(t) in self.d.scored and self.d.scored[_key(t)][2] is not None for t in trajs):
            for t in trajs:
                t.ref_logprobs = self.d.scored[_key(t)][2]
            return
        parts = _split(trajs, len(self.d.plan.reference))
        refs = [self.d.workers[dev].reference_logprobs.remote(part)
                for dev, part in zip(self.d.plan.reference, parts) if part]
        for t, lp in zip(trajs, [lp for chunk in self.d.call(refs) for lp in chunk]):
            t.ref_logprobs = lp


def _train_shards(devices: RayDevices, trajs: list[Trajectory]) -> list[tuple[int, list[Trajectory]]]:
    """(train device, its samples): the batch split by tokens across the data-parallel ranks
    of the train devices (the devices of one tensor-parallel group get the same part)."""
    from rlfusion.queue import split_balanced

    plan = devices.plan
    parts = split_balanced([t.num_tokens for t in trajs], plan.train_dp)
    return [(dev, [trajs[i] for i in parts[plan.dp_index(dev)]]) for dev in plan.train]


class _ActorProxy:
    """Splits the batch across the train devices by tokens; each takes the same full-batch
    step. In separated mode the new weights then go to the rollout devices."""

    def __init__(self, devices: RayDevices):
        self.d, self.version = devices, 0
        self.optimizer = _RemoteOptimizer(devices)
        self.weight_sync_bytes = 0
        self.last_sync_s = 0.0  # separated: the broadcast, including waiting for a running rollout

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        metrics = self.d.call([self.d.workers[dev].update.remote(part) for dev, part in _train_shards(self.d, trajs)])[0]
        self.version += 1
        self._sync_rollout_weights()
        return metrics

    def skip_update(self) -> None:
        self.d.call([self.d.workers[dev].skip_update.remote() for dev in self.d.plan.train])
        self.version += 1

    def _sync_rollout_weights(self) -> None:
        if not self.d.plan.colocated_actor:
            start = time.perf_counter()
            group = sorted({self.d.plan.train[0], *self.d.plan.rollout})
            self.weight_sync_bytes = self.d.call([self.d.workers[dev].sync_weights.remote() for dev in group])[0]
            self.last_sync_s = time.perf_counter() - start


class _RemoteOptimizer:
    """`state_dict` / `load_state_dict` of the train devices' optimizers (identical replicas)."""

    def __init__(self, devices: RayDevices):
        self.d = devices

    def state_dict(self) -> dict[str, Any]:
        return self.d.on_train_devices("state")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.d.call([w.load_state.remote(state) for w in self.d.workers])


class _CriticProxy:
    """PPO's value model on the train devices: values and updates split across them by tokens
    (each replica takes the full-batch step); `model` / `optimizer` give checkpoints its state."""

    def __init__(self, devices: RayDevices):
        self.d = devices
        self.model, self.optimizer = _RemoteCriticPart(devices, "model"), _RemoteCriticPart(devices, "optimizer")

    def values(self, trajs: list[Trajectory]) -> None:
        parts = _train_shards(self.d, trajs)
        outs = self.d.call([self.d.workers[dev].critic_values.remote(part) for dev, part in parts])
        for (_, part), values in zip(parts, outs):
            for t, v in zip(part, values):
                t.values = v

    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        return self.d.call([self.d.workers[dev].critic_update.remote(part) for dev, part in _train_shards(self.d, trajs)])[0]


class _RemoteCriticPart:
    """`state_dict` / `load_state_dict` of the critic's model or optimizer (identical replicas)."""

    def __init__(self, devices: RayDevices, part: str):
        self.d, self.part = devices, part

    def state_dict(self) -> dict[str, Any]:
        return self.d.call([self.d.workers[self.d.plan.train[0]].critic_state.remote()])[0][self.part]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.d.call([self.d.workers[dev].load_critic_state.remote(self.part, state) for dev in self.d.plan.train])

