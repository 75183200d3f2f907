"""What a base model is, read from its config files alone: no tensor is read or allocated.

Owns `base_config` (the native config of an HF folder or rlfusion checkpoint, from its
`config.json`), `hf_tokenizer` / `base_tokenizer` (the tokenizer and chat template, read before
any weight so that a bad one is named first), the memory of this machine (`host_memory`,
`cuda_memory`) and `check_weights_fit`, which every HF load runs before building anything: a
base whose float32 weights alone exceed the machine's memory is refused in one line instead of
ending in an allocator's traceback, or in the machine swapping itself to a halt.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from rlfusion.model.config import ModelConfig, config_from_dict
from rlfusion.model.files import first_line, read_json_file
from rlfusion.model.hf_config import config_from_hf, is_hf_checkpoint

FP32_BYTES = 4  # every copy of the weights is float32 (bf16 runs autocast; the weights stay fp32)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def billions(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params:,}"


# ---- the machine ---------------------------------------------------------------------------

def host_memory() -> tuple[int, str]:
    """`(bytes, what)`: the host memory this process may use and what sets it — the machine's
    RAM, or a lower cgroup limit (containers) or address-space limit (`ulimit -v`)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [(ram, f"this machine's {gib(ram)} of RAM")]
    cgroup = _cgroup_limit()
    if cgroup is not None:
        limits.append((cgroup, f"this process's cgroup memory limit of {gib(cgroup)}"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, f"this process's address-space limit (ulimit -v) of {gib(soft)}"))
    return min(limits)


def _cgroup_limit() -> int | None:
    for file in CGROUP_LIMITS:
        try:
            text = Path(file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # cgroup v1 writes a huge number for "none"
            return int(text)
    return None


def cuda_memory() -> tuple[int, str]:
    """`(bytes, what)` of the smallest GPU torch sees (call only where it sees one)."""
    import torch

    props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                key=lambda p: p.total_memory)
    return props.total_memory, f"the {gib(props.total_memory)} of one {props.name}"


def check_weights_fit(cfg: ModelConfig, where: str | Path) -> None:
    """Refuse to build a model whose float32 weights alone exceed this machine's host memory
    (`where`: the `config.json` it was read from). Loading builds on the host, whatever the
    device: nothing is allocated before this check."""
    params = cfg.param_counts()["total"]
    need = FP32_BYTES * params
    have, what = host_memory()
    if need > have:
        raise ValueError(f"{where}: the model has {billions(params)} parameters, {gib(need)} in float32, "
                         f"more than {what}; use a smaller base or a machine with more memory")


# ---- the base's files ----------------------------------------------------------------------

def base_config(path: str | Path, max_seq_len: int | None = None) -> tuple[ModelConfig, Path] | None:
    """`(native config, config.json)` of a base folder (HF or rlfusion), from `config.json`
    alone; None where it has none (the loader names what is missing)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    if is_hf_checkpoint(path):
        return config_from_hf(read_json_file(config), str(config), max_seq_len), config
    meta = read_json_file(config)
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise ValueError(f"{config} is not an rlfusion checkpoint config (no 'model' table)")
    fields = {**meta["model"], **({"max_seq_len": max_seq_len} if max_seq_len else {})}
    try:
        return config_from_dict(fields), config
    except (TypeError, ValueError) as e:  # wrong keys, types or values
        raise ValueError(f"{config}: bad model config ({first_line(e)})") from None


def hf_tokenizer(path: Path, hf: dict, cfg: ModelConfig):
    """The `HFTokenizer` of an HF folder (None without `tokenizer.json`), its chat template
    compiled; `hf` is the folder's `config.json`, whose `eos_token_id` names eos where the
    tokenizer config does not."""
    if not (path / "tokenizer.json").is_file():
        return None
    from rlfusion.model.hf_tokenizer import HFTokenizer

    eos = hf.get("eos_token_id")
    tokenizer = HFTokenizer.from_dir(path, eos[0] if isinstance(eos, list) and eos else eos)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{path / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size} tokens "
                         f"but the vocab_size of {path / 'config.json'} is {cfg.vocab_size}")
    return tokenizer


def base_tokenizer(path: str | Path):
    """The tokenizer of a base folder (HF or rlfusion), read without its weights; None where it
    has none. Errors name the file (a bad chat template: the file and the template line)."""
    from rlfusion.model.hf_tokenizer import tokenizer_from_dict

    path = Path(path)
    found = base_config(path)
    if found is None:
        return None
    cfg, config = found
    meta = read_json_file(config)
    if is_hf_checkpoint(path):
        return hf_tokenizer(path, meta, cfg)
    return tokenizer_from_dict(meta["tokenizer"], str(config)) if meta.get("tokenizer") else None
