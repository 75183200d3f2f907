"""Replayed response lengths: a reasoning-shaped, long-tailed workload for throughput runs.

With `rollout.lengths=replay` every response is forced to a length drawn for its prompt group
and sample (the end token is ignored until then; the model really decodes every token), so a
throughput comparison no longer depends on what the policy has learned. The shape is that of
published RL runs of reasoning models, scaled to the tiny model's context:

- log-normal, median `replay_median` tokens, log-space standard deviation `replay_sigma`;
- `replay_between` of the log-variance lies between prompt groups, the rest between the samples
  of a group (published traces: ~90% between prompts);
- capped at `rollout.max_new_tokens`. With ~10% of responses at the cap, p99 = cap, so a p99 /
  median of 4 needs sigma = ln 4 / 1.2816 ≈ 1.08 (the 90th percentile of a normal at the cap):
  the defaults, median 40 with the default cap of 160 tokens (the tiny model holds 256).

A length depends on (group id, sample) only, never on the device or the run's progress, so an
aborted and resumed request (StaleSync's partial rollout) keeps it.

Owns the draw. The rollout stage turns it into each request's `max_new_tokens`.
"""

from __future__ import annotations

import math
import random


def replay_length(group_id: int, sample: int, median: float, sigma: float, between: float, cap: int) -> int:
    """The forced response length of sample `sample` of prompt group `group_id` (1..cap)."""
    z_group = random.Random(f"replay-group:{group_id}").gauss(0.0, 1.0)
    z_sample = random.Random(f"replay-sample:{group_id}/{sample}").gauss(0.0, 1.0)
    log_len = math.log(median) + sigma * (math.sqrt(between) * z_group + math.sqrt(1.0 - between) * z_sample)
    return max(1, min(cap, round(math.exp(log_len))))
