"""Checkpoints: safetensors weights plus a JSON file with the model config (and tokenizer).

`save_checkpoint(dir, model, tokenizer)` writes `model.safetensors` and `config.json`;
`load_checkpoint(dir)` rebuilds both with one call; `load_base(dir)` also reads Hugging Face folders.
`find_base()` picks the base model a run starts from when none is named: the user's cached
one (`rlfusion pretrain`, `default_base_path`), else the one shipped with the package;
`resolve_base(base)` reads a run's `base=`: a checkpoint folder, or a shipped base by name.

This module is also the one layer that reads model files from disk (`read_json_file`,
`read_text_file`, `read_safetensors_file`) and loads weights into a model (`load_weights_into`):
every unreadable or mismatched file ends in a one-line `ValueError` that names the file and what
is wrong, which the CLI prints as its error line.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlfusion.model.config import MLAConfig, ModelConfig
from rlfusion.model.hf_tokenizer import tokenizer_from_dict
from rlfusion.model.tokenizer import Tokenizer
from rlfusion.model.transformer import MoETransformer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_BASE = ASSETS / "base-tiny"  # made by `rlfusion pretrain`


# ---- reading files -------------------------------------------------------------------------

def first_line(e: BaseException, limit: int = 200) -> str:
    """The gist of a library's error: its first line, clipped (some are multi-line or huge)."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of `path`; `ValueError` naming the file if it cannot be read or decoded."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or first_line(e)})") from None


def read_json_file(path: str | Path) -> object:
    """The parsed JSON of `path`; `ValueError` naming the file if it is not UTF-8 JSON."""
    try:
        return json.loads(read_text_file(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def read_safetensors_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, on the CPU (callers copy them into a model).
    `ValueError` naming the file for anything that is not one: a truncated download, a
    `torch.save` pickle under the wrong name, a folder, a file we may not read."""
    try:
        return load_file(str(path))
    except Exception as e:  # the Rust reader raises SafetensorError, OSError, ... by case
        raise ValueError(f"{path}: not a readable safetensors file ({first_line(e)})") from None


# ---- loading weights -----------------------------------------------------------------------

def load_weights_into(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], where: str,
                      mismatch: str = "does not fit this run's model", assign: bool = False) -> None:
    """Copy `state_dict` into `model`: same names, same shapes, nothing left over. Anything else
    is a one-line `ValueError`, `{where} {mismatch}: ...` naming the first tensor that differs
    (torch's own error lists every tensor, over many lines). For resuming from, or loading, a
    checkpoint that may come from another architecture."""
    own = model.state_dict()
    for name, t in state_dict.items():
        if name in own and tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"{where} {mismatch}: tensor {name!r} has shape {list(t.shape)}, "
                             f"the model needs {list(own[name].shape)}")
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors are missing (e.g. {missing[0]!r})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors are not in the model (e.g. {unexpected[0]!r})")
    if problems:
        raise ValueError(f"{where} {mismatch}: {'; '.join(problems)}")
    model.load_state_dict(state_dict, strict=True, assign=assign)  # assign: a meta-built model takes the tensors


# ---- rlfusion checkpoints ------------------------------------------------------------------

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
    try:
        save_file(state, str(tmp))
    except SafetensorError as e:  # e.g. the disk filled: an OS failure, reported as one
        tmp.unlink(missing_ok=True)
        raise OSError(errno.EIO, f"cannot write safetensors ({first_line(e)})", str(tmp)) from None
    tmp.replace(path / WEIGHTS)
    meta = {"model": config_to_dict(model.config),
            "tokenizer": tokenizer.to_dict() if tokenizer is not None else None,
            "extra": extra or {}}
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
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise FileNotFoundError(f"checkpoint {path} has no {name} (expected {WEIGHTS} + {CONFIG})")
    meta = read_json_file(path / CONFIG)
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


def load_base(path: str | Path, device: str | torch.device = "cpu", max_seq_len: int | None = None
              ) -> tuple[MoETransformer, Tokenizer | None, dict]:
    """The one place a base model is read: an rlfusion checkpoint, or a local Hugging Face
    folder (`config.json` with a `model_type`, see `model/hf.py`). `max_seq_len`: the context
    length to build the model with (None: the checkpoint's)."""
    from rlfusion.model.hf import is_hf_checkpoint, load_hf

    if is_hf_checkpoint(path):
        model, tokenizer, meta = load_hf(path, max_seq_len)
        return model.to(device), tokenizer, meta
    return load_checkpoint(path, device, max_seq_len)


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
