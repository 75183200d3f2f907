"""Host offload: move tensors' device storage to host memory and back, keeping the tensors.

Owns the `HostPool` that, during a rollout, holds what training needs later but generation
does not (optimizer states, gradients, optionally the training weights), and the helpers that
list those tensors. Offloading works on *storages*: each storage is copied to a host buffer
(pinned when it lives on an accelerator, so the copy can run asynchronously) and then resized
to 0 bytes, which returns the device memory; restoring resizes it back and copies the bytes
in. The tensor objects never change, so the optimizer's state dict, DTensor wrappers, FSDP
views and `.grad` references stay valid, and the round trip is bitwise exact.

It is device-agnostic: on CPU the "host" is the same RAM (the storage is still freed and
the pool's byte counters still tell what moved). It does not know about layouts or buckets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
from rlfusion.parallel.data_parallel import local_tensor


@dataclass(frozen=True)
class OffloadStats:
    """One offload or restore: how many storages and bytes moved, and how long it took."""

    num_storages: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Entry:
    storage: torch.UntypedStorage  # the device storage, 0 bytes while offloaded
    host_U: torch.Tensor  # uint8 copy of its bytes


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's per-parameter state (e.g. AdamW's exp_avg, exp_avg_sq,
    step)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def grad_tensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Distinct, non-empty storages behind `tensors` (views of one storage move once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of storage the tensors currently hold (0 for offloaded ones)."""
    return sum(s.nbytes() for s in _storages(tensors))


def _sync(devices: set[torch.device]) -> None:
    for device in devices:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)


@dataclass
class HostPool:
    """Storages currently offloaded to host memory; `restore()` puts all of them back."""

    entries: list[_Entry] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(e.host_U.numel() for e in self.entries)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> OffloadStats:
        start, devices, moved = time.perf_counter(), set(), 0
        storages = _storages(tensors)
        for storage in storages:
            device = storage.device
            host_U = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                 pin_memory=device.type != "cpu")
            host_U.copy_(torch.tensor([], dtype=torch.uint8, device=device).set_(storage),
                         non_blocking=True)
            devices.add(device)
            moved += storage.nbytes()
            self.entries.append(_Entry(storage, host_U))
        _sync(devices)  # the host copies must land before the device bytes are handed back
        for storage in storages:
            storage.resize_(0)
        return OffloadStats(len(storages), moved, time.perf_counter() - start)

    @torch.no_grad()
    def restore(self) -> OffloadStats:
        start, devices, moved = time.perf_counter(), set(), 0
        for entry in self.entries:
            storage, nbytes = entry.storage, entry.host_U.numel()
            assert storage.nbytes() == 0, "an offloaded storage was reallocated behind the pool"
            storage.resize_(nbytes)
            device_U = torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage)
            device_U.copy_(entry.host_U, non_blocking=True)
            devices.add(storage.device)
            moved += nbytes
        _sync(devices)  # pinned host buffers are dropped below; copies must finish first
        count, self.entries = len(self.entries), []
        return OffloadStats(count, moved, time.perf_counter() - start)
