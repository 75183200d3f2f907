"""Buckets: the plain model's tensors cut into contiguous flat buffers of bounded size.

Owns the plan (which tensor goes into which bucket, at which element offset) and the pack /
unpack helpers. A plan is a pure function of `(name, shape, dtype)` in a fixed order and a
byte budget, so every rank computes the same plan without talking to the others; a switch then
moves one bucket at a time and never holds more than one bucket's worth of extra memory.

Rules: tensors keep the given order; a bucket holds one dtype (a flat buffer has one); a new
bucket starts when the next tensor would overflow `bucket_bytes` or changes dtype; a tensor
larger than `bucket_bytes` gets a bucket of its own (tensors are never split, so the receiving
side copies whole tensors). It does not know about layouts, collectives or modules
(`reshard.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the plain model's state dict."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside its bucket: elements `[offset, offset + spec.numel)`."""

    spec: TensorSpec
    offset: int


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype
    slots: tuple[Slot, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def names(self) -> list[str]:
        return [s.spec.name for s in self.slots]


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """Specs of a state dict (or any name → tensor map), in its order. Works on meta tensors."""
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy contiguous packing in the given order (see module docstring for the rules)."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: must be an integer >= 1")
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    numel = 0
    for spec in specs:
        full = (numel + spec.numel) * spec.dtype.itemsize > bucket_bytes
        if slots and (full or spec.dtype != slots[0].spec.dtype):
            buckets.append(Bucket(len(buckets), slots[0].spec.dtype, tuple(slots), numel))
            slots, numel = [], 0
        slots.append(Slot(spec, numel))
        numel += spec.numel
    if slots:
        buckets.append(Bucket(len(buckets), slots[0].spec.dtype, tuple(slots), numel))
    return buckets


def empty_bucket(bucket: Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=bucket.dtype, device=device)


def slot_view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor-shaped view of one slot inside a flat bucket buffer (no copy)."""
    return flat[slot.offset:slot.offset + slot.spec.numel].view(slot.spec.shape)


def pack(bucket: Bucket, tensors: Mapping[str, torch.Tensor],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the bucket's tensors into one flat buffer (`out`, or a new one on their device)."""
    if out is None:
        out = empty_bucket(bucket, tensors[bucket.slots[0].spec.name].device)
    for slot in bucket.slots:
        slot_view(out, slot).copy_(tensors[slot.spec.name])
    return out


def unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Name → view into `flat` (copy them out before `flat` is reused)."""
    if flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
        raise ValueError(f"flat buffer of {flat.numel()} x {flat.dtype} does not match bucket "
                         f"{bucket.index} ({bucket.numel} x {bucket.dtype})")
    return {slot.spec.name: slot_view(flat, slot) for slot in bucket.slots}
