"""Loading prompt sets from JSONL files into `Problem`s.

Owns the file format and its error messages: every bad line is reported as one
`path:line: what is wrong` ValueError. Knows nothing about tokenization or sampling order.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlfusion.rl.problem import Problem
from rlfusion.rl.verifiers import normalize_number


def load_jsonl_problems(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    answer_from_solution: bool = False,
    limit: int | None = None,
) -> list[Problem]:
    """One `Problem` per non-blank line of `path`, up to `limit`.

    With `answer_from_solution`, the answer field is a worked solution ending in `#### <answer>`
    (GSM8K style): the final answer becomes `answer` and the whole text `solution`.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} is invalid: must be >= 1 or None")
    problems: list[Problem] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(problems) == limit:
                break
            if line.strip():
                problems.append(_parse_line(line, f"{path}:{lineno}", prompt_key, answer_key,
                                            answer_from_solution))
    if not problems:
        raise ValueError(f"{path}: no problems found (the file is empty or all lines are blank)")
    return problems


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[Problem]:
    return load_jsonl_problems(path, prompt_key="question", answer_key="answer",
                               answer_from_solution=True, limit=limit)


def _parse_line(line: str, where: str, prompt_key: str, answer_key: str,
                answer_from_solution: bool) -> Problem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, prompt_key, where, allow_numbers=False)
    answer = _field(row, answer_key, where, allow_numbers=not answer_from_solution)
    if not prompt.strip():
        raise ValueError(f"{where}: empty prompt in key {prompt_key!r}")
    if not answer_from_solution:
        return Problem(prompt=prompt, answer=answer)
    if "####" not in answer:
        raise ValueError(f"{where}: answer_from_solution is set but key {answer_key!r} has no "
                         f"'####' marking the final answer")
    final = answer.rsplit("####", 1)[1].strip()
    if not final:
        raise ValueError(f"{where}: nothing after '####' in key {answer_key!r}")
    return Problem(prompt=prompt, answer=normalize_number(final), solution=answer)


def _field(row: dict, key: str, where: str, allow_numbers: bool) -> str:
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r}; keys present: {sorted(row)}")
    value = row[key]
    # bool is an int subclass, but `True` is never a meaningful answer.
    if allow_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: key {key!r} must be a string, got {type(value).__name__} "
                         f"{value!r:.60}")
    return value
