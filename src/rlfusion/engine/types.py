"""Typed contracts of the rollout engine: sampling parameters, requests and completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "aborted")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` disable
    those filters. Log-probabilities are reported under the temperature-scaled distribution
    (before top-k/top-p truncation), which is the policy an RL loss differentiates."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass
class Request:
    """A prompt to complete. `output_ids` (with `logprobs` and `versions`) are tokens already
    generated before an abort: resubmitting them continues the sequence where it stopped, and
    `max_new_tokens` counts them too."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # with an engine that records routes: the routed experts of each token fed so far, per MoE
    # layer (`[positions, L * K]`, the first positions first; `model.routes`), kept across an
    # abort so a resumed request keeps the routes its tokens were sampled with
    routes: Any = None  # a torch.Tensor (this module is imported without torch by the simulator)
    # a turn of a multi-turn episode (`engine/episodes.py`): `output_ids` may hold observation
    # tokens an environment appended, marked 0 here (1: sampled; None: every output token was
    # sampled); the cache row is kept when the request stops on one of `keep_row_after` (a call),
    # so its continuation (the same tokens plus an observation) prefills only the new tokens
    output_mask: list[int] | None = None
    keep_row_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if not len(self.output_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"request {self.request_id!r}: output_ids, logprobs and versions "
                             "must have the same length")
        if self.output_mask is not None and len(self.output_mask) != len(self.output_ids):
            raise ValueError(f"request {self.request_id!r}: output_mask has {len(self.output_mask)} entries "
                             f"for {len(self.output_ids)} output tokens")

    @classmethod
    def resume(cls, completion: "Completion") -> "Request":
        """Continue an aborted completion."""
        return cls(completion.request_id, list(completion.prompt_ids), completion.params,
                   list(completion.output_ids), list(completion.logprobs), list(completion.versions),
                   completion.routes, _copy(completion.output_mask))


@dataclass
class Completion:
    """What the engine returns: every generated token with its log-probability under the sampling
    distribution and the policy version that produced it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # one of FINISH_REASONS
    params: SamplingParams = field(default_factory=SamplingParams)
    routes: Any = None  # `Request.routes` (the engine recorded them)
    output_mask: list[int] | None = None  # `Request.output_mask`, with the tokens sampled since


def _copy(mask: list[int] | None) -> list[int] | None:
    return None if mask is None else list(mask)
