"""How much two busy device processes slow each other on this machine (part of
`rlfusion.measure.calibrate_all`'s calibration; `bench/simulator.py` also samples it between its rounds).

Two Ray actors, placed as the real device workers are (1 thread each), run a fixed workload
sized like one colocated device's step — a rollout of `PROBE_SAMPLES` rows, decode passes of
`CONTEXT_ROWS` rows at a long and at a short context, and an update on `PROBE_SAMPLES` samples —
each part timed apart (`PARTS`: decode, context, train), since two busy processes slow
memory-bound work (the attention's reads over a long cache) more than compute-bound work:

    alone      each actor in turn, the other idle
    together   both at once, independently (separated devices that overlap work like this)
    lockstep   both at once, meeting as a colocated step's devices do: a barrier after each
               part (the driver waits for every device's rollout before the update) and the
               data-parallel gradient all-reduce inside the update

concurrent_speed = alone / together and lockstep_speed = alone / lockstep (medians) of the whole
workload, and the same of each part (`decode_speed`, `decode_lockstep_speed`, ...). Other work
on the machine (other sessions, Ray's own processes) slows whichever process it lands on; two
independent processes each lose only their own share, while two in lock-step both wait for
the slower one at every meeting, so lock-step speed is the lower one here (whole workload
0.73-0.80 vs 0.80-0.86 between the rounds of `bench/simulator.py`; the long-context reads the
lowest, 0.55-0.75 in lock-step). The
lock-step run includes its own gradient all-reduce (~1% of the workload here), which the
simulator also charges separately (`grad_sync_GB`): a small pessimistic bias, stated.

torch and Ray are imported inside the functions, as in `calibrate.py`.
"""

from __future__ import annotations

import copy
import datetime
import math
import statistics
import time

from rlfusion.measure.calibrate import (CONTEXT_ROWS, LONG_CONTEXT, Setup, context_steps, engine_step_times,
                                        load_base_model, synthetic_trajectories, task_prompts)

PROBE_SAMPLES = 128  # a colocated device's share of the default batch (32 prompts x 8 samples / 2)
PARTS = ("decode", "context", "train")  # the kinds of work timed apart (Calibration.speed)
CONTEXT_SHORT = 64  # the context part: passes at `LONG_CONTEXT` less passes at this (about the decode table's)
CONTEXT_PASSES = 12  # passes at each of the two contexts per run of the workload
CALL_TIMEOUT_S = 300  # one call of both workers (a warm run of the workload takes seconds), at most


def _mixed_workload(model, tokenizer, actor, trajs, context, meet=None) -> dict[str, float]:
    """The probe's fixed work, sized like one colocated device's step: a rollout of
    `PROBE_SAMPLES` rows (a full KV cache's worth), decode passes at a long and at a short
    context (`context`: the two callables, `CONTEXT_PASSES` of each in turn) and an update on
    `PROBE_SAMPLES` samples. Two busy processes slow each other by how much their working sets
    crowd the shared caches and memory bus, so the probe's must be the real one's size, not
    smaller. Returns the seconds of each part (`PARTS`; "context" is the long passes' time less
    the short ones': the attention's reads over the longer context). `meet()`, if given, runs
    after each part (the lock-step run's barriers: colocated devices meet after the rollout and
    in the update's gradient all-reduce), and its wait counts in the part before it."""
    def met() -> float:
        if meet is not None:
            meet()
        return time.perf_counter()

    model.eval()
    start = time.perf_counter()
    engine_step_times(model, task_prompts(tokenizer, PROBE_SAMPLES), 24)
    after_rollout = met()
    long_step, short_step = context
    short_s = 0.0
    for _ in range(CONTEXT_PASSES):
        long_step()
        t = time.perf_counter()
        short_step()
        short_s += time.perf_counter() - t
    after_context = met()
    actor.update(trajs)
    end = met()
    # the long passes: the part's time less the short ones' (the barrier's wait counts with them)
    long_s = after_context - after_rollout - short_s
    # noise can make the long passes no slower than the short ones: no context figure then (nan)
    return {"decode": after_rollout - start, "context": long_s - short_s if long_s > short_s else math.nan,
            "train": end - after_context, "total": end - start}


class ContentionWorker:
    """A device-like process (a Ray actor) running a fixed rollout + update workload."""

    def __init__(self, setup: Setup, seed: int):
        from rlfusion.runtime.actor import ActorStage
        from rlfusion.runtime.train_config import AlgoConfig, OptimConfig

        self.model, self.tokenizer = load_base_model(setup)
        # the same weights built for the long context (rotary positions), as the replay runs load them
        long_model, _ = load_base_model(setup, max_seq_len=max(self.model.config.max_seq_len, LONG_CONTEXT))
        long_model.eval()
        self.context = context_steps(long_model, CONTEXT_ROWS, (LONG_CONTEXT - 1, CONTEXT_SHORT))
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

    def work(self, lockstep: bool = False) -> dict[str, float]:
        """Seconds of the workload's parts and in all ("total"); `lockstep`: meeting the other
        worker (both must call)."""
        import torch.distributed as dist

        if lockstep:
            return _mixed_workload(self.model, self.tokenizer, self.dp_actor, self.trajs, self.context,
                                   meet=dist.barrier)
        return _mixed_workload(self.model, self.tokenizer, self.actor, self.trajs, self.context)


def contention_workers(setup: Setup) -> list:
    """Two warmed-up, connected `ContentionWorker` Ray actors (Ray must be running)."""
    import ray

    env = {"env_vars": {"OMP_NUM_THREADS": str(setup.threads),
                        "MKL_NUM_THREADS": str(setup.threads)}}
    cls = ray.remote(ContentionWorker)
    workers = [cls.options(num_cpus=setup.threads, runtime_env=env).remote(setup, r)
               for r in range(2)]
    try:
        port = _get(workers[0].address.remote(), "start")
        _get([w.connect.remote(port, r) for r, w in enumerate(workers)], "join their gloo world")
        _get([w.work.remote() for w in workers], "warm up")  # load + warm-up
        _get([w.work.remote(lockstep=True) for w in workers], "warm up in lock-step")
    except BaseException:
        for w in workers:  # they hold CPUs of the caller's Ray cluster and a gloo store
            ray.kill(w)
        raise
    return workers


def contention_probe(workers: list, reps: int = 1) -> tuple[list[dict], list[dict], list[dict]]:
    """(alone, together, in lock-step): the seconds of the workload's parts (`work`) of each
    worker alone, then both independently, then both in lock-step."""
    alone, together, lockstep = [], [], []
    for _ in range(reps):
        alone += [_get(w.work.remote(), "run alone") for w in workers]
        together += _get([w.work.remote() for w in workers], "run at once")
        lockstep += _get([w.work.remote(lockstep=True) for w in workers], "run in lock-step")
    return alone, together, lockstep


def _get(refs, what: str):
    """`ray.get` of the workers' calls, an error naming the step where they are not done in
    `CALL_TIMEOUT_S` (an actor Ray cannot place or start, a world that never forms)."""
    import ray

    try:
        return ray.get(refs, timeout=CALL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the contention probe's Ray workers did not {what} in {CALL_TIMEOUT_S} s") from None


def concurrent_speed(alone: list[dict], together: list[dict], part: str = "total") -> float:
    """Median alone / median together (or in lock-step) of one part of the workload, at most 1;
    0 (not measured: the calibration then uses the whole workload's) where that part has no
    valid sample on either side."""
    a = [x[part] for x in alone if x[part] > 0]  # nan compares false
    b = [x[part] for x in together if x[part] > 0]
    if not a or not b:
        return 0.0
    return min(1.0, statistics.median(a) / statistics.median(b))


def probe_speeds(alone: list[dict], together: list[dict], lockstep: list[dict]) -> dict[str, float]:
    """The calibration's contention fields from probe samples: the whole workload's speeds
    (`concurrent_speed`, `lockstep_speed`), each part's (`decode_speed`, ...) and `probe_s`, the
    whole workload alone (the machine-speed mark)."""
    out = {"concurrent_speed": concurrent_speed(alone, together),
           "lockstep_speed": concurrent_speed(alone, lockstep),
           "probe_s": statistics.median(x["total"] for x in alone)}
    for part in PARTS:
        out[f"{part}_speed"] = concurrent_speed(alone, together, part)
        out[f"{part}_lockstep_speed"] = concurrent_speed(alone, lockstep, part)
    return out


def speeds_line(speeds: dict[str, float]) -> str:
    """The probe's speeds in one line (independent / lock-step)."""
    return ", ".join(f"{part} {speeds[f'{part}_speed']:.2f} / {speeds[f'{part}_lockstep_speed']:.2f}"
                     for part in PARTS) + \
        f"; whole workload {speeds['concurrent_speed']:.2f} / {speeds['lockstep_speed']:.2f}"


def measure_contention(setup: Setup) -> dict:
    """Two Ray device actors: the workload alone (one at a time), both at once, and both in
    lock-step."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2 * setup.threads, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    workers = []
    try:
        workers = contention_workers(setup)
        alone, together, lockstep = contention_probe(workers, 1 if setup.smoke else 2 if setup.quick else 3)
    finally:
        for w in workers:
            ray.kill(w)
        if started:
            ray.shutdown()
    return {**probe_speeds(alone, together, lockstep),
            "_contention": tuple(statistics.median(x["total"] for x in runs) for runs in (alone, together, lockstep))}
