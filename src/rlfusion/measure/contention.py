"""How much two busy device processes slow each other on this machine (part of
`rlfusion.measure.calibrate`'s calibration; `bench/simulator.py` also samples it between its rounds).

Two Ray actors, placed as the real device workers are (1 thread each), run a fixed workload
sized like one colocated device's step — a rollout of `PROBE_SAMPLES` rows and an update on as
many samples:

    alone      each actor in turn, the other idle
    together   both at once, independently (separated devices that overlap work like this)
    lockstep   both at once, meeting as a colocated step's devices do: a barrier after the
               rollout (the driver waits for every device's rollout before the update) and
               the data-parallel gradient all-reduce inside the update

concurrent_speed = alone / together and lockstep_speed = alone / lockstep (medians). Other work
on the machine (other sessions, Ray's own processes) slows whichever process it lands on; two
independent processes each lose only their own share, while two in lock-step both wait for
the slower one at every meeting, so lock-step speed is the lower one here (0.84 vs 0.90 on a
quiet machine, 0.78 vs 0.85 beside 12 idle device workers, one measurement each). The
lock-step run includes its own gradient all-reduce (~1% of the workload here), which the
simulator also charges separately (`grad_sync_GB`): a small pessimistic bias, stated.

torch and Ray are imported inside the functions, as in `calibrate.py`.
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time

from rlfusion.measure.calibrate import _load, _Setup, engine_step_times, synthetic_trajectories, task_prompts

PROBE_SAMPLES = 128  # a colocated device's share of the default batch (32 prompts x 8 samples / 2)


def _mixed_workload(model, tokenizer, actor, trajs, meet=None) -> None:
    """The probe's fixed work, sized like one colocated device's step: a rollout of
    `PROBE_SAMPLES` rows (a full KV cache's worth) and an update on as many samples. Two busy
    processes slow each other by how much their working sets crowd the shared caches and memory
    bus, so the probe's must be the real one's size, not smaller. `meet()`, if given, runs
    between the rollout and the update (the lock-step run's barrier)."""
    model.eval()
    engine_step_times(model, task_prompts(tokenizer, PROBE_SAMPLES), 24)
    if meet is not None:
        meet()
    actor.update(trajs)


class ContentionWorker:
    """A device-like process (a Ray actor) running a fixed rollout + update workload."""

    def __init__(self, setup: _Setup, seed: int):
        from rlfusion.runtime.actor import ActorStage
        from rlfusion.runtime.train_config import AlgoConfig, OptimConfig

        self.model, self.tokenizer = _load(setup)
        self.actor = ActorStage(copy.deepcopy(self.model), AlgoConfig(), OptimConfig(), 1.0)
        self.trajs = synthetic_trajectories(self.tokenizer, PROBE_SAMPLES, self.model.config.vocab_size,
                                            seed=seed)
        self.dp_actor = None  # the same update, data parallel with the other worker (`connect`)
        self._store = None

    def address(self) -> int:
        """Hold the rendezvous store of the two workers' gloo world; returns its port."""
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        return self._store.port

    def connect(self, port: int, rank: int) -> None:
        """Join the two workers' gloo world (rank 0 holds the store, `address`) and build the
        data-parallel actor the lock-step run updates."""
        import torch.distributed as dist

        from rlfusion.runtime.actor import ActorStage
        from rlfusion.runtime.train_config import AlgoConfig, OptimConfig

        store = self._store if rank == 0 else dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        group = dist.new_group([0, 1])
        self.dp_actor = ActorStage(copy.deepcopy(self.model), AlgoConfig(), OptimConfig(), 1.0, dp_group=group)

    def work(self, lockstep: bool = False) -> float:
        """Seconds of the workload; `lockstep`: meeting the other worker (both must call)."""
        import torch.distributed as dist

        start = time.perf_counter()
        if lockstep:
            _mixed_workload(self.model, self.tokenizer, self.dp_actor, self.trajs, meet=dist.barrier)
        else:
            _mixed_workload(self.model, self.tokenizer, self.actor, self.trajs)
        return time.perf_counter() - start


def contention_workers(setup: _Setup) -> list:
    """Two warmed-up, connected `ContentionWorker` Ray actors (Ray must be running)."""
    import ray

    env = {"env_vars": {"OMP_NUM_THREADS": str(setup.threads),
                        "MKL_NUM_THREADS": str(setup.threads)}}
    cls = ray.remote(ContentionWorker)
    workers = [cls.options(num_cpus=setup.threads, runtime_env=env).remote(setup, r)
               for r in range(2)]
    try:
        port = ray.get(workers[0].address.remote())
        ray.get([w.connect.remote(port, r) for r, w in enumerate(workers)])
        ray.get([w.work.remote() for w in workers])  # load + warm-up
        ray.get([w.work.remote(lockstep=True) for w in workers])
    except BaseException:
        for w in workers:  # they hold CPUs of the caller's Ray cluster and a gloo store
            ray.kill(w)
        raise
    return workers


def contention_probe(workers: list, reps: int = 1) -> tuple[list[float], list[float], list[float]]:
    """(seconds alone, together, in lock-step) of the workload: each worker alone, then both
    independently, then both in lock-step."""
    import ray

    alone, together, lockstep = [], [], []
    for _ in range(reps):
        alone += [ray.get(w.work.remote()) for w in workers]
        together += ray.get([w.work.remote() for w in workers])
        lockstep += ray.get([w.work.remote(lockstep=True) for w in workers])
    return alone, together, lockstep


def concurrent_speed(alone: list[float], together: list[float]) -> float:
    """Median alone / median together (or in lock-step), at most 1."""
    return min(1.0, statistics.median(alone) / statistics.median(together))


def measure_contention(setup: _Setup) -> dict:
    """Two Ray device actors: the workload alone (one at a time), both at once, and both in
    lock-step."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2 * setup.threads, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    workers = []
    try:
        workers = contention_workers(setup)
        alone, together, lockstep = contention_probe(workers, 2 if setup.quick else 3)
    finally:
        for w in workers:
            ray.kill(w)
        if started:
            ray.shutdown()
    return {"concurrent_speed": concurrent_speed(alone, together),
            "lockstep_speed": concurrent_speed(alone, lockstep),
            "probe_s": statistics.median(alone),
            "_contention": (statistics.median(alone), statistics.median(together),
                            statistics.median(lockstep))}
