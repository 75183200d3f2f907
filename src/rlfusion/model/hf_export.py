"""Export the MoE decoder to Hugging Face transformers as an equivalent `Qwen2MoeForCausalLM`.

Owns the weight mapping and the HF tokenizer that mirrors `CharTokenizer`, so the same model can
run through HF tools (generation, TRL's trainers) for comparisons. `transformers` is optional
(the `bench` extra) and imported only inside the functions. Knows nothing about training.

How our blocks map onto Qwen2-MoE (checked against transformers 5.24's `modeling_qwen2_moe.py`):

    ours                                  Qwen2-MoE
    dense layers [0, num_dense_layers)    mlp_only_layers=[0..]; intermediate_size=dense_ffn_dim
    GQA wq/wk/wv/wo, no biases            q/k/v/o_proj with qkv_bias=False
    RoPE half-split (cat(x1, x2))         rotate_half: the same convention
    router softmax -> top-k -> renorm     softmax -> topk -> /sum when norm_topk_prob=True
    x @ w_gate_EDF[e], x @ w_up_EDF[e]    gate_up_proj[e] = [w_gate[e].T; w_up[e].T]   [E, 2F, D]
    x @ w_down_EFD[e] * routed_scaling    down_proj[e] = w_down[e].T * routed_scaling  [E, D, F]
    shared SwiGLU, added as is            sigmoid(shared_expert_gate(x)) * shared_expert(x):
                                          gate weight 0 gives exactly 0.5, so down_proj is x2
    embedding, untied lm_head             embed_tokens (padding_idx = pad id 0: it only stops
                                          that row's gradient; pad never reaches the loss)

The aux-loss-free `expert_bias` has no HF counterpart: it changes which experts are selected,
so the export is exact only when every router's bias is zero. `to_hf` refuses a model with a
non-zero bias unless told to drop it (`ignore_expert_bias=True`); the result then routes as if
the bias were zero. MLA attention and sigmoid router scores have no Qwen2-MoE form and raise.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlfusion.model.config import ModelConfig
from rlfusion.model.tokenizer import SPECIAL_TOKENS, CharTokenizer
from rlfusion.model.transformer import MoETransformer

EXTRA = "bench"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("HF export needs transformers, an optional dependency: "
                          f"pip install 'rlfusion[{EXTRA}]'") from None
    return transformers


def hf_config(cfg: ModelConfig):
    """The `Qwen2MoeConfig` of the same architecture; `ValueError` for what it cannot express."""
    unsupported = {
        "attention": (cfg.attention == "gqa", "only 'gqa' maps onto Qwen2-MoE"),
        "score_func": (cfg.score_func == "softmax", "only 'softmax' maps onto Qwen2-MoE"),
        "num_shared_experts": (cfg.num_shared_experts >= 1, "Qwen2-MoE always has a shared expert"),
        "num_moe_layers": (cfg.num_moe_layers >= 1, "need at least one MoE layer"),
    }
    for key, (ok, why) in unsupported.items():
        if not ok:
            raise ValueError(f"model.{key}={getattr(cfg, key)!r} cannot be exported: {why}")
    transformers = _transformers()
    return transformers.Qwen2MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, qkv_bias=False, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        mlp_only_layers=list(range(cfg.num_dense_layers)), decoder_sparse_step=1,
        intermediate_size=cfg.dense_ffn_dim if cfg.num_dense_layers else cfg.expert_ffn_dim,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_ffn_dim, norm_topk_prob=cfg.norm_topk_prob,
        shared_expert_intermediate_size=cfg.num_shared_experts * cfg.expert_ffn_dim,
        router_aux_loss_coef=cfg.aux_loss_coef, output_router_logits=False,
        use_sliding_window=False, attention_dropout=0.0,
        pad_token_id=CharTokenizer.pad_id, bos_token_id=CharTokenizer.bos_id,
        eos_token_id=CharTokenizer.eos_id,
    )


def hf_state_dict(model: MoETransformer) -> dict[str, torch.Tensor]:
    """Our weights under Qwen2-MoE names and layouts (see the module docstring)."""
    cfg = model.config
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight
        for ours, theirs in zip(("wq", "wk", "wv", "wo"), ("q_proj", "k_proj", "v_proj", "o_proj")):
            sd[p + f"self_attn.{theirs}.weight"] = getattr(layer.attn, ours).weight
        if not layer.is_moe:
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                sd[p + f"mlp.{theirs}.weight"] = getattr(layer.mlp, ours).weight
            continue
        moe, experts = layer.mlp, layer.mlp.experts
        sd[p + "mlp.gate.weight"] = moe.router.weight
        sd[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [experts.w_gate_EDF.transpose(1, 2), experts.w_up_EDF.transpose(1, 2)], dim=1)
        scaled_down_EFD = experts.w_down_EFD * cfg.routed_scaling_factor
        sd[p + "mlp.experts.down_proj"] = scaled_down_EFD.transpose(1, 2)
        sd[p + "mlp.shared_expert.gate_proj.weight"] = moe.shared.gate.weight
        sd[p + "mlp.shared_expert.up_proj.weight"] = moe.shared.up.weight
        # HF scales the shared expert by sigmoid(gate(x)); a zero gate gives exactly 0.5.
        sd[p + "mlp.shared_expert.down_proj.weight"] = moe.shared.down.weight * 2.0
        sd[p + "mlp.shared_expert_gate.weight"] = torch.zeros(1, cfg.d_model)
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}


def max_expert_bias(model: MoETransformer) -> float:
    return max((float(r.expert_bias.abs().max()) for r in model.routers()), default=0.0)


def to_hf(model: MoETransformer, ignore_expert_bias: bool = False):
    """An equivalent `Qwen2MoeForCausalLM` (float32, eval mode) with copied weights."""
    bias = max_expert_bias(model)
    if bias and not ignore_expert_bias:
        raise ValueError(f"router expert_bias is non-zero (max |bias| = {bias:.3g}) and Qwen2-MoE "
                         f"has no expert bias: the export would route differently. Zero the bias "
                         f"first, or pass ignore_expert_bias=True to drop it")
    transformers = _transformers()
    hf = transformers.Qwen2MoeForCausalLM(hf_config(model.config)).to(torch.float32)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    hf.generation_config.pad_token_id = CharTokenizer.pad_id
    hf.generation_config.bos_token_id = CharTokenizer.bos_id
    hf.generation_config.eos_token_id = CharTokenizer.eos_id
    return hf.eval()


def hf_tokenizer(tokenizer: CharTokenizer):
    """A `PreTrainedTokenizerFast` with the same ids; encoding adds `<bos>` like `encode_prompt`.

    Unlike `CharTokenizer.encode`, it drops characters outside the alphabet instead of raising.
    """
    from tokenizers import Tokenizer, decoders, models, processors

    transformers = _transformers()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(tokenizer.alphabet)})
    # A BPE without merges and without a pre-tokenizer splits text into single characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()  # characters join without spaces
    bos = SPECIAL_TOKENS[tokenizer.bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, tokenizer.bos_id)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIAL_TOKENS[tokenizer.pad_id], bos_token=bos,
        eos_token=SPECIAL_TOKENS[tokenizer.eos_id], padding_side="left")


def save_hf(model: MoETransformer, tokenizer: CharTokenizer, path: str | Path,
            ignore_expert_bias: bool = False) -> Path:
    """Write a folder that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load."""
    path = Path(path)
    to_hf(model, ignore_expert_bias).save_pretrained(path)
    hf_tokenizer(tokenizer).save_pretrained(path)
    return path
