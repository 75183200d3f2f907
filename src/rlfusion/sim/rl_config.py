"""Typed configuration of one RL simulation, loaded from TOML.

Owns `RLSimConfig` and `load_rl_config()`. A TOML file has flat keys matching the fields
(optionally under a `[simulate]` table); `calibration = "cpu-default"` or a path to a JSON
file written by a microbenchmark (`calibration.save_calibration`).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from rlfusion.engine.scheduler import MAX_NUM_SEQS
from rlfusion.stalesync.rules import STOP_SYNC_EVERY

MODES = ("separated", "colocated", "fully_shared", "hybrid")  # deploy.mode
STALESYNC_MODELS = ("samples", "runtime")
SCORERS = ("rollout", "train")


@dataclass(frozen=True)
class RLSimConfig:
    """Keys that a run has too carry the run's names (`rlfusion train`'s `deploy.mode`,
    `rollout.*`, `stalesync.*`)."""

    mode: str = "colocated"  # separated | colocated | fully_shared (actor, ref, reward on one pool) | hybrid
    devices_per_supernode: int = 2  # devices (workers/chips) in one supernode
    num_supernodes: int = 1
    rollout_fraction: float = 0.5  # separated mode: share of devices that generate
    prompts_per_step: int = 32  # per supernode (weak scaling keeps this per supernode)
    group_size: int = 8  # samples per prompt (rollout.group_size)
    num_steps: int = 6  # RL updates to simulate
    prompt_len: int = 12  # tokens
    response_median: float = 24.0  # tokens, median of the log-normal length distribution
    response_p99_over_median: float = 3.75  # long tail (measured on the arithmetic task: 3.5-4)
    max_new_tokens: int = 128  # longest response (rollout.max_new_tokens)
    # Measured lengths, used in order (sample i gets response_lengths[i % len]) instead of the
    # log-normal: replays a real run's response-length distribution. Empty = log-normal.
    response_lengths: tuple[int, ...] = ()
    # Measured prompt lengths, used the same way (sample i's prompt has prompt_lengths[i % len]
    # tokens); empty = `prompt_len` for every sample. A decode pass attends over its longest
    # context, so the spread of prompt lengths matters, not only their mean.
    prompt_lengths: tuple[int, ...] = ()
    train_fraction: float = 1.0  # share of a batch's tokens the update trains on (DAPO dynamic
    #                              sampling drops groups whose rewards are all equal; measured)
    max_num_seqs: int = MAX_NUM_SEQS  # continuous-batching slots per engine instance (rollout.max_num_seqs)
    min_prefill_batch: int = 1  # while decoding, admit only once this many slots are free (or
    #                             every waiting sample fits), as the engine's scheduler does
    scorers: str = "rollout"  # "rollout": each engine computes reference logprobs of its samples
    #                           after generating them; "train": the train devices do, before the
    #                           update (separated mode only; deploy.scorers)
    max_staleness: int = 0  # s: an update at version u only uses samples started at >= u - s
    partial_rollout: bool = False  # co-located: end rollout at N finished, resume the rest
    # How StaleSync (max_staleness >= 1, partial_rollout) is modelled. "samples": the idealised
    # sample-level rule (an update goes ahead once N samples are ready; projections use it).
    # "runtime": the runtime's StalenessBook exactly (rl_stalesync.py): prompt groups admitted
    # while fewer than (s+1)*B are in flight, a group admitted at version a due at update a+s,
    # a partial rollout that stops once rollout_finish_threshold of the B groups are finished
    # and the due ones are done (overdue = wait), separated rollout/update overlap for s >= 1.
    stalesync_model: str = "samples"
    rollout_finish_threshold: float = 1.0  # runtime model: a fraction in (0, 1] or a count > 1
    # runtime model: how an aborted sample resumes (stalesync.resume_kv): "keep" (back on its
    # device, from its saved cache row, no prefill) or "recompute" (prompt + partial output prefilled)
    resume_kv: str = "keep"
    max_num_batched_tokens: int = 4096  # runtime model: the engine's token budget per step (packed prefill)
    stop_sync_every: int = STOP_SYNC_EVERY  # runtime model: engine steps between the rollout
    #                                         devices' stop-rule sums (the runtime's own constant)
    reference: bool = True  # a reference-model pass per sample (False: no KL term, algo.kl_coef=0)
    reward_model: bool = False  # fully_shared mode: a reward-model forward (else a free verifier)
    queue_bytes_per_token: int = 12  # token id, behaviour logprob, policy version
    padding_free: bool = True  # DistQueue packs samples without padding
    inter_supernode_GBps: float = 0.0  # per-device bandwidth between supernodes; 0 = ideal
    # stragglers (samples model): each engine's work for one policy version, and each update's
    # train devices, take exp(N(0, sigma)) times as long (the update waits for the slowest of
    # its devices); 0 = every device at the calibrated speed
    straggler_sigma: float = 0.0
    calibration: str = "cpu-default"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"simulate.mode={self.mode!r}; allowed: {', '.join(MODES)}")
        if self.scorers not in SCORERS:
            raise ValueError(f"simulate.scorers={self.scorers!r}; allowed: {', '.join(SCORERS)}")
        if self.stalesync_model not in STALESYNC_MODELS:
            raise ValueError(f"simulate.stalesync_model={self.stalesync_model!r}; "
                             f"allowed: {', '.join(STALESYNC_MODELS)}")
        if self.resume_kv not in ("keep", "recompute"):
            raise ValueError(f"simulate.resume_kv={self.resume_kv!r}; allowed: keep, recompute")
        t = self.rollout_finish_threshold
        if not (0 < t <= 1 or (t > 1 and float(t).is_integer())):
            raise ValueError(f"simulate.rollout_finish_threshold={t}: allowed: a fraction in "
                             "(0, 1] or a whole count > 1")
        for key in ("devices_per_supernode", "num_supernodes", "prompts_per_step",
                    "group_size", "num_steps", "max_new_tokens",
                    "max_num_seqs", "min_prefill_batch", "max_num_batched_tokens",
                    "stop_sync_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"simulate.{key}={getattr(self, key)} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"simulate.max_staleness={self.max_staleness} must be >= 0")
        if not 0 <= self.straggler_sigma < 1:
            raise ValueError(f"simulate.straggler_sigma={self.straggler_sigma} must be in [0, 1)")
        if self.straggler_sigma and self.stalesync_model == "runtime":
            raise ValueError("simulate.straggler_sigma applies to stalesync_model='samples' only (the runtime "
                             "model replays this machine's devices, whose spread the calibration measured)")
        if self.mode == "hybrid" and (self.stalesync_model != "runtime" or self.max_staleness < 1):
            raise ValueError("simulate.mode='hybrid' needs stalesync_model='runtime' and max_staleness >= 1 "
                             "(the runtime's StaleSync schedule is what places it)")
        if not 0.0 < self.rollout_fraction < 1.0:
            raise ValueError(f"simulate.rollout_fraction={self.rollout_fraction} must be "
                             "in (0, 1)")
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"simulate.train_fraction={self.train_fraction} must be in (0, 1]")
        if any(n < 1 for n in self.response_lengths):
            raise ValueError("simulate.response_lengths must all be >= 1")
        if any(n < 1 for n in self.prompt_lengths):
            raise ValueError("simulate.prompt_lengths must all be >= 1")
        if self.response_p99_over_median < 1.0 or self.response_median <= 0:
            raise ValueError("simulate.response_p99_over_median must be >= 1 and "
                             "response_median > 0")

    @property
    def num_devices(self) -> int:
        return self.devices_per_supernode * self.num_supernodes

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size * self.num_supernodes

    @property
    def length_sigma(self) -> float:
        """Log-normal sigma giving the configured p99/median (z_0.99 = 2.326)."""
        return math.log(self.response_p99_over_median) / 2.326

    def replace(self, **changes) -> "RLSimConfig":
        return dataclasses.replace(self, **changes)


def expected_longest(n: int, median: float, sigma: float, points: int = 4001) -> float:
    """The expected longest of `n` log-normal draws (median `median`, log-sigma `sigma`):
    E[max] = integral of median e^(sigma z) n phi(z) Phi(z)^(n-1) dz, by Simpson's rule over
    z in [-10, 10]. It grows with `n`: the longest response an update waits for gets longer the
    more samples it draws (one draw: the mean, median e^(sigma^2 / 2))."""
    if n < 1 or sigma < 0 or median <= 0:
        raise ValueError(f"expected_longest needs n >= 1, sigma >= 0 and median > 0, got {n}, {sigma}, {median}")
    lo, hi = -10.0, 10.0
    h = (hi - lo) / (points - 1)
    total = 0.0
    for i in range(points):
        z = lo + i * h
        cdf = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
        density = n * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) * cdf ** (n - 1)
        weight = 1 if i in (0, points - 1) else 4 if i % 2 else 2
        total += weight * math.exp(sigma * z) * density
    return median * total * h / 3.0


def load_rl_config(path: str | Path) -> RLSimConfig:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    data = data.get("simulate", data)
    allowed = {f.name for f in fields(RLSimConfig)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(sorted(allowed))}")
    for f in fields(RLSimConfig):
        if f.name in data:
            _check_type(path, f.name, data[f.name], getattr(RLSimConfig, f.name, None))
    if "response_lengths" in data:
        data["response_lengths"] = tuple(data["response_lengths"])
    try:
        return RLSimConfig(**data)
    except TypeError as exc:  # a value of the wrong type (e.g. a string for a number)
        raise ValueError(f"{path}: {exc}") from None


def _check_type(path, key: str, value, default) -> None:
    """A TOML value of the type the field's default has (an int is fine for a float)."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    elif isinstance(default, tuple):
        ok = isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                             for x in value)
        want = "a list of integers"
    else:
        return
    if not ok:
        raise ValueError(f"{path}: simulate.{key}={value!r} must be {want}")
