"""Expert load balancing across EP ranks: count routed tokens, predict the next interval's load,
plan a placement of experts on ranks, and migrate experts (weights, grads, optimizer state).

    router forward hook ─counts_ME─▶ LoadPredictor (sum over DP, EMA) ─pred_ME─▶
    plan_placement (LPT, equal experts per rank) ─slot_to_expert─▶ trigger (margin) ─▶
    migrate_experts (all-to-all of rows, EP group) ─▶ ExpertParallelExperts.expert_to_slot_E

A placement is `slot_to_expert`: physical slot s (on EP member s // C) holds logical expert
`slot_to_expert[s]`. The router keeps producing logical ids; `ExpertParallelExperts` maps them
to slots, so routing math and the gathered (logical-order) state dict are unchanged by a
migration. Counting hooks sit on the routers from outside the model file and count every
forward (training and rollout), except recomputation in backward (`recompute.py`).

Owns counting, prediction, planning and the migration protocol. It does not know how the
all-to-all dispatch works (`expert_parallel.py`) or which optimizer is used beyond "state
tensors shaped like the parameter move with it".

Legend: M MoE layers (of this pipeline stage), E experts, P EP group size, C experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlfusion.model.moe import MoE, Router
from rlfusion.model.routes import NO_ROUTE
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.recompute import is_recomputing


@dataclass(frozen=True)
class BalanceConfig:
    """`ema_decay`: weight of the past prediction (0 = last interval only). `margin`: migrate a
    layer only when its predicted max/mean rank load drops by at least this much."""

    ema_decay: float = 0.5
    margin: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"balance.ema_decay={self.ema_decay!r} is invalid: must be in [0, 1)")
        if self.margin < 0:
            raise ValueError(f"balance.margin={self.margin!r} is invalid: must be >= 0")


# ---- counting and prediction ---------------------------------------------------------------

class ExpertLoadTracker:
    """Per-layer, per-expert routed (token, expert) pairs since the last `take()`. `valid_of`
    (router → a `[N]` real-token mask, or None): which tokens count, where a pass pads its
    rows (a pipeline's micro-batches, `pipeline.PaddedRouting.valid_of`)."""

    def __init__(self, routers: list[Router], valid_of=None):
        if not routers:
            raise ValueError("ExpertLoadTracker needs at least one router")
        self.counts_ME = torch.zeros(len(routers), routers[0].num_experts, dtype=torch.float64)
        self.valid_of = valid_of
        self._handles = [r.register_forward_hook(self._hook(m)) for m, r in enumerate(routers)]

    def _hook(self, m: int):
        def count(router, args, output) -> None:
            if is_recomputing():  # the same tokens again, replayed for backward
                return
            ids_NK = output[0].detach()
            valid_N = self.valid_of(router) if self.valid_of is not None else None
            if valid_N is not None:
                ids_NK = ids_NK[valid_N.to(ids_NK.device)]
            ids = ids_NK.flatten()
            self.counts_ME[m] += torch.bincount(ids, minlength=router.num_experts).cpu().double()
        return count

    def take(self) -> torch.Tensor:
        counts_ME, self.counts_ME = self.counts_ME, torch.zeros_like(self.counts_ME)
        return counts_ME

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class LoadPredictor:
    """EMA over intervals of the per-expert load summed over data-parallel replicas."""

    def __init__(self, ema_decay: float, group: dist.ProcessGroup | None = None):
        self.ema_decay, self.group = ema_decay, group
        self.pred_ME: torch.Tensor | None = None
        self.last_ME: torch.Tensor | None = None  # the last interval's counts, summed over replicas

    def update(self, counts_ME: torch.Tensor) -> torch.Tensor:
        counts_ME = counts_ME.double().clone()
        if self.group is not None:
            dist.all_reduce(counts_ME, group=self.group)
        self.last_ME = counts_ME
        if self.pred_ME is None:
            self.pred_ME = counts_ME
        else:
            self.pred_ME = self.ema_decay * self.pred_ME + (1 - self.ema_decay) * counts_ME
        return self.pred_ME


# ---- planning (pure) -----------------------------------------------------------------------

def rank_loads(load_E: torch.Tensor, slot_to_expert: list[int], num_ranks: int) -> list[float]:
    per_rank = len(slot_to_expert) // num_ranks
    load = load_E.tolist()
    return [sum(load[e] for e in slot_to_expert[r * per_rank:(r + 1) * per_rank])
            for r in range(num_ranks)]


def imbalance(load_E: torch.Tensor, slot_to_expert: list[int], num_ranks: int) -> float:
    """max/mean rank load (1.0 = perfectly balanced, or no load at all)."""
    loads = rank_loads(load_E, slot_to_expert, num_ranks)
    mean = sum(loads) / num_ranks
    return max(loads) / mean if mean > 0 else 1.0


def _lpt_bins(load: list[float], num_ranks: int) -> list[list[int]]:
    """Longest processing time first onto the lightest rank that still has a free slot."""
    per_rank = len(load) // num_ranks
    bins: list[list[int]] = [[] for _ in range(num_ranks)]
    sums = [0.0] * num_ranks
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        r = min((r for r in range(num_ranks) if len(bins[r]) < per_rank),
                key=lambda r: (sums[r], r))
        bins[r].append(e)
        sums[r] += load[e]
    return bins


def _bins_to_slots(bins: list[list[int]], current: list[int]) -> list[int]:
    """Give each bin the rank (and slots) already holding most of its experts: fewer bytes move."""
    P, C = len(bins), len(current) // len(bins)
    on_rank = [set(current[r * C:(r + 1) * C]) for r in range(P)]
    pairs = sorted((-len(on_rank[r] & set(b)), i, r) for i, b in enumerate(bins) for r in range(P))
    rank_of_bin: dict[int, int] = {}
    for _, i, r in pairs:
        if i not in rank_of_bin and r not in rank_of_bin.values():
            rank_of_bin[i] = r
    out = [-1] * len(current)
    for i, b in enumerate(bins):
        r = rank_of_bin[i]
        stay = [e for e in b if e in on_rank[r]]
        for e in stay:
            out[current.index(e)] = e
        free = [s for s in range(r * C, (r + 1) * C) if out[s] < 0]
        for s, e in zip(free, sorted(set(b) - set(stay))):
            out[s] = e
    return out


def plan_placement(load_E: torch.Tensor, num_ranks: int,
                   current: list[int] | None = None) -> list[int]:
    """A `slot_to_expert` placement with equal experts per rank minimizing the max rank load
    (greedy LPT), laid out to keep as many experts in place as possible."""
    E = load_E.numel()
    if num_ranks < 1 or E % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} is invalid: must divide num_experts={E}")
    current = list(range(E)) if current is None else current
    if sorted(current) != list(range(E)):
        raise ValueError(f"current placement {current} is not a permutation of {E} experts")
    return _bins_to_slots(_lpt_bins(load_E.tolist(), num_ranks), current)


def inverse(slot_to_expert: list[int]) -> list[int]:
    expert_to_slot = [0] * len(slot_to_expert)
    for s, e in enumerate(slot_to_expert):
        expert_to_slot[e] = s
    return expert_to_slot


# ---- migration (collective over the EP group) ----------------------------------------------

def _moving_tensors(module: ExpertParallelExperts, optimizer) -> list[torch.Tensor]:
    """Weights, grads and optimizer state shaped like the weights, in one order on every rank."""
    out = []
    for p in (module.w_gate_EDF, module.w_up_EDF, module.w_down_EFD):
        out.append(p.data)
        if p.grad is not None:
            out.append(p.grad)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        out += [state[k] for k in sorted(state) if torch.is_tensor(state[k])
                and state[k].shape == p.shape]
    return out


def _row_plan(old: list[int], new: list[int], P: int, me: int):
    """Rows this rank sends (old local rows, by destination) and where received rows go."""
    C, old_slot = len(old) // P, inverse(old)
    send: list[int] = []
    recv: list[int] = []
    in_splits: list[int] = []
    out_splits: list[int] = []
    for dst in range(P):
        rows = [old_slot[new[s]] % C for s in range(dst * C, (dst + 1) * C)
                if old_slot[new[s]] // C == me]
        send += rows
        in_splits.append(len(rows))
    for src in range(P):
        rows = [s % C for s in range(me * C, (me + 1) * C) if old_slot[new[s]] // C == src]
        recv += rows
        out_splits.append(len(rows))
    return send, in_splits, recv, out_splits


@torch.no_grad()
def migrate_experts(module: ExpertParallelExperts, new: list[int], optimizer=None) -> int:
    """Move experts to the placement `new` (collective over the EP group); returns bytes sent to
    other ranks. Weights, their grads and same-shaped optimizer state move in place, so the
    optimizer keeps its parameter references."""
    g = module.ep
    old = list(range(len(new))) if module.expert_to_slot_E is None else inverse(
        module.expert_to_slot_E.tolist())
    send, in_splits, recv, out_splits = _row_plan(old, new, g.size, g.index)
    sent = 0
    for t in _moving_tensors(module, optimizer):
        rows_out = t.new_empty((sum(out_splits), *t.shape[1:]))
        if g.size == 1:
            rows_out.copy_(t[send])
        else:
            dist.all_to_all_single(rows_out, t[send].contiguous(), out_splits, in_splits,
                                   group=g.group)
        t[recv] = rows_out
        row_bytes = t[0].numel() * t.element_size()
        sent += row_bytes * sum(n for j, n in enumerate(in_splits) if j != g.index)
    module.expert_to_slot_E = torch.tensor(inverse(new), device=module.w_gate_EDF.device)
    return sent


# ---- the per-interval driver ---------------------------------------------------------------

@dataclass
class LayerBalance:
    """Predicted max/mean rank load of one MoE layer before and after this interval's decision,
    and the max/mean rank load this interval measured (in the placement it ran with)."""

    before: float
    after: float
    migrated: bool
    measured: float = 1.0


@dataclass
class BalanceReport:
    layers: list[LayerBalance] = field(default_factory=list)
    bytes_moved: int = 0  # this rank's bytes sent to other EP ranks

    @property
    def migrated(self) -> bool:
        return any(layer.migrated for layer in self.layers)


def moe_pairs(chunks) -> list[tuple[Router, ExpertParallelExperts]]:
    return [(m.router, m.experts) for c in chunks for m in c.modules()
            if isinstance(m, MoE) and isinstance(m.experts, ExpertParallelExperts)]


class ExpertBalancer:
    """Counts routing of a `ParallelModel`'s MoE layers and, on `step()`, migrates layers whose
    predicted imbalance improves by `cfg.margin`. Call `step()` on every rank at the same point
    (e.g. between backward and the optimizer step, so grads move too)."""

    def __init__(self, pm, cfg: BalanceConfig = BalanceConfig()):
        pairs = moe_pairs(pm.chunks)
        if not pairs:
            raise ValueError("ExpertBalancer needs a model parallelized with layout.ep > 1")
        self.cfg, self.experts = cfg, [e for _, e in pairs]
        # each balanced layer's index among the model's MoE layers (`Block.moe_index`)
        self.moe_layers = [int(name.split(".")[1]) - pm.config.num_dense_layers for c in pm.chunks
                           for name, m in c.named_modules() if isinstance(m, MoE) and isinstance(m.experts, ExpertParallelExperts)]
        self.num_moe_layers = pm.config.num_moe_layers
        routing = getattr(pm, "routing", None)  # a pipeline's padded micro-batches
        self.tracker = ExpertLoadTracker([r for r, _ in pairs], routing.valid_of if routing else None)
        dp_group = pm.mesh.group("dp") if pm.layout.dp > 1 else None
        self.predictor = LoadPredictor(cfg.ema_decay, dp_group)
        num_experts = pairs[0][0].num_experts
        self.placements = [list(range(num_experts)) for _ in pairs]

    def load_of(self, routes_NX: torch.Tensor | None) -> torch.Tensor:
        """Per balanced layer, the tokens routed to each expert by recorded routes (`[N, L * K]`,
        `NO_ROUTE` rows not counted; None: no tokens)."""
        E = len(self.placements[0])
        counts_ME = torch.zeros(len(self.moe_layers), E, dtype=torch.float64)
        if routes_NX is not None:
            ids_NLK = routes_NX.view(len(routes_NX), -1, len(routes_NX[0]) // self.num_moe_layers)
            for m, layer in enumerate(self.moe_layers):
                fed_NK = ids_NLK[:, layer][ids_NLK[:, layer, 0] != NO_ROUTE]
                counts_ME[m] = torch.bincount(fed_NK.flatten(), minlength=E).double()
        return counts_ME

    def step(self, optimizer=None, counts_ME: torch.Tensor | None = None) -> BalanceReport:
        """`counts_ME`: this interval's per-layer expert load from elsewhere (the rollout's
        recorded routes) instead of what this rank's routers counted."""
        counted_ME = self.tracker.take()
        pred_ME = self.predictor.update(counted_ME if counts_ME is None else counts_ME.double())
        report = BalanceReport()
        for m, module in enumerate(self.experts):
            P, current = module.ep.size, self.placements[m]
            before = imbalance(pred_ME[m], current, P)
            proposed = plan_placement(pred_ME[m], P, current)
            after = imbalance(pred_ME[m], proposed, P)
            move = before - after >= self.cfg.margin and proposed != current
            if move:
                report.bytes_moved += migrate_experts(module, proposed, optimizer)
                self.placements[m] = proposed
            measured = imbalance(self.predictor.last_ME[m], current, P)
            report.layers.append(LayerBalance(before, after if move else before, move, measured))
        return report

    def close(self) -> None:
        self.tracker.close()
