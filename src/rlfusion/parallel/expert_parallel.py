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
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlfusion.model import lora
from rlfusion.model.moe import GroupedExperts, expert_ffn
from rlfusion.parallel.mesh import A2AGroup, ParallelMesh
from rlfusion.parallel.overlap import paired_structure, yield_turn


TRACE_MIN_WAIT_S = 5e-4


@dataclass
class CommCounter:
    """Bytes this rank sent through expert all-to-alls (forward and backward, payload and
    routing metadata), the part that went to ranks on another node, and the seconds this rank
    waited for them: the exposed communication, the part no computation covered (a blocking
    all-to-all is exposed whole; an overlapped one only where its chunk's wait found it still
    in flight)."""

    sent_bytes: int = 0
    internode_bytes: int = 0
    calls: int = 0
    wait_s: float = 0.0
    # called with (wall start, wall end) of each wait of at least TRACE_MIN_WAIT_S (a run's
    # device timeline records them); shorter ones only add to `wait_s`
    on_wait: Callable[[float, float], None] | None = field(default=None, repr=False, compare=False)

    def record(self, in_splits: list[int], g: A2AGroup, row_bytes: int) -> None:
        self.calls += 1
        for j, rows in enumerate(in_splits):
            if j != g.index:
                self.sent_bytes += rows * row_bytes
                if g.remote[j]:
                    self.internode_bytes += rows * row_bytes

    def reset(self) -> None:
        self.sent_bytes = self.internode_bytes = self.calls = 0
        self.wait_s = 0.0


@dataclass
class LinkModel:
    """An emulated link for measuring overlap where the real one is nearly free (loopback gloo
    on one machine): an all-to-all's bytes (the more of what this rank sends to and receives
    from its peers) cross at `bytes_per_s` after `latency_s`, one transfer at a time per rank,
    in the background from the moment it is issued. Waiting on it returns no earlier than that
    arrival, so a rank that computes meanwhile loses nothing and one that waits at once loses
    all of it. Set on a rank's expert modules by `ParallelModel.emulate_link` (benchmarks)."""

    latency_s: float
    bytes_per_s: float
    free_at: float = 0.0  # when this rank's link finishes the transfers queued on it

    def arrival(self, nbytes: int) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + nbytes / self.bytes_per_s
        return self.free_at + self.latency_s


class InFlight:
    """One all-to-all issued asynchronously; `wait()` returns its output."""

    def __init__(self, out: torch.Tensor, work, arrive: float, counter: CommCounter):
        self.out, self.work, self.arrive, self.counter = out, work, arrive, counter

    def wait(self, handover: bool = True) -> torch.Tensor:
        """`handover`: inside a forward/backward pair, let the other half compute first
        (`overlap.yield_turn`); False for a transfer too small to be worth a turn (routing
        counts) or one whose group was just handed over for."""
        if self.work is not None and handover:
            yield_turn()
        start, wall = time.perf_counter(), time.time()
        if self.work is not None:
            self.work.wait()
        while time.perf_counter() < self.arrive:  # spin: a device waiting on its link stays
            pass                                    # its own (a sleep hands the core away)
        waited = time.perf_counter() - start
        self.counter.wait_s += waited
        if self.counter.on_wait is not None and waited >= TRACE_MIN_WAIT_S:
            self.counter.on_wait(wall, wall + waited)
        self.work = None
        return self.out


def start_a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: A2AGroup,
              counter: CommCounter, link: LinkModel | None = None) -> InFlight:
    """Issue an all-to-all of rows (uneven splits) without waiting for it."""
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    counter.record(in_splits, g, row_bytes)
    if g.size == 1:
        return InFlight(x.clone(), None, 0.0, counter)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=g.group, async_op=True)
    arrive = 0.0
    if link is not None:
        others = [j for j in range(g.size) if j != g.index]
        arrive = link.arrival(row_bytes * max(sum(in_splits[j] for j in others),
                                              sum(out_splits[j] for j in others)))
    return InFlight(out, work, arrive, counter)


class _Pair:
    """The two halves of one differentiable all-to-all: forward's transfer, then backward's."""

    def __init__(self, out_splits, in_splits, g, counter, link):
        self.args = (out_splits, in_splits, g, counter, link)
        self.forward: InFlight | None = None
        self.backward: InFlight | None = None


class _Start(torch.autograd.Function):
    """Issues the all-to-all. Its backward waits for the gradient's transfer back, which
    `_Wait`'s backward issued, so whatever autograd runs between the two covers it."""

    @staticmethod
    def forward(ctx, x, pair):
        ctx.pair = pair
        pair.forward = start_a2a(x, *pair.args)
        return pair.forward.out  # filled in the background: only `_Wait` reads it

    @staticmethod
    def backward(ctx, grad):
        back, ctx.pair.backward = ctx.pair.backward, None
        return back.wait(), None  # `grad` is what `_Wait`'s backward sent


class _Wait(torch.autograd.Function):
    """Waits for the all-to-all `_Start` issued. Its backward issues the gradient's transfer
    back along the same splits and leaves the waiting to `_Start`'s backward."""

    @staticmethod
    def forward(ctx, out, pair, handover):
        ctx.pair = pair
        pair.forward.wait(handover)
        # the pair (on both nodes' ctx) must not keep `_Start`'s output: a tensor reachable from
        # its own grad_fn is a cycle Python's collector cannot see, and every step would leak it
        pair.forward = None
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, g, counter, link = ctx.pair.args
        ctx.pair.backward = start_a2a(grad.contiguous(), in_splits, out_splits, g, counter, link)
        return grad, None, None  # only for its shape: `_Start`'s backward returns the transfer


class Transfer:
    """An all-to-all of rows in flight, differentiable when autograd records: `wait()` gives
    the rows; in backward the gradients travel back asynchronously the same way."""

    def __init__(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], g: A2AGroup,
                 counter: CommCounter, link: LinkModel | None):
        self.grad = x.is_floating_point() and torch.is_grad_enabled() and x.requires_grad
        if self.grad:
            self.pair = _Pair(out_splits, in_splits, g, counter, link)
            self.out = _Start.apply(x, self.pair)
        else:
            self.inflight = start_a2a(x, out_splits, in_splits, g, counter, link)

    def wait(self, handover: bool = True) -> torch.Tensor:
        if self.grad:
            return _Wait.apply(self.out, self.pair, handover)
        return self.inflight.wait(handover)


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


def _overlapped(n: int, sides, start, work) -> tuple[list, list | None]:
    """Chunks 0..n-1 in a pipeline: chunk c+1's `start(c + 1)` (its transfers issued) before
    chunk c's `work(c, started)`; `sides` (two callables, or None) run after the first start
    and after the last work. Returns what each `work` returned and what the sides did."""
    started = [start(0)]
    side_out = [sides[0]()] if sides else None
    done = []
    for c in range(n):
        if c + 1 < n:
            started.append(start(c + 1))
        done.append(work(c, started[c]))
    if sides:
        side_out.append(sides[1]())
    return done, side_out


class ExpertParallelExperts(nn.Module):
    """This rank's slice of a layer's routed experts, called like `GroupedExperts`.

    `chunks` (the layout's `a2a_chunks`): 0 runs each all-to-all blocking, in the plain model's
    order (routed experts, then the shared ones). n >= 1 overlaps: the layer's tokens split into
    n chunks; the shared experts compute while the first chunk's tokens are in flight, each
    chunk's experts while the next chunk's dispatch and the previous one's combine are, and in
    backward autograd runs the same interleaving in reverse (each transfer's gradient is issued
    where its forward was waited for and waited for where it was issued)."""

    lora_scale, lora_merged = None, False  # this rank's experts' LoRA adapters, when they have them

    def __init__(self, experts: GroupedExperts, mesh: ParallelMesh):
        super().__init__()
        num_experts = experts.w_gate_EDF.shape[0]
        self.ep, self.rail, self.node = mesh.ep, mesh.rail, mesh.node
        self.edp_group, self.dp = mesh.edp_group, mesh.layout.dp
        self.tp, self.tp_index = mesh.layout.tp, mesh.coord("tp")
        self.tp_group = mesh.group("tp") if self.tp > 1 else None
        self.chunks = mesh.layout.a2a_chunks
        self.num_local = num_experts // self.ep.size
        self.first_expert = self.ep.index * self.num_local
        local = slice(self.first_expert, self.first_expert + self.num_local)
        self.w_gate_EDF = nn.Parameter(experts.w_gate_EDF.detach()[local].clone())
        self.w_up_EDF = nn.Parameter(experts.w_up_EDF.detach()[local].clone())
        self.w_down_EFD = nn.Parameter(experts.w_down_EFD.detach()[local].clone())
        for w in (self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD):
            w.requires_grad_(experts.w_gate_EDF.requires_grad)  # (frozen under LoRA)
        lora.copy_expert_adapters(experts, self, local)  # per-expert adapters go with their experts
        self.counter = CommCounter()
        self.link: LinkModel | None = None  # an emulated link (benchmarks), else the real one
        # Logical expert id → physical slot after a migration (`parallel/balance.py`); slot s
        # lives on EP member s // L. None: the identity, as built.
        self.expert_to_slot_E: torch.Tensor | None = None

    def forward(self, x_ND: torch.Tensor, topk_ids_NK: torch.Tensor, weights_NK: torch.Tensor,
                shared=None) -> torch.Tensor:
        if self.expert_to_slot_E is not None:  # the router's math stays in logical ids
            topk_ids_NK = self.expert_to_slot_E[topk_ids_NK]
        full_ND = x_ND  # the shared experts are TP-sharded: every TP rank runs them on all rows
        if self.tp > 1:
            sizes = _row_sizes(len(x_ND), self.tp)
            x_ND = _SliceRows.apply(x_ND, sizes, self.tp_index, self.tp_group)
            weights_NK = _SliceRows.apply(weights_NK, sizes, self.tp_index, self.tp_group)
            start = sum(sizes[:self.tp_index])
            topk_ids_NK = topk_ids_NK[start:start + sizes[self.tp_index]]
        # overlapped: the shared experts' first half of the rows computes under the first
        # chunk's dispatch, the second under the last chunk's combine (and in backward, in
        # reverse, under the first combine's and the last dispatch's gradients)
        # inside a forward/backward pair (`overlap.py`) the other half is the cover: at most one
        # chunk, the shared experts' halves under the routing counts' exchange and the combine
        # (a recompute's replay splits as its original forward did)
        paired = paired_structure()
        chunks = min(self.chunks, 1) if paired else self.chunks
        half = len(full_ND) // 2
        sides = ((lambda: shared(full_ND[:half])), (lambda: shared(full_ND[half:]))) if shared and chunks else None
        routed = self._hierarchical if self.rail is not None else self._flat
        y_ND, side_ND = routed(x_ND, topk_ids_NK, weights_NK, sides, chunks, paired)
        if self.tp > 1:
            y_ND = _GatherRows.apply(y_ND, sizes, self.tp_index, self.tp_group)
        if shared is None:
            return y_ND
        return y_ND + (torch.cat(side_ND) if side_ND else shared(full_ND))

    # ---- the two algorithms ------------------------------------------------------------------

    @staticmethod
    def _chunk_rows(n: int, chunks: int) -> list[slice]:
        """Contiguous row ranges of `chunks` chunks (one range for 0: blocking); every rank runs
        as many, empty or not, so their all-to-alls pair up."""
        sizes = _row_sizes(n, max(1, chunks))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [slice(a, a + k) for a, k in zip(starts, sizes)]

    def _flat(self, x_nD, ids_nK, w_nK, sides, chunks, paired=False):
        """Flat dispatch → local experts → combine in the EP group, chunk by chunk. Returns the
        output and what `sides` returned (None without)."""
        return self._pipeline(x_nD, ids_nK, w_nK, self.ep, chunks, sides, paired)

    def _pipeline(self, x_nD, ids_nK, w_nK, g: A2AGroup, chunks: int, sides=None, paired=False):
        """Dispatch → local experts → combine inside `g` over `chunks` chunks of the rows (0:
        one, blocking), each chunk's transfers issued ahead of the work that waits for them;
        `sides` (two callables): work that runs while the first dispatch is in flight (`paired`:
        while the routing counts are, the dispatch having the other half of the pair as cover),
        and while the last combine is.

        `ids_nK` are expert ids relative to the group's first expert (member j holds
        `[j*L, (j+1)*L)`), or -1 for pairs handled elsewhere."""
        K, L, P = ids_nK.shape[1], self.num_local, g.size
        plans = []  # per chunk: its (token, expert) pairs in expert order and their tokens
        counts = []
        for rows in self._chunk_rows(len(x_nD), chunks):
            flat = ids_nK[rows].reshape(-1)
            pairs = (flat >= 0).nonzero().squeeze(1)
            pairs = pairs[torch.argsort(flat[pairs], stable=True)]  # expert order, as the plain model
            plans.append((rows, pairs, pairs // K + rows.start))
            counts.append(torch.bincount(flat[pairs], minlength=P * L).view(P, L))
        send_CPL = torch.stack(counts)  # one exchange of every chunk's counts
        counted = start_a2a(send_CPL.transpose(0, 1).contiguous(), [1] * P, [1] * P, g, self.counter, self.link)
        early = None
        if sides and paired:
            early, sides = sides[0](), (lambda: early, sides[1])
        recv_CPL = counted.wait(handover=False).transpose(0, 1)
        in_splits, out_splits = send_CPL.sum(2).tolist(), recv_CPL.sum(2).tolist()
        local_ids = [torch.arange(L, device=x_nD.device).repeat(P).repeat_interleave(r.flatten())
                     for r in recv_CPL]
        combine, side_out = _overlapped(
            len(plans), sides,
            lambda c: Transfer(x_nD[plans[c][2]], out_splits[c], in_splits[c], g, self.counter, self.link),
            lambda c, dispatch: Transfer(self._run_local(dispatch.wait(), local_ids[c]), in_splits[c],
                                         out_splits[c], g, self.counter, self.link))
        y_ND = torch.zeros_like(x_nD)
        for (rows, pairs, tok), back in zip(plans, combine):
            w = w_nK[rows].reshape(-1)[pairs].unsqueeze(-1)
            y_ND = y_ND.index_add(0, tok, back.wait() * w)
        return y_ND, side_out

    def _hierarchical(self, x_nD, ids_nK, w_nK, sides, chunks, paired=False):
        """Stage 1: one copy per (token, node) over the rail group; stage 2: the flat exchange
        inside the node. Chunk by chunk, the next chunk's rail transfers and the previous one's
        way back are in flight while a chunk's node stage runs."""
        rail, per_node = self.rail, self.node.size * self.num_local
        node_nK = ids_nK // per_node
        plans = []
        for rows in self._chunk_rows(len(x_nD), chunks):
            toks, ids, ws = [], [], []
            for m in range(rail.size):
                hit_nK = node_nK[rows] == m
                sel = hit_nK.any(1).nonzero().squeeze(1)
                toks.append(sel + rows.start)
                ids.append(torch.where(hit_nK, ids_nK[rows] - m * per_node, -1)[sel].to(torch.int32))
                ws.append(torch.where(hit_nK, w_nK[rows], 0.0)[sel])
            plans.append((torch.cat(toks), torch.cat(ids), torch.cat(ws), [len(t) for t in toks]))
        ones = [1] * rail.size
        send_CM = torch.tensor([p[3] for p in plans], device=x_nD.device)
        counted = start_a2a(send_CM.t().contiguous(), ones, ones, rail, self.counter, self.link)
        early = None
        if sides and paired:  # (as `_pipeline`: the first shared half under the counts' exchange)
            early, sides = sides[0](), (lambda: early, sides[1])
        recv_CM = counted.wait(handover=False).t()
        out_splits = recv_CM.tolist()
        def send(c):
            tok, ids, ws, in_splits = plans[c]
            return [Transfer(t, out_splits[c], in_splits, rail, self.counter, self.link) for t in (x_nD[tok], ids, ws)]

        def node_stage(c, sent):
            rx_RD, rids_RK, rw_RK = (t.wait(handover=i == 0) for i, t in enumerate(sent))
            y_RD, _ = self._pipeline(rx_RD, rids_RK.long(), rw_RK, self.node, 0)
            return Transfer(y_RD, plans[c][3], out_splits[c], rail, self.counter, self.link)

        backs, side_out = _overlapped(len(plans), sides, send, node_stage)
        y_ND = torch.zeros_like(x_nD)
        for (tok, *_), back in zip(plans, backs):
            y_ND = y_ND.index_add(0, tok, back.wait())
        return y_ND, side_out

    def _run_local(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(local_ids_R, stable=True)
        counts = torch.bincount(local_ids_R, minlength=self.num_local).tolist()
        x_sorted, outs, start = x_RD[order], [], 0
        for e, count in enumerate(counts):
            if count:
                x = x_sorted[start:start + count]
                outs.append(expert_ffn(self, e, x, self.w_gate_EDF[e], self.w_up_EDF[e], self.w_down_EFD[e]))
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
            if not p.requires_grad:  # a frozen base (LoRA)
                continue
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
