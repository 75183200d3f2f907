import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlfusion.model.tokenizer import ARITHMETIC_ALPHABET, CharTokenizer, Tokenizer
from rlfusion.rl.tasks import ArithmeticConfig, ArithmeticTask


def test_arithmetic_vocab_fits_tiny_model():
    tok = CharTokenizer.arithmetic()
    assert tok.vocab_size == 17
    assert tok.vocab_size <= 32
    assert isinstance(tok, Tokenizer)


def test_special_ids_and_first_char_id():
    tok = CharTokenizer.arithmetic()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("0") == [3]
    assert tok.encode("#") == [3 + ARITHMETIC_ALPHABET.index("#")]


@given(st.text(alphabet=ARITHMETIC_ALPHABET, max_size=200))
def test_round_trip_over_alphabet(text):
    tok = CharTokenizer.arithmetic()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_on_task_texts():
    tok = CharTokenizer.arithmetic()
    for p in ArithmeticTask(ArithmeticConfig(num_heldout=20)).heldout():
        text = p.prompt + p.solution
        assert tok.decode(tok.encode(text)) == text


def test_decode_skips_specials_by_default():
    tok = CharTokenizer.arithmetic()
    ids = [tok.bos_id, *tok.encode("1+2=3"), tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "1+2=3"
    assert tok.decode(ids, skip_special=False) == "<bos>1+2=3<eos><pad><pad>"


def test_decode_rejects_out_of_range_id():
    tok = CharTokenizer.arithmetic()
    with pytest.raises(ValueError, match=r"token id 17 out of range.*\[0, 17\)"):
        tok.decode([3, 17])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])


def test_unknown_character_error_names_char_index_and_alphabet():
    tok = CharTokenizer.arithmetic()
    with pytest.raises(ValueError) as e:
        tok.encode("12+x=")
    msg = str(e.value)
    assert "'x'" in msg and "index 3" in msg and repr(ARITHMETIC_ALPHABET) in msg


@pytest.mark.parametrize("alphabet", ["", "abca"])
def test_bad_alphabet_rejected(alphabet):
    with pytest.raises(ValueError, match="empty|duplicate character 'a'"):
        CharTokenizer(alphabet)


def test_to_dict_from_dict_round_trip_through_json():
    tok = CharTokenizer.printable()
    restored = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert restored.vocab_size == tok.vocab_size
    text = "Janet's ducks lay 16 eggs.\n\tTotal: $18"
    assert restored.encode(text) == tok.encode(text)
    assert restored.decode(restored.encode(text)) == text


def test_from_dict_rejects_other_kinds():
    with pytest.raises(ValueError, match="kind='hf'"):
        CharTokenizer.from_dict({"kind": "hf", "alphabet": "abc"})


def test_printable_excludes_vertical_tab_and_form_feed():
    tok = CharTokenizer.printable()
    assert tok.vocab_size == 3 + 98
    for ch in "\x0b\x0c":
        with pytest.raises(ValueError):
            tok.encode(ch)
