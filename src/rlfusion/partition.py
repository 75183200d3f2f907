"""Contiguous balanced partition: items in order (layers), each with a cost, cut into a given
number of non-empty runs so that the costliest run is as cheap as possible.

Pure Python (no torch, nothing else of rlfusion), shared by the planner (`rlfusion.sim.step`,
which feeds it simulated per-layer seconds) and training (`rlfusion.parallel.pipeline`, which
feeds it per-layer FLOPs) so both cut a model into pipeline stages the same way. It sits below
both, so neither imports the other. It does not know what the items or costs are.
"""

from __future__ import annotations


def partition(costs: list[float], parts: int) -> list[int]:
    """Contiguous split of `costs` into `parts` non-empty groups minimizing the largest sum.
    Returns the group index of each item (binary search on the bound, greedy fill)."""
    assert 0 < parts <= len(costs)

    def greedy(bound: float) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        acc = 0.0
        for i, cost in enumerate(costs):
            if groups[-1] and acc + cost > bound:
                groups.append([])
                acc = 0.0
            groups[-1].append(i)
            acc += cost
        return groups

    lo, hi = max(costs), sum(costs)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if len(greedy(mid)) > parts else (lo, mid)
    groups = greedy(hi)
    while len(groups) < parts:  # splitting a group never raises the largest sum
        i = max(range(len(groups)), key=lambda g: len(groups[g]))
        half = len(groups[i]) // 2
        groups[i:i + 1] = [groups[i][:half], groups[i][half:]]
    return [g for g, items in enumerate(groups) for _ in items]


def ranges(owner: list[int]) -> list[range]:
    """The items of each group of a contiguous `owner` list (`partition`'s answer), in order."""
    out: list[range] = []
    for i, g in enumerate(owner):
        if g == len(out):
            out.append(range(i, i + 1))
        else:
            assert g == len(out) - 1, "groups must be contiguous and numbered in order"
            out[-1] = range(out[-1].start, i + 1)
    return out
