"""The HF export (`rlfusion.model.hf_export`) computes the same function as our model."""

import pytest
import torch

pytest.importorskip("transformers")

from rlfusion.evaluate import encode_prompt  # noqa: E402
from rlfusion.model.config import get_preset  # noqa: E402
from rlfusion.model.hf_export import hf_tokenizer, save_hf, to_hf  # noqa: E402
from rlfusion.model.tokenizer import CharTokenizer  # noqa: E402
from rlfusion.model.transformer import MoETransformer  # noqa: E402


def _random_tiny(seed: int = 0, **changes) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(get_preset("tiny").replace(**changes)).eval()
    with torch.no_grad():  # larger weights than the init: decisive routing, far-from-uniform logits
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(5.0)
    return model


@pytest.mark.parametrize("changes", [{}, {"routed_scaling_factor": 2.5, "norm_topk_prob": False}])
def test_hf_logits_match_ours(changes):
    model = _random_tiny(**changes)
    assert all(float(r.expert_bias.abs().max()) == 0.0 for r in model.routers())
    hf = to_hf(model)
    rng = torch.Generator().manual_seed(1)
    tokens_BT = torch.randint(0, model.config.vocab_size, (3, 48), generator=rng)
    with torch.no_grad():
        ours, theirs = model(tokens_BT), hf(input_ids=tokens_BT).logits
    assert ours.abs().max() > 1.0  # not a trivially small comparison
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


def test_save_hf_loads_with_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _random_tiny(), CharTokenizer.arithmetic()
    save_hf(model, tok, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = hf_tok("17+5+23=")["input_ids"]
    assert ids == encode_prompt(tok, "17+5+23=")
    with_specials = [1, 4, 10, 13, 2]
    assert hf_tok.decode(with_specials, skip_special_tokens=True) == tok.decode(with_specials)
    assert hf.generation_config.eos_token_id == tok.eos_id
    with torch.no_grad():
        tokens_BT = torch.tensor([ids])
        theirs = hf(input_ids=tokens_BT).logits
        torch.testing.assert_close(theirs, model(tokens_BT), atol=1e-4, rtol=0)


def test_nonzero_expert_bias_is_refused_unless_dropped():
    model = _random_tiny()
    model.routers()[0].expert_bias[3] = 0.5
    with pytest.raises(ValueError, match="expert_bias"):
        to_hf(model)
    to_hf(model, ignore_expert_bias=True)  # allowed, but routes as if the bias were zero


def test_hf_tokenizer_matches_char_tokenizer():
    tok = CharTokenizer.arithmetic()
    hf_tok = hf_tokenizer(tok)
    text = "12+34=12+34=46;#46"
    assert hf_tok(text)["input_ids"] == encode_prompt(tok, text)
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)


def test_mla_is_not_exportable():
    with pytest.raises(ValueError, match="model.attention"):
        to_hf(MoETransformer(get_preset("tiny-mla")))
