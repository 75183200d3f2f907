"""Reward functions for tests, loaded by name through the `module:function` reward spec."""


def length_reward(response: str, problem) -> float:
    """Varied rewards even from an untrained model, so groups carry a learning signal."""
    return float(len(response) % 3 == 0)


class ShortIsGood:
    """A stand-in reward model: scores a whole batch at once, like a model on its own device."""

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0 if len(r) < 6 else 0.0 for r in responses]
