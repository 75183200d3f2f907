"""Hugging Face `config.json` -> the native `ModelConfig`, refusing what the native model lacks.

Owns the families `model/hf.py` reads (`FAMILIES`) and `config_from_hf`: the field mapping per
family, and one `ValueError` line naming the first field the native model does not implement
(RoPE scaling, sliding windows, o_proj / MLP biases, quantized weights, ...), a missing field or
one of the wrong type. Reads no tensors: what a base costs can be known from here before it is
built (`model/base_size.py`).
"""

from __future__ import annotations

from pathlib import Path

from rlfusion.model.config import MLAConfig, ModelConfig
from rlfusion.model.files import first_line, read_json_file

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3")
DEFAULT_MAX_SEQ_LEN = 4096  # RoPE tables are precomputed per layer; RL contexts rarely need more


def is_hf_checkpoint(path: str | Path) -> bool:
    """An HF folder has a `config.json` with a `model_type` (rlfusion's has a `model` table).
    An unreadable `config.json` is a `ValueError` naming it: it is no checkpoint of either kind."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    meta = read_json_file(config)
    return isinstance(meta, dict) and "model_type" in meta and "model" not in meta


def read_hf_config(path: Path) -> tuple[dict, Path]:
    """`(fields, file)` of an HF folder's `config.json`; errors name the file."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path} has no config.json (not an HF checkpoint folder)")
    hf = read_json_file(config)
    if not isinstance(hf, dict):
        raise ValueError(f"{config}: not a model config (a JSON object), got a JSON {type(hf).__name__}")
    return hf, config


def _refuse(where: str, key: str, value, why: str) -> None:
    raise ValueError(f"{where}: {key}={value!r} is not supported: {why}")


def config_from_hf(hf: dict, where: str = "config.json",
                   max_seq_len: int | None = None) -> ModelConfig:
    """The native config of an HF `config.json`; `ValueError` naming the first unsupported,
    missing or mistyped field."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        _refuse(where, "model_type", family, f"allowed: {', '.join(FAMILIES)}")
    try:
        return _native_config(hf, where, family, max_seq_len)
    except KeyError as e:  # the fields are read with hf[key]: a missing one lands here
        raise ValueError(f"{where}: field {e.args[0]!r} is missing (model_type={family})") from None
    except TypeError as e:  # e.g. a string where a number belongs
        raise ValueError(f"{where}: a field has the wrong type ({first_line(e)})") from None


def _native_config(hf: dict, where: str, family: str, max_seq_len: int | None) -> ModelConfig:
    _check_common(hf, where, family)
    positions = int(hf.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN))
    common = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf, where), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or min(positions, DEFAULT_MAX_SEQ_LEN),
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
    )
    no_moe = dict(num_dense_layers=hf["num_hidden_layers"], dense_ffn_dim=hf["intermediate_size"],
                  num_experts=0, top_k=0, expert_ffn_dim=0, num_shared_experts=0)
    if family == "llama":
        return _model_config(where, **common, **no_moe)
    if family == "qwen2":
        return _model_config(where, **common, **no_moe, qkv_bias=True)
    if family == "qwen3":
        return _model_config(where, **common, **no_moe, qk_norm=True)
    if family in ("qwen2_moe", "qwen3_moe"):
        return _model_config(where, **common, **_qwen_moe(hf, where, family))
    return _model_config(where, **{**common, **_deepseek_v3(hf, where)})


def _model_config(where: str, **fields) -> ModelConfig:
    """`ModelConfig` validates sizes against each other (e.g. top_k <= num_experts)."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{where}: maps to an invalid native config ({first_line(e)})") from None


def _check_common(hf: dict, where: str, family: str) -> None:
    if quant := hf.get("quantization_config"):
        _refuse(where, "quantization_config", quant.get("quant_method") if isinstance(quant, dict) else quant,
                "load a dequantized (bf16/fp32) checkpoint")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "only 'silu' (SwiGLU) is implemented")
    for key in ("use_sliding_window", "mlp_bias"):
        if hf.get(key):
            _refuse(where, key, hf[key], "not implemented by the native model")
    if "sliding_attention" in (hf.get("layer_types") or []):
        _refuse(where, "layer_types", "sliding_attention", "sliding-window attention is not implemented")
    if family in ("llama", "qwen3", "qwen3_moe", "deepseek_v3") and hf.get("attention_bias"):
        _refuse(where, "attention_bias", True, "the native model has no o_proj bias")


def _rope_theta(hf: dict, where: str) -> float:
    """Transformers 5 writes `rope_parameters` (`rope_type` 'default' for plain RoPE); older
    configs write `rope_scaling` (null, or a dict with `type` or `rope_type`) beside a top-level
    `rope_theta`. Transformers lets `rope_scaling` win when both are set, so both are checked."""
    tables = {key: hf.get(key) or {} for key in ("rope_parameters", "rope_scaling")}
    for key, params in tables.items():
        if not isinstance(params, dict):
            _refuse(where, key, params, "must be a JSON object")
        type_key = "rope_type" if "rope_type" in params else "type"
        if (params.get(type_key) or "default") != "default":
            _refuse(where, f"{key}.{type_key}", params[type_key],
                    "only plain RoPE ('default') is implemented (no yarn/llama3/linear scaling)")
    theta = [t["rope_theta"] for t in tables.values() if "rope_theta" in t]
    return float(theta[0] if theta else hf.get("rope_theta", 10000.0))


def _first(hf: dict, where: str, *keys: str):
    """The first present key: hub configs and transformers 5 name some fields differently."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    raise ValueError(f"{where}: has none of the fields {', '.join(keys)}")


def _dense_first(hf: dict, where: str, dense: list[int]) -> int:
    """Native MoE models have their dense layers first: `mlp_only_layers` must be 0..k-1."""
    if dense != list(range(len(dense))):
        _refuse(where, "mlp_only_layers", dense, "dense layers must be the first ones (0..k-1)")
    if hf.get("decoder_sparse_step", 1) != 1:
        _refuse(where, "decoder_sparse_step", hf["decoder_sparse_step"], "only 1 (every layer MoE)")
    return len(dense)


def _qwen_moe(hf: dict, where: str, family: str) -> dict:
    num_dense = _dense_first(hf, where, sorted(hf.get("mlp_only_layers") or []))
    out = dict(num_dense_layers=num_dense, dense_ffn_dim=hf.get("intermediate_size", 0),
               num_experts=_first(hf, where, "num_experts", "num_local_experts"),
               top_k=hf["num_experts_per_tok"], expert_ffn_dim=hf["moe_intermediate_size"],
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)), num_shared_experts=0)
    if family == "qwen3_moe":
        return {**out, "qk_norm": True}
    shared, width = hf.get("shared_expert_intermediate_size", 0), hf["moe_intermediate_size"]
    if shared % width or not shared:
        _refuse(where, "shared_expert_intermediate_size", shared,
                f"must be a positive multiple of moe_intermediate_size={width}")
    return {**out, "num_shared_experts": shared // width, "shared_expert_gate": True,
            "qkv_bias": bool(hf.get("qkv_bias", True))}


def _deepseek_v3(hf: dict, where: str) -> dict:
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, want) != want:
            _refuse(where, key, hf[key], f"only {want!r} is implemented")
    if not hf.get("n_shared_experts"):
        _refuse(where, "n_shared_experts", hf.get("n_shared_experts"), "must be >= 1")
    heads = hf["num_attention_heads"]
    return dict(
        attention="mla", num_kv_heads=heads,
        head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        mla=MLAConfig(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                      qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                      v_head_dim=hf["v_head_dim"]),
        num_dense_layers=hf.get("first_k_dense_replace", 0), dense_ffn_dim=hf["intermediate_size"],
        num_experts=_first(hf, where, "n_routed_experts", "num_local_experts"),
        top_k=hf["num_experts_per_tok"],
        expert_ffn_dim=hf["moe_intermediate_size"], num_shared_experts=hf["n_shared_experts"],
        score_func="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_expert_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1)
