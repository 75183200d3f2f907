import json
from pathlib import Path

import pytest

from rlfusion.rl.datasets import load_gsm8k, load_jsonl_problems
from rlfusion.rl.problem import Problem
from rlfusion.rl.verifiers import MATH_FALLBACKS, extract_answer, math_reward, normalize_number

GSM8K_TEST = Path(__file__).resolve().parents[1] / "data" / "gsm8k_test.jsonl"  # rows of the GSM8K test split


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{ 2 }", "2"),  # the last statement
    ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{7} but also #### 9", "9"),  # statements in the order written
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 1 then #### 1,234", "1,234"),
    ("The answer is 18.", "18"),
    ("Answer: 18 dollars\nQ: What is 2+2?\nAnswer: 4", "18 dollars"),  # a new question: not read
])
def test_extract_answer_takes_the_last_answer_statement(text, expected):
    for fallback in MATH_FALLBACKS:
        assert extract_answer(text, fallback) == expected


@pytest.mark.parametrize("text,final_line,last_number", [
    ("He had 3 apples and ate 2, leaving 1.", "He had 3 apples and ate 2, leaving 1.", "1"),
    ("The temperature fell to -12 degrees", "The temperature fell to -12 degrees", "-12"),
    ("It costs $1,234,567.50 in total", "It costs $1,234,567.50 in total", "1,234,567.50"),
    ("x is .5", "x is .5", ".5"),
    ("pages 3-5", "pages 3-5", "5"),
    ("18 apples.\nThat was fun.", "That was fun.", "18"),
    ("no numbers here", "no numbers here", None),
    ("\\boxed{12 and 5", "\\boxed{12 and 5", "5"),  # unbalanced: no statement
    ("", None, None),
])
def test_extract_answer_without_a_statement_follows_the_fallback(text, final_line, last_number):
    assert extract_answer(text, "final_line") == final_line
    assert extract_answer(text, "last_number") == last_number
    assert extract_answer(text, "none") is None


@pytest.mark.parametrize("raw,expected", [
    ("18.00", "18"), ("-3.50", "-3.5"), (" $1,234 ", "1234"), ("18.", "18"),
    ("100", "100"), ("100.0", "100"), (".0", "0"), ("\\$5", "5"), ("  x + 1 ", "x + 1"),
])
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


@pytest.mark.parametrize("response,answer,expected", [
    ("The answer is \\boxed{18}", "18", 1.0),
    ("#### 18.00", "18", 1.0),
    ("so she pays $1,234.", "1234", 1.0),
    ("half is 0.5", ".5", 1.0),
    ("it is -3.50", "-3.5", 1.0),
    ("The answer is 17", "18", 0.0),
    ("no answer", "18", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("#### 18", "18.5", 0.0),
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


# Reward hacking and honest answers in every form a response writes them: (response, reference, score)
HEDGED = [
    ("A: 26 or 18", "18", 0.0),
    ("The answer is either 18 or 26.", "18", 0.0),
    ("#### 18 or 26", "18", 0.0),
    ("\\boxed{18 \\text{ or } 26}", "18", 0.0),
    ("It is 17-19 dollars.", "18", 0.0),  # a range is two answers
    ("The answer is 18 or 18.", "18", 1.0),  # the same value twice is one answer
]
LISTS = [
    ("The answer is 18, 26, 30", "18", 0.0),
    ("\\boxed{18, 26}", "18", 0.0),
    ("\\boxed{26} wait no \\boxed{18}", "18", 0.0),  # two statements, two answers
    ("#### 18\n\n#### 26", "26", 0.0),
    ("The answer is 18.\n#### 18", "18", 1.0),  # two statements that agree
    ("#### 1,234", "1234", 1.0),  # a thousands separator is not a list
]
RUN_ON = [
    ("3 * 6 = 18\n#### 18\nQ: Tom has 5 apples and buys 3. How many?\nA: 8\n#### 8", "18", 1.0),
    ("He pays 18.\nQuestion: how much is 2 + 3?\n5", "18", 1.0),  # the final line before it
    ("Q: What is 2+2?\nA: 4\n#### 4", "4", 1.0),  # a response that begins with a question line
    ("#### 18\nProblem 2: a train leaves at 3 pm...\n#### 3", "3", 0.0),
]
EMPTY_TRUNCATED = [
    ("", "18", 0.0),
    ("   \n  ", "18", 0.0),
    ("The answer is", "18", 0.0),
    ("####", "18", 0.0),
    ("3 * 6 = 1", "18", 0.0),  # cut off mid-number
    ("\\boxed{18", "18", 0.0),  # an unclosed box: a truncated answer
]
HUGE = [
    ("#### " + "9" * 5000, "18", 0.0),
    ("\\boxed{10^{100000}}", "18", 0.0),
    ("#### " + "1" + "0" * 300, "1" + "0" * 300, 0.0),  # past the digits an answer may have
]
LATEX = [
    ("\\boxed{\\frac{36}{2}}", "18", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("The answer is $\\frac{7}{14}$.", "0.5", 1.0),
    ("The answer is 7/14.", "1/2", 1.0),  # a fraction, not its denominator
    ("\\boxed{18.0}", "18", 1.0),
    ("\\boxed{3^2}", "9", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{x+1}", "1+x", 1.0),  # symbolic equivalence
]
UNITS_SEPARATORS = [
    ("#### 18 dollars", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{18\\%}", "18", 1.0),  # a percent for a reference that is its number
    ("The answer is 18%.", "18", 1.0),
    ("The answer is 18%.", "0.18", 1.0),
    ("#### $1,234.50", "1234.5", 1.0),
    ("The area is 18 m^2.", "18", 1.0),
    ("The answer is 18 cm³", "18", 1.0),
    ("The answer is 12 and the remainder is 3.", "12", 1.0),  # the sentence goes on: not a list
]


@pytest.mark.parametrize("response,answer,expected",
                         HEDGED + LISTS + RUN_ON + EMPTY_TRUNCATED + HUGE + LATEX + UNITS_SEPARATORS)
def test_math_reward_classes(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_reward_of_huge_numbers_is_quick():
    import time

    start = time.perf_counter()
    for response, answer, _ in HUGE:
        math_reward(response, answer)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("response,final_line,last_number,none", [
    ("He pays 3 * 6 = 18", 1.0, 1.0, 0.0),  # a bare final line
    ("18 is the price.\nHe was happy about it.", 0.0, 1.0, 0.0),  # the last number is not on the final line
    ("#### 18", 1.0, 1.0, 1.0),  # a statement counts in every mode
])
def test_math_reward_strictness(response, final_line, last_number, none):
    assert [math_reward(response, "18", f) for f in MATH_FALLBACKS] == [final_line, last_number, none]


def test_every_gsm8k_test_solution_scores_one_and_a_changed_final_number_zero():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    for row in rows:
        solution = row["answer"]
        head, final = solution.rsplit("####", 1)
        final = final.strip()
        assert math_reward(solution, final) == 1.0, solution[-80:]
        changed = int(final.replace(",", "")) + 1
        assert math_reward(f"{head}#### {changed}", final) == 0.0, solution[-80:]


@pytest.fixture
def gsm8k_path() -> Path:
    return GSM8K_TEST


def test_load_gsm8k(gsm8k_path):
    problems = load_gsm8k(gsm8k_path)
    assert len(problems) == 1319
    first = problems[0]
    assert first.answer == "18"
    assert first.prompt.startswith("Janet")
    assert first.solution.endswith("#### 18")
    assert all(math_reward(p.solution, p.answer) == 1.0 for p in problems)
    assert all("," not in p.answer for p in problems)  # "#### 1,234" is stored as "1234"


def test_load_gsm8k_limit(gsm8k_path):
    assert len(load_gsm8k(gsm8k_path, limit=5)) == 5


def _write(tmp_path: Path, lines: list[str], name: str = "set.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loads_plain_prompt_set_skipping_blank_lines(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "2+2=", "answer": "4"}),
        "",
        "   ",
        json.dumps({"prompt": "half of 3?", "answer": 1.5, "extra": [1]}),
        json.dumps({"prompt": "count", "answer": 7}),
    ])
    assert load_jsonl_problems(path) == [
        Problem("2+2=", "4"), Problem("half of 3?", "1.5"), Problem("count", "7"),
    ]
    assert load_jsonl_problems(path, limit=2) == [
        Problem("2+2=", "4"), Problem("half of 3?", "1.5"),
    ]


GOOD = json.dumps({"prompt": "p", "answer": "1"})


@pytest.mark.parametrize("bad_line,problem", [
    ('{"prompt": "p", "answer": ', "invalid JSON"),
    ('["p", "1"]', "expected a JSON object, got list"),
    ('{"prompt": "p"}', "missing key 'answer'; keys present: ['prompt']"),
    ('{"question": "p", "answer": "1"}',
     "missing key 'prompt'; keys present: ['answer', 'question']"),
    ('{"prompt": 5, "answer": "1"}', "key 'prompt' must be a string, got int"),
    ('{"prompt": "p", "answer": [1]}', "key 'answer' must be a string, got list"),
    ('{"prompt": "p", "answer": true}', "key 'answer' must be a string, got bool"),
    ('{"prompt": "  ", "answer": "1"}', "empty prompt"),
])
def test_malformed_line_error_names_file_line_and_problem(tmp_path, bad_line, problem):
    path = _write(tmp_path, [GOOD, "", bad_line, GOOD], name="broken.jsonl")
    with pytest.raises(ValueError) as e:
        load_jsonl_problems(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ")
    assert "broken.jsonl" in msg and problem in msg
    assert "\n" not in msg


@pytest.mark.parametrize("answer,problem", [
    ("She has 3 apples. The answer is 3", "no '####'"),
    ("She has 3 apples.\n#### ", "nothing after '####'"),
    (18, "key 'answer' must be a string, got int"),
])
def test_answer_from_solution_errors(tmp_path, answer, problem):
    path = _write(tmp_path, [json.dumps({"question": "q", "answer": answer})], name="gsm.jsonl")
    with pytest.raises(ValueError, match=problem) as e:
        load_gsm8k(path)
    assert str(e.value).startswith(f"{path}:1: ")


def test_empty_file_names_the_file(tmp_path):
    path = _write(tmp_path, ["", "  "], name="empty.jsonl")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no problems found"):
        load_jsonl_problems(path)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl_problems(path)


def test_bad_limit_rejected(tmp_path):
    with pytest.raises(ValueError, match="limit=0"):
        load_jsonl_problems(_write(tmp_path, [GOOD]), limit=0)
