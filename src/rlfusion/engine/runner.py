"""Model runner: owns the KV cache and executes a `StepPlan` — moves, restores, permutation,
decode, extend, prefill, sampling.

It also holds the saved cache rows of paused requests (`save_rows`, in host memory: they outlive
the cache while it is released for training), which a plan's `restores` copy back.

The runner never decides what runs; it turns the scheduler's plan into tensors.

Legend: B rows, T tokens per row, V vocab.
"""

from __future__ import annotations

import contextlib
import time

import torch

from rlfusion.engine.sampling import sample
from rlfusion.engine.scheduler import Sequence, StepPlan
from rlfusion.model.kv_cache import CacheBatch, PackedSeqs
from rlfusion.model.routes import Routes, route_dtype
from rlfusion.model.transformer import MoETransformer


class ModelRunner:
    def __init__(self, model: MoETransformer, num_slots: int, max_seq_len: int, seed: int = 0,
                 compute_dtype: torch.dtype | None = None, record_routes: bool = False):
        """`compute_dtype`: run the model's passes under autocast to it (bf16: matmuls in bf16,
        the weights and the sampling's logits in fp32); None: the weights' dtype.
        `record_routes`: append each fed token's routed experts to its request (`Request.routes`)."""
        self.model = model
        self.record_routes = record_routes and model.config.num_moe_layers > 0
        self.route_dtype = route_dtype(model.config.num_experts)
        self.device = next(model.parameters()).device
        self.compute_dtype = compute_dtype
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.cache = model.new_kv_cache(num_slots, max_seq_len)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.saved: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (positions, row)
        # time spent per kind of pass since the last `take_stats` (for cost models and reports)
        self.stats = fresh_stats()

    def take_stats(self) -> dict[str, float]:
        """Decode / prefill passes, their rows (prefill: tokens) and seconds; resets."""
        out, self.stats = self.stats, fresh_stats()
        return out

    @torch.inference_mode()
    def execute(self, plan: StepPlan, passes: tuple[int, int, int] = (0, 0, 0)) -> tuple[list[int], list[float]]:
        """Run one step; returns the next token and its logprob for `plan.decode + plan.extend +
        plan.prefill`. `passes` (lock-step engines): the decode passes (0 or 1), extend passes and
        prefill passes (0 or 1) the group runs — this member joins those its plan has no rows
        for with empty passes (`idle_pass`)."""
        for src, dst in plan.moves:
            self.cache.move_slot(src, dst)
        for seq, slot in plan.restores:
            positions, row = self.saved.pop(seq.request_id)
            self.cache.write_slot(slot, row)
            self.stats["restored_tokens"] += positions
        if plan.permutation:
            self.cache.permute_slots(plan.permutation, max(s.num_cached for s in plan.decode))
        logits: list[torch.Tensor] = []
        extends = _by_new_length(plan.extend)
        with autocast(self.device, self.compute_dtype):
            if passes[0] and not plan.decode:
                self.idle_pass()
            if plan.decode:
                self._timed("decode", lambda: logits.append(self._decode(plan.decode)), rows=len(plan.decode),
                            context=sum(s.num_cached + 1 for s in plan.decode))  # positions attended
            slot = len(plan.decode)
            for group in extends:
                self._timed("extend", lambda: logits.append(self._extend(group, slot)), rows=len(group),
                            tokens=sum(s.num_new for s in group))
                slot += len(group)
            for _ in range(passes[1] - len(extends)):
                self.idle_pass()
            if plan.prefill:
                self._timed("prefill", lambda: logits.append(self._prefill(plan.prefill, slot_start=slot)),
                            tokens=sum(s.num_tokens for s in plan.prefill))
            if passes[2] and not plan.prefill:
                self.idle_pass()
        seqs = plan.decode + plan.extend + plan.prefill
        if not seqs:
            return [], []
        tokens_B, logprobs_B = sample(torch.cat(logits).float(), [s.request.params for s in seqs],
                                      self.generator)
        return tokens_B.tolist(), logprobs_B.tolist()

    def idle_pass(self) -> None:
        """A pass with no rows: each MoE layer's expert exchange, in layer order, with nothing of
        this member's to send, so busy members of its expert-parallel group meet it in every
        all-to-all and their tokens routed to its experts are computed here."""
        t0 = time.perf_counter()
        x_BTD = self.model.embed(torch.zeros(1, 0, dtype=torch.long, device=self.device))
        for block in self.model.layers:
            if block.is_moe:
                block.mlp(block.mlp_norm(x_BTD))
        self.stats["idle_passes"] += 1
        self.stats["idle_s"] += time.perf_counter() - t0

    def save_rows(self, seqs: list[Sequence]) -> None:
        """Keep a host copy of each running sequence's cached keys and values (its slot must be
        current: apply pending moves first)."""
        for s in seqs:
            self.saved[s.request_id] = (s.num_cached, self.cache.read_slot(s.slot, s.num_cached))

    @property
    def saved_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, row in self.saved.values() for t in row)

    def _timed(self, kind: str, run, **counts: int) -> None:
        """`run()` one pass of `kind`, counted in the stats with its rows / tokens / context (the
        positions a decode pass attended)."""
        t0 = time.perf_counter()
        run()
        self.stats[f"{kind}_passes"] += 1
        for name, n in counts.items():
            self.stats[f"{kind}_{name}"] += n
        self.stats[f"{kind}_s"] += time.perf_counter() - t0

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        tokens_B1 = torch.tensor([[s.token_ids[-1]] for s in seqs], device=self.device)
        start_B = torch.tensor([s.num_cached for s in seqs], device=self.device)
        routes = Routes(record=True) if self.record_routes else None
        logits_B1V = self.model(tokens_B1, CacheBatch(self.cache, 0, start_B), routes=routes)
        if routes is not None:
            self._keep_routes(seqs, routes.recorded_NLK(), [1] * len(seqs))
        for s in seqs:
            s.num_cached += 1
        return logits_B1V[:, -1]

    def _extend(self, seqs: list[Sequence], slot_start: int) -> torch.Tensor:
        """Feed rows restored short of their tokens (`StepPlan.extend`, each adding the same
        number T of tokens) their new tokens, after their cached positions."""
        T = seqs[0].num_new
        tokens_BT = torch.tensor([s.token_ids[s.num_cached:] for s in seqs], device=self.device)
        start_B = torch.tensor([s.num_cached for s in seqs], device=self.device)
        routes = Routes(record=True) if self.record_routes else None
        logits_BTV = self.model(tokens_BT, CacheBatch(self.cache, slot_start, start_B), routes=routes)
        if routes is not None:
            self._keep_routes(seqs, routes.recorded_NLK(), [T] * len(seqs))
        for s in seqs:
            s.num_cached += T
        return logits_BTV[:, -1]

    def _keep_routes(self, seqs: list[Sequence], chosen_NLK: torch.Tensor, lengths: list[int]) -> None:
        """Append what the pass routed to each sequence's request: its tokens' positions after
        those it already has routes for (a resumed request re-prefilled keeps the routes its
        earlier tokens were sampled with)."""
        chosen_NX = chosen_NLK.to("cpu", self.route_dtype).flatten(1)
        for s, part in zip(seqs, chosen_NX.split(lengths)):
            r = s.request
            have = 0 if r.routes is None else len(r.routes)
            start = have - s.num_cached  # positions of this pass's tokens already held
            if start < len(part):
                new = part[max(start, 0):]
                r.routes = new if r.routes is None else torch.cat([r.routes, new])

    def _prefill(self, seqs: list[Sequence], slot_start: int) -> torch.Tensor:
        # Packed, no padding: the sequences concatenated, each attending only to itself and
        # writing its keys/values into its own cache row; a resumed request's hundreds of tokens
        # no longer pad a batch of short prompts to its length.
        lengths = [s.num_tokens for s in seqs]
        tokens_1N = torch.tensor([[t for s in seqs for t in s.token_ids]], device=self.device)
        start_B = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        routes = Routes(record=True) if self.record_routes else None
        logits_1NV = self.model(tokens_1N, CacheBatch(self.cache, slot_start, start_B),
                                packed=PackedSeqs.from_lengths(lengths), routes=routes)
        for s in seqs:  # a prefill computes every position anew (a waiting request whose saved row
            s.num_cached = 0  # found no free slot is prefilled too): its routes start at position 0
        if routes is not None:
            self._keep_routes(seqs, routes.recorded_NLK(), lengths)
        for s, n in zip(seqs, lengths):
            s.num_cached = n
        last_B = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return logits_1NV[0, last_B]


def _by_new_length(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Runs of consecutive sequences adding the same number of tokens (the plan orders them)."""
    runs: list[list[Sequence]] = []
    for s in seqs:
        if runs and runs[-1][0].num_new == s.num_new:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to `dtype` on `device`'s kind, or nothing (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def fresh_stats() -> dict[str, float]:
    """Zeroed pass counts and seconds: the keys every engine's `take_stats` reports
    (`decode_context`: the positions the decode rows attended, summed; `idle_*`: a lock-step
    engine's empty passes; 0 where an engine does not report it)."""
    return dict.fromkeys(("decode_passes", "decode_rows", "decode_context", "decode_s", "prefill_passes",
                          "prefill_tokens", "prefill_s", "extend_passes", "extend_rows", "extend_tokens",
                          "extend_s", "restored_tokens", "idle_passes", "idle_s"), 0.0)

