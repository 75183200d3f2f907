"""Reading model files from disk and loading weights into a model: the one layer that does, so
every unreadable or mismatched file (`read_json_file`, `read_text_file`, `read_safetensors_file`,
`load_weights_into`) ends in a one-line `ValueError` that names the file and what is wrong, which
the CLI prints as its error line. Knows no model family or checkpoint layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


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
    """The tensors of one safetensors file, on the CPU, each in memory of its own (the reader's
    tensors map the file: a model that takes them as its weights could neither offload them to
    host, whose storage must be resizable, nor outlive a rewrite of the file). `ValueError`
    naming the file for anything that is not one: a truncated download, a `torch.save` pickle
    under the wrong name, a folder, a file we may not read."""
    try:
        return {name: t.clone() for name, t in load_file(str(path)).items()}
    except Exception as e:  # the Rust reader raises SafetensorError, OSError, ... by case
        raise ValueError(f"{path}: not a readable safetensors file ({first_line(e)})") from None


def load_weights_into(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], where: str,
                      mismatch: str = "does not fit this run's model", assign: bool = False,
                      part: Callable[[str], bool] | None = None) -> None:
    """Copy `state_dict` into `model`: same names, same shapes, nothing left over. Anything else
    is a one-line `ValueError`, `{where} {mismatch}: ...` naming the first tensor that differs
    (torch's own error lists every tensor, over many lines). For resuming from, or loading, a
    checkpoint that may come from another architecture. `part`: which of the model's tensors
    `state_dict` holds (by name; None: all of them), e.g. only a LoRA model's adapters."""
    own = {k: v for k, v in model.state_dict().items() if part is None or part(k)}
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
    model.load_state_dict(state_dict, strict=part is None, assign=assign)  # assign: a meta-built model takes the tensors
