"""Expert parallelism: routed experts split over the ranks of an EP group, tokens moved to them
with `all_to_all_single` (uneven splits) and back, flat or hierarchical.

Owns the drop-in replacement for the model's `GroupedExperts` (same call signature, same
parameter names, only this rank's experts), the two dispatch/combine algorithms and the byte
counters. It does not know about the router (routing happens before, on every rank, exactly as
in the plain model) or how groups were chosen (`mesh.py`).

Flat: each (token, expert) pair is sent to the rank holding the expert, so a token routed to
two experts on one remote node crosses the node boundary twice.

Hierarchical (`ranks_per_node`): stage 1 sends each token once to every *node* that holds at
least one of its experts (to the peer with the same local index, over the "rail" group),
together with its expert ids and combine weights; stage 2 is a flat all-to-all inside the node.
Combine runs in reverse: outputs are weighted and summed inside the node, and one row per
(token, node) crosses back. Summation order matches the plain model (expert order), so flat,
hierarchical and single-process outputs agree to rounding of the expert matmuls.

TP ranks inside an EP group hold the same tokens; each takes a contiguous 1/tp slice of them
before dispatch and the slices are all-gathered after combine.

Legend: n local tokens, D model dim, K experts per token, R rows received, P group size,
L experts per rank, F expert FFN width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlfusion.model.moe import GroupedExperts
from rlfusion.parallel.mesh import A2AGroup, ParallelMesh


@dataclass
class CommCounter:
    """Bytes this rank sent through expert all-to-alls (forward and backward, payload and
    routing metadata), and the part that went to ranks on another node."""

    sent_bytes: int = 0
    internode_bytes: int = 0
    calls: int = 0

    def record(self, in_splits: list[int], g: A2AGroup, row_bytes: int) -> None:
        self.calls += 1
        for j, rows in enumerate(in_splits):
            if j != g.index:
                self.sent_bytes += rows * row_bytes
                if g.remote[j]:
                    self.internode_bytes += rows * row_bytes

    def reset(self) -> None:
        self.sent_bytes = self.internode_bytes = self.calls = 0


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: A2AGroup,
         counter: CommCounter) -> torch.Tensor:
    counter.record(in_splits, g, x.element_size() * math.prod(x.shape[1:]))
    if g.size == 1:
        return x.clone()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=g.group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of rows; backward sends gradients back along the same splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, g, counter):
        ctx.args = (out_splits, in_splits, g, counter)
        return _a2a(x, out_splits, in_splits, g, counter)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, g, counter = ctx.args
        return _a2a(grad.contiguous(), in_splits, out_splits, g, counter), None, None, None, None


def all_to_all_rows(x, out_splits, in_splits, g: A2AGroup, counter: CommCounter) -> torch.Tensor:
    if x.is_floating_point() and torch.is_grad_enabled():
        return _AllToAll.apply(x, out_splits, in_splits, g, counter)
    return _a2a(x, out_splits, in_splits, g, counter)


# ---- TP slices: tokens replicated over TP are split before dispatch, gathered after combine --

def _row_sizes(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _gather_rows(x_nD: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    padded = F.pad(x_nD, (0, 0, 0, max(sizes) - len(x_nD)))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


class _SliceRows(torch.autograd.Function):
    """Forward: this TP rank's rows. Backward: all-gather, since the input is replicated."""

    @staticmethod
    def forward(ctx, x, sizes, index, group):
        ctx.args = (sizes, group)
        start = sum(sizes[:index])
        return x[start:start + sizes[index]].clone()

    @staticmethod
    def backward(ctx, grad):
        sizes, group = ctx.args
        return _gather_rows(grad, sizes, group), None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather the TP slices. Backward: the (replicated) grad's own slice."""

    @staticmethod
    def forward(ctx, x, sizes, index, group):
        ctx.args = (sizes, index)
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, index = ctx.args
        start = sum(sizes[:index])
        return grad[start:start + sizes[index]].contiguous(), None, None, None


class ExpertParallelExperts(nn.Module):
    """This rank's slice of a layer's routed experts, called like `GroupedExperts`."""

    def __init__(self, experts: GroupedExperts, mesh: ParallelMesh):
        super().__init__()
        num_experts = experts.w_gate_EDF.shape[0]
        self.ep, self.rail, self.node = mesh.ep, mesh.rail, mesh.node
        self.edp_group, self.dp = mesh.edp_group, mesh.layout.dp
        self.tp, self.tp_index = mesh.layout.tp, mesh.coord("tp")
        self.tp_group = mesh.group("tp") if self.tp > 1 else None
        self.num_local = num_experts // self.ep.size
        self.first_expert = self.ep.index * self.num_local
        local = slice(self.first_expert, self.first_expert + self.num_local)
        self.w_gate_EDF = nn.Parameter(experts.w_gate_EDF.detach()[local].clone())
        self.w_up_EDF = nn.Parameter(experts.w_up_EDF.detach()[local].clone())
        self.w_down_EFD = nn.Parameter(experts.w_down_EFD.detach()[local].clone())
        self.counter = CommCounter()
        # Logical expert id → physical slot after a migration (`parallel/balance.py`); slot s
        # lives on EP member s // L. None: the identity, as built.
        self.expert_to_slot_E: torch.Tensor | None = None

    def forward(self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor,
                weights_NK: torch.Tensor) -> torch.Tensor:
        if self.expert_to_slot_E is not None:  # the router's math stays in logical ids
            topk_ids_NK = self.expert_to_slot_E[topk_ids_NK]
        if self.tp > 1:
            sizes = _row_sizes(len(x_ND), self.tp)
            x_ND = _SliceRows.apply(x_ND, sizes, self.tp_index, self.tp_group)
            weights_NK = _SliceRows.apply(weights_NK, sizes, self.tp_index, self.tp_group)
            start = sum(sizes[:self.tp_index])
            topk_ids_NK = topk_ids_NK[start:start + sizes[self.tp_index]]
        if self.rail is not None:
            y_ND = self._hierarchical(x_ND, topk_ids_NK, weights_NK)
        else:
            y_ND = self._exchange(x_ND, topk_ids_NK, weights_NK, self.ep)
        if self.tp > 1:
            y_ND = _GatherRows.apply(y_ND, sizes, self.tp_index, self.tp_group)
        return y_ND

    # ---- the two algorithms ------------------------------------------------------------------

    def _exchange(self, x_nD, ids_nK, w_nK, g: A2AGroup) -> torch.Tensor:
        """Flat dispatch → local experts → combine inside `g`.

        `ids_nK` are expert ids relative to the group's first expert (member j holds
        `[j*L, (j+1)*L)`), or -1 for pairs handled elsewhere.
        """
        K, L = ids_nK.shape[1], self.num_local
        flat = ids_nK.reshape(-1)
        pairs = (flat >= 0).nonzero().squeeze(1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]  # expert order, as the plain model
        tok = pairs // K
        send_counts_PL = torch.bincount(flat[pairs], minlength=g.size * L).view(g.size, L)
        recv_counts_PL = _a2a(send_counts_PL, [1] * g.size, [1] * g.size, g, self.counter)
        in_splits, out_splits = send_counts_PL.sum(1).tolist(), recv_counts_PL.sum(1).tolist()
        recv_x_RD = all_to_all_rows(x_nD[tok], out_splits, in_splits, g, self.counter)
        local_ids_R = torch.arange(L, device=x_nD.device).repeat(g.size).repeat_interleave(
            recv_counts_PL.flatten())
        y_RD = self._run_local(recv_x_RD, local_ids_R)
        y_pairs = all_to_all_rows(y_RD, in_splits, out_splits, g, self.counter)
        y_pairs = y_pairs * w_nK.reshape(-1)[pairs].unsqueeze(-1)
        return torch.zeros_like(x_nD).index_add_(0, tok, y_pairs)

    def _hierarchical(self, x_nD, ids_nK, w_nK) -> torch.Tensor:
        """Stage 1: one copy per (token, node) over the rail group; stage 2: `_exchange` in node."""
        rail, per_node = self.rail, self.node.size * self.num_local
        node_nK = ids_nK // per_node
        toks, ids, ws = [], [], []
        for m in range(rail.size):
            hit_nK = node_nK == m
            sel = hit_nK.any(1).nonzero().squeeze(1)
            toks.append(sel)
            ids.append(torch.where(hit_nK, ids_nK - m * per_node, -1)[sel].to(torch.int32))
            ws.append(torch.where(hit_nK, w_nK, 0.0)[sel])
        tok = torch.cat(toks)
        in_splits = [len(t) for t in toks]
        ones = [1] * rail.size
        out_splits = _a2a(torch.tensor(in_splits, device=x_nD.device), ones, ones, rail,
                          self.counter).tolist()
        rx_RD = all_to_all_rows(x_nD[tok], out_splits, in_splits, rail, self.counter)
        rids_RK = all_to_all_rows(torch.cat(ids), out_splits, in_splits, rail, self.counter).long()
        rw_RK = all_to_all_rows(torch.cat(ws), out_splits, in_splits, rail, self.counter)
        y_RD = self._exchange(rx_RD, rids_RK, rw_RK, self.node)
        y_back = all_to_all_rows(y_RD, in_splits, out_splits, rail, self.counter)
        return torch.zeros_like(x_nD).index_add_(0, tok, y_back)

    def _run_local(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(local_ids_R, stable=True)
        counts = torch.bincount(local_ids_R, minlength=self.num_local).tolist()
        x_sorted, outs, start = x_RD[order], [], 0
        for e, count in enumerate(counts):
            if count:
                x = x_sorted[start:start + count]
                outs.append((F.silu(x @ self.w_gate_EDF[e]) * (x @ self.w_up_EDF[e]))
                            @ self.w_down_EFD[e])
                start += count
        if not outs:  # keep the autograd path so every rank runs the backward all-to-all
            return x_RD * 0
        return torch.cat(outs)[torch.argsort(order)]

    # ---- gradients and full weights ----------------------------------------------------------

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum expert grads over the EDP group and average over data-parallel replicas.

        Each expert received gradient from every token routed to it inside its EP group, i.e.
        the sum of `ep/tp` replicas' mean losses; the EDP group holds the other replicas.
        """
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.edp_group is not None:
                dist.all_reduce(p.grad, group=self.edp_group)
            p.grad.div_(self.dp)

    def gather_full(self, p: torch.Tensor) -> torch.Tensor:
        """All experts of one of this module's parameters, in logical order (collective over the
        EP group)."""
        if self.ep.size == 1:
            return p.detach().clone()
        parts = [torch.empty_like(p) for _ in range(self.ep.size)]
        dist.all_gather(parts, p.detach().contiguous(), group=self.ep.group)
        full = torch.cat(parts)
        return full if self.expert_to_slot_E is None else full[self.expert_to_slot_E]
