"""Hugging Face export of a model with LoRA adapters (`model/lora.py`): the merged model, and the
adapters in PEFT's format beside the base they adapt.

Owns the adapters' PEFT names, shapes and `adapter_config.json`; the base tensors' names and
transformations are `model/hf.py`'s (`HFNames`). Every transformation the export makes of a
base weight W `[out, in]` acts on its rows (DeepSeek-V3's RoPE row permutation, Qwen's folded
`routed_scaling_factor`, Qwen2-MoE's doubled shared down projection, the per-expert transpose),
so the update `scale * B A` is exported by giving B the same transformation: `HFNames` applied
to B gives PEFT's B. Needs neither `transformers` nor `peft`. Layout (i = layer, E experts,
r = rank, D model dim, F expert FFN width; PEFT names below `base_model.model.`):

    native                              PEFT                                      how PEFT adapts it
    attention Linear  A [r, in]         model.layers.i.self_attn.X.lora_A.weight  target_modules
                      B [out, r]        ...X.lora_B.weight (B transformed as W)
    dense / shared MLP Linear           model.layers.i.mlp.(shared_expert(s).)    target_parameters
                                        {gate,up,down}_proj.lora_{A,B}.weight     (X.weight)
    router  A [r, D], B [E, r]          model.layers.i.mlp.gate.lora_{A,B}.weight target_parameters
    experts gate, up: A_* [E, D, r],    mlp.experts.base_layer.lora_A [E*2r, D]   target_parameters
            B_* [E, r, F]               mlp.experts.base_layer.lora_B [2F, 2r*E]  (gate_up_proj)
    experts down: A [E, F, r],          mlp.experts.lora_A [E*r, F]               target_parameters
                  B [E, r, D]           mlp.experts.lora_B [D, r*E]               (down_proj)

Transformers 5 fuses each layer's experts into `gate_up_proj [E, 2F, D]` and `down_proj
[E, D, F]`, parameters PEFT adapts with nested `ParamWrapper`s (gate_up_proj, registered first,
inside: its names have `base_layer`). Per expert e they add `scale * B_e A_e` with A_e rows
e*R .. e*R+R-1 of `lora_A` and B_e columns k*E + e (k < R) of `lora_B`. The fused gate/up
update has rank 2r: A_e = [A_gate[e]^T; A_up[e]^T], B_e = blockdiag(B_gate[e]^T, B_up[e]^T), with
`rank_pattern` 2r and `alpha_pattern` 2 alpha keeping the scale alpha / r (PEFT 0.21 warns
that those keys match no target module: they match the target parameter). The MLP Linears of
the MoE families go by `target_parameters` (their `weight`; dense families: `target_modules`):
PEFT rewrites a target module named gate_proj, up_proj or down_proj of a transformers 5 MoE
model (qwen3_moe, deepseek_v3) into the fused experts' parameters. `base_model_name_or_path` is
the base folder's absolute path (PEFT reads a relative one from the working directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfusion.model import lora
from rlfusion.model.hf import HFNames, infer_family, save_hf
from rlfusion.model.transformer import MoETransformer

PEFT_DIR, BASE_DIR = "peft", "base"
PREFIX = "base_model.model."
GATE_UP = r"mlp\.experts\.gate_up_proj"  # the rank_pattern / alpha_pattern key of the fused experts


def save_lora_hf(model: MoETransformer, path: str | Path, tokenizer=None, family: str | None = None) -> Path:
    """Write the merged model as an HF folder at `path` (`save_hf`), the adapters in PEFT's format
    at `path/peft` and their base at `path/peft/base`, which
    `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path/peft/base), path/peft)`
    loads as the same function as `path`."""
    path = Path(path)
    family = family or infer_family(model.config)
    save_hf(MoETransformer.of_state(model.config, lora.merged_state(model)).eval(), path, tokenizer, family)
    save_peft(model, path / PEFT_DIR, tokenizer, family)
    return path


def save_peft(model: MoETransformer, path: str | Path, tokenizer=None, family: str | None = None) -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` of `model`'s adapters at `path`
    and the unadapted base they name (an HF folder) at `path/base`."""
    path, spec = Path(path), lora.spec_of(model)
    if spec is None:
        raise ValueError("the model has no LoRA adapters; a PEFT export needs a LoRA checkpoint")
    family = family or infer_family(model.config)
    base_state = {k: v.detach() for k, v in model.state_dict().items() if not lora.is_adapter(k)}
    base = save_hf(MoETransformer.of_state(model.config, base_state).eval(), path / BASE_DIR, tokenizer, family)
    tensors, modules, parameters = peft_tensors(model, family)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base.resolve()),
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "target_modules": modules, "target_parameters": parameters,
              "rank_pattern": {}, "alpha_pattern": {}}
    if "experts" in spec.targets:
        config |= {"rank_pattern": {GATE_UP: 2 * spec.rank}, "alpha_pattern": {GATE_UP: 2 * spec.alpha}}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def peft_tensors(model: MoETransformer, family: str) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """`(tensors by PEFT name, target_modules, target_parameters)` of `model`'s adapters."""
    to_hf = HFNames(model.config, family)
    moe = model.config.num_moe_layers > 0
    tensors, modules, parameters = {}, [], []
    for name, m in model.named_modules():
        if getattr(m, "lora_A", None) is not None:  # an adapted Linear or router: weight [out, in]
            weight, B = to_hf.tensors(f"{name}.weight", m.lora_B.detach())[0]
            hf = weight.removesuffix(".weight")
            tensors |= {f"{PREFIX}{hf}.lora_A.weight": m.lora_A.detach(), f"{PREFIX}{hf}.lora_B.weight": B}
            by_module = isinstance(m, lora.LoRALinear) and (".self_attn." in hf or not moe)
            (modules if by_module else parameters).append(hf if by_module else weight)
        elif lora.has_expert_adapters(m):
            hf = f"model.{name}"
            B = {proj: [b for _, b in to_hf.tensors(f"{name}.{w}", getattr(m, f"lora_B_{proj}").detach())]
                 for proj, w in zip(lora.EXPERT_PROJS, ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))}
            A = {proj: getattr(m, f"lora_A_{proj}").detach().transpose(1, 2) for proj in lora.EXPERT_PROJS}
            gate_up_A = torch.cat([A["gate"], A["up"]], dim=1)  # [E, 2r, D]
            gate_up_B = [torch.block_diag(g, u) for g, u in zip(B["gate"], B["up"])]  # E x [2F, 2r]
            tensors |= _stacked(f"{PREFIX}{hf}.base_layer", gate_up_A, gate_up_B)
            tensors |= _stacked(f"{PREFIX}{hf}", A["down"], B["down"])
            parameters += [f"{hf}.gate_up_proj", f"{hf}.down_proj"]
    return {k: v.to(torch.float32).contiguous().clone() for k, v in tensors.items()}, modules, parameters


def _stacked(prefix: str, A_ERI: torch.Tensor, B: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `ParamWrapper`'s tensors from per-expert `A_e [R, in]` and `B_e [out, R]`: `lora_A`
    `[E*R, in]` (expert-major rows), `lora_B` `[out, R*E]` (expert-minor columns)."""
    return {f"{prefix}.lora_A.weight": A_ERI.reshape(-1, A_ERI.shape[-1]),
            f"{prefix}.lora_B.weight": torch.stack(B, dim=-1).flatten(1)}
