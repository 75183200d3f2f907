"""`Problem`: one prompt with its reference answer, the unit every task and dataset yields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # reference final answer, compared by the task's verifier
    solution: str | None = None  # reference response for supervised warm-up; None if prompt-only
