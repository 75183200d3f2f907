"""Tiny random Hugging Face checkpoints for the HF-interop and end-to-end tests (no downloads).

`make_tokenizer` writes a byte-level BPE `tokenizer.json` (3 ChatML specials + 256 bytes, no
merges) with a ChatML chat template; `make_hf_model` builds a tiny random model of one family
with `transformers`, with weights scaled up so routing is decisive and logits far from uniform.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 320  # model vocab: 259 tokenizer ids, padded like real checkpoints


def make_tokenizer(path: Path, chat_template: str | None = CHATML) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None}
    if chat_template:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_config(family: str, **changes):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    gqa = dict(num_key_value_heads=2, head_dim=16)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, **gqa),
        "qwen2": lambda: transformers.Qwen2Config(**common, **gqa),
        "qwen3": lambda: transformers.Qwen3Config(**common, **gqa),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, **gqa, **moe, shared_expert_intermediate_size=64, mlp_only_layers=[0],
            norm_topk_prob=False),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **gqa, **moe, mlp_only_layers=[0], norm_topk_prob=True),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **common, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=0),
    }
    cfg = configs[family]()
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def make_hf_model(family: str, path: Path | None = None, seed: int = 0, tokenizer: bool = True,
                  **changes):
    """A random tiny `family` model (eval mode, float32); saved to `path` when given."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **changes))
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:  # norms around 1, biases around 0: every mapped tensor matters
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    if path is not None:
        model.save_pretrained(path)
        if tokenizer:
            make_tokenizer(path)
    return model


FAKE_VLLM_DIR = Path(__file__).parent / "fake_vllm"  # holds the package `vllm`: the fake


def fake_vllm():
    """The fake `vllm` module (`tests/fake_vllm/vllm`), loaded from its file under its own name
    `fake_vllm.vllm`: it never takes the place of a real vLLM unless a test puts it there."""
    import importlib.util
    import sys

    name = "fake_vllm.vllm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FAKE_VLLM_DIR / "vllm" / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
