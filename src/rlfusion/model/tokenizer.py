"""Tokenizers: the `Tokenizer` contract and the character-level tokenizer of the tiny path.

Owns text <-> id conversion and the special ids (pad, bos, eos). Knows nothing about models,
batching or where the tokenizer is saved; `to_dict`/`from_dict` give checkpoints a JSON form.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

# Digits, the two operators, the step separator and the answer marker of the arithmetic task.
ARITHMETIC_ALPHABET = "0123456789+=;#"
# ... and the brackets of a calculator call (`rl/tools/calculator.py`), after them: the same ids
CALCULATOR_ALPHABET = ARITHMETIC_ALPHABET + "[]"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and trainer need from a tokenizer (an HF wrapper satisfies it too)."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class CharTokenizer:
    """One id per character of `alphabet`, after the three special ids.

    Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, then `alphabet[i]` = 3 + i. `encode` adds no specials;
    the caller decides where bos/eos go.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str) -> None:
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty; give at least one character")
        seen: set[str] = set()
        for ch in alphabet:
            if ch in seen:
                raise ValueError(f"CharTokenizer alphabet has duplicate character {ch!r}: "
                                 f"{alphabet!r}")
            seen.add(ch)
        self.alphabet = alphabet
        self.vocab_size = len(SPECIAL_TOKENS) + len(alphabet)
        self._id_of = {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)}

    @classmethod
    def arithmetic(cls) -> CharTokenizer:
        return cls(ARITHMETIC_ALPHABET)

    @classmethod
    def arithmetic_calculator(cls) -> CharTokenizer:
        return cls(CALCULATOR_ALPHABET)

    @classmethod
    def printable(cls) -> CharTokenizer:
        # Vertical tab and form feed never appear in prompt sets; dropping them keeps ids stable.
        return cls("".join(ch for ch in string.printable if ch not in "\x0b\x0c"))

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, ch in enumerate(text):
            if ch not in self._id_of:
                raise ValueError(f"unknown character {ch!r} at index {i} of text; "
                                 f"allowed alphabet: {self.alphabet!r}")
            ids.append(self._id_of[ch])
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        num_special = len(SPECIAL_TOKENS)
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range; allowed: [0, {self.vocab_size})")
            if i >= num_special:
                out.append(self.alphabet[i - num_special])
            elif not skip_special:
                out.append(SPECIAL_TOKENS[i])
        return "".join(out)

    def to_dict(self) -> dict[str, str]:
        return {"kind": "char", "alphabet": self.alphabet}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        if d.get("kind") != "char":
            raise ValueError(f"tokenizer kind={d.get('kind')!r} is not a CharTokenizer; "
                             f"expected 'char'")
        if not isinstance(d.get("alphabet"), str):
            raise ValueError(f"tokenizer dict needs a string 'alphabet'; got keys {sorted(d)}")
        return cls(d["alphabet"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self.alphabet!r})"
