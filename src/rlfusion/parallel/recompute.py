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
import itertools
import statistics
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlfusion.model.moe import Router

_state = threading.local()
CHILDREN = ("attn_norm", "attn", "mlp_norm", "mlp")  # per-layer candidates, besides the layer


def is_recomputing() -> bool:
    """True while a checkpointed module re-runs its forward during backward."""
    return getattr(_state, "depth", 0) > 0


# ---- measuring saved tensors ---------------------------------------------------------------

class SavedTensorMeter:
    """Bytes of distinct storages kept for backward by a forward pass, excluding parameters,
    attributed to every profiled module active when they were saved. Inputs that a
    checkpointed module keeps alive are counted too (`add`)."""

    def __init__(self, model: nn.Module):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        self.stack: list[str] = []
        self.by_module: dict[str, int] = defaultdict(int)

    @property
    def total_bytes(self) -> int:
        return sum(self.seen.values())

    def add(self, t: torch.Tensor) -> None:
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

    def __init__(self, model: nn.Module):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes_out = 0
        self._moved: dict[int, tuple[weakref.ref, tuple]] = {}

    def reset(self) -> None:
        self.bytes_out = 0
        self._moved.clear()

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return t  # weights stay where they are; only activations swap
        hit = self._moved.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        self.bytes_out += host.numel() * host.element_size()
        self._moved[id(t)] = (weakref.ref(t), (t.device, host))
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
    contexts = lambda: (contextlib.nullcontext(), _Replay(routers))
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _swapped(pool: HostPool, forward, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack):
        return forward(*args, **kwargs)


@dataclass(frozen=True)
class MemoryPlan:
    """Module names (as in `named_modules()`) to recompute and to swap, and what the planner
    predicted from measurements: activation bytes saved and seconds added per step."""

    recompute: tuple[str, ...] = ()
    swap: tuple[str, ...] = ()
    predicted_saved_bytes: float = 0.0
    predicted_added_s: float = 0.0
    fits: bool = True


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


# ---- profiling -----------------------------------------------------------------------------

@dataclass
class ModuleProfile:
    """Measured on one forward: saved-tensor bytes (this module and its children), bytes of
    its tensor inputs (kept alive when it is recomputed) and forward seconds (median)."""

    saved_bytes: int
    input_bytes: int
    forward_s: float


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


# ---- the planner (pure) --------------------------------------------------------------------

@dataclass(frozen=True)
class _Choice:
    recompute: tuple[str, ...]
    swap: tuple[str, ...]
    saved: float
    added_s: float


def _layer_choices(layer: str, prof: dict[str, ModuleProfile], bandwidth: float) -> list[_Choice]:
    """Every keep/recompute/swap combination of the layer's children, plus the whole layer."""
    def option(name: str, how: str) -> tuple[float, float]:
        p = prof[name]
        if how == "recompute":
            return max(p.saved_bytes - p.input_bytes, 0), p.forward_s
        return p.saved_bytes, 2 * p.saved_bytes / bandwidth  # out in forward, back in backward

    children = [f"{layer}.{c}" for c in CHILDREN if f"{layer}.{c}" in prof]
    out = []
    for hows in itertools.product(("keep", "recompute", "swap"), repeat=len(children)):
        picked = [(n, h, option(n, h)) for n, h in zip(children, hows) if h != "keep"]
        out.append(_Choice(tuple(n for n, h, _ in picked if h == "recompute"),
                           tuple(n for n, h, _ in picked if h == "swap"),
                           sum(o[0] for *_, o in picked), sum(o[1] for *_, o in picked)))
    saved, added = option(layer, "recompute")
    out.append(_Choice((layer,), (), saved, added))
    saved, added = option(layer, "swap")
    out.append(_Choice((), (layer,), saved, added))
    return out


def _frontier(choices: list[_Choice]) -> list[_Choice]:
    """Choices no other beats on both saved bytes and added time, by increasing saving."""
    best: list[_Choice] = []
    for c in sorted(choices, key=lambda c: (c.added_s, -c.saved)):
        if not best or c.saved > best[-1].saved:
            best.append(c)
    return best


def plan_memory(profiles: dict[str, ModuleProfile], total_bytes: int, budget_bytes: float,
                swap_bandwidth: float, allow_swap: bool = True) -> MemoryPlan:
    """Fit `total_bytes` of activations into `budget_bytes` with the least added time: per
    layer a Pareto frontier of choices, then greedy upgrades by added seconds per saved byte.
    `fits` is False when even the most aggressive choice does not fit."""
    if budget_bytes < 0 or swap_bandwidth <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} and swap_bandwidth={swap_bandwidth} "
                         "must be >= 0 and > 0")
    layers = [n for n in profiles if n.count(".") == 1]  # "layers.i"
    fronts = [_frontier([c for c in _layer_choices(n, profiles, swap_bandwidth)
                         if allow_swap or not c.swap]) for n in layers]
    picked = [0] * len(layers)  # index into each frontier; 0 = keep everything
    need = total_bytes - budget_bytes
    saved = lambda: sum(f[i].saved for f, i in zip(fronts, picked))
    while saved() < need:
        steps = [((f[j].added_s - f[picked[k]].added_s) / (f[j].saved - f[picked[k]].saved), k, j)
                 for k, f in enumerate(fronts) for j in range(picked[k] + 1, len(f))]
        if not steps:
            break
        _, k, j = min(steps)
        picked[k] = j
    chosen = [f[i] for f, i in zip(fronts, picked)]
    return MemoryPlan(tuple(n for c in chosen for n in c.recompute),
                      tuple(n for c in chosen for n in c.swap), saved(),
                      sum(c.added_s for c in chosen), saved() >= need)
