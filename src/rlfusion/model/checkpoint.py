"""Checkpoints: safetensors weights plus a JSON file with the model config (and tokenizer).

`save_checkpoint(dir, model, tokenizer)` writes `model.safetensors` and `config.json`;
`load_checkpoint(dir)` rebuilds both with one call; `load_base(dir)` also reads Hugging Face folders.
`find_base()` picks the base model a run starts from when none is named: the user's cached
one (`rlfusion pretrain`, `default_base_path`), else the one shipped with the package;
`resolve_base(base)` reads a run's `base=`: a checkpoint folder, or a shipped base by name.

Model files are read, and weights loaded into a model, through `model/files.py`.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from rlfusion.model import lora
from rlfusion.model.config import config_from_dict, config_to_dict
from rlfusion.model.files import first_line, load_weights_into, read_json_file, read_safetensors_file
from rlfusion.model.hf_tokenizer import tokenizer_from_dict
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer

WEIGHTS = "model.safetensors"
ADAPTERS = "adapters.safetensors"  # a LoRA run's checkpoint: the adapters only, beside a pointer to its base
CONFIG = "config.json"
ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_BASE = ASSETS / "base-tiny"  # made by `rlfusion pretrain`


# ---- rlfusion checkpoints ------------------------------------------------------------------

def save_checkpoint(path: str | Path, model: MoETransformer, tokenizer: Tokenizer | None = None,
                    extra: dict | None = None) -> Path:
    """Write weights and config atomically enough for our use: files go to a temp name first.
    A model with LoRA adapters (`model/lora.py`) writes only the adapters (`adapters.safetensors`)
    and, in `config.json`, their spec and the base they adapt (`model.lora_base`: its path and
    fingerprint), which `load_checkpoint` loads them onto."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = lora.spec_of(model)
    state = {k: v.detach().contiguous().cpu() for k, v in
             (lora.adapter_state(model) if spec else model.state_dict()).items()}
    file = ADAPTERS if spec else WEIGHTS
    tmp = path / (file + ".tmp")
    try:
        save_file(state, str(tmp))
    except SafetensorError as e:  # e.g. the disk filled: an OS failure, reported as one
        tmp.unlink(missing_ok=True)
        raise OSError(errno.EIO, f"cannot write safetensors ({first_line(e)})", str(tmp)) from None
    tmp.replace(path / file)
    meta = {"model": config_to_dict(model.config),
            "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
            "extra": extra or {}}
    if spec:
        meta["lora"] = {**spec.to_dict(), **model.lora_base}
    (path / (CONFIG + ".tmp")).write_text(json.dumps(meta, indent=2))
    (path / (CONFIG + ".tmp")).replace(path / CONFIG)
    return path


def _model_of(meta: object, where: Path) -> MoETransformer:
    """The (randomly initialised) model a checkpoint's `config.json` describes."""
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise ValueError(f"{where} is not an rlfusion checkpoint config (no 'model' table)")
    try:
        return MoETransformer(config_from_dict(meta["model"]))
    except (TypeError, ValueError, RuntimeError) as e:  # wrong keys, types or values
        raise ValueError(f"{where}: bad model config ({first_line(e)})") from None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", max_seq_len: int | None = None
                    ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """Returns `(model, tokenizer, extra)`; errors name the file and what is wrong.
    `max_seq_len` replaces the checkpoint's context length (rotary positions are derived from
    it, not stored, so the same weights load at any length)."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {CONFIG} (expected {WEIGHTS} + {CONFIG})")
    meta = read_json_file(path / CONFIG)
    if isinstance(meta, dict) and isinstance(meta.get("lora"), dict):
        return _load_adapters(path, meta, device, max_seq_len)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {WEIGHTS} (expected {WEIGHTS} + {CONFIG}, "
                                f"or {ADAPTERS} + {CONFIG} with a 'lora' table)")
    if max_seq_len and isinstance(meta, dict) and isinstance(meta.get("model"), dict):
        meta["model"]["max_seq_len"] = max_seq_len
    model = _model_of(meta, path / CONFIG)
    load_weights_into(model, read_safetensors_file(path / WEIGHTS), str(path / WEIGHTS),
                      mismatch=f"does not match its config {path / CONFIG}")
    tok = tokenizer_from_dict(meta["tokenizer"], str(path / CONFIG)) if meta.get("tokenizer") else None
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"{path / CONFIG}: the tokenizer has {tok.vocab_size} tokens but the "
                         f"model's vocab_size is {model.config.vocab_size}")
    return model.to(device), tok, meta.get("extra", {})


def lora_table(path: str | Path) -> dict | None:
    """A checkpoint's `lora` table (spec, base path, fingerprint): None for a full checkpoint."""
    meta = read_json_file(Path(path) / CONFIG)
    return meta.get("lora") if isinstance(meta, dict) and isinstance(meta.get("lora"), dict) else None


def lora_spec_of(info: dict, where: Path) -> lora.LoraSpec:
    """The adapters' spec of a checkpoint's `lora` table (`where`: its file, for the message);
    one line where the table lacks a field or holds a bad one."""
    try:
        missing = [key for key in ("base", "fingerprint") if key not in info]
        if missing:
            raise KeyError(missing[0])
        return lora.LoraSpec.from_dict(info)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad 'lora' table ({first_line(e)}); expected rank, alpha, targets, base, "
                         f"fingerprint") from None


def load_adapters_into(model: MoETransformer, path: str | Path, info: dict) -> None:
    """A LoRA checkpoint's adapters (`lora_table` `info`) into `model`, which carries the same
    adapters on its base: refused in one line unless that base's fingerprint is the one the
    adapters were trained on."""
    path = Path(path)
    if not (path / ADAPTERS).is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {ADAPTERS} (its {CONFIG} says it holds LoRA adapters)")
    found = model.lora_base["fingerprint"]
    if found != info["fingerprint"]:
        raise ValueError(f"{path / CONFIG}: the adapters were trained on base {info['base']} with fingerprint "
                         f"{info['fingerprint']}, but this base ({model.lora_base['base']}) holds other weights ({found})")
    load_weights_into(model, read_safetensors_file(path / ADAPTERS), str(path / ADAPTERS),
                      mismatch=f"does not match the adapters {path / CONFIG} describes", part=lora.is_adapter)


def _load_adapters(path: Path, meta: dict, device, max_seq_len: int | None
                   ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """A LoRA checkpoint: its base (where `lora.base` points) with the adapters put on and loaded."""
    info = meta["lora"]
    spec = lora_spec_of(info, path / CONFIG)
    base = Path(info["base"])
    if not base.exists():
        raise FileNotFoundError(f"{path / CONFIG}: the adapters' base {base} does not exist (a LoRA checkpoint "
                                f"holds only adapters; put the base back there)")
    model, base_tok, _ = load_base(base, max_seq_len=max_seq_len or meta["model"].get("max_seq_len"))
    load_adapters_into(lora.attach(model, spec, base=base), path, info)
    tok = tokenizer_from_dict(meta["tokenizer"], str(path / CONFIG)) if meta.get("tokenizer") else base_tok
    return model.to(device), tok, meta.get("extra", {})


def load_base(path: str | Path, device: str | torch.device = "cpu", max_seq_len: int | None = None
              ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """The one place a base model is read: an rlfusion checkpoint (a LoRA run's as its merged
    model), or a local Hugging Face folder (`config.json` with a `model_type`, see
    `model/hf.py`). `max_seq_len`: the context length to build the model with (None: the
    checkpoint's)."""
    from rlfusion.model.hf import is_hf_checkpoint, load_hf

    if is_hf_checkpoint(path):
        model, tokenizer, meta = load_hf(path, max_seq_len)
        return model.to(device), tokenizer, meta
    model, tokenizer, extra = load_checkpoint(path, device, max_seq_len)
    if lora.spec_of(model) is not None:  # a LoRA run's checkpoint as a base: its adapters folded in
        model = folded(model)
    return model, tokenizer, extra


def folded(model: MoETransformer) -> MoETransformer:
    """A plain model (no adapters) whose weights are `model`'s with its LoRA adapters folded in."""
    plain = MoETransformer.of_state(model.config, lora.merged_state(model))
    return plain.to(next(model.parameters()).device).train(model.training)


def default_base_path(model: str = "tiny") -> Path:
    """Where `rlfusion pretrain` caches a base model (`$RLFUSION_CACHE`, else ~/.cache/rlfusion)."""
    root = Path(os.environ.get("RLFUSION_CACHE", Path.home() / ".cache" / "rlfusion"))
    return root / f"base-{model}"


def shipped_bases() -> list[str]:
    """Names of the base checkpoints shipped with the package (`assets/base-NAME`)."""
    return sorted(p.name.removeprefix("base-") for p in ASSETS.glob("base-*") if (p / WEIGHTS).is_file())


def resolve_base(base: str, key: str = "base") -> Path | None:
    """A run's `base=` (or pretraining's `init=`: `key`, for the message): a checkpoint folder,
    else the name of a shipped base (`tiny`, the default task's; `tiny-long`, the long-reasoning
    task's); "" = `find_base()`."""
    if not base:
        return find_base()
    path = Path(base)
    if path.exists():
        return path
    if base in shipped_bases():
        return ASSETS / f"base-{base}"
    raise ValueError(f"{key}={base!r} is neither a checkpoint folder nor a shipped base; shipped: "
                     f"{', '.join(shipped_bases())}")


def find_base(model: str = "tiny") -> Path | None:
    """The base model to start from: one the user pretrained (cache) first, else the checkpoint
    shipped with the package (made by `rlfusion pretrain`, see docs/benchmarks.md); None if
    neither holds weights."""
    for path in (default_base_path(model), SHIPPED_BASE if model == "tiny" else None):
        if path is not None and (path / WEIGHTS).is_file():
            return path
    return None
