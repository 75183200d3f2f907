"""The rollout engine: continuous batching over a scheduler (decides) and a runner (computes).

Each `step()` asks the scheduler for a plan, runs it, appends one token to every scheduled
sequence and retires the ones that hit a stop token or their length limit. `abort()` returns
partial outputs that `Request.resume()` continues later; `abort(..., keep_cache=True)` also
keeps each running request's cache row (host memory, through `sleep`), so adding the resumed
request again decodes on at once instead of prefilling its prompt and partial output anew.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import torch.distributed as dist

from rlfusion.engine.runner import ModelRunner
from rlfusion.engine.scheduler import MAX_NUM_SEQS, Scheduler, SchedulerConfig, Sequence
from rlfusion.engine.types import Completion, Request
from rlfusion.model.transformer import MoETransformer


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = 4096
    max_seq_len: int | None = None  # default: the model's context length
    min_prefill_batch: int = 1  # see SchedulerConfig
    seed: int = 0
    compute_dtype: torch.dtype | None = None  # autocast the passes to it (see ModelRunner)
    # keep each fed token's routed experts per MoE layer on its request (`Request.routes`), for
    # routing replay in training and the mismatch metrics
    record_routes: bool = False


class LLMEngine:
    def __init__(self, model: MoETransformer, config: EngineConfig = EngineConfig()):
        max_len = config.max_seq_len or model.config.max_seq_len
        if max_len > model.config.max_seq_len:
            raise ValueError(f"engine.max_seq_len={max_len} exceeds the model's context length "
                             f"{model.config.max_seq_len}")
        self.config = config
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   max_len, config.min_prefill_batch))
        self.runner = ModelRunner(model, config.max_num_seqs, max_len, config.seed, config.compute_dtype,
                                  config.record_routes)
        self.policy_version = 0  # stamped on every generated token
        self.num_steps = 0
        # the expert-parallel group of a replica whose routed experts are split over devices
        # (`deploy.infer_ep`): its members' engines step in lock-step (see `step`); None: alone
        self.lockstep: dist.ProcessGroup | None = None

    holds_weights = False  # generates from the module it was given: nothing to load into it

    def add_request(self, request: Request) -> None:
        """Queue `request`; one with a saved cache row (aborted with `keep_cache`, or a turn that
        kept its row on stop) continues from that row: it decodes on, or first prefills the
        tokens added since (an observation). The row holds the keys and values of the request's
        first tokens: the caller adds tokens, never changes them (a row longer than the request
        is dropped and it is prefilled)."""
        saved = self.runner.saved.get(request.request_id)
        n = len(request.prompt_ids) + len(request.output_ids) - 1
        if saved is not None and saved[0] > n:
            del self.runner.saved[request.request_id]
            saved = None
        self.scheduler.add(request, cached=saved[0] if saved is not None else 0)

    def drop_row(self, request_id: str) -> None:
        """Forget the saved cache row of `request_id`, if any (an episode that ended after a turn
        whose row was kept for its continuation)."""
        self.runner.saved.pop(request_id, None)

    def drop_saved(self) -> int:
        """Forget every saved cache row no queued request is using (their requests resume
        elsewhere, or never); returns the rows dropped."""
        live = self.scheduler.waiting_ids()
        stale = [rid for rid in self.runner.saved if rid not in live]
        for rid in stale:
            del self.runner.saved[rid]
        return len(stale)

    def saved_rows(self) -> dict[str, tuple[int, list[torch.Tensor]]]:
        """The saved cache rows (request id -> (positions, per-buffer tensors)), for a checkpoint."""
        return dict(self.runner.saved)

    def load_saved_rows(self, rows: dict[str, tuple[int, list[torch.Tensor]]]) -> None:
        """Put a checkpoint's saved cache rows back (replacing any)."""
        self.runner.saved = dict(rows)

    @property
    def saved_bytes(self) -> int:
        """Host bytes of the saved cache rows of paused requests."""
        return self.runner.saved_bytes

    # ---- what the RL roles use beside generation (`engine/vllm_backend.VLLMEngine` has the same) ----

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache while the device does something else (the weights are the
        model's, not the engine's, so every level frees the same)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("cannot sleep with unfinished requests; abort them first")
        self.runner.cache.release()

    def wake_up(self) -> None:
        self.runner.cache.restore()

    @property
    def cache_bytes(self) -> int:
        return self.runner.cache.nbytes

    def take_stats(self) -> dict[str, float]:
        """Decode / prefill passes, their rows (prefill: tokens) and seconds since the last call."""
        return self.runner.take_stats()

    def rng_state(self) -> torch.Tensor:
        return self.runner.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.runner.generator.set_state(state)

    def has_unfinished(self) -> bool:
        """Requests left here — in lock-step, anywhere in the group (collective: every member
        asks as often as the others, and all get the same answer)."""
        if self.lockstep is None:
            return self.scheduler.has_unfinished()
        return self.any_in_group(self.scheduler.has_unfinished())

    def has_work(self) -> bool:
        """Requests left on this engine (never collective)."""
        return self.scheduler.has_unfinished()

    def any_in_group(self, flag: bool) -> bool:
        """Whether `flag` holds on any member of the lock-step group (collective)."""
        return bool(self.group_max([flag])[0])

    def group_max(self, flags: list[bool]) -> list[int]:
        """Each flag's maximum over the lock-step group (collective)."""
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.lockstep)
        return t.tolist()

    def step(self) -> list[Completion]:
        """Run one scheduling step; returns the requests that finished in it.

        In lock-step (`lockstep` set) every member of the group calls `step` together, busy or
        not: the members agree which passes the step runs (a decode pass where any has running
        rows, a prefill pass where any admits new ones), and one with no rows for a pass joins
        it with an empty pass, since each MoE layer of the pass exchanges tokens across the group."""
        plan = self.scheduler.schedule()
        passes = (0, 0, 0)
        if self.lockstep is not None:
            passes = tuple(self.group_max([bool(plan.decode), len({s.num_new for s in plan.extend}),
                                            bool(plan.prefill)]))
            if not any(passes):
                return []
        elif plan.is_empty:
            return []
        tokens, logprobs = self.runner.execute(plan, passes)
        self.num_steps += 1
        ended = []
        for seq, token, logprob in zip(plan.decode + plan.extend + plan.prefill, tokens, logprobs):
            req = seq.request
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            req.versions.append(self.policy_version)
            if req.output_mask is not None:
                req.output_mask.append(1)
            reason = finish_reason(seq, token, self.runner.max_seq_len)
            if reason:
                ended.append((seq, reason))
        # rows kept for a continuation are read before any finished row's slot is reused
        self.runner.save_rows([seq for seq, reason in ended
                               if reason == "stop" and seq.request.output_ids[-1] in seq.request.keep_row_after])
        for seq, _ in ended:
            self.scheduler.finish(seq)
        return [_completion(seq, reason) for seq, reason in ended]

    def abort(self, request_ids, keep_cache: bool = False) -> list[Completion]:
        """Stop the given requests now; their partial outputs come back with reason `aborted`.
        `keep_cache`: the running ones' cache rows are saved for their resumption."""
        ids = set(request_ids)
        if keep_cache:
            for src, dst in self.scheduler.take_moves():  # rows where the scheduler has them
                self.runner.cache.move_slot(src, dst)
            self.runner.save_rows([s for s in self.scheduler.running if s.request_id in ids and s.num_cached])
        return [_completion(s, "aborted") for s in self.scheduler.abort(ids)]

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run the given requests to completion; results in the order of `requests`."""
        return run_to_completion(self, requests)


def run_to_completion(engine, requests: list[Request]) -> list[Completion]:
    """Add `requests` to any engine with `add_request` / `has_unfinished` / `step` and step it
    until all are done; results in the order of `requests`."""
    for req in requests:
        engine.add_request(req)
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    return [done[r.request_id] for r in requests]



def finish_reason(seq: Sequence, token: int, max_seq_len: int) -> str | None:
    """Why `seq` ends after appending `token`, or None if it goes on."""
    params = seq.request.params
    if token in params.stop_ids:
        return "stop"
    if len(seq.request.output_ids) >= params.max_new_tokens or seq.num_tokens >= max_seq_len:
        return "length"
    return None


def _completion(seq: Sequence, reason: str) -> Completion:
    r = seq.request
    return Completion(r.request_id, list(r.prompt_ids), list(r.output_ids), list(r.logprobs),
                      list(r.versions), reason, r.params, r.routes,
                      None if r.output_mask is None else list(r.output_mask))
