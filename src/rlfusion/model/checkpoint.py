"""Checkpoints: safetensors weights plus a JSON file with the model config (and tokenizer).

`save_checkpoint(dir, model, tokenizer)` writes `model.safetensors` and `config.json`;
`load_checkpoint(dir)` rebuilds both with one call; `load_base(dir)` also reads Hugging Face folders.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlfusion.model.config import MLAConfig, ModelConfig
from rlfusion.model.hf_tokenizer import tokenizer_from_dict
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown model config keys {unknown}; allowed: {sorted(known)}")
    if isinstance(d.get("mla"), dict):
        d["mla"] = MLAConfig(**d["mla"])
    return ModelConfig(**d)


def save_checkpoint(path: str | Path, model: MoETransformer, tokenizer: Tokenizer | None = None,
                    extra: dict | None = None) -> Path:
    """Write weights and config atomically enough for our use: files go to a temp name first."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = path / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(path / WEIGHTS)
    meta = {"model": config_to_dict(model.config),
            "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
            "extra": extra or {}}
    (path / (CONFIG + ".tmp")).write_text(json.dumps(meta, indent=2))
    (path / (CONFIG + ".tmp")).replace(path / CONFIG)
    return path


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu"
                    ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """Returns `(model, tokenizer, extra)`; errors name the file and what is wrong."""
    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} has no {name} (expected {WEIGHTS} + {CONFIG})")
    try:
        meta = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise ValueError(f"{path / CONFIG} is not an rlfusion checkpoint config (no 'model' table)")
    try:
        model = MoETransformer(config_from_dict(meta["model"]))
    except TypeError as e:
        raise ValueError(f"{path / CONFIG}: bad model config ({e})") from None
    state = load_file(str(path / WEIGHTS), device=str(device))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ValueError(f"{path / WEIGHTS} does not match its config: "
                         f"{str(e).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS} does not match its config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    tok = tokenizer_from_dict(meta["tokenizer"]) if meta.get("tokenizer") else None
    return model.to(device), tok, meta.get("extra", {})


def load_base(path: str | Path, device: str | torch.device = "cpu"
              ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """The one place a base model is read: an rlfusion checkpoint, or a local Hugging Face
    folder (`config.json` with a `model_type`, see `model/hf.py`)."""
    from rlfusion.model.hf import is_hf_checkpoint, load_hf

    if is_hf_checkpoint(path):
        model, tokenizer, meta = load_hf(path)
        return model.to(device), tokenizer, meta
    return load_checkpoint(path, device)
