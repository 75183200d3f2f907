import random
import re

import pytest

from rlfusion.rl.problem import Problem
from rlfusion.rl.tasks import ArithmeticConfig, ArithmeticTask, verify_arithmetic


def test_solve_matches_documented_example():
    task = ArithmeticTask(ArithmeticConfig(num_heldout=0))
    assert task.solve("17+5+23+8=") == "17+5=22;22+23=45;45+8=53;#53"


def test_problem_solution_recomputes_running_sums():
    task = ArithmeticTask(ArithmeticConfig(num_heldout=10))
    for p in task.train_problems(200, seed=1):
        terms = [int(t) for t in p.prompt.rstrip("=").split("+")]
        assert re.fullmatch(r"\d+(\+\d+)+=", p.prompt)
        steps, final = p.solution.split("#")
        total = terms[0]
        for term, step in zip(terms[1:], steps.rstrip(";").split(";"), strict=True):
            assert step == f"{total}+{term}={total + term}"
            total += term
        assert final == p.answer == str(sum(terms))
        assert task.reward(p.solution, p) == 1.0


def test_solve_rejects_malformed_prompt():
    task = ArithmeticTask(ArithmeticConfig(num_heldout=0))
    for bad in ["17+5", "17++5=", "=", "a+b="]:
        with pytest.raises(ValueError, match="malformed"):
            task.solve(bad)


@pytest.mark.parametrize("response,expected", [
    ("17+5=22;#22", 1.0),
    ("#22", 1.0),
    ("17+5=22;#23", 0.0),  # wrong answer
    ("17+5=22;22", 0.0),  # no '#'
    ("#22#23", 0.0),  # only the last '#' counts
    ("#23#22", 1.0),
    ("#  22 \n", 1.0),  # surrounding whitespace is ignored
    ("#2 2", 0.0),
    ("#", 0.0),
    ("", 0.0),
    ("17+5=99;#22", 1.0),  # the scratchpad is not graded
])
def test_verifier(response, expected):
    assert verify_arithmetic(response, "22") == expected


def test_heldout_is_deterministic_per_seed_and_distinct():
    a = ArithmeticTask(ArithmeticConfig(seed=3)).heldout()
    b = ArithmeticTask(ArithmeticConfig(seed=3)).heldout()
    c = ArithmeticTask(ArithmeticConfig(seed=4)).heldout()
    assert a == b
    assert len(a) == 500 and len({p.prompt for p in a}) == 500
    assert [p.prompt for p in a] != [p.prompt for p in c]


def test_heldout_is_cached_and_copied():
    task = ArithmeticTask(ArithmeticConfig(num_heldout=5))
    first = task.heldout()
    first.clear()
    assert len(task.heldout()) == 5


def test_train_never_yields_heldout_prompt():
    # A small space (two terms up to 9: 81 prompts, 40 held out) forces many collisions.
    task = ArithmeticTask(ArithmeticConfig(max_terms=2, max_value=9, num_heldout=40))
    heldout = {p.prompt for p in task.heldout()}
    rng = random.Random(0)
    train = {task.sample(rng).prompt for _ in range(2000)}
    assert not train & heldout
    assert len(train) == 81 - 40  # every non-held-out prompt is still reachable


def test_train_and_heldout_disjoint_with_defaults():
    task = ArithmeticTask(ArithmeticConfig())
    heldout = {p.prompt for p in task.heldout()}
    assert not {p.prompt for p in task.train_problems(3000, seed=0)} & heldout


def test_max_terms_caps_length():
    task = ArithmeticTask(ArithmeticConfig())
    rng = random.Random(0)
    counts = {task.sample(rng, max_terms=3).prompt.count("+") + 1 for _ in range(500)}
    assert counts == {2, 3}
    with pytest.raises(ValueError, match=r"max_terms=13 is invalid.*\[2, 12\]"):
        task.sample(rng, max_terms=13)
    with pytest.raises(ValueError, match=r"max_terms=1 is invalid"):
        task.sample(rng, max_terms=1)


def test_train_problems_reproducible():
    task = ArithmeticTask(ArithmeticConfig(num_heldout=10))
    assert task.train_problems(50, seed=7) == task.train_problems(50, seed=7)
    assert task.train_problems(50, seed=7) != task.train_problems(50, seed=8)
    assert all(isinstance(p, Problem) for p in task.train_problems(3, seed=0))


def test_response_length_has_long_tail():
    task = ArithmeticTask(ArithmeticConfig())
    lengths = sorted(len(p.solution) for p in task.train_problems(5000, seed=0))
    median = lengths[len(lengths) // 2]
    p99 = lengths[int(0.99 * len(lengths))]
    assert max(len(p.prompt) for p in task.heldout()) < 64
    assert p99 / median >= 3, (median, p99)


@pytest.mark.parametrize("field,value,allowed", [
    ("min_terms", 1, ">= 2"),
    ("max_terms", 1, "min_terms=2"),
    ("p_stop", 1.5, r"\[0, 1\]"),
    ("p_stop", -0.1, r"\[0, 1\]"),
    ("max_value", 0, ">= 1"),
    ("num_heldout", -1, ">= 0"),
    ("num_heldout", 81, "81 distinct prompts"),
])
def test_config_validation(field, value, allowed):
    small = {"max_terms": 2, "max_value": 9, "num_heldout": 0}
    pattern = rf"arithmetic\.{field}={re.escape(repr(value))} .*{allowed}"
    with pytest.raises(ValueError, match=pattern):
        ArithmeticConfig(**{**small, field: value})
