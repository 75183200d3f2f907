"""Continuous-batching scheduler: decides which sequences run each step. Pure Python, no tensors.

Running sequences occupy KV-cache slots `[0, num_running)` with no holes. When one leaves, the
sequence in the last slot moves into the hole; the moves are part of the next `StepPlan`, so the
runner always decodes a contiguous block of rows (a view of the cache, no gather). New requests
are admitted into the slots after the running block, up to `max_num_seqs` sequences and a
per-step token budget.

The running rows are kept roughly longest first: a decode pass reads each run of rows of
similar length only up to its own longest (`model.row_segments`), so rows of a long-tailed
rollout in arbitrary order read mostly padding. Every row grows by one token a step, so an order
by length persists; what breaks it is a short row moved into a finished row's hole, or a long
(resumed) request admitted behind shorter running rows. Each admitted batch takes its slots
longest first; when the order's reads exceed the sorted order's by
`RESORT_GAIN`, the plan permutes the rows (one copy of the rows' cache).

A request added with its keys and values already saved (`add(request, cached=n)`: an aborted
request whose cache row the engine kept) needs no prefill: it takes the next free slot, the
plan's `restores` tell the runner to copy its saved row there, and it decodes in the same step.
One whose saved row holds fewer than all its tokens but the last (the next turn of an episode:
the row of the turn before, the tokens now followed by an observation) is restored the same way
into a slot after the running block and `extend`ed: only its new tokens are prefilled, into its
row after the saved positions; it decodes from the next step on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlfusion.engine.types import Request
from rlfusion.model.row_segments import read_cost

# permute the running rows longest first once their reads exceed the sorted order's by this
RESORT_GAIN = 1.25
# sequences an engine runs at once (`max_num_seqs`): the one default of every layer that has the
# knob (`rollout.max_num_seqs`, the engines, evaluation, the simulator, the calibration)
MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = 4096  # prefill + decode tokens in one step
    max_seq_len: int = 256  # KV-cache positions per slot
    # While sequences are decoding, new ones are admitted only once this many slots are free
    # (or all waiting ones fit): every prefill is an extra forward pass, so admitting one or two
    # sequences per step as slots free up costs more than it gains. 1 = admit at once.
    min_prefill_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "min_prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name}={getattr(self, name)} must be >= 1")


@dataclass
class Sequence:
    """Mutable per-request state while a request is in the engine."""

    request: Request
    slot: int = -1
    num_cached: int = 0  # tokens whose keys/values are in the cache (waiting: in a saved row)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.request.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.request.output_ids)

    @property
    def num_new(self) -> int:
        """Tokens not in the cache (in a restored row): what feeding it computes."""
        return self.num_tokens - self.num_cached


@dataclass
class StepPlan:
    """One engine step: cache-row moves and a permutation, then a decode pass, then a prefill
    pass over new rows.

    `decode` sequences occupy slots `[0, len(decode))`; `extend` sequences the slots right after
    them, then `prefill` sequences, in order.
    """

    moves: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot)
    # after the moves: saved cache rows to copy into these slots (before the permutation)
    restores: list[tuple[Sequence, int]] = field(default_factory=list)
    # after the moves: new slot i takes the running row of old slot permutation[i]
    permutation: list[int] | None = None
    decode: list[Sequence] = field(default_factory=list)
    # restored rows that prefill their tokens after the saved positions, in the slots right
    # after the decode rows, rows of equal new length together (one pass per length)
    extend: list[Sequence] = field(default_factory=list)
    prefill: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.decode or self.extend or self.prefill)

    @property
    def num_tokens(self) -> int:
        """Tokens the runner computes: one per decode row, each extended row's new tokens and
        every prefill token (packed)."""
        return len(self.decode) + sum(s.num_new for s in self.extend) + sum(s.num_tokens for s in self.prefill)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index == slot
        self._pending_moves: list[tuple[int, int]] = []
        self._live_ids: set[str] = set()
        self._reordered = False  # rows left or joined since the order was last checked

    def add(self, request: Request, cached: int = 0) -> None:
        """Queue `request`. `cached`: its first `cached` tokens' keys and values are saved (the
        engine restores them instead of a prefill; all but the last: it decodes at once, fewer:
        the rest is `extend`ed)."""
        if request.request_id in self._live_ids:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        seq = Sequence(request, num_cached=cached)
        if not 0 <= cached < seq.num_tokens:
            raise ValueError(f"request {request.request_id!r} has {seq.num_tokens} tokens: a saved cache row "
                             f"holds at most all but the last, not {cached}")
        if seq.num_tokens >= self.config.max_seq_len:
            raise ValueError(f"request {request.request_id!r} has {seq.num_tokens} tokens; the "
                             f"KV cache holds {self.config.max_seq_len} per sequence")
        if seq.num_new > self.config.max_num_batched_tokens:
            raise ValueError(f"request {request.request_id!r} has {seq.num_new} tokens to compute, more "
                             f"than max_num_batched_tokens={self.config.max_num_batched_tokens}")
        self.waiting.append(seq)
        self._live_ids.add(request.request_id)

    def waiting_ids(self) -> set[str]:
        return {s.request_id for s in self.waiting}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan(moves=self._pending_moves)
        self._pending_moves = []
        self._admit_restored(plan)
        plan.permutation = self._longest_first()
        plan.decode = list(self.running)
        # The runner prefills new rows packed (no padding), so the budget counts their tokens.
        budget = self.config.max_num_batched_tokens - len(plan.decode)
        budget = self._admit_extends(plan, budget)
        free = self.config.max_num_seqs - len(self.running)
        if self.running and free < min(len(self.waiting), self.config.min_prefill_batch):
            return plan
        while self.waiting and len(self.running) + len(plan.prefill) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > budget:
                break
            self.waiting.popleft()
            budget -= seq.num_tokens
            plan.prefill.append(seq)
        plan.prefill.sort(key=lambda s: -s.num_tokens)  # longest first, as the running rows
        for seq in plan.prefill:
            seq.slot = len(self.running)
            self.running.append(seq)
            self._reordered = True
        return plan

    def _admit_restored(self, plan: StepPlan) -> None:
        """Waiting requests with a saved cache row join the running block while slots are free
        (in waiting order); each costs one decode row, no prefill."""
        if not any(s.num_cached for s in self.waiting):
            return
        keep: deque[Sequence] = deque()
        for seq in self.waiting:
            if seq.num_cached and seq.num_new == 1 and len(self.running) < self.config.max_num_seqs:
                seq.slot = len(self.running)
                self.running.append(seq)
                plan.restores.append((seq, seq.slot))
                self._reordered = True
            else:
                keep.append(seq)
        self.waiting = keep

    def _admit_extends(self, plan: StepPlan, budget: int) -> int:
        """Waiting requests with a saved row short of their tokens take the slots after the
        running block while slots and the token budget allow (in waiting order), grouped by how
        many tokens they add; returns the budget left."""
        if not any(s.num_cached for s in self.waiting):
            return budget
        keep: deque[Sequence] = deque()
        for seq in self.waiting:
            if (seq.num_cached and seq.num_new <= budget
                    and len(self.running) + len(plan.extend) < self.config.max_num_seqs):
                plan.extend.append(seq)
                budget -= seq.num_new
            else:
                keep.append(seq)
        self.waiting = keep
        plan.extend.sort(key=lambda s: s.num_new)
        for seq in plan.extend:
            seq.slot = len(self.running)
            self.running.append(seq)
            plan.restores.append((seq, seq.slot))
            self._reordered = True
        return budget

    def _longest_first(self) -> list[int] | None:
        """Reorder the running rows longest first when that cuts the decode pass's reads by
        `RESORT_GAIN`; returns the old slots in their new order, or None (no change)."""
        if not self._reordered or len(self.running) < 2:
            return None
        self._reordered = False
        lengths = [s.num_tokens for s in self.running]
        if all(a >= b for a, b in zip(lengths, lengths[1:])):
            return None  # already longest first (a synchronous rollout's rows all are)
        ordered = sorted(self.running, key=lambda s: -s.num_tokens)
        if read_cost(lengths) <= RESORT_GAIN * read_cost([s.num_tokens for s in ordered]):
            return None
        permutation = [s.slot for s in ordered]
        for slot, seq in enumerate(ordered):
            seq.slot = slot
        self.running = ordered
        return permutation

    def take_moves(self) -> list[tuple[int, int]]:
        """The row moves of finished sequences not yet applied to the cache (cleared): for a
        caller that reads cache rows between steps."""
        moves, self._pending_moves = self._pending_moves, []
        return moves

    def finish(self, seq: Sequence) -> None:
        """Release `seq`'s slot; the last running sequence moves into it."""
        slot = seq.slot
        assert self.running[slot] is seq, "slot bookkeeping out of sync"
        last = self.running.pop()
        self._reordered = True
        if last is not seq:
            self.running[slot] = last
            last.slot = slot
            self._pending_moves.append((len(self.running), slot))
        seq.slot = -1
        self._live_ids.discard(seq.request_id)

    def abort(self, request_ids: set[str]) -> list[Sequence]:
        """Remove the given requests wherever they are; returns the removed sequences."""
        removed = [s for s in self.waiting if s.request_id in request_ids]
        self.waiting = deque(s for s in self.waiting if s.request_id not in request_ids)
        self._live_ids -= {s.request_id for s in removed}
        for seq in [s for s in self.running if s.request_id in request_ids]:
            self.finish(seq)
            removed.append(seq)
        return removed
