"""Final-answer verification: math prompt sets (GSM8K, MATH-style `\\boxed{}` answers),
multiple choice (a letter) and exact match.

Owns answer extraction, number normalization and the 0/1 rewards; `VERIFIERS` names them for
`data.verifier`. Grades only the final answer, never the reasoning, and knows nothing about
tokenizers or where problems come from.
"""

from __future__ import annotations

import logging
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


MATH_FALLBACKS = ("final_line", "last_number", "none")
# A line that starts a new question: what a response says after it is not its answer.
_NEW_QUESTION = re.compile(r"^[ \t]*(?:Q|Question|Problem|Exercise)[ \t]*\d*[ \t]*[:.)]", re.IGNORECASE | re.MULTILINE)
# Answer statements besides \boxed{}: "#### X", "the (final) answer is X", "Answer: X".
_STATEMENT = re.compile(r"####|\b(?:the\s+)?(?:final\s+)?answer\s+is\b\s*:?|^[ \t]*(?:final\s+)?answer\s*[:=]",
                        re.IGNORECASE | re.MULTILINE)
# A value in an answer: a thousands-grouped or plain number, a fraction a/b or \frac{a}{b}.
_VALUE = re.compile(r"\\frac\{\s*-?\d+\s*\}\{\s*-?\d+\s*\}|(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
                    r"(?:\s*/\s*\d+(?:\.\d+)?)?")
# What may stand between two values of one hedged answer ("26 or 18", "18, 26", "12 and 13").
_ALTERNATIVE = re.compile(r"^\s*(?:\$|\\\$)?\s*(?:,|;|&|\bor\b|\band\b|\bto\b|-|–)?\s*(?:\bor\b|\beither\b)?\s*(?:\$|\\\$)?\s*$",
                          re.IGNORECASE)
_CLAUSE_END = re.compile(r"\s+(?:and|because|since|so|which|as|but|with)\b|;|,(?!\d{3})", re.IGNORECASE)
_UNIT_POWER = re.compile(r"\^\s*\{?\s*-?\d+\s*\}?|[²³]")  # m^2, cm³: part of a unit, not a value
# a number with what may follow it in an answer: a percent, unit words ("18 dollars", "18 m^2")
_NUMBER_WITH_UNIT = re.compile(r"(?:\\?\$\s*)?(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+)"
                               r"\s*(?:\\?%|(?:[A-Za-z]+\.?(?:\s*(?:\^\s*\{?\d+\}?|[²³]))?\s*)*)")
_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{\s*([^{}]*?)\s*\}")
# The answer label of the "Q: ... A: ..." style, at the start of a line. It also opens worked
# solutions ("A: Natalia sold 48/2 = 24 clips..."), so it states the answer only when a value
# follows it (`_states_a_value`); a final line keeps it out of what is compared (`extract_answer`).
_ANSWER_LABEL = re.compile(r"^[ \t]*A[ \t]*:", re.MULTILINE)
# A value as a whole answer: a currency sign, the value, then a percent or a few unit words.
_VALUE_ANSWER = re.compile(r"(?:\\?\$\s*)?(?:" + _VALUE.pattern + r")\s*"
                           r"(?:\\?%|(?:[A-Za-z]+\.?(?:\s*(?:\^\s*\{?\d+\}?|[²³]))?\s*){0,3})")
_MAX_DIGITS = 100  # a "number" longer than this is not an answer (and would only slow the parser)


def answer_statements(text: str) -> list[str]:
    """The final-answer statements of a response, in order: each `\\boxed{...}`, each `####`
    line, each "the answer is ..." / "Answer: ..." up to the end of its sentence. Text from a
    line that starts a new question ("Q: ...") on is not the response's answer and is ignored."""
    text = _before_new_question(text)
    found: list[tuple[int, str]] = []
    start = 0
    while (at := text.find(_BOXED, start)) >= 0:
        inner = _boxed_at(text, at)
        if inner is not None:
            found.append((at, inner))
        start = at + len(_BOXED)
    for m in _STATEMENT.finditer(text):
        rest = _statement_at(text, m.end(), sentence=m.group(0) != "####")
        if _BOXED not in rest and rest:
            found.append((m.start(), rest))
    for m in _ANSWER_LABEL.finditer(text):
        rest = _statement_at(text, m.end(), sentence=True)
        if _BOXED not in rest and _STATEMENT.search(rest) is None and _states_a_value(rest):
            found.append((m.start(), rest))
    return [segment for _, segment in sorted(found)]


def _statement_at(text: str, start: int, sentence: bool) -> str:
    """What a marker ending at `start` states: the rest of its line, or of its sentence (up to
    a full stop that ends no number)."""
    rest = text[start:].split("\n", 1)[0]
    if sentence:
        rest = re.split(r"(?<=[^\d\s])\.(?:\s|$)|\.\s|\.$", rest, maxsplit=1)[0]
    return rest.strip()


def _states_a_value(segment: str) -> bool:
    """Whether an answer-label segment is a value ("18", "$1,234", "1/2 cup", "18%"), or values
    given as alternatives (which `math_reward` then scores as hedged), rather than reasoning."""
    if _hedged(segment):
        return True
    inner = _TEXT_COMMAND.sub(r" \1 ", _clause(segment)).strip()
    if len(inner) > 1 and inner[0] == inner[-1] == "$":  # inline math: $\frac{1}{2}$
        inner = inner[1:-1].strip()
    return _VALUE_ANSWER.fullmatch(inner) is not None


def _before_new_question(text: str) -> str:
    """The response up to a line that starts a new question (not counting its first line)."""
    m = _NEW_QUESTION.search(text, 1)
    return text[:m.start()] if m else text


def extract_answer(text: str, fallback: str = "final_line") -> str | None:
    """The response's final answer: its last answer statement (`answer_statements`), else by
    `fallback`: "final_line" its last non-empty line (before any new question), "last_number"
    the last number anywhere, "none" nothing."""
    statements = answer_statements(text)
    if statements:
        return statements[-1]
    kept = _before_new_question(text)
    if fallback == "final_line":
        lines = [line.strip() for line in kept.splitlines() if line.strip()]
        # "A: x = 18": the label is not part of the answer (math would read "A: 18" as A/18)
        return (_ANSWER_LABEL.sub("", lines[-1], count=1).strip() or None) if lines else None
    if fallback == "last_number":
        numbers = _NUMBER.findall(kept)
        return numbers[-1] if numbers else None
    return None


def normalize_number(s: str) -> str:
    """`$1,234.50` -> `1234.5`, `18.00` -> `18`; strings that are not numbers come back stripped."""
    cleaned = s.strip().replace("\\$", "").replace("$", "").replace(",", "").strip().rstrip(".")
    if not _NUMERIC.fullmatch(cleaned):
        return s.strip()
    if "." in cleaned:
        cleaned = cleaned.rstrip("0").rstrip(".")
    return cleaned if cleaned not in ("", "-") else "0"  # `.0` and `-.0` strip to nothing


def math_reward(response: str, answer: str, fallback: str = "final_line") -> float:
    """1.0 iff the response's final answer has the reference's value, else 0.0.

    The final answer is the last answer statement (`\\boxed{}`, `####`, "the answer is"), else
    what `fallback` says (`extract_answer`); text after a line that starts a new question is
    not read. A response whose statements give different values, or whose final answer names
    two different values ("26 or 18", "18, 26"), earns 0. Values compare as math: plain
    numbers exactly (`1,234` = `1234.00`), anything else with `math-verify` (fractions,
    `\\frac`, LaTeX, units and words around the number); a percent also matches its number
    (`18\\%` for a reference of 18)."""
    statements = answer_statements(response)
    final = statements[-1] if statements else extract_answer(response, fallback)
    if final is None or any(_hedged(s) for s in statements or [final]):
        return 0.0
    values = [_clause(s) for s in statements]
    if len(set(map(normalize_number, values))) > 1 and not all(_same(v, values[-1]) for v in values):
        return 0.0  # two statements, two different answers
    return 1.0 if _same(_clause(final), answer) else 0.0


def _clause(segment: str) -> str:
    """An answer up to where its sentence goes on ("12 and the remainder is 3" -> "12")."""
    return _CLAUSE_END.split(segment, maxsplit=1)[0]


def _hedged(segment: str) -> bool:
    """Two different values side by side as alternatives or a list."""
    cleaned = _UNIT_POWER.sub("", _TEXT_COMMAND.sub(r" \1 ", segment))  # "18 \text{ or } 26" too
    values = list(_VALUE.finditer(cleaned))
    for a, b in zip(values, values[1:]):
        if _ALTERNATIVE.match(cleaned[a.end():b.start()]) and _number(a.group(0)) != _number(b.group(0)):
            return True
    return False


def _number(token: str) -> Decimal | None:
    """The value of one `_VALUE` token, None when it is not a finite decimal."""
    token = token.replace(",", "").replace(" ", "")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", token)
    num, _, den = (m.group(1), "/", m.group(2)) if m else token.partition("/")
    try:
        value = Decimal(num)
        return value / Decimal(den) if den else value
    except (ArithmeticError, ValueError):
        return None


def _same(got: str, want: str) -> bool:
    """Whether answer text `got` has the value of answer text `want`."""
    if any(len(run) > _MAX_DIGITS for run in re.findall(r"\d+", got + " " + want)):
        return False  # not an answer a problem has (and slow to parse)
    got = got.strip().removesuffix(".")  # the sentence's full stop ("#### 1/2."), not the value's
    a, b = normalize_number(got), normalize_number(want)
    if _NUMERIC.fullmatch(b):  # a numeric reference, the common case: exact and fast
        m = _NUMBER_WITH_UNIT.fullmatch(_TEXT_COMMAND.sub(r" \1 ", got).strip())
        if m:  # a number, perhaps with a currency sign, a percent or unit words after it
            value = Decimal(normalize_number(m.group(1)))
            percent = "%" in m.group(0)  # 18% answers a reference of 18 or of 0.18
            return value == Decimal(b) or (percent and value / 100 == Decimal(b))
    elif a == b:
        return True
    gold, pred = _parse(want), _parse(got)
    return bool(gold and pred and _verify(gold, pred))


def _parse(text: str):
    """math-verify's reading of an answer: as LaTeX math when it is written as math (a LaTeX
    command, or numbers and one-letter symbols), else as text (it takes the value out of words
    around it)."""
    from math_verify import parse  # imported on first use: sympy takes a second to import

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are off on purpose: no signals in threads
    text = _TEXT_COMMAND.sub(r" \1 ", text).strip()
    as_math = "\\" in text or not re.search(r"[A-Za-z]{2}", text)
    return parse(f"${text}$" if as_math else text, parsing_timeout=None)


def _verify(gold, pred) -> bool:
    from math_verify import verify

    return verify(gold, pred, timeout_seconds=None)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), None if there is none."""
    start = text.rfind(_BOXED)
    return None if start < 0 else _boxed_at(text, start)


def _boxed_at(text: str, start: int) -> str | None:
    """The content of the `\\boxed{...}` at `start`; None when its braces do not close."""
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


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
