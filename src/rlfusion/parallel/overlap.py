"""Adaptive Pipe: the forward of one micro-batch overlapped with the backward of another on the
same pipeline rank, each one's expert all-to-alls running under the other's computation.

The schedule (`pipeline.build_schedule` with `overlap_fb`) is DualPipeV's: each pipeline rank
holds two stages in a V (rank p: stages p and 2·pp−1−p, so the model is not duplicated), and in
the steady state every action is a pair — the forward of one stage's micro-batch and the
backward of the other stage's. `run_pair` runs the two halves in two threads that take turns:
only the thread holding the turn computes; at each expert all-to-all it is about to wait for
(`InFlight.wait` calls `yield_turn`) it hands the turn to the other half, which computes its
next piece (attention, router, experts, or their gradients) while the transfer is in flight,
until it reaches a transfer of its own and hands the turn back. The pieces are thus attention,
dispatch, experts and combine of each layer, interleaved forward against backward.

Every rank of a stage's expert groups runs the same halves in the same turn order, so the
collectives both threads issue pair up across ranks (no rank decides a turn from timing).

Adaptive order: which half computes first in a pair. The first `PROBE_PASSES` passes with a
backward take one order each (forward first, then backward first) and time every pair; then the
order with the lower mean pair time (summed over every rank of the layout, so all agree) is kept
for the run (`OverlapOrder`, reported by `ParallelModel.overlap_report`).

A layer recomputed in backward (activation checkpointing) replays its forward inside the
backward half; `paired_structure` makes the replay split its all-to-all as the original forward
did, paired or not (`PairingRecord`, `PairingReplay`: the contexts `recompute.py` gives torch's
checkpoint).

On CUDA, autograd runs a backward in its device thread, which holds no turn: the pairs' halves
then run one after the other (the same results, nothing overlapped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

PROBE_PASSES = 2  # backward passes that time both orders before one is kept


class PartnerFailed(RuntimeError):
    """Raised in the half of a pair whose partner raised (the partner's error is the one reported)."""


class _Turns:
    """Two threads ("F" and "B") of which only the one holding the turn runs."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.turn: str | None = None
        self.alive: set[str] = set()
        self.failed = False  # a half raised: the other stops at its next hand-over
        self.local = threading.local()
        self.switches = 0

    def run(self, role: str, fn: Callable[[], None], errors: list[BaseException]) -> None:
        self.local.role = role
        try:
            with self.cv:
                while self.turn != role:
                    self.cv.wait()
            fn()
        except BaseException as e:  # re-raised by `run_pair` in the caller's thread
            errors.append(e)
            with self.cv:
                self.failed = True
        finally:
            self.local.role = None
            with self.cv:
                self.alive.discard(role)
                self.turn = next(iter(self.alive), None)
                self.cv.notify_all()

    def yield_turn(self) -> None:
        role = getattr(self.local, "role", None)
        if role is None:
            return
        with self.cv:
            if self.failed:  # (going on alone would issue collectives the other ranks pair differently)
                raise PartnerFailed("the other half of this forward/backward pair failed")
            partner = "B" if role == "F" else "F"
            if partner not in self.alive:
                return
            self.turn = partner
            self.switches += 1
            self.cv.notify_all()
            while self.turn != role:
                self.cv.wait()


_TURNS = _Turns()


def in_pair() -> bool:
    """Whether this thread runs one half of a pair (its transfers have the other half as cover)."""
    return getattr(_TURNS.local, "role", None) is not None


def paired_structure() -> bool:
    """Whether an expert layer's forward runs as inside a pair (`in_pair`), or, in a recompute's
    replay, as its original forward did."""
    replayed = getattr(_TURNS.local, "replayed", None)
    return in_pair() if replayed is None else replayed


class PairingRecord:
    """Context around a checkpointed forward: records whether it ran inside a pair."""

    paired = False

    def __enter__(self) -> None:
        self.paired = paired_structure()

    def __exit__(self, *exc) -> None:
        pass


class PairingReplay:
    """Context around that forward's replay: the expert layers split as the record says."""

    def __init__(self, record: PairingRecord):
        self.record = record

    def __enter__(self) -> None:
        self.saved = getattr(_TURNS.local, "replayed", None)
        _TURNS.local.replayed = self.record.paired

    def __exit__(self, *exc) -> None:
        _TURNS.local.replayed = self.saved


def yield_turn() -> None:
    """Called before waiting on an expert all-to-all: inside a pair, the other half computes
    while the transfer is in flight; elsewhere, nothing."""
    _TURNS.yield_turn()


def run_pair(forward: Callable[[], None], backward: Callable[[], None], first: str) -> None:
    """Run `forward` and `backward` taking turns at their all-to-all waits, `first` ("F" or
    "B") computing first. The backward runs in a second thread (autograd runs a CPU graph in the
    thread that calls it); errors of either are raised here."""
    t = _TURNS
    errors: list[BaseException] = []
    with t.cv:
        t.alive, t.turn, t.failed = {"F", "B"}, first, False
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def backward_thread() -> None:
        if device is not None:  # (the current device is per thread)
            torch.cuda.set_device(device)
        with torch.set_grad_enabled(grad):
            backward()

    thread = threading.Thread(target=t.run, args=("B", backward_thread, errors), daemon=True)
    thread.start()
    t.run("F", forward, errors)
    thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, PartnerFailed)), errors[0])


class OverlapOrder:
    """Which half of a pair computes first, chosen from measured pair times (module doc)."""

    def __init__(self, agree: Callable[[torch.Tensor], None]):
        self.agree = agree  # sums a tensor over the ranks that must pick the same order
        self.times: dict[str, list[float]] = {"F": [], "B": []}
        self.chosen: str | None = None
        self.means: dict[str, float] = {}
        self._passes = 0

    def run(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        """One pair, in the kept order; while probing, one order per pass (every pair kind timed
        in both orders)."""
        first = self.chosen if self.chosen is not None else "FB"[self._passes % 2]
        start = time.perf_counter()
        run_pair(forward, backward, first)
        if self.chosen is None:
            self.times[first].append(time.perf_counter() - start)

    def settle(self) -> None:
        """After each pass with a backward, on every rank of the layout (the same count
        everywhere, so the sum below is collective): after `PROBE_PASSES`, fix the order."""
        self._passes += 1
        if self.chosen is not None or self._passes < PROBE_PASSES:
            return
        means = torch.tensor([sum(v) / len(v) if v else 0.0 for v in (self.times["F"], self.times["B"])],
                             dtype=torch.float64)
        self.agree(means)
        self.chosen = "F" if means[0] <= means[1] else "B"
        self.means = {"F": float(means[0]), "B": float(means[1])}

    def report(self) -> dict[str, float]:
        """`overlap_fb_forward_first` (1 forward first, 0 backward first, -1 still probing) and
        the mean pair seconds each order measured (summed over the agreeing ranks)."""
        if self.chosen is None:
            return {"overlap_fb_forward_first": -1.0}
        return {"overlap_fb_forward_first": float(self.chosen == "F"),
                "overlap_fb_pair_s_forward_first": self.means["F"],
                "overlap_fb_pair_s_backward_first": self.means["B"]}


# ---- the schedule: DualPipeV's order, every backward whole, pairs run by `run_pair` ---------

def dualpipev_schedule(stages: list, n_microbatches: int, loss_fn: Callable, order: OverlapOrder):
    """torch's DualPipeV schedule over this rank's two V-placed stages, with its input/weight
    split backwards (zero bubble) made whole backwards — the split would replay our expert
    all-to-all's autograd functions — and its OVERLAP_F_B pairs run by `run_pair`."""
    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD, OVERLAP_F_B, ScheduleDualPipeV, _Action)

    schedule = ScheduleDualPipeV(stages, n_microbatches, loss_fn=loss_fn)
    whole = {}
    for rank, actions in schedule.pipeline_order.items():
        whole[rank] = [a if a is None or a.computation_type != BACKWARD_INPUT
                       else _Action(a.stage_index, FULL_BACKWARD, a.microbatch_index)
                       for a in actions if a is None or a.computation_type != BACKWARD_WEIGHT]
    schedule.pipeline_order = whole
    schedule._prepare_schedule_with_comms(whole)
    schedule.register_custom_function(OVERLAP_F_B, lambda action, ctx: _overlap_action(action, ctx, order))
    return schedule


def _overlap_action(action, ctx, order: OverlapOrder) -> None:
    """One OVERLAP_F_B action: wait for both halves' inputs, then run the pair."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    schedule = ctx.schedule_ref
    stages = {s.stage_index: s for s in schedule._stages}
    f, b = action.sub_actions
    fs, bs = stages[f.stage_index], stages[b.stage_index]
    if not fs.is_first and f.stage_index - 1 not in stages:  # (V: adjacent stages hand over locally)
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((f.stage_index, f.microbatch_index)))
    if not bs.is_last and b.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((b.stage_index, b.microbatch_index)))

    def forward() -> None:
        schedule._assert_unsharded(fs)
        mb = f.microbatch_index
        out = fs.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        schedule._maybe_compute_loss(fs, out, ctx.target_mbs, mb)
        if f.stage_index + 1 in stages:
            stages[f.stage_index + 1].set_local_fwd_input(out, mb)

    def backward() -> None:
        schedule._assert_unsharded(bs)
        mb = b.microbatch_index
        schedule.backward_counter[b.stage_index] += 1
        last = schedule.backward_counter[b.stage_index] == schedule._n_microbatches
        bs.backward_one_chunk(mb, loss=schedule._maybe_get_loss(bs, mb), full_backward=True, last_backward=last)
        if b.stage_index - 1 in stages:
            stages[b.stage_index - 1].set_local_bwd_input(bs.get_local_bwd_output(mb), mb)

    if not bs.has_backward:  # a forward-only pass: the backward half is nothing
        forward()
        return
    order.run(forward, backward)
