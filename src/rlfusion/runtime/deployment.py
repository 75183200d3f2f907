"""Deployment: which devices run which RL roles, in which mode (MISSION.md §1).

    separated     rollout devices ≠ train devices; new weights go rollout-ward after every update
                  (bucketed broadcast). N devices: the first ⌈N/2⌉ generate, the rest train and
                  host reference and reward.
    colocated     the actor trains and generates on the same devices, switching layouts;
                  reference and reward get their own device when N ≥ 3, else share the actor's
                  devices with their weights kept resident.
    fully_shared  every role on every device, time-multiplexed: the reference weights are
                  offloaded to host while unused.

A device is one worker process: on CPU a process with `threads_per_device` threads, on CUDA one
GPU. `DeploymentPlan` is pure data (testable without Ray or torch.distributed); `workers.py`
places one Ray actor per device from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.config import check_fields

MODES = ("separated", "colocated", "fully_shared")
BACKENDS = ("ray", "local")
ROLES = ("rollout", "train", "reference", "reward")


@dataclass(frozen=True)
class DeployConfig:
    """`backend="local"` runs the same worker classes in the driver process (one device, for
    debugging); `"ray"` starts one Ray actor per device (`ray_address` "" = a local cluster)."""

    mode: str = "colocated"
    num_devices: int = 1
    threads_per_device: int = 1
    backend: str = "local"
    ray_address: str = ""
    bucket_mb: float = 4.0  # weight-sync bucket size

    def __post_init__(self) -> None:
        check_fields("deploy", {
            "mode": (self.mode in MODES, f"allowed: {', '.join(MODES)}"),
            "num_devices": (self.num_devices >= 1, "must be >= 1"),
            "threads_per_device": (self.threads_per_device >= 1, "must be >= 1"),
            "backend": (self.backend in BACKENDS, f"allowed: {', '.join(BACKENDS)}"),
            "bucket_mb": (self.bucket_mb > 0, "must be > 0"),
        }, self)
        if self.mode == "separated" and self.num_devices < 2:
            raise ValueError(f"deploy.num_devices={self.num_devices} is invalid: mode 'separated' "
                             "needs >= 2 (rollout and training devices are disjoint)")
        if self.backend == "local" and self.num_devices != 1:
            raise ValueError(f"deploy.num_devices={self.num_devices} is invalid: backend 'local' runs "
                             "in one process, so it has exactly 1 device (use backend='ray' for more)")


@dataclass(frozen=True)
class DeploymentPlan:
    """Device indices per role. `actor` devices hold trainable weights; in colocated and
    fully-shared modes they are also the rollout devices."""

    mode: str
    num_devices: int
    rollout: tuple[int, ...]
    train: tuple[int, ...]
    reference: tuple[int, ...]
    reward: tuple[int, ...]

    @classmethod
    def build(cls, cfg: DeployConfig) -> "DeploymentPlan":
        n, devices = cfg.num_devices, tuple(range(cfg.num_devices))
        if cfg.mode == "separated":
            k = (n + 1) // 2
            return cls(cfg.mode, n, rollout=devices[:k], train=devices[k:],
                       reference=devices[k:], reward=devices[k:])
        if cfg.mode == "colocated" and n >= 3:
            return cls(cfg.mode, n, rollout=devices[:-1], train=devices[:-1],
                       reference=devices[-1:], reward=devices[-1:])
        return cls(cfg.mode, n, rollout=devices, train=devices, reference=devices, reward=devices)

    @property
    def colocated_actor(self) -> bool:
        return self.rollout == self.train

    def roles(self, device: int) -> tuple[str, ...]:
        return tuple(r for r in ROLES if device in getattr(self, r))

    def describe(self) -> str:
        return f"{self.mode}: " + ", ".join(f"device {d} = {'+'.join(self.roles(d))}"
                                            for d in range(self.num_devices))
