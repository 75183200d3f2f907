"""Adaptive Pipe's turn taking (`parallel/overlap.py`) in one process: the two halves of a pair
alternate at each hand-over, only the turn holder runs, and a half that raises stops its
partner at the partner's next hand-over, its own error being the one raised."""

import pytest

from rlfusion.parallel import overlap


def _half(name: str, pieces: int, steps: list[str]):
    def run() -> None:
        for i in range(pieces):
            steps.append(f"{name}{i}")
            overlap.yield_turn()
    return run


@pytest.mark.parametrize("first, want", [("F", ["F0", "B0", "F1", "B1", "B2"]), ("B", ["B0", "F0", "B1", "F1", "B2"])])
def test_the_halves_alternate_at_each_hand_over(first, want):
    steps: list[str] = []
    overlap.run_pair(_half("F", 2, steps), _half("B", 3, steps), first)
    assert steps == want
    assert not overlap.in_pair()  # (the caller's thread holds no role after the pair)


def test_a_failed_half_stops_its_partner_and_its_error_is_raised():
    steps: list[str] = []

    def backward() -> None:
        steps.append("B0")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        overlap.run_pair(_half("F", 3, steps), backward, "F")
    assert steps == ["F0", "B0", "F1"]  # F stops at its next hand-over instead of running on alone
