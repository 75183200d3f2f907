"""Prompt sets from local JSONL and Parquet files, with the field mapping in config.

Owns the file formats, `DataConfig` (which field is the prompt, where the reference answer comes
from) and their error messages: every bad row is reported as one `path:line: what is wrong`
ValueError (`path:row N` for Parquet). Knows nothing about tokenization, prompt rendering or
sampling order (`rl/tasks/dataset.py` does those).
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlfusion.config import check_fields
from rlfusion.rl.problem import Problem
from rlfusion.rl.verifiers import MATH_FALLBACKS, VERIFIERS, last_boxed, normalize_number

FORMATS = ("auto", "jsonl", "parquet")
ANSWER_RULES = ("field", "after_hashes", "boxed")
LONG_PROMPTS = ("error", "drop")


@dataclass(frozen=True)
class DataConfig:
    """A prompt set. `path` "" keeps the built-in arithmetic task.

    `answer_rule`: "field" (the answer field is the reference answer), "after_hashes" (the field
    is a worked solution ending in `#### <answer>`, GSM8K), "boxed" (a solution whose last
    `\\boxed{}` is the answer, MATH). With `choices_field` (a list of options) the prompt gets
    lettered option lines and the answer (an index, a letter or an option's text) becomes a
    letter. `prompt_template` wraps the prompt (`{prompt}` marks where); `system_prompt` and
    `chat_template` (the tokenizer's, HF tokenizers only) shape the text the model sees."""

    path: str = ""
    format: str = "auto"  # by extension: .jsonl/.json -> jsonl, .parquet -> parquet
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    answer_rule: str = "field"
    choices_field: str = ""
    verifier: str = "math"  # see rl/verifiers.py VERIFIERS
    # the math verifier, for a response with no answer statement (\\boxed{}, ####, "the answer
    # is"): "final_line" grades its last line, "last_number" the last number anywhere (lenient),
    # "none" gives it 0 (strict)
    math_fallback: str = "final_line"
    prompt_template: str = "{prompt}"
    system_prompt: str = ""
    chat_template: bool = False
    num_heldout: int = 50  # rows kept for evaluation (the last ones after a seeded shuffle)
    limit: int = 0  # read at most this many rows; 0 = all
    long_prompts: str = "error"  # a prompt longer than the context: "error" or "drop" the row
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields("data", {
            "format": (self.format in FORMATS, f"allowed: {', '.join(FORMATS)}"),
            "prompt_field": (bool(self.prompt_field), "must name a field"),
            "answer_field": (bool(self.answer_field), "must name a field"),
            "answer_rule": (self.answer_rule in ANSWER_RULES, f"allowed: {', '.join(ANSWER_RULES)}"),
            "verifier": (self.verifier in VERIFIERS, f"allowed: {', '.join(VERIFIERS)}"),
            "math_fallback": (self.math_fallback in MATH_FALLBACKS, f"allowed: {', '.join(MATH_FALLBACKS)}"),
            "prompt_template": ("{prompt}" in self.prompt_template, "must contain {prompt}"),
            "num_heldout": (self.num_heldout >= 1, "must be >= 1"),
            "limit": (self.limit >= 0, "must be >= 0 (0 = every row)"),
            "long_prompts": (self.long_prompts in LONG_PROMPTS, f"allowed: {', '.join(LONG_PROMPTS)}"),
        }, self)
        if self.choices_field and self.verifier != "choice":
            raise ValueError(f"data.verifier={self.verifier!r} is invalid with choices_field="
                             f"{self.choices_field!r}: multiple-choice sets need verifier='choice'")

    @property
    def file_format(self) -> str:
        if self.format != "auto":
            return self.format
        suffix = Path(self.path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            return "jsonl"
        if suffix == ".parquet":
            return "parquet"
        raise ValueError(f"data.path={self.path!r}: cannot tell the format from the extension "
                         f"{suffix!r}; set data.format to one of jsonl, parquet")


def load_problems(cfg: DataConfig) -> list[tuple[str, Problem]]:
    """`(where, problem)` for every row of `cfg.path` (up to `cfg.limit`); `where` is the
    `path:line` / `path:row N` that error messages name."""
    if not cfg.path:
        raise ValueError("data.path is empty; name a .jsonl or .parquet prompt set")
    out = []
    for where, row in _rows(Path(cfg.path), cfg.file_format):
        if cfg.limit and len(out) == cfg.limit:
            break
        out.append((where, problem_from_row(row, where, cfg)))
    if not out:
        raise ValueError(f"{cfg.path}: no problems found (the file is empty or all lines are blank)")
    return out


def _rows(path: Path, fmt: str) -> Iterator[tuple[str, object]]:
    if path.is_dir():
        raise ValueError(f"data.path={str(path)!r} is a directory; allowed: a .jsonl or .parquet "
                         f"file (name the file inside it)")
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist")
    if fmt == "parquet":
        yield from _parquet_rows(path)
        return
    # Bytes, decoded line by line, so that a byte that is not UTF-8 is reported with its line.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode_line(raw, where, first=lineno == 1)
            if line.strip():
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise ValueError(f"{where}: JSON nested too deeply to read") from None


def _decode_line(raw: bytes, where: str, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")  # "-sig": an editor's leading BOM
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                         f"{e.start + 1}); allowed: JSON Lines saved as UTF-8") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow as pa  # ships with the `datasets` package (the `hf` extra)
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"data.path={str(path)!r} is Parquet, which needs pyarrow: "
                         f"pip install -e '.[hf]'") from None
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # keep the first line: some span several
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"data.path={str(path)!r} is not a readable Parquet file ({first}); "
                         f"allowed: a .parquet file, or set data.format=jsonl") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def problem_from_row(row: object, where: str, cfg: DataConfig) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, cfg.prompt_field, where, allow_numbers=False)
    if not prompt.strip():
        raise ValueError(f"{where}: empty prompt in key {cfg.prompt_field!r}")
    if cfg.choices_field:
        return _choice_problem(row, where, cfg, prompt)
    answer = _field(row, cfg.answer_field, where, allow_numbers=cfg.answer_rule == "field")
    if cfg.answer_rule == "field":
        if not answer.strip():
            raise ValueError(f"{where}: empty answer in key {cfg.answer_field!r}")
        return Problem(prompt=prompt, answer=answer.strip())
    if cfg.answer_rule == "after_hashes":
        if "####" not in answer:
            raise ValueError(f"{where}: answer_rule='after_hashes' but key {cfg.answer_field!r} "
                             f"has no '####' marking the final answer")
        final = answer.rsplit("####", 1)[1].strip()
        if not final:
            raise ValueError(f"{where}: nothing after '####' in key {cfg.answer_field!r}")
        return Problem(prompt=prompt, answer=normalize_number(final), solution=answer)
    final = last_boxed(answer)
    if not final:
        raise ValueError(f"{where}: answer_rule='boxed' but key {cfg.answer_field!r} has no "
                         f"non-empty \\boxed{{...}}")
    return Problem(prompt=prompt, answer=final, solution=answer)


def _choice_problem(row: dict, where: str, cfg: DataConfig, prompt: str) -> Problem:
    key = cfg.choices_field
    if key not in row:
        raise ValueError(f"{where}: missing key {key!r}; keys present: {sorted(row)}")
    choices = row[key]
    if (not isinstance(choices, list) or not 2 <= len(choices) <= 26
            or not all(isinstance(c, str) and c.strip() for c in choices)):
        raise ValueError(f"{where}: key {key!r} must be a list of 2 to 26 non-empty strings, got "
                         f"{choices!r:.60}")
    letters = string.ascii_uppercase[:len(choices)]
    if cfg.answer_field not in row:
        raise ValueError(f"{where}: missing key {cfg.answer_field!r}; keys present: {sorted(row)}")
    raw = row[cfg.answer_field]
    if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < len(choices):
        letter = letters[raw]
    elif isinstance(raw, str) and raw.strip().upper() in letters and len(raw.strip()) == 1:
        letter = raw.strip().upper()
    elif isinstance(raw, str) and raw in choices:
        letter = letters[choices.index(raw)]
    else:
        raise ValueError(f"{where}: key {cfg.answer_field!r}={raw!r:.40} is not a choice: give a "
                         f"0-based index < {len(choices)}, a letter in {letters}, or an option's text")
    lines = "\n".join(f"{ch}. {c}" for ch, c in zip(letters, choices))
    return Problem(prompt=f"{prompt}\n{lines}", answer=letter)


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


# ---- the original helpers, kept as thin wrappers over DataConfig ----

def load_jsonl_problems(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                        answer_from_solution: bool = False, limit: int | None = None) -> list[Problem]:
    """One `Problem` per non-blank line of `path`, up to `limit`. With `answer_from_solution`,
    the answer field is a worked solution ending in `#### <answer>` (GSM8K style)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} is invalid: must be >= 1 or None")
    cfg = DataConfig(path=str(path), format="jsonl", prompt_field=prompt_key, answer_field=answer_key,
                     answer_rule="after_hashes" if answer_from_solution else "field", limit=limit or 0)
    return [p for _, p in load_problems(cfg)]


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[Problem]:
    return load_jsonl_problems(path, prompt_key="question", answer_key="answer",
                               answer_from_solution=True, limit=limit)
