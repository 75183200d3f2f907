"""Selective recompute and swap of activations, and the memory planner that chooses them.

- Recompute: a module's forward runs under `torch.utils.checkpoint` (non-reentrant), so only
  its inputs stay alive and its saved tensors are rebuilt in backward.
- Swap: a module's forward runs under `saved_tensors_hooks` that move each saved tensor into a
  `HostPool` (a pinned host copy on accelerators; on CPU a separate copy whose bytes the pool
  accounts) and bring it back in backward.
- Planner: `profile_modules` MEASURES, per candidate module, the saved-tensor bytes of its
  forward (a `SavedTensorMeter` on `saved_tensors_hooks`) and its forward time (the recompute
  cost); `plan_memory` picks, per layer, among keep / recompute / swap of attention, MLP (or
  MoE) and the two norms, or the whole layer, the set that fits a per-device activation budget
  with the least added time (swap time = bytes out and back at a measured copy bandwidth).
  The planner itself is pure Python in `rlfusion.memory_plan`, shared with `rlfusion plan`.

Both are applied to module instances from outside the model file (`apply_plan` overrides the
instance's `forward`; `remove()` restores it), so parameter names do not change.
Recomputed forwards replay routers: `is_recomputing()` tells counting hooks to skip them and the
routers' own `tokens_per_expert` are restored after the replay.

Owns the wrappers, the measurements and the plan. It does not know about optimizers,
parallel layouts or where the budget comes from.
"""

from __future__ import annotations

import contextlib
import functools
import re
import statistics
import threading
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlfusion.memory_plan import CHILDREN, MemoryPlan, ModuleProfile, plan_memory
from rlfusion.model.moe import Router
from rlfusion.parallel.overlap import PairingRecord, PairingReplay

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed module re-runs its forward during backward."""
    return getattr(_state, "depth", 0) > 0


def _param_ptrs(model: nn.Module) -> set[int]:
    """Storages of the parameters (a layout's shards: their local tensors)."""
    return {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in model.parameters()}


# ---- measuring saved tensors ---------------------------------------------------------------

class SavedTensorMeter:
    """Bytes of distinct storages kept for backward by a forward pass, excluding parameters,
    attributed to every profiled module active when they were saved. Inputs that a
    checkpointed module keeps alive are counted too (`add`)."""

    def __init__(self, model: nn.Module):
        self.param_ptrs = _param_ptrs(model)
        self.seen: dict[int, int] = {}
        self.stack: list[str] = []
        self.by_module: dict[str, int] = defaultdict(int)

    @property
    def total_bytes(self) -> int:
        return sum(self.seen.values())

    def add(self, t: torch.Tensor) -> None:
        if hasattr(t, "to_local"):  # a DTensor (a TP layout): its shard is what this rank keeps
            t = t.to_local()
        key = t.untyped_storage().data_ptr()
        if key in self.param_ptrs or key in self.seen:
            return
        self.seen[key] = t.untyped_storage().nbytes()
        for name in self.stack:
            self.by_module[name] += self.seen[key]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        _state.meter = self
        return self

    def __exit__(self, *exc) -> None:
        _state.meter = None
        self._hooks.__exit__(*exc)


class HostPool:
    """Swapped-out activations. `bytes_out`: bytes moved to host since `reset()`; a tensor
    saved by several ops (one input to q, k and v projections) moves once."""

    def __init__(self, model: nn.Module, ledger: Any = None):
        self.param_ptrs = _param_ptrs(model)
        self.bytes_out = 0
        self.ledger = ledger  # a `fusion.memory.MemoryLedger`: host "activations" follow bytes_out
        self._moved: dict[int, tuple[weakref.ref, tuple]] = {}

    def reset(self) -> None:
        self.bytes_out = 0
        self._moved.clear()
        self._account()

    def _account(self) -> None:
        if self.ledger is not None:
            self.ledger.set("activations", self.bytes_out, location="host", name="swap")

    def pack(self, t: torch.Tensor):
        if hasattr(t, "to_local") or t.untyped_storage().data_ptr() in self.param_ptrs:
            return t  # weights stay where they are; only plain activations swap (a DTensor's stay)
        hit = self._moved.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        self.bytes_out += host.numel() * host.element_size()
        self._moved[id(t)] = (weakref.ref(t), (t.device, host))
        self._account()
        return t.device, host

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


# ---- applying recompute and swap -----------------------------------------------------------

class _Replay:
    """The recompute phase: flag it, and undo the routers' counting of replayed tokens."""

    def __init__(self, routers: list[Router]):
        self.routers = routers

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1
        self.saved = [r.tokens_per_expert.clone() for r in self.routers]

    def __exit__(self, *exc) -> None:
        _state.depth -= 1
        for r, counts in zip(self.routers, self.saved):
            r.tokens_per_expert.copy_(counts)


def _checkpointed(module: nn.Module, forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    meter = getattr(_state, "meter", None)
    if meter is not None:
        for a in args:
            if isinstance(a, torch.Tensor):
                meter.add(a)  # checkpoint keeps its inputs alive until backward
    routers = [m for m in module.modules() if isinstance(m, Router)]

    def contexts():
        record = PairingRecord()  # (Adaptive Pipe: the replay splits its all-to-all as the forward did)
        return record, _replay(_Replay(routers), PairingReplay(record))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextlib.contextmanager
def _replay(routers: "_Replay", pairing: PairingReplay):
    """The contexts around a replay: the routers replay their choices, the all-to-alls their split."""
    with routers, pairing:
        yield


def _swapped(pool: HostPool, forward, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack):
        return forward(*args, **kwargs)


class AppliedPlan:
    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def remove(self) -> None:
        for m in self.modules:
            del m.forward  # back to the class's forward


def apply_plan(model: nn.Module, plan: MemoryPlan, pool: HostPool | None = None) -> AppliedPlan:
    """Wrap the planned modules' forwards; `remove()` on the result undoes it."""
    named = dict(model.named_modules())
    unknown = [n for n in (*plan.recompute, *plan.swap) if n not in named]
    if unknown:
        raise ValueError(f"plan names unknown modules {unknown}")
    if set(plan.recompute) & set(plan.swap):
        raise ValueError(f"modules {sorted(set(plan.recompute) & set(plan.swap))} are both "
                         "recomputed and swapped")
    if plan.swap and pool is None:
        raise ValueError("a plan with swapped modules needs a HostPool")
    touched = []
    for name in plan.recompute:
        m = named[name]
        m.forward = functools.partial(_checkpointed, m, m.forward)
        touched.append(m)
    for name in plan.swap:
        m = named[name]
        m.forward = functools.partial(_swapped, pool, m.forward)
        touched.append(m)
    return AppliedPlan(touched)


_LAYER = re.compile(r"layers\.\d+")


def fixed_plan(model: nn.Module, mode: str) -> MemoryPlan:
    """The plans that need no measurement: "selective" recomputes each layer's attention,
    "full" each whole layer, "swap" swaps each layer's saved tensors; "none" keeps everything.
    `model` is a plain model or a pipeline chunk (both name their layers `layers.<i>`)."""
    layers = tuple(n for n, _ in model.named_modules() if _LAYER.fullmatch(n))
    plans = {"none": MemoryPlan(), "selective": MemoryPlan(recompute=tuple(f"{n}.attn" for n in layers)),
             "full": MemoryPlan(recompute=layers), "swap": MemoryPlan(swap=layers)}
    if mode not in plans:
        raise ValueError(f"recompute mode {mode!r} is invalid: allowed: {', '.join(plans)}")
    return plans[mode]


def measured_plan(model: nn.Module, forward_fn, budget_bytes: float) -> MemoryPlan:
    """The planner's choice for `model`: each candidate module's saved bytes and forward time
    measured on `forward_fn()` (a training forward of a representative micro-batch), then the
    cheapest recompute/swap mix that fits `budget_bytes`. The profiling passes leave the
    routers' load counts as they were."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    counts = [r.tokens_per_expert.clone() for r in routers]
    try:
        profiles, total = profile_modules(model, forward_fn, candidate_names(model))
    finally:
        for r, c in zip(routers, counts):
            r.tokens_per_expert.copy_(c)
    return plan_memory(profiles, total, budget_bytes, measure_copy_bandwidth())


# ---- profiling -----------------------------------------------------------------------------

def candidate_names(model: nn.Module) -> list[str]:
    """Per layer: the layer itself, then its attention, MLP and norms."""
    names = []
    for i, _ in enumerate(model.layers):
        names += [f"layers.{i}"] + [f"layers.{i}.{c}" for c in CHILDREN]
    return names


def profile_modules(model: nn.Module, forward_fn, names: list[str],
                    repeats: int = 3) -> tuple[dict[str, ModuleProfile], int]:
    """Run `forward_fn()` (a training forward, grad enabled) `repeats` times; returns per-module
    profiles and the total saved-tensor bytes of the whole forward."""
    named = dict(model.named_modules())
    times: dict[str, list[float]] = defaultdict(list)
    inputs: dict[str, int] = {}
    meter_box: list[SavedTensorMeter] = []

    def pre(name, module, args):
        meter = meter_box[-1]
        meter.stack.append(name)
        inputs[name] = sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
        module._t0 = time.perf_counter()

    def post(name, module, args, output):
        times[name].append(time.perf_counter() - module._t0)
        meter_box[-1].stack.pop()

    handles = [h for n in names for h in (
        named[n].register_forward_pre_hook(functools.partial(pre, n)),
        named[n].register_forward_hook(functools.partial(post, n)))]
    try:
        for _ in range(repeats):
            with SavedTensorMeter(model) as meter:
                meter_box.append(meter)
                forward_fn()
    finally:
        for h in handles:
            h.remove()
    profiles = {n: ModuleProfile(meter.by_module[n], inputs[n], statistics.median(times[n]))
                for n in names}
    return profiles, meter.total_bytes


def measure_copy_bandwidth(nbytes: int = 1 << 24, device: str = "cpu") -> float:
    """Bytes/s of a device → host copy (on CPU: a host memory copy)."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty(nbytes // 4, pin_memory=src.is_cuda)
    dst.copy_(src)  # warm up
    best = float("inf")
    for _ in range(3):
        if src.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
