"""The math verifier over every final-answer form a response writes: each marker it accepts x
each way the value may end x values of each kind, right and wrong; hedged and listed answers
in each marker; and the GSM8K test solutions with their final statement rewritten into each
marker form, scored against their labels."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction
from pathlib import Path

import pytest

from rlfusion.rl.verifiers import MATH_FALLBACKS, math_reward

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k_test.jsonl"
REASONING = "She sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18 every day."

# marker -> the response's last statement around the value text `v`
MARKERS = {
    "A:": lambda v: f"A: {v}",
    "Answer:": lambda v: f"Answer: {v}",
    "Final answer:": lambda v: f"Final answer: {v}",
    "The answer is": lambda v: f"The answer is {v}",
    "####": lambda v: f"#### {v}",
    "boxed": lambda v: f"So the total is \\boxed{{{v}}}",
    "bare final line": lambda v: v,
}
# how the value is written, then what follows it (`$` in LaTeX inside \boxed{})
TRAILING = {
    "nothing": lambda v, boxed: v,
    "full stop": lambda v, boxed: v + ("" if boxed else "."),
    "unit word": lambda v, boxed: v + (" \\text{ dollars}" if boxed else " dollars"),
    "currency": lambda v, boxed: ("\\$" if boxed else "$") + v,
    "newline": lambda v, boxed: v + "\n",
    "trailing spaces": lambda v, boxed: v + "   ",
}
VALUES = {  # value -> its wrong neighbour
    "18": "19", "0": "1", "1234": "1235", "2500000": "2500001",  # integers (separators below)
    "-7": "-8", "-1250": "-1251",  # negatives
    "2.5": "3.5", "0.75": "0.7", "1234.5": "1234.25",  # decimals
    "1/2": "1/3", "3/4": "5/4", "-5/2": "-3/2",  # fractions
}


def _written(value: str, separators: bool) -> str:
    """`value` as a response writes it, with thousands separators when asked."""
    if not separators or "/" in value:
        return value
    sign, digits = ("-", value[1:]) if value.startswith("-") else ("", value)
    whole, _, frac = digits.partition(".")
    return sign + f"{int(whole):,}" + (f".{frac}" if frac else "")


def _response(marker: str, trailing: str, value: str, separators: bool = False) -> str:
    boxed = marker == "boxed"
    shown = TRAILING[trailing](_written(value, separators), boxed)
    if boxed and trailing in ("newline", "trailing spaces"):  # what follows the box, not its content
        return f"{REASONING}\n{MARKERS[marker](_written(value, separators))}{shown[len(_written(value, separators)):]}"
    return f"{REASONING}\n{MARKERS[marker](shown)}"


@pytest.mark.parametrize("marker", MARKERS)
def test_a_right_value_scores_one_and_a_wrong_one_zero_in_every_form(marker):
    failures = []
    for trailing, (right, wrong), separators in itertools.product(TRAILING, VALUES.items(), (False, True)):
        for written, want in ((right, 1.0), (wrong, 0.0)):
            response = _response(marker, trailing, written, separators)
            got = math_reward(response, right)
            if got != want:
                failures.append((response[len(REASONING) + 1:], right, got))
    assert not failures, failures[:10]


def test_a_labelled_value_counts_in_every_fallback_mode():
    # an answer statement, not a fallback: the strict mode reads it too
    for marker in ("A:", "Answer:", "Final answer:", "The answer is", "####", "boxed"):
        assert [math_reward(_response(marker, "nothing", "18"), "18", f) for f in MATH_FALLBACKS] == [1.0] * 3


HEDGES = ["{a} or {b}", "{a}, {b}", "either {a} or {b}", "{a} - {b}", "{a}; {b}"]


@pytest.mark.parametrize("marker", MARKERS)
def test_hedged_and_listed_answers_score_zero_in_every_marker(marker):
    for hedge, (a, b) in itertools.product(HEDGES, [("18", "26"), ("26", "18"), ("1/2", "3/4")]):
        text = hedge.format(a=a, b=b)
        if marker == "boxed":
            text = text.replace(" or ", " \\text{ or } ")
        response = f"{REASONING}\n{MARKERS[marker](text)}"
        assert math_reward(response, a) == 0.0, response
        assert math_reward(response, b) == 0.0, response


def test_an_answer_label_that_opens_reasoning_is_not_the_answer():
    worked = "A: Natalia sold 48/2 = 24 clips in May. Altogether she sold 48+24 = 72 clips. The answer is 72."
    assert math_reward(worked, "72") == 1.0
    assert math_reward(worked, "24") == 0.0
    assert math_reward("Q: How many?\nA: 17\n#### 18", "18") == 0.0  # two statements, two answers
    assert math_reward("Q: How many?\nA: 18\nQ: And now?\nA: 5", "18") == 1.0  # a new question is not read


def _gsm8k_rows() -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    out = []
    for row in rows:
        head, final = row["answer"].rsplit("####", 1)
        out.append((head.rstrip(), final.strip()))
    return out


def test_gsm8k_solutions_rewritten_into_every_marker_agree_with_their_labels():
    """Each test solution's `#### X` as every marker form, with X and with X + 1 (rotating the
    trailing forms over the rows): a right answer 1, a wrong one 0, on all 1,319 solutions."""
    rows = _gsm8k_rows()
    assert len(rows) == 1319
    trailings = list(TRAILING)
    disagreements, checked = [], 0
    for i, (head, final) in enumerate(rows):
        wrong = str(int(final.replace(",", "")) + 1)
        for j, marker in enumerate(MARKERS):
            trailing = trailings[(i + j) % len(trailings)]
            boxed = marker == "boxed"
            for value, label in ((final, 1.0), (wrong, 0.0)):
                response = f"{head}\n{MARKERS[marker](TRAILING[trailing](value, boxed))}"
                checked += 1
                if math_reward(response, final) != label:
                    disagreements.append((marker, trailing, response[-60:], final, label))
    assert checked == 1319 * len(MARKERS) * 2
    assert not disagreements, f"{len(disagreements)} of {checked} disagree: {disagreements[:5]}"


@pytest.mark.parametrize("ending", ["A: 18", "A: 18.", "A: $18", "Answer: 18", "The answer is 18.", "#### 18",
                                    "\\boxed{18}"])
def test_a_gsm8k_style_set_scores_each_final_statement_through_the_reward_stage(tmp_path, ending):
    from rlfusion.rl.datasets import DataConfig
    from rlfusion.rl.tasks.dataset import DatasetTask

    path = tmp_path / "set.jsonl"
    rows = [{"question": f"How much does Tom earn in {d} days?", "answer": f"9 * 2 = 18\n#### 18"} for d in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask(DataConfig(path=str(path), prompt_field="question", answer_rule="after_hashes",
                                  verifier="math", num_heldout=1))
    problem = task.heldout()[0]
    assert task.reward(f"Tom earns 9 an hour for 2 hours.\n2*9=18 per day\n{ending}", problem) == 1.0
    assert task.reward(f"Tom earns 9 an hour for 2 hours.\n2*9=18 per day\n{ending.replace('18', '19')}", problem) == 0.0
