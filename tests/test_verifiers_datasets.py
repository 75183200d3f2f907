import json
from pathlib import Path

import pytest

from rlfusion.rl.datasets import load_gsm8k, load_jsonl_problems
from rlfusion.rl.problem import Problem
from rlfusion.rl.verifiers import extract_answer, math_reward, normalize_number

GSM8K_TEST = Path(__file__).resolve().parent / "data" / "gsm8k_test.jsonl"  # rows of the GSM8K test split


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{ 2 }", "2"),  # last box wins
    ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{7} but also #### 9", "7"),  # boxed beats ####
    ("\\boxed{12 and 5", "5"),  # unbalanced box falls through to the last number
    ("3 + 4 = 7\n#### 7", "7"),
    ("#### 1 then #### 1,234", "1,234"),
    ("####   ", None),
    ("He had 3 apples and ate 2, leaving 1.", "1"),
    ("The temperature fell to -12 degrees", "-12"),
    ("It costs $1,234,567.50 in total", "1,234,567.50"),
    ("pi is about 3.14.", "3.14"),
    ("x is .5", ".5"),
    ("pages 3-5", "5"),
    ("no numbers here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


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
