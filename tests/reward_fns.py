"""Reward functions for tests, loaded by name through the `module:function` reward spec."""


def length_reward(response: str, problem) -> float:
    """Varied rewards even from an untrained model, so groups carry a learning signal."""
    return float(len(response) % 3 == 0)
