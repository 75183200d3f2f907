"""Static batching, the baseline the engine is measured against (HF `generate`-style).

A batch is prefilled together and decoded in lock-step until its *longest* member finishes;
finished rows keep occupying the batch (their extra tokens are discarded). Uses the same model
runner and KV cache as the engine, so a comparison measures scheduling alone.
"""

from __future__ import annotations

from rlfusion.engine.engine import finish_reason
from rlfusion.engine.runner import ModelRunner
from rlfusion.engine.scheduler import Sequence, StepPlan
from rlfusion.engine.types import Completion, Request
from rlfusion.model.transformer import MoETransformer


def generate_static(model: MoETransformer, requests: list[Request], batch_size: int,
                    max_seq_len: int | None = None, seed: int = 0) -> list[Completion]:
    max_len = max_seq_len or model.config.max_seq_len
    runner = ModelRunner(model, batch_size, max_len, seed)
    out: list[Completion] = []
    for i in range(0, len(requests), batch_size):
        out += _run_batch(runner, requests[i:i + batch_size], max_len)
    return out


def _run_batch(runner: ModelRunner, requests: list[Request], max_len: int) -> list[Completion]:
    seqs = [Sequence(r, slot=b) for b, r in enumerate(requests)]
    reasons: list[str | None] = [None] * len(seqs)
    ends = [0] * len(seqs)  # number of output tokens when each row finished
    plan = StepPlan(prefill=seqs)
    while True:
        tokens, logprobs = runner.execute(plan)
        for b, seq in enumerate(seqs):
            seq.request.output_ids.append(tokens[b])
            seq.request.logprobs.append(logprobs[b])
            seq.request.versions.append(0)
            if reasons[b] is None:
                reasons[b] = finish_reason(seq, tokens[b], max_len)
                ends[b] = len(seq.request.output_ids)
        if all(reasons) or max(s.num_tokens for s in seqs) >= max_len:
            break
        plan = StepPlan(decode=seqs)
    return [_completion(s.request, reason, n) if reason else
            _completion(s.request, "length", len(s.request.output_ids))
            for s, reason, n in zip(seqs, reasons, ends)]


def _completion(r: Request, reason: str, n: int) -> Completion:
    """Drop the tokens a row generated after it had finished."""
    return Completion(r.request_id, list(r.prompt_ids), r.output_ids[:n], r.logprobs[:n],
                      r.versions[:n], reason, r.params)
