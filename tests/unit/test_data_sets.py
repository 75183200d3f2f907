"""Prompt sets from JSONL / Parquet with a field mapping (rl/datasets.py), the dataset-backed
task (rl/tasks/dataset.py) and the math / multiple-choice verifiers on real data."""

import json
import random
from decimal import Decimal
from pathlib import Path

import pytest

from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.rl.datasets import DataConfig, load_problems
from rlfusion.rl.problem import Problem
from rlfusion.rl.tasks import ArithmeticConfig, ArithmeticTask, DatasetTask, make_task
from rlfusion.rl.verifiers import choice_reward, extract_choice, math_reward

GSM8K = Path(__file__).parents[1] / "data" / "gsm8k_test.jsonl"  # rows of the GSM8K test split
GSM8K_CFG = dict(path=str(GSM8K), prompt_field="question", answer_field="answer",
                 answer_rule="after_hashes", verifier="math")


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_gsm8k_every_reference_solution_scores_correct_and_a_wrong_final_number_wrong():
    items = load_problems(DataConfig(**GSM8K_CFG))
    assert len(items) == 1319
    wrong_scored_right = []
    for where, p in items:
        assert math_reward(p.solution, p.answer) == 1.0, where
        head = p.solution.rsplit("####", 1)[0]
        wrong = f"{head}#### {Decimal(p.answer) + 1}"
        if math_reward(wrong, p.answer) != 0.0:
            wrong_scored_right.append(where)
    assert not wrong_scored_right
    first = items[0][1]
    assert first.prompt.startswith("Janet") and first.answer == "18"


def test_gsm8k_task_splits_and_grades_with_config_only():
    task = make_task(ArithmeticConfig(), DataConfig(**GSM8K_CFG, num_heldout=100))
    assert isinstance(task, DatasetTask)
    heldout = task.heldout()
    assert len(heldout) == 100
    train = {p.prompt for p in task.train_problems(500, seed=0)}
    assert not train & {p.prompt for p in heldout}
    p = heldout[0]
    assert task.reward(f"so the total is {p.answer}.", p) == 1.0
    assert task.reward("I do not know", p) == 0.0


def test_parquet_loads_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"q": "2+2?", "a": "4"}, {"q": "half of 3?", "a": "1.5"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "set.parquet")
    _write_jsonl(tmp_path / "set.jsonl", rows)
    got = {fmt: [p for _, p in load_problems(DataConfig(path=str(tmp_path / f"set.{fmt}"),
                                                        prompt_field="q", answer_field="a"))]
           for fmt in ("parquet", "jsonl")}
    assert got["parquet"] == got["jsonl"] == [Problem("2+2?", "4"), Problem("half of 3?", "1.5")]
    bad = DataConfig(path=str(tmp_path / "set.parquet"), prompt_field="question")
    with pytest.raises(ValueError, match=r"set\.parquet:row 0: missing key 'question'; keys present: \['a', 'q'\]"):
        load_problems(bad)


def test_multiple_choice_rows_become_lettered_prompts(tmp_path):
    rows = [{"question": "Sky colour?", "options": ["red", "blue", "green"], "label": 1},
            {"question": "2+2?", "options": ["3", "4"], "label": "B"},
            {"question": "Capital of France?", "options": ["Rome", "Paris"], "label": "Paris"}]
    cfg = DataConfig(path=str(_write_jsonl(tmp_path / "mc.jsonl", rows)), prompt_field="question",
                     answer_field="label", choices_field="options", verifier="choice", num_heldout=1)
    problems = [p for _, p in load_problems(cfg)]
    assert problems[0] == Problem("Sky colour?\nA. red\nB. blue\nC. green", "B")
    assert [p.answer for p in problems] == ["B", "B", "B"]
    task = DatasetTask(cfg)
    p = problems[0]
    assert task.reward("The answer is (B).", p) == 1.0
    assert task.reward("Answer: A", p) == 0.0
    assert task.reward("blue", p) == 0.0  # the option text is not a letter


@pytest.mark.parametrize("text,letter", [
    ("The answer is (B).", "B"), ("Answer: C", "C"), ("\\boxed{D}", "D"), ("(C)", "C"), ("B", "B"),
    ("answer is B. On reflection the answer is D", "D"), ("So the answer is B\nDone", "B"),
    ("I think A is wrong", None), ("Answer: I think", None), ("the answer is a guess", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter
    assert choice_reward(text, "b") == float(letter == "B")


@pytest.mark.parametrize("row,cfg,problem", [
    ({"prompt": "p"}, {}, "missing key 'answer'; keys present: ['prompt']"),
    ({"prompt": "  \n", "answer": "1"}, {}, "empty prompt in key 'prompt'"),
    ({"prompt": "p", "answer": " "}, {}, "empty answer in key 'answer'"),
    ({"prompt": "p", "answer": "no box"}, {"answer_rule": "boxed"}, "has no non-empty \\boxed{...}"),
    ({"prompt": "p", "answer": "x"}, {"answer_rule": "after_hashes"}, "has no '####'"),
    ({"prompt": "p", "answer": 0, "opts": ["a"]}, {"choices_field": "opts", "verifier": "choice"},
     "must be a list of 2 to 26 non-empty strings"),
    ({"prompt": "p", "answer": 5, "opts": ["a", "b"]}, {"choices_field": "opts", "verifier": "choice"},
     "is not a choice: give a 0-based index < 2, a letter in AB, or an option's text"),
])
def test_bad_rows_give_one_line_naming_file_line_and_problem(tmp_path, row, cfg, problem):
    good = {"prompt": "ok", "opts": ["a", "b"],
            "answer": 0 if cfg.get("choices_field") else "\\boxed{1} #### 1"}  # passes every rule
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(ValueError) as e:
        load_problems(DataConfig(path=str(path), **cfg))
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: ") and problem in msg and "\n" not in msg


@pytest.mark.parametrize("changes,problem", [
    ({"format": "csv"}, "data.format='csv' is invalid: allowed: auto, jsonl, parquet"),
    ({"answer_rule": "last"}, "data.answer_rule='last' is invalid: allowed: field, after_hashes, boxed"),
    ({"verifier": "regex"}, "data.verifier='regex' is invalid: allowed: math, choice, exact"),
    ({"prompt_template": "Q:"}, "data.prompt_template='Q:' is invalid: must contain {prompt}"),
    ({"choices_field": "opts"}, "multiple-choice sets need verifier='choice'"),
])
def test_bad_data_config_is_one_line(changes, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace("{", r"\{")):
        DataConfig(path="x.jsonl", **changes)


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the format from the extension '.txt'"):
        load_problems(DataConfig(path=str(tmp_path / "set.txt")))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_problems(DataConfig(path=str(tmp_path / "nope.jsonl")))


def test_prompts_longer_than_the_context_error_or_drop(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1+1+1+1+1+1+1=", "answer": "8"},
            {"prompt": "2+2=", "answer": "4"}]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    tok = CharTokenizer.arithmetic()
    with pytest.raises(ValueError, match=r"long\.jsonl:2: prompt is 17 tokens but only 10 fit"):
        DatasetTask(DataConfig(path=str(path), num_heldout=1), tok, max_prompt_tokens=10)
    task = DatasetTask(DataConfig(path=str(path), num_heldout=1, long_prompts="drop"), tok,
                       max_prompt_tokens=10)
    assert {p.prompt for p in task.heldout() + task._train} == {"1+1=", "2+2="}


def test_too_few_rows_for_the_heldout_split(tmp_path):
    path = _write_jsonl(tmp_path / "two.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(ValueError, match="data.num_heldout=2 is invalid: .* has 2 usable rows"):
        DatasetTask(DataConfig(path=str(path), num_heldout=2))


def test_system_prompt_template_and_chat_template(tmp_path):
    from hf_helpers import make_tokenizer

    from rlfusion.model.hf_tokenizer import HFTokenizer

    path = _write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(3)])
    plain = DatasetTask(DataConfig(path=str(path), num_heldout=1, system_prompt="Be brief.",
                                   prompt_template="Question: {prompt}\nAnswer:"))
    assert all(p.prompt.startswith("Be brief.\n\nQuestion: q") and p.prompt.endswith("\nAnswer:")
               for p in plain.heldout() + plain._train)
    make_tokenizer(tmp_path / "tok")
    tok = HFTokenizer.from_dir(tmp_path / "tok")
    chat = DatasetTask(DataConfig(path=str(path), num_heldout=1, system_prompt="Be brief.",
                                  chat_template=True), tok, max_prompt_tokens=200)
    p = chat.heldout()[0]
    assert p.prompt == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{p.prompt.split('user', 1)[1][1:]}")
    assert p.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(p.prompt)
    assert ids[0] == 1 and tok.decode(ids, skip_special=False) == p.prompt  # specials are single ids
    with pytest.raises(ValueError, match="data.chat_template=true needs an HF tokenizer"):
        DatasetTask(DataConfig(path=str(path), num_heldout=1, chat_template=True), CharTokenizer.printable())


def test_make_task_without_a_path_is_the_builtin_task():
    assert isinstance(make_task(ArithmeticConfig(num_heldout=10), DataConfig()), ArithmeticTask)
    task = make_task(ArithmeticConfig(), DataConfig(**GSM8K_CFG, limit=60, num_heldout=10))
    assert len(task.heldout()) == 10 and task.sample(random.Random(0)).answer
