"""Hugging Face checkpoints <-> the native MoE decoder, by a documented name mapping.

Owns reading a local HF checkpoint folder (`config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json`, tokenizer files) into `MoETransformer`, and writing a native
model back as an HF folder that `transformers` loads. Needs only safetensors (and `tokenizers`
for the tokenizer), not `transformers`. Knows nothing about training or parallelism.

Families (`config.json` `model_type`) and the native features they switch on:

    llama        dense; GQA
    qwen2        dense; GQA with q/k/v biases (`qkv_bias`)
    qwen3        dense; GQA with per-head q/k RMSNorm (`qk_norm`)
    qwen2_moe    MoE with softmax router, gated shared expert (`shared_expert_gate`), q/k/v biases
    qwen3_moe    MoE with softmax router, no shared expert, `qk_norm`
    deepseek_v3  MLA; MoE with sigmoid router, `e_score_correction_bias`, group-limited routing

Name mapping (HF names left, native right; i = layer, e = expert):

    model.embed_tokens.weight / model.norm.weight / lm_head.weight  embed / norm / lm_head
    model.layers.i.input_layernorm.weight            layers.i.attn_norm.weight
    model.layers.i.post_attention_layernorm.weight   layers.i.mlp_norm.weight
    self_attn.{q,k,v,o}_proj.{weight,bias}           attn.{wq,wk,wv,wo}.{weight,bias}   (GQA)
    self_attn.{q,k}_norm.weight                      attn.{q,k}_norm.weight             (GQA)
    self_attn.q_proj                                 attn.wq                            (MLA)
    self_attn.q_a_proj / q_a_layernorm / q_b_proj    attn.wq.0 / attn.wq.1 / attn.wq.2  (MLA)
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm    attn.wkv_a / attn.kv_norm          (MLA)
    self_attn.kv_b_proj                              attn.wkv_b                         (MLA)
    mlp.{gate,up,down}_proj.weight                   mlp.{gate,up,down}.weight          (dense)
    mlp.gate.weight                                  mlp.router.weight
    mlp.gate.e_score_correction_bias                 mlp.router.expert_bias             (DSv3)
    mlp.experts.e.{gate,up}_proj.weight  [F, D]      mlp.experts.w_{gate,up}_EDF[e] = W^T
    mlp.experts.e.down_proj.weight       [D, F]      mlp.experts.w_down_EFD[e] = W^T
    mlp.shared_expert(s).{gate,up,down}_proj.weight  mlp.shared.{gate,up,down}.weight
    mlp.shared_expert_gate.weight                    mlp.shared_gate.weight             (Qwen2-MoE)

Transformers 5's fused in-memory expert layout (`mlp.experts.gate_up_proj`, `down_proj`) is read
too. DeepSeek-V3 stores RoPE dims interleaved (`rope_interleave`); loading permutes the RoPE rows
of `q` and `kv_a_proj_with_mqa` to the native half-split layout (evens, then odds), which gives
identical attention scores; export undoes it. Its multi-token-prediction layers (index >=
`num_hidden_layers`) are not used and are skipped. A config field the native model does not
implement (RoPE scaling, sliding windows, o_proj / MLP biases, quantized weights, ...) is
refused with one line naming the field (`model/hf_config.py` maps `config.json`); so is a
missing field, an unreadable file and a tensor whose shape does not fit `config.json` (the file
readers are `model/files.py`'s). A base too large for the machine is refused from its
`config.json` before anything is built (`model/base_info.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfusion.model.base_info import check_weights_fit, hf_tokenizer
from rlfusion.model.config import ModelConfig
from rlfusion.model.files import load_weights_into, read_json_file, read_safetensors_file
from rlfusion.model.hf_config import (DEFAULT_MAX_SEQ_LEN, FAMILIES, config_from_hf,  # noqa: F401 (re-exported)
                                      is_hf_checkpoint, read_hf_config)
from rlfusion.model.transformer import MoETransformer

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


# ---- ModelConfig -> config.json ------------------------------------------------------------

def infer_family(cfg: ModelConfig) -> str:
    """The HF family a native config exports to by default."""
    if cfg.attention == "mla":
        return "deepseek_v3"
    if cfg.num_moe_layers:
        return "qwen3_moe" if cfg.qk_norm else "qwen2_moe"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def config_to_hf(cfg: ModelConfig, family: str, special_ids: dict[str, int] | None = None) -> dict:
    """The HF `config.json` of `cfg` as `family`; `ValueError` for what that family cannot hold."""
    _check_exportable(cfg, family)
    out = {"architectures": [_ARCHITECTURES[family]], "model_type": family,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "attention_dropout": 0.0, "use_cache": True, "dtype": "float32",
           **(special_ids or {})}
    if family in ("llama", "qwen2", "qwen3"):
        return {**out, "intermediate_size": cfg.dense_ffn_dim}
    moe = {"num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.expert_ffn_dim,
           "norm_topk_prob": cfg.norm_topk_prob,
           "intermediate_size": cfg.dense_ffn_dim if cfg.num_dense_layers else cfg.expert_ffn_dim}
    if family in ("qwen2_moe", "qwen3_moe"):
        out |= moe | {"num_experts": cfg.num_experts, "decoder_sparse_step": 1,
                      "mlp_only_layers": list(range(cfg.num_dense_layers)),
                      "use_sliding_window": False, "router_aux_loss_coef": cfg.aux_loss_coef}
        if family == "qwen2_moe":
            out |= {"qkv_bias": cfg.qkv_bias,
                    "shared_expert_intermediate_size": cfg.num_shared_experts * cfg.expert_ffn_dim}
        return out
    m = cfg.mla
    return out | moe | {
        "n_routed_experts": cfg.num_experts, "n_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.num_dense_layers, "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.num_expert_groups, "topk_group": cfg.topk_groups,
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim, "rope_interleave": True,
        "num_key_value_heads": cfg.num_heads, "num_nextn_predict_layers": 0}


def _check_exportable(cfg: ModelConfig, family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; allowed: {', '.join(FAMILIES)}")
    mla, moe, qwen3 = family == "deepseek_v3", family.endswith("_moe") or family == "deepseek_v3", "qwen3" in family
    checks = {
        "attention": (cfg.attention == ("mla" if mla else "gqa"), f"{family} uses {'MLA' if mla else 'GQA'}"),
        "num_moe_layers": ((cfg.num_moe_layers > 0) == moe,
                           f"{family} is {'an MoE' if moe else 'a dense'} family"),
        "qk_norm": (cfg.qk_norm == qwen3, f"{family} {'always has' if qwen3 else 'has no'} q/k norms"),
        "qkv_bias": (not cfg.qkv_bias or family in ("qwen2", "qwen2_moe"), f"{family} has no q/k/v biases"),
        "score_func": (not moe or cfg.score_func == ("sigmoid" if mla else "softmax"),
                       f"{family} routes with {'sigmoid' if mla else 'softmax'} scores"),
        "num_expert_groups": (mla or cfg.num_expert_groups == 1, f"{family} has no group-limited routing"),
        "shared_expert_gate": (not cfg.shared_expert_gate or family == "qwen2_moe",
                               f"{family} has no shared-expert gate"),
        "num_shared_experts": (not moe or (cfg.num_shared_experts > 0) == (family != "qwen3_moe"),
                               f"{family} {'has no' if family == 'qwen3_moe' else 'needs a'} shared expert"),
    }
    if family == "qwen2" and not cfg.qkv_bias:
        checks["qkv_bias"] = (False, "qwen2 always has q/k/v biases")
    for key, (ok, why) in checks.items():
        if not ok:
            value = cfg.num_moe_layers if key == "num_moe_layers" else getattr(cfg, key)
            raise ValueError(f"model.{key}={value!r} cannot be exported as {family}: {why}")


# ---- weights -------------------------------------------------------------------------------

def name_pairs(cfg: ModelConfig, family: str) -> list[tuple[str, str]]:
    """`(native, hf)` names of every tensor that maps one to one (routed experts are stacked
    separately, see `_expert_names`)."""
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    for i in range(cfg.num_layers):
        n, h = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(n + "attn_norm.weight", h + "input_layernorm.weight"),
                  (n + "mlp_norm.weight", h + "post_attention_layernorm.weight")]
        pairs += [(n + "attn." + a, h + "self_attn." + b) for a, b in _attn_names(cfg)]
        pairs += [(n + "mlp." + a, h + "mlp." + b) for a, b in _mlp_names(cfg, family, i)]
    return pairs


def _attn_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    if cfg.attention == "gqa":
        out = [(f"w{x}.weight", f"{x}_proj.weight") for x in "qkvo"]
        out += [(f"w{x}.bias", f"{x}_proj.bias") for x in "qkv"] if cfg.qkv_bias else []
        return out + ([("q_norm.weight", "q_norm.weight"), ("k_norm.weight", "k_norm.weight")]
                      if cfg.qk_norm else [])
    q = ([("wq.0.weight", "q_a_proj.weight"), ("wq.1.weight", "q_a_layernorm.weight"),
          ("wq.2.weight", "q_b_proj.weight")] if cfg.mla.q_lora_rank else [("wq.weight", "q_proj.weight")])
    return q + [("wkv_a.weight", "kv_a_proj_with_mqa.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
                ("wkv_b.weight", "kv_b_proj.weight"), ("wo.weight", "o_proj.weight")]


def _mlp_names(cfg: ModelConfig, family: str, layer: int) -> list[tuple[str, str]]:
    if layer < cfg.num_dense_layers:
        return [(f"{x}.weight", f"{x}_proj.weight") for x in ("gate", "up", "down")]
    out = [("router.weight", "gate.weight")]
    if family == "deepseek_v3":
        out.append(("router.expert_bias", "gate.e_score_correction_bias"))
    if cfg.num_shared_experts:
        shared = "shared_experts" if family == "deepseek_v3" else "shared_expert"
        out += [(f"shared.{x}.weight", f"{shared}.{x}_proj.weight") for x in ("gate", "up", "down")]
    if cfg.shared_expert_gate:
        out.append(("shared_gate.weight", "shared_expert_gate.weight"))
    return out


def _rope_perm(cfg: ModelConfig) -> torch.Tensor:
    """Native RoPE row j holds interleaved HF row perm[j] (evens first, then odds)."""
    p = cfg.mla.qk_rope_head_dim
    return torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])


def _permute_rope_rows(native: str, w: torch.Tensor, cfg: ModelConfig, to_native: bool) -> torch.Tensor:
    m, perm = cfg.mla, _rope_perm(cfg)
    if native.endswith(("attn.wq.weight", "attn.wq.2.weight")):
        w_HQI = w.reshape(cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, -1).clone()
        rope = w_HQI[:, m.qk_nope_head_dim:]
        w_HQI[:, m.qk_nope_head_dim:] = rope[:, perm] if to_native else rope[:, torch.argsort(perm)]
        return w_HQI.reshape(w.shape)
    if native.endswith("attn.wkv_a.weight"):
        w = w.clone()
        rope = w[m.kv_lora_rank:]
        w[m.kv_lora_rank:] = rope[perm] if to_native else rope[torch.argsort(perm)]
    return w


def state_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig, family: str,
                  rope_interleave: bool = True, where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Native state dict from HF tensors; `ValueError` naming missing or unused tensors."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise ValueError(f"{where}: tensor {name!r} is missing (model_type={family})")
        used.add(name)
        return hf_sd[name]

    if cfg.tie_embeddings and "lm_head.weight" in hf_sd:
        used.add("lm_head.weight")  # a tied copy some exporters write anyway
    out = {}
    for native, hf_name in name_pairs(cfg, family):
        w = take(hf_name)
        if family == "deepseek_v3" and rope_interleave:
            w = _permute_rope_rows(native, w, cfg, to_native=True)
        out[native] = w
    for i in range(cfg.num_dense_layers, cfg.num_layers):
        h, n = f"model.layers.{i}.mlp.experts.", f"layers.{i}.mlp.experts."
        if h + "gate_up_proj" in hf_sd:  # transformers 5 fused layout: [E, 2F, D] and [E, D, F]
            gate_EFD, up_EFD = take(h + "gate_up_proj").chunk(2, dim=1)
            down_EDF = take(h + "down_proj")
        else:
            stack = lambda x: torch.stack([take(f"{h}{e}.{x}_proj.weight") for e in range(cfg.num_experts)])
            gate_EFD, up_EFD, down_EDF = stack("gate"), stack("up"), stack("down")
        out[n + "w_gate_EDF"] = gate_EFD.transpose(1, 2)
        out[n + "w_up_EDF"] = up_EFD.transpose(1, 2)
        out[n + "w_down_EFD"] = down_EDF.transpose(1, 2)
    unused = sorted(k for k in set(hf_sd) - used if not _is_mtp(k, cfg))
    if unused:
        raise ValueError(f"{where}: {len(unused)} tensors have no native counterpart, e.g. {unused[0]!r} "
                         f"(model_type={family})")
    return {k: v.contiguous() for k, v in out.items()}


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """DeepSeek-V3's multi-token-prediction layers sit after the last decoder layer."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_layers


def state_to_hf_checks(model: MoETransformer, family: str) -> None:
    """`ValueError` unless `family` holds `model` exactly: its architecture, and no router expert
    bias where the family has none."""
    _check_exportable(model.config, family)
    bias = max((float(r.expert_bias.abs().max()) for r in model.routers()), default=0.0)
    if family != "deepseek_v3" and bias:
        raise ValueError(f"router expert_bias is non-zero (max |bias| = {bias:.3g}) and {family} has "
                         f"no expert bias: the export would route differently; zero it first")


def state_to_hf(model: MoETransformer, family: str) -> dict[str, torch.Tensor]:
    """HF tensors (per-expert hub layout) of a native model. Folds `routed_scaling_factor` into
    the expert down projections for the Qwen families (they have no such factor); a Qwen2-MoE
    export of a model without a shared-expert gate writes a zero gate (sigmoid(0) = 1/2) and
    doubles the shared down projection."""
    cfg = model.config
    state_to_hf_checks(model, family)
    to_hf = HFNames(cfg, family)
    out = {}
    for native, w in model.state_dict().items():
        out.update(to_hf.tensors(native, w))
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


class HFNames:
    """Native tensor -> HF tensors, one tensor at a time (what a streamed weight update needs)."""

    def __init__(self, cfg: ModelConfig, family: str):
        self.cfg, self.family = cfg, family
        self.pairs = dict(name_pairs(cfg, family))

    def tensors(self, native: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`[(hf_name, tensor)]` for one native tensor; [] for tensors HF does not hold (the
        zero expert bias of the Qwen families)."""
        cfg, family = self.cfg, self.family
        if native in self.pairs:
            if family == "deepseek_v3":
                w = _permute_rope_rows(native, w, cfg, to_native=False)
            if family == "qwen2_moe" and not cfg.shared_expert_gate and native.endswith("mlp.shared.down.weight"):
                # doubled, beside a zero gate (sigmoid(0) = 1/2) the native model does not have
                layer = native.removeprefix("layers.").partition(".")[0]
                gate = torch.zeros(1, cfg.d_model, dtype=w.dtype, device=w.device)
                return [(self.pairs[native], w * 2.0), (f"model.layers.{layer}.mlp.shared_expert_gate.weight", gate)]
            return [(self.pairs[native], w)]
        layer, _, rest = native.removeprefix("layers.").partition(".")
        experts = {"mlp.experts.w_gate_EDF": "gate", "mlp.experts.w_up_EDF": "up", "mlp.experts.w_down_EFD": "down"}
        if rest in experts:
            scale = cfg.routed_scaling_factor if rest.endswith("down_EFD") and family != "deepseek_v3" else 1.0
            proj = experts[rest]
            return [(f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", w[e].T * scale)
                    for e in range(w.shape[0])]
        if rest == "mlp.router.expert_bias":
            return []
        raise KeyError(f"native tensor {native!r} has no {family} name")


# ---- folders -------------------------------------------------------------------------------

def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF folder: one `model.safetensors` or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_file(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' of "
                             f"tensor name -> file name)")
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json "
                                f"(only safetensors HF checkpoints are supported)")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{index}: shard {file.name} named by the index is missing")
    return files


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    return read_weights(path)[0]


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """`(tensors, file of each tensor)` of an HF folder; errors name the file."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in weight_files(path):
        shard = read_safetensors_file(file)
        tensors.update(shard)
        origin.update(dict.fromkeys(shard, file))
    return tensors, origin


def hf_shapes(model: MoETransformer, family: str) -> dict[str, tuple[int, ...]]:
    """The shape `model` needs of each HF tensor, in the hub's per-expert layout and in
    transformers 5's fused one (a checkpoint has one or the other)."""
    cfg, native = model.config, {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = {hf_name: native[name] for name, hf_name in name_pairs(cfg, family)}
    for i in range(cfg.num_dense_layers, cfg.num_layers):
        h = f"model.layers.{i}.mlp.experts."
        E, D, F = native[f"layers.{i}.mlp.experts.w_gate_EDF"]
        out |= {h + "gate_up_proj": (E, 2 * F, D), h + "down_proj": (E, D, F)}
        for e in range(E):
            out |= {f"{h}{e}.gate_proj.weight": (F, D), f"{h}{e}.up_proj.weight": (F, D),
                    f"{h}{e}.down_proj.weight": (D, F)}
    return out


def check_shapes(tensors: dict[str, torch.Tensor], origin: dict[str, Path], model: MoETransformer,
                 family: str, config: Path) -> None:
    """Every HF tensor the model maps has the shape `config` gives it; checked before the name
    mapping, which reshapes and stacks tensors and would fail with a torch trace otherwise."""
    for name, shape in hf_shapes(model, family).items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"{origin[name]}: tensor {name!r} has shape {list(tensors[name].shape)} "
                             f"but {config} needs {list(shape)}")


def load_hf(path: str | Path, max_seq_len: int | None = None, dtype: torch.dtype = torch.float32):
    """`(model, tokenizer or None, meta)` from a local HF folder; `meta` keeps the family and the
    original `config.json`. `max_seq_len` defaults to min(max_position_embeddings, 4096).

    Nothing of the model is allocated before its size, from `config.json`, is compared with the
    machine's memory, and the tokenizer (with its chat template) is read before any weight. The
    model is built on the meta device and takes the tensors read from the files as its own: no
    random initialisation, no second copy of the weights."""
    path = Path(path)
    hf, config = read_hf_config(path)
    cfg = config_from_hf(hf, str(config), max_seq_len)
    check_weights_fit(cfg, config)
    tokenizer = hf_tokenizer(path, hf, cfg)
    model = MoETransformer.meta(cfg)
    tensors, origin = read_weights(path)
    check_shapes(tensors, origin, model, hf["model_type"], config)
    state = state_from_hf(tensors, cfg, hf["model_type"],
                          rope_interleave=bool(hf.get("rope_interleave", True)), where=str(path))
    del tensors, origin  # the per-expert tensors: `state` holds them stacked
    # Families without an expert bias keep the native zero bias (it only shifts selection).
    state |= {k: torch.zeros(cfg.num_experts) for k in model.state_dict()
              if k.endswith("router.expert_bias") and k not in state}
    load_weights_into(model, state, str(path), mismatch=f"does not match {config}", assign=True)
    model.derive_buffers()
    return model.to(dtype).eval(), tokenizer, {"family": hf["model_type"], "hf_config": hf}


def save_hf(model: MoETransformer, path: str | Path, tokenizer=None, family: str | None = None) -> Path:
    """Write `config.json`, `model.safetensors` and (for an `HFTokenizer`) the tokenizer files,
    a folder `transformers.AutoModelForCausalLM.from_pretrained` loads."""
    path = Path(path)
    family = family or infer_family(model.config)
    tensors = state_to_hf(model, family)
    special = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                   "pad_token_id": tokenizer.pad_id}
    config = config_to_hf(model.config, family, special)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(path)
    return path
