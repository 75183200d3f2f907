"""Final-answer verification: math prompt sets (GSM8K, MATH-style `\\boxed{}` answers),
multiple choice (a letter) and exact match.

Owns answer extraction, number normalization and the 0/1 rewards; `VERIFIERS` names them for
`data.verifier`. Grades only the final answer, never the reasoning, and knows nothing about
tokenizers or where problems come from.
"""

from __future__ import annotations

import re
from decimal import Decimal

# Thousands-grouped numbers first so `1,234` is one number, not `1` and `234`. The lookbehind
# keeps `3-5` from reading as `-5` and `1.5` from yielding a bare `5`.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_NUMERIC = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_BOXED = "\\boxed{"
# "the answer is (B)", "Answer: B", "answer is B." -- a capital letter closed by a bracket,
# punctuation or the end of a line, so "Answer: I think" and "answer is a guess" do not count.
_CHOICE_PHRASE = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*[(\[]?([A-Z])(?=[)\].,:;]|\s*$)",
                            re.MULTILINE)
_BARE_CHOICE = re.compile(r"\(?([A-Z])[).:]?")


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}`, else the text after the last `####`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        if after:
            return after
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_number(s: str) -> str:
    """`$1,234.50` -> `1234.5`, `18.00` -> `18`; strings that are not numbers come back stripped."""
    cleaned = s.strip().replace("\\$", "").replace("$", "").replace(",", "").strip().rstrip(".")
    if not _NUMERIC.fullmatch(cleaned):
        return s.strip()
    if "." in cleaned:
        cleaned = cleaned.rstrip("0").rstrip(".")
    return cleaned if cleaned not in ("", "-") else "0"  # `.0` and `-.0` strip to nothing


def math_reward(response: str, answer: str) -> float:
    """1.0 iff the response's final answer equals `answer` (numerically when both are numbers)."""
    extracted = extract_answer(response)
    if extracted is None:
        return 0.0
    got, want = normalize_number(extracted), normalize_number(answer)
    if _NUMERIC.fullmatch(got) and _NUMERIC.fullmatch(want):
        return 1.0 if Decimal(got) == Decimal(want) else 0.0
    return 1.0 if got == want else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), None if there is none."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced braces: no usable boxed answer


def extract_choice(text: str) -> str | None:
    """The chosen letter: the last `\\boxed{B}`, else the last "answer is B" / "Answer: (B)",
    else a response that is only a letter ("B", "(B)", "B."). A letter elsewhere in the text
    ("I think A is wrong") is not taken as the choice."""
    boxed = last_boxed(text)
    if boxed is not None:
        m = _BARE_CHOICE.fullmatch(boxed.strip())
        return m.group(1) if m else None
    phrases = _CHOICE_PHRASE.findall(text)
    if phrases:
        return phrases[-1]
    m = _BARE_CHOICE.fullmatch(text.strip())
    return m.group(1) if m else None


def choice_reward(response: str, answer: str) -> float:
    """1.0 iff the response's chosen letter is `answer` (case-insensitive)."""
    return 1.0 if extract_choice(response) == answer.strip().upper() else 0.0


def exact_reward(response: str, answer: str) -> float:
    """1.0 iff the whole response, stripped, equals `answer` stripped."""
    return 1.0 if response.strip() == answer.strip() else 0.0


VERIFIERS = {"math": math_reward, "choice": choice_reward, "exact": exact_reward}
