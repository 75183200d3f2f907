"""The activation-memory planner: per layer keep / recompute / swap, under a budget.

Pure Python (no torch, nothing else of rlfusion), shared by training (`rlfusion.parallel.recompute`,
which feeds it MEASURED profiles) and the simulator (`rlfusion.sim.step`, which feeds it the cost
model's per-layer activation bytes and forward FLOPs), so `rlfusion plan` and training pick
recompute/swap with the same cost terms. It sits below both, so neither imports the other.

Model: each candidate module (a layer `layers.i` and its children `layers.i.attn_norm`,
`.attn`, `.mlp_norm`, `.mlp`) has a `ModuleProfile`: bytes it saves for backward (itself and
its children), bytes of its inputs (kept alive when it is recomputed) and its forward seconds.
- recompute saves `saved_bytes - input_bytes` for `forward_s` extra seconds;
- swap saves `saved_bytes` for `2 * saved_bytes / bandwidth` seconds (out in forward, back in
  backward; not overlapped with compute, a conservative assumption).
`plan_memory` builds, per layer, the Pareto frontier of every keep/recompute/swap combination
of the children plus the whole layer recomputed or swapped, then greedily takes the upgrade
with the least added seconds per saved byte until the activations fit the budget.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

CHILDREN = ("attn_norm", "attn", "mlp_norm", "mlp")  # per-layer candidates, besides the layer


@dataclass
class ModuleProfile:
    """One forward of one module: saved-tensor bytes (this module and its children), bytes of
    its tensor inputs (kept alive when it is recomputed) and forward seconds."""

    saved_bytes: float
    input_bytes: float
    forward_s: float


@dataclass(frozen=True)
class MemoryPlan:
    """Module names (as in `named_modules()`) to recompute and to swap, and what the planner
    predicted: activation bytes saved and seconds added per step."""

    recompute: tuple[str, ...] = ()
    swap: tuple[str, ...] = ()
    predicted_saved_bytes: float = 0.0
    predicted_added_s: float = 0.0
    fits: bool = True


@dataclass(frozen=True)
class _Choice:
    recompute: tuple[str, ...]
    swap: tuple[str, ...]
    saved: float
    added_s: float


def _option(p: ModuleProfile, how: str, bandwidth: float) -> tuple[float, float]:
    """(bytes saved, seconds added) of recomputing or swapping one module."""
    if how == "recompute":
        return max(p.saved_bytes - p.input_bytes, 0), p.forward_s
    return p.saved_bytes, 2 * p.saved_bytes / bandwidth  # out in forward, back in backward


def _layer_choices(layer: str, prof: dict[str, ModuleProfile], bandwidth: float) -> list[_Choice]:
    """Every keep/recompute/swap combination of the layer's children, plus the whole layer."""
    children = [f"{layer}.{c}" for c in CHILDREN if f"{layer}.{c}" in prof]
    out = []
    for hows in itertools.product(("keep", "recompute", "swap"), repeat=len(children)):
        picked = [(n, h, _option(prof[n], h, bandwidth)) for n, h in zip(children, hows)
                  if h != "keep"]
        out.append(_Choice(tuple(n for n, h, _ in picked if h == "recompute"),
                           tuple(n for n, h, _ in picked if h == "swap"),
                           sum(o[0] for *_, o in picked), sum(o[1] for *_, o in picked)))
    saved, added = _option(prof[layer], "recompute", bandwidth)
    out.append(_Choice((layer,), (), saved, added))
    saved, added = _option(prof[layer], "swap", bandwidth)
    out.append(_Choice((), (layer,), saved, added))
    return out


def _frontier(choices: list[_Choice]) -> list[_Choice]:
    """Choices no other beats on both saved bytes and added time, by increasing saving."""
    best: list[_Choice] = []
    for c in sorted(choices, key=lambda c: (c.added_s, -c.saved)):
        if not best or c.saved > best[-1].saved:
            best.append(c)
    return best


_FRONTIERS: dict[tuple, list[_Choice]] = {}  # by (child profiles, bandwidth, allow_swap)


def _layer_frontier(layer: str, prof: dict[str, ModuleProfile], bandwidth: float,
                    allow_swap: bool) -> list[_Choice]:
    """`_frontier` of the layer's (swap-free unless `allow_swap`) choices. Layers with equal
    profiles (every MoE layer of a simulated stage) share one computed frontier, renamed."""
    names = [layer] + [f"{layer}.{c}" for c in CHILDREN]
    key = (tuple((n[len(layer):], prof[n].saved_bytes, prof[n].input_bytes, prof[n].forward_s)
                 for n in names if n in prof), bandwidth, allow_swap)
    template = _FRONTIERS.get(key)
    if template is None:
        template = _frontier([c for c in _layer_choices("L", {
            "L" + suffix: ModuleProfile(s, i, f) for suffix, s, i, f in key[0]}, bandwidth)
            if allow_swap or not c.swap])
        if len(_FRONTIERS) > 4096:
            _FRONTIERS.clear()
        _FRONTIERS[key] = template
    rename = lambda ns: tuple(layer + n[1:] for n in ns)
    return [_Choice(rename(c.recompute), rename(c.swap), c.saved, c.added_s) for c in template]


def plan_memory(profiles: dict[str, ModuleProfile], total_bytes: float, budget_bytes: float,
                swap_bandwidth: float, allow_swap: bool = True) -> MemoryPlan:
    """Fit `total_bytes` of activations into `budget_bytes` with the least added time: per
    layer a Pareto frontier of choices, then greedy upgrades by added seconds per saved byte
    (ties: lowest layer, then smallest upgrade). `fits` is False when even the most
    aggressive choice does not fit."""
    if budget_bytes < 0 or swap_bandwidth <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} and swap_bandwidth={swap_bandwidth} "
                         "must be >= 0 and > 0")
    need = total_bytes - budget_bytes
    if need <= 0:
        return MemoryPlan()
    layers = [n for n in profiles if n.count(".") == 1]  # "layers.i"
    fronts = [_layer_frontier(n, profiles, swap_bandwidth, allow_swap) for n in layers]
    picked = [0] * len(layers)  # index into each frontier; 0 = keep everything
    saved = lambda: sum(f[i].saved for f, i in zip(fronts, picked))

    def best_step(k: int):
        f, i = fronts[k], picked[k]
        return min(((f[j].added_s - f[i].added_s) / (f[j].saved - f[i].saved), k, j)
                   for j in range(i + 1, len(f))) if i + 1 < len(f) else None

    heap = [s for s in map(best_step, range(len(layers))) if s is not None]
    heapq.heapify(heap)  # one entry per layer that can still save more: its cheapest upgrade
    while saved() < need and heap:
        _, k, j = heapq.heappop(heap)
        picked[k] = j
        step = best_step(k)
        if step is not None:
            heapq.heappush(heap, step)
    chosen = [f[i] for f, i in zip(fronts, picked)]
    return MemoryPlan(tuple(n for c in chosen for n in c.recompute),
                      tuple(n for c in chosen for n in c.swap), saved(),
                      sum(c.added_s for c in chosen), saved() >= need)
