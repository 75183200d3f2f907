"""`RayDevices`: the device workers as Ray actors, one per device (`workers.DeviceWorker`), in a
placement group, joined in one torch.distributed world, with the run's DistQueue on Ray: its
controller actor (row metadata only) in the devices' placement group, and its storage in the
devices themselves: each worker hosts the shard of the rows it creates (`queue.shard_host`).
Commands go out as actor calls (`devices.Devices` holds them); answers are checked as they
arrive, so a dead worker is named at once (`WorkerDiedError`).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from rlfusion.errors import RunError
from rlfusion.queue.shard_host import STORAGE_GROUP
from rlfusion.runtime.dataflow import queue_config
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.devices import Devices
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.workers import DeviceWorker


class RayDevices(Devices):
    """One Ray actor per device (placement group, `threads_per_device` CPUs each, and one GPU
    each with `deploy.device` cuda), joined in one process-group world, sharing one Ray
    DistQueue."""

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
        else:  # this process is attached to a cluster already: the address must name that one
            check_attached(ray, cfg.deploy.ray_address)
        try:
            plan = plan.on(cluster_device(cfg.deploy.device, ray.cluster_resources(), plan.num_devices))
        except BaseException:
            if self.owns_ray:
                ray.shutdown()
            raise
        super().__init__(cfg, plan, None)
        self.ray = ray
        self.count_bytes = True
        self.single_node = len(ray.nodes()) == 1
        self.workers: list[Any] = []
        threads = cfg.deploy.threads_per_device
        self.pg = placement_group(device_bundles(plan, threads), strategy="PACK")
        try:
            self._start_workers(base_path, threads)
        except BaseException as e:  # nothing may outlive a failed start: workers, queue, the group, Ray
            cpus = ray.cluster_resources().get("CPU", 0)
            self.shutdown()
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"the Ray cluster cannot place {plan.num_devices} devices of {threads} CPU(s) each "
                    f"within {PLACEMENT_TIMEOUT_S:.0f} s (deploy.num_devices x deploy.threads_per_device; "
                    f"it has {cpus:g} CPUs)") from e
            raise

    def _start_workers(self, base_path: str, threads: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlfusion.queue.ray_backend import RayDistQueue

        ray, plan, cfg = self.ray, self.plan, self.cfg
        ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        # the queue's controller first (in the first device's bundle, taking no CPU of it), then
        # the devices, which host its storage: shard d is device d's, holding the rows it creates
        controller = [PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)]
        self.queue = RayDistQueue(queue_config(cfg.rollout.group_size), num_shards=plan.num_devices,
                                  placement=controller, hosted=True)
        env = {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}
        if self.single_node:  # gloo's and NCCL's bootstrap connections: loopback only, nothing listens outside
            env["env_vars"]["GLOO_SOCKET_IFNAME"] = env["env_vars"]["NCCL_SOCKET_IFNAME"] = _loopback_interface()
        # "ping": answered on its own thread while the device works (`_dead_devices`)
        # STORAGE_GROUP: its queue shard answers the peers' reads and writes meanwhile
        actor_cls = ray.remote(concurrency_groups={"ping": 1, STORAGE_GROUP: 1})(DeviceWorker)
        self.workers = [actor_cls.options(
            **worker_options(plan, threads), runtime_env=env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=d),
        ).remote(d, plan, cfg, str(base_path), self.queue) for d in range(plan.num_devices)]
        self.queue.host_shards(self.workers)
        address = self.call([self.workers[0].address.remote()])[0] if plan.num_devices > 1 else None
        self.rendezvous = address  # (host, port) of the device world's store, for checks
        self.call([w.connect.remote(address) for w in self.workers])
        self.call([w.settle.remote() for w in self.workers])

    def _start(self, device: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[device], method).remote(*args)

    def _wait(self, handles: list[Any]) -> list[Any]:
        return self.call(handles)

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
        """Devices whose worker process is gone (asked on the "ping" thread, which answers even
        while the worker's main thread is busy)."""
        refs = [w.ping.options(concurrency_group="ping").remote() for w in self.workers]
        dead = []
        for device, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=DEAD_CHECK_TIMEOUT_S)
            except self.ray.exceptions.RayActorError:
                dead.append(device)
            except self.ray.exceptions.GetTimeoutError:
                pass  # alive but not answering in time: not known to be dead
        return dead

    def shutdown(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        if self.queue is not None:
            self.queue.shutdown()
        self.ray.util.remove_placement_group(self.pg)
        if self.owns_ray:
            self.ray.shutdown()


DEAD_CHECK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # how long `deploy.ray_address` may take to accept a connection


def cluster_device(device: str, resources: dict[str, float], num_devices: int) -> str:
    """`deploy.device` for a Ray cluster with `resources` (`ray.cluster_resources()`): "auto" is
    "cuda" when it has GPUs; "cuda" needs one GPU per device."""
    gpus = int(resources.get("GPU", 0))
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device == "cuda" and gpus < num_devices:
        raise RunError(f"deploy.device=cuda needs one GPU per device: {num_devices} devices "
                       f"(deploy.num_devices), and the Ray cluster has {gpus} GPU(s); lower deploy.num_devices, "
                       f"add GPU nodes, or set deploy.device=cpu")
    return device


def device_bundles(plan: DeploymentPlan, threads: int) -> list[dict[str, float]]:
    """The placement group's bundles: one per device, `threads` CPUs (and one GPU on CUDA)."""
    bundle = {"CPU": threads, **({"GPU": 1} if plan.device == "cuda" else {})}
    return [dict(bundle) for _ in range(plan.num_devices)]


def worker_options(plan: DeploymentPlan, threads: int) -> dict[str, float]:
    """What one device worker asks of its bundle: Ray then shows it only its own GPU
    (`CUDA_VISIBLE_DEVICES`), which the worker binds as `cuda:0`."""
    return {"num_cpus": threads, "num_gpus": 1 if plan.device == "cuda" else 0}


def _start_ray(ray, address: str, num_cpus: int) -> None:
    """Join the cluster at `address`, or start a single-node one (on loopback when this process
    had not imported Ray before, see `RayDevices`)."""
    if address:
        _check_reachable(address)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        # "local": a new single-node cluster even where `ray start` left one running on this machine
        # (Ray would join that one, the last started, and refuse num_cpus)
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
                 num_cpus=num_cpus)


def check_attached(ray, address: str) -> None:
    """With Ray already initialized in this process, a `deploy.ray_address` must name the
    cluster it is attached to (an unreachable one is refused as when starting)."""
    if not address or address == "auto":
        return
    _check_reachable(address)
    current = ray.get_runtime_context().gcs_address
    if address.rpartition(":")[2] != current.rpartition(":")[2]:  # (a host may be named several ways: the port tells)
        raise RunError(f"deploy.ray_address={address!r}: this process is already attached to the Ray cluster "
                       f"at {current}; leave deploy.ray_address empty to use it, or run from a fresh process")


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
