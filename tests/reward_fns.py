"""Reward functions for tests, loaded by name through the `module:function` reward spec."""


def length_reward(response: str, problem) -> float:
    """Varied rewards even from an untrained model, so groups carry a learning signal."""
    return float(len(response) % 3 == 0)


class ShortIsGood:
    """A stand-in reward model: scores a whole batch at once, like a model on its own device."""

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0 if len(r) < 6 else 0.0 for r in responses]


# Faulty rewards for tests/unit/test_reward_faults.py: each one breaks a run in a way the reward
# stage must turn into one RewardError naming the spec and the sample.

def none_on_12_plus_7(response: str, problem) -> float | None:
    """Forgets to return on one path (the prompt '12+7=')."""
    if problem.prompt != "12+7=":
        return 1.0


def string_reward(response: str, problem) -> str:
    return "1.0"


def nan_reward(response: str, problem) -> float:
    return float("nan")


def divides_by_zero(response: str, problem) -> float:
    return 1 / (len(problem.prompt) - len(problem.prompt))


def hangs(response: str, problem) -> float:
    import time
    time.sleep(30)
    return 1.0


class ReturnsStrings:
    """A reward model whose scores are not numbers."""

    def score(self, prompts: list[str], responses: list[str]) -> list:
        return ["good" for _ in responses]


class ReturnsNone:
    """A reward model that forgot its return statement."""

    def score(self, prompts: list[str], responses: list[str]) -> None:
        pass


class ReturnsTooFew:
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0]


def always_none(response: str, problem) -> None:
    """A reward function that never returns a value."""


def huge_int(response: str, problem) -> int:
    return 10 ** 400  # too large for a float


def exits(response: str, problem) -> float:
    import sys
    sys.exit(3)


def fails_on_every_fourth(response: str, problem) -> float:
    """Raises for about a quarter of the responses (by length), else the length reward."""
    if len(response) % 4 == 0:
        raise ValueError("flaky scorer")
    return float(len(response) % 3 == 0)
