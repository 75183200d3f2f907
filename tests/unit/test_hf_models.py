"""HF checkpoints of six families load into the native model with the same logits, and native
models export back to folders transformers loads with the same logits (model/hf.py)."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import make_hf_model  # noqa: E402
from rlfusion.model.checkpoint import load_base  # noqa: E402
from rlfusion.model.hf import FAMILIES, config_from_hf, load_hf, save_hf  # noqa: E402
from rlfusion.model.hf_tokenizer import HFTokenizer  # noqa: E402

ATOL = 1e-4  # float32; the largest difference observed is recorded in docs/models_data.md


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_logits_match_native_both_ways(family, tmp_path):
    import transformers

    hf = make_hf_model(family, tmp_path / "hf")
    model, tok, meta = load_hf(tmp_path / "hf")
    assert meta["family"] == family and isinstance(tok, HFTokenizer)
    tokens_BT = _tokens(model.config.vocab_size)
    with torch.no_grad():
        theirs, ours = hf(input_ids=tokens_BT).logits, model(tokens_BT)
    assert theirs.abs().max() > 1.0  # not a trivially small comparison
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)

    save_hf(model, tmp_path / "out", tok)  # family inferred from the native config
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=tokens_BT).logits, theirs, atol=ATOL, rtol=0)
    again, _, _ = load_hf(tmp_path / "out")
    for name, t in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], t, atol=0, rtol=0, msg=name)


def test_native_cache_decoding_matches_full_forward_for_hf_features(tmp_path):
    """Biases, q/k norms, the shared-expert gate and group routing also hold in the KV-cache path
    the rollout engine uses."""
    from rlfusion.engine.engine import EngineConfig, LLMEngine
    from rlfusion.engine.types import Request, SamplingParams

    for family in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):
        make_hf_model(family, tmp_path / family)
        model, tok, _ = load_hf(tmp_path / family)
        prompt = [tok.bos_id] + tok.encode("12 apples and 7 pears")
        engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_seq_len=64))
        out = engine.generate([Request("0", prompt, SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                   stop_ids=()))])[0]
        ids = prompt + list(out.output_ids)
        with torch.no_grad():
            greedy = model(torch.tensor([ids]))[0, len(prompt) - 1:-1].argmax(-1).tolist()
        assert greedy == list(out.output_ids), family


def test_load_base_dispatches_native_and_hf(tmp_path):
    from rlfusion.model.checkpoint import load_checkpoint, save_checkpoint

    make_hf_model("qwen3_moe", tmp_path / "hf")
    model, tok, _ = load_base(tmp_path / "hf")
    save_checkpoint(tmp_path / "native", model, tok)
    again, tok2, _ = load_base(tmp_path / "native")
    assert isinstance(tok2, HFTokenizer) and tok2.encode("a b") == tok.encode("a b")
    assert load_checkpoint(tmp_path / "native")[0].config == model.config
    tokens_BT = _tokens(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens_BT), model(tokens_BT), atol=0, rtol=0)


def _config(family: str) -> dict:
    from hf_helpers import hf_config

    return hf_config(family).to_dict()


@pytest.mark.parametrize("family,change,field", [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters.rope_type='llama3'"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0}},
     "rope_parameters.rope_type='yarn'"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 40}, "shared_expert_intermediate_size=40"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config='fp8'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("mixtral", {}, "model_type='mixtral'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_fields_are_refused_by_name(family, change, field):
    hf = _config("llama" if family == "mixtral" else family) | change
    if family == "mixtral":
        hf["model_type"] = "mixtral"
    with pytest.raises(ValueError) as e:
        config_from_hf(hf, "x/config.json")
    msg = str(e.value)
    assert msg.startswith(f"x/config.json: {field} is not supported") and "\n" not in msg


def test_missing_and_extra_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_hf_model("qwen2", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no native counterpart, e.g. 'model.layers.0.self_attn.o_proj.bias'"):
        load_hf(tmp_path)
    del tensors["model.layers.0.self_attn.o_proj.bias"], tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.k_proj.bias' is missing"):
        load_hf(tmp_path)


def test_export_refuses_what_the_family_cannot_hold():
    from rlfusion.model.config import get_preset
    from rlfusion.model.transformer import MoETransformer

    model = MoETransformer(get_preset("tiny"))
    with pytest.raises(ValueError, match="model.attention='gqa' cannot be exported as deepseek_v3"):
        save_hf(model, "/nonexistent", family="deepseek_v3")
    with pytest.raises(ValueError, match="model.qk_norm=False cannot be exported as qwen3_moe"):
        save_hf(model, "/nonexistent", family="qwen3_moe")
    model.routers()[0].expert_bias[0] = 0.3
    with pytest.raises(ValueError, match="expert_bias is non-zero"):
        save_hf(model, "/nonexistent", family="qwen2_moe")


def test_native_tiny_preset_exports_as_qwen2_moe(tmp_path):
    import transformers

    from rlfusion.model.config import get_preset
    from rlfusion.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(get_preset("tiny").replace(routed_scaling_factor=2.0)).eval()
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens_BT = _tokens(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens_BT).logits, model(tokens_BT), atol=ATOL, rtol=0)
