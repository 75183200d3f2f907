"""Per-device memory ledger: bytes per category and location, and the peak of each phase.

Owns the accounting used to check zero-redundancy switching (train <-> rollout on the same
device): which categories (`CATEGORIES`) hold how many bytes on the device and in host memory,
the peak device total reached inside each phase, and the rule "a switch never needs more than
the larger of the training and rollout peaks plus one bucket". It does not allocate, move or
free anything; callers tell it what they hold. It does not know layouts, buckets or models
beyond the byte-count helpers at the bottom (`param_bytes`, `grad_bytes`, `optimizer_bytes`).

On CPU the ledger counts tracked tensor bytes only. A tensor counts its whole storage (a view
into a bucket costs the bucket), and a storage tracked under several names or categories counts
once in the totals, so weights that live inside bucket buffers are not double counted. On CUDA
the ledger can also record the caching allocator's peak per phase (`allocator_peaks`).

A ledger may carry the device's budget (`budget_bytes`, `deploy.device_memory_mb`): `check_budget`
raises `MemoryBudgetError` when the device total is above it. The ledger only compares; its owner
(`fusion/switch.py`) decides when.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlfusion.errors import RunError

CATEGORIES = ("weights", "grads", "optimizer", "kv_cache", "activations", "buckets")
LOCATIONS = ("device", "host")  # host: tensors offloaded to CPU memory beside an accelerator

# A category entry is either a plain byte count (`set`) or a set of storages (`track`),
# keyed by (storage device, data pointer) so a shared storage counts once.
StorageKey = tuple[str, int]
EntryKey = tuple[str, str, str]  # (category, location, part name)


@dataclass
class _Entry:
    nbytes: int = 0
    storages: dict[StorageKey, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ZeroRedundancyReport:
    """The numbers behind `check_zero_redundancy`; `limit_bytes` is what the switch may use."""

    switch_peak_bytes: int
    train_peak_bytes: int
    rollout_peak_bytes: int
    bucket_bytes: int
    limit_bytes: int
    excess_bytes: int  # switch peak above the limit; 0 when the rule holds


class MemoryBudgetError(RunError):
    """A device's tracked bytes went above its budget (`deploy.device_memory_mb`) during a phase;
    the message names the device, the phase, the bytes by category and the budget."""


class MemoryLedger:
    """Bytes held on one device (and in host memory on its behalf), with per-phase peaks.

    `phase()` blocks may nest; while several are open, every open phase's peak is updated.
    `budget_bytes`: what the device may hold (0 = no budget), for `check_budget`.
    """

    def __init__(self, device: str = "cpu:0", *, read_allocator: bool = False, budget_bytes: int = 0) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0 (0 = no budget), got {budget_bytes!r}")
        self.device = device
        self.budget_bytes = budget_bytes
        self._entries: dict[EntryKey, _Entry] = {}
        self._active: list[str] = []
        self._peaks: dict[str, int] = {}
        self._part_peaks: dict[str, dict[tuple[str, str], int]] = {}  # phase -> (category, name) -> device bytes
        self._alloc_peaks: dict[str, int] = {}
        self._cuda_index = _cuda_index(device) if read_allocator else None
        self.reads_allocator = read_allocator

    # ---- what is held -------------------------------------------------------------------

    def set(self, category: str, nbytes: int, *, location: str = "device", name: str = "") -> None:
        """Set the byte count of `category` (or of its part `name`), replacing tracked tensors."""
        key = _key(category, location, name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"bytes for {location}/{category} must be an int >= 0, got {nbytes!r}")
        self._entries[key] = _Entry(nbytes=nbytes)
        self._record()

    def track(
        self, category: str, tensors: Iterable[torch.Tensor], *, location: str = "device",
        name: str = "",
    ) -> int:
        """Set `category` (or its part `name`) to these tensors' storages; returns their bytes."""
        key = _key(category, location, name)
        storages = _storages(tensors)
        self._entries[key] = _Entry(storages=storages)
        self._record()
        return sum(storages.values())

    def clear(self, category: str, *, location: str = "device", name: str | None = None) -> None:
        """Forget `category` at `location` (only its part `name` if given)."""
        key = _key(category, location, name or "")
        for entry_key in [k for k in self._entries if k[:2] == key[:2]]:
            if name is None or entry_key == key:
                del self._entries[entry_key]
        self._record()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{location: {category: bytes}} for every location and category (zeros included).

        Storages are deduplicated within a category; a storage shared by two categories shows
        in both here but counts once in `total`.
        """
        return {
            loc: {cat: self._bytes(lambda k, c=cat, o=loc: k[:2] == (c, o)) for cat in CATEGORIES}
            for loc in LOCATIONS
        }

    def total(self, location: str = "device") -> int:
        """Bytes held at `location`, shared storages counted once."""
        _key(CATEGORIES[0], location, "")
        return self._bytes(lambda k: k[1] == location)

    # ---- phases and peaks ---------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Within the block, device totals (and allocator peaks) count toward phase `name`."""
        self._enter(name)
        try:
            yield
        finally:
            self._exit()

    def set_phase(self, name: str | None) -> None:
        """Make `name` the only open phase (None: no phase), for loops that cannot use `with`."""
        while self._active:
            self._exit()
        if name is not None:
            self._enter(name)

    def fresh(self) -> "MemoryLedger":
        """A ledger holding the same entries (each category's parts apart) with no phase peaks
        yet: the next interval's (peaks are per step)."""
        new = MemoryLedger(self.device, read_allocator=self.reads_allocator, budget_bytes=self.budget_bytes)
        new._entries = {key: _Entry(entry.nbytes, dict(entry.storages)) for key, entry in self._entries.items()}
        return new

    def part_peaks(self, category: str, name: str = "") -> dict[str, int]:
        """Per phase, the most device bytes the part `name` of `category` held in it."""
        return {phase: parts.get((category, name), 0) for phase, parts in self._part_peaks.items()}

    def peaks(self) -> dict[str, int]:
        """{phase: highest device total (tracked bytes) seen while it was open}."""
        return dict(self._peaks)

    @property
    def current_phase(self) -> str | None:
        """The innermost open phase, or None outside every phase."""
        return self._active[-1] if self._active else None

    def check_budget(self, where: str = "") -> None:
        """`MemoryBudgetError` if the device total is above `budget_bytes` (a no-op without one).
        `where` names the device in the message (default: the ledger's `device`)."""
        total = self.total("device")
        if not self.budget_bytes or total <= self.budget_bytes:
            return
        held = ", ".join(f"{cat} {_mib(n)}" for cat, n in self.snapshot()["device"].items() if n)
        raise MemoryBudgetError(
            f"{where or self.device}: the {self.current_phase or 'setup'} phase holds {_mib(total)} on the device "
            f"({held}), more than its budget deploy.device_memory_mb={self.budget_bytes / 2**20:g} "
            f"({_mib(self.budget_bytes)})")

    def allocator_peaks(self) -> dict[str, int]:
        """{phase: torch.cuda.max_memory_allocated inside it}; empty unless reading CUDA."""
        return dict(self._alloc_peaks)

    def check_zero_redundancy(
        self, *, bucket_bytes: int, switch_phase: str = "switch", train_phase: str = "train",
        rollout_phase: str = "rollout",
    ) -> tuple[bool, ZeroRedundancyReport]:
        """Does the switch peak stay within max(train peak, rollout peak) + one bucket?"""
        return check_zero_redundancy(
            self._peaks, bucket_bytes=bucket_bytes, switch_phase=switch_phase,
            train_phase=train_phase, rollout_phase=rollout_phase,
        )

    # ---- internals ----------------------------------------------------------------------

    def _bytes(self, keep: Callable[[EntryKey], bool]) -> int:
        counts, storages = 0, {}
        for key, entry in self._entries.items():
            if keep(key):
                counts += entry.nbytes
                storages.update(entry.storages)
        return counts + sum(storages.values())

    def _record(self) -> None:
        if not self._active:
            return
        total = self.total("device")
        parts = {(k[0], k[2]): e.nbytes + sum(e.storages.values()) for k, e in self._entries.items() if k[1] == "device"}
        for name in set(self._active):
            self._peaks[name] = max(self._peaks.get(name, 0), total)
            peak = self._part_peaks.setdefault(name, {})
            for part, nbytes in parts.items():
                peak[part] = max(peak.get(part, 0), nbytes)

    def _enter(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string (e.g. 'train'), got {name!r}")
        self._fold_allocator_peak(reset=True)
        self._active.append(name)
        self._peaks.setdefault(name, 0)
        self._record()

    def _exit(self) -> None:
        if self._active:  # a set_phase inside a `with phase()` block already closed it
            self._fold_allocator_peak(reset=False)
            self._active.pop()

    def _fold_allocator_peak(self, *, reset: bool) -> None:
        """Credit the allocator's peak since the last reset to every open phase.

        Resetting on entry makes an inner phase's peak its own; the outer phases were credited
        just before the reset, and are credited again when the inner one exits.
        """
        if self._cuda_index is None:
            return
        peak = torch.cuda.max_memory_allocated(self._cuda_index)
        for name in set(self._active):
            self._alloc_peaks[name] = max(self._alloc_peaks.get(name, 0), peak)
        if reset:
            torch.cuda.reset_peak_memory_stats(self._cuda_index)


def check_zero_redundancy(
    peaks: dict[str, int], *, bucket_bytes: int, switch_phase: str = "switch",
    train_phase: str = "train", rollout_phase: str = "rollout",
) -> tuple[bool, ZeroRedundancyReport]:
    """The rule on per-phase peaks: peak[switch] <= max(peak[train], peak[rollout]) + bucket."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    for phase in (switch_phase, train_phase, rollout_phase):
        if phase not in peaks:
            raise ValueError(f"phase {phase!r} has no recorded peak; recorded: {sorted(peaks)}")
    limit = max(peaks[train_phase], peaks[rollout_phase]) + bucket_bytes
    excess = max(0, peaks[switch_phase] - limit)
    report = ZeroRedundancyReport(
        switch_peak_bytes=peaks[switch_phase], train_peak_bytes=peaks[train_phase],
        rollout_peak_bytes=peaks[rollout_phase], bucket_bytes=bucket_bytes,
        limit_bytes=limit, excess_bytes=excess,
    )
    return excess == 0, report


# ---- byte counts of model state -----------------------------------------------------------


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (views cost their base)."""
    return sum(_storages(tensors).values())


def param_bytes(module: torch.nn.Module) -> int:
    """Parameter storage bytes of `module`; tied parameters count once."""
    return tensor_bytes(module.parameters())


def grad_bytes(module: torch.nn.Module) -> int:
    """Gradient storage bytes of `module` (parameters without a grad count 0)."""
    return tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state, each storage once.

    That includes per-parameter scalar tensors: AdamW after one step holds exp_avg and
    exp_avg_sq (2x the parameter bytes) plus one 0-d `step` tensor per parameter (float32,
    4 bytes each, on CPU unless `capturable` or `fused`).
    """
    state_tensors = (
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return tensor_bytes(state_tensors)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[StorageKey, int]:
    out: dict[StorageKey, int] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"item {i} is a {type(t).__name__}, not a tensor")
        if callable(getattr(t, "to_local", None)):  # DTensor: this rank's shard is what it holds
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            out[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return out


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _key(category: str, location: str, name: str) -> EntryKey:
    if category not in CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; allowed: {', '.join(CATEGORIES)}")
    if location not in LOCATIONS:
        raise ValueError(f"unknown memory location {location!r}; allowed: {', '.join(LOCATIONS)}")
    if not isinstance(name, str):
        raise ValueError(f"part name for {location}/{category} must be a string, got {name!r}")
    return category, location, name


def _cuda_index(device: str) -> int | None:
    """The CUDA device index to read the allocator of, or None when there is none to read."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.device(device).index or 0
