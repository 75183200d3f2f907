"""Multi-term addition: the synthetic reasoning task of the tiny path.

Owns the problem distribution, the held-out set, the reference solution and the verifier.
The number of terms is geometric, so response lengths have the long tail that makes rollout
scheduling interesting: a few responses are many times longer than the median.

    prompt    17+5+23+8=
    solution  17+5=22;22+23=45;45+8=53;#53      (running sums, then '#' and the answer)

Knows nothing about tokenizers or models; rewards are computed on response text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlfusion.rl.problem import Problem

_MAX_ATTEMPTS = 10_000  # rejection-sampling budget before a config is declared too small


def verify_arithmetic(response: str, answer: str) -> float:
    """1.0 iff the text after the last '#' equals `answer`; the scratchpad is not graded."""
    if "#" not in response:
        return 0.0
    return 1.0 if response.rsplit("#", 1)[1].strip() == answer else 0.0


@dataclass(frozen=True)
class ArithmeticConfig:
    min_terms: int = 2
    max_terms: int = 12
    p_stop: float = 0.4  # after min_terms, each further term is added with prob 1 - p_stop
    max_value: int = 99  # terms are uniform in [1, max_value]
    seed: int = 0  # fixes the held-out set
    num_heldout: int = 500

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"arithmetic.{key}={getattr(self, key)!r} is invalid: {allowed}")

        need(self.min_terms >= 2, "min_terms", "must be >= 2")
        need(self.max_terms >= self.min_terms, "max_terms",
             f"must be >= min_terms={self.min_terms}")
        need(0.0 <= self.p_stop <= 1.0, "p_stop", "must be in [0, 1]")
        need(self.max_value >= 1, "max_value", "must be >= 1")
        need(self.num_heldout >= 0, "num_heldout", "must be >= 0")
        need(self.num_heldout < self.num_distinct_prompts(), "num_heldout",
             f"must be < the {self.num_distinct_prompts()} distinct prompts this config can make")

    def num_distinct_prompts(self) -> int:
        return sum(self.max_value**k for k in range(self.min_terms, self.max_terms + 1))


class ArithmeticTask:
    """Samples training problems, holds the held-out set and grades responses."""

    def __init__(self, config: ArithmeticConfig) -> None:
        self.config = config
        self._heldout: list[Problem] | None = None
        self._heldout_prompts: frozenset[str] = frozenset()

    def heldout(self) -> list[Problem]:
        """The evaluation set: `num_heldout` distinct problems, fixed by `config.seed`."""
        if self._heldout is None:
            self._heldout = self._draw_heldout()
            self._heldout_prompts = frozenset(p.prompt for p in self._heldout)
        return list(self._heldout)

    def sample(self, rng: random.Random, max_terms: int | None = None) -> Problem:
        """A training problem, never a held-out prompt. `max_terms` caps length for curricula."""
        cap = self.config.max_terms if max_terms is None else max_terms
        if not self.config.min_terms <= cap <= self.config.max_terms:
            raise ValueError(f"max_terms={max_terms} is invalid: must be in "
                             f"[{self.config.min_terms}, {self.config.max_terms}]")
        self.heldout()  # builds the prompt set that training samples must avoid
        for _ in range(_MAX_ATTEMPTS):
            problem = self._draw(rng, cap)
            if problem.prompt not in self._heldout_prompts:
                return problem
        raise ValueError(f"max_terms={cap} leaves no training prompts outside the held-out set; "
                         f"raise max_terms or max_value, or lower num_heldout")

    def train_problems(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def reward(self, response: str, problem: Problem) -> float:
        return verify_arithmetic(response, problem.answer)

    def solve(self, prompt: str) -> str:
        """The reference response for `prompt`: running sums, then '#' and the total."""
        terms = _parse_prompt(prompt)
        total, steps = terms[0], []
        for term in terms[1:]:
            steps.append(f"{total}+{term}={total + term};")
            total += term
        return "".join(steps) + f"#{total}"

    def solve_with_calculator(self, prompt: str, call_terms: int) -> list[tuple[str, bool]]:
        """The reference episode with the calculator (`rl/tools/calculator.py`) called on the
        first `call_terms` terms, the rest summed by hand: `(text, is_observation)` pieces."""
        terms = _parse_prompt(prompt)
        if not 2 <= call_terms <= len(terms):
            raise ValueError(f"call_terms={call_terms} must be in [2, {len(terms)}] for {prompt!r}")
        total = sum(terms[:call_terms])
        steps = []
        for term in terms[call_terms:]:
            steps.append(f"{total}+{term}={total + term};")
            total += term
        return [("[" + "+".join(map(str, terms[:call_terms])) + "]", False), (f"={sum(terms[:call_terms])};", True),
                ("".join(steps) + f"#{total}", False)]

    def _draw_heldout(self) -> list[Problem]:
        # A string seed keeps this stream apart from any int-seeded training rng.
        rng = random.Random(f"arithmetic-heldout:{self.config.seed}")
        problems: dict[str, Problem] = {}
        budget = _MAX_ATTEMPTS + 100 * self.config.num_heldout
        while len(problems) < self.config.num_heldout:
            if budget == 0:
                raise ValueError(f"arithmetic.num_heldout={self.config.num_heldout} is too large: "
                                 f"drew only {len(problems)} distinct prompts; "
                                 f"raise max_value or max_terms")
            budget -= 1
            problem = self._draw(rng, self.config.max_terms)
            problems.setdefault(problem.prompt, problem)
        return list(problems.values())

    def _draw(self, rng: random.Random, cap: int) -> Problem:
        num_terms = self.config.min_terms
        while num_terms < cap and rng.random() >= self.config.p_stop:
            num_terms += 1
        terms = [rng.randint(1, self.config.max_value) for _ in range(num_terms)]
        prompt = "+".join(map(str, terms)) + "="
        return Problem(prompt=prompt, answer=str(sum(terms)), solution=self.solve(prompt))


def _parse_prompt(prompt: str) -> list[int]:
    body = prompt[:-1] if prompt.endswith("=") else ""
    parts = body.split("+")
    if not body or not all(p.isdigit() and p.isascii() for p in parts):
        raise ValueError(f"arithmetic prompt {prompt!r} is malformed: expected terms joined "
                         f"by '+' and ending in '=', e.g. '17+5+23='")
    return [int(p) for p in parts]
