"""A base too large for the machine is refused from its `config.json` alone, in one line naming
the bytes, the machine's memory and a layout that would fit, before anything of it is allocated
(runtime/base_fit.py, model/base_info.py); a base that fits is built on the meta device and
takes its weights without a second copy."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_helpers import make_tokenizer
from rlfusion.config import load_config
from rlfusion.model import base_info
from rlfusion.model.hf_config import config_from_hf
from rlfusion.runtime import base_fit
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.train_config import TrainConfig

pytest.importorskip("tokenizers")

GIB = 2**30
# A Qwen2-MoE of ~30B parameters (Qwen1.5-MoE-A2.7B's widths, 48 layers, 64 experts): 110.5 GiB
# per float32 copy, far beyond a CI machine
QWEN2_MOE_30B = {
    "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 16,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts": 64, "num_experts_per_tok": 4, "max_position_embeddings": 8192, "rope_theta": 1e6,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2, "hidden_act": "silu"}
# a small MoE (53M parameters, most of them routed experts) the tests size the machine to
SMALL_MOE = {**QWEN2_MOE_30B, "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
             "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}


def _hf_folder(path: Path, config: dict) -> Path:
    """`config.json` and tokenizer files, no weights: all a size check may read."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    make_tokenizer(path)
    return path


def _prompts(path: Path) -> Path:
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["algo.kl_coef=0.001", *overrides])


def _full(config: dict) -> int:
    return base_info.FP32_BYTES * config_from_hf(config).param_counts()["total"]


# Starts the command and prints its seconds and peak RSS (`os.wait4`: no other process
# counts). A child's peak RSS includes its parent's high-water mark at the fork (exec carries
# it over), and this test process may have grown large by now (the tests before it), so a
# fresh small Python starts the command instead of this process.
MEASURE = """import os, subprocess, sys, time
start = time.monotonic()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(time.monotonic() - start, usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _measured(argv: list[str], **kwargs) -> tuple[int, str, float, int]:
    """`(exit status, stderr, seconds, peak RSS in bytes)` of one child process."""
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)
    out, err = proc.communicate()
    seconds, peak_kib = out.split()
    return proc.returncode, err, float(seconds), int(peak_kib) * 1024


def _one_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlfusion {command}: error: "), err
    return lines[0]


# ---- through the CLI -----------------------------------------------------------------------

def test_30b_base_is_refused_in_one_line_within_seconds_allocating_little(tmp_path):
    """The issue's case: before, the model was built in full first (a traceback from the
    allocator, or without a limit the machine's memory exhausted)."""
    base = _hf_folder(tmp_path / "qwen2-moe-30b", QWEN2_MOE_30B)
    rc, err, seconds, peak_rss = _measured([
        sys.executable, "-m", "rlfusion.cli", "train", f"base={base}", f"data.path={_prompts(tmp_path / 'p.jsonl')}",
        "data.prompt_field=question", "data.chat_template=true", "data.num_heldout=2", "deploy.backend=local",
        f"out_dir={tmp_path / 'runs'}"])
    assert rc == 2, err
    line = _one_line(err, "train")
    assert f"{base / 'config.json'}: 29.67B parameters, 110.5 GiB per float32 copy" in line
    assert "holds at least" in line and "in host memory" in line and "more than this" in line
    assert "no layout" in line and "use a smaller base" in line
    assert seconds < 5, seconds
    assert peak_rss < GIB, peak_rss


def test_default_ray_deployment_is_refused_before_ray_starts(tmp_path):
    base = _hf_folder(tmp_path / "big", QWEN2_MOE_30B)
    rc, err, _, peak_rss = _measured([sys.executable, "-m", "rlfusion.cli", "train", f"base={base}",
                                      f"out_dir={tmp_path / 'runs'}", "deploy.num_devices=2"])
    assert rc == 2 and "the controller's copy + 2 device(s) x up to" in _one_line(err, "train")
    assert peak_rss < GIB, peak_rss


def test_load_under_an_address_space_limit_is_one_line(tmp_path):
    """`ulimit -v` below the weights: refused by name where it was an allocator's RuntimeError
    traceback (through `rlfusion pretrain init=`, which loads the base without a run's check)."""
    base = _hf_folder(tmp_path / "mid", {**QWEN2_MOE_30B, "num_hidden_layers": 4})  # ~2.7B parameters

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (4 * GIB, 4 * GIB))

    rc, err, _, _ = _measured([sys.executable, "-m", "rlfusion.cli", "pretrain", f"init={base}",
                               f"out={tmp_path / 'out'}"], preexec_fn=limited)
    line = _one_line(err, "pretrain")
    assert rc == 2 and f"{base / 'config.json'}: the model has" in line and " GiB in float32, more than" in line
    assert "address-space limit (ulimit -v) of 4.0 GiB" in line or "RAM" in line, line
    assert not (tmp_path / "out").exists()


# ---- what a run holds ----------------------------------------------------------------------

def _need(cfg: TrainConfig, on_gpu: bool = False) -> base_fit.Need:
    return base_fit.run_need(cfg, DeploymentPlan.build(cfg.deploy), config_from_hf(SMALL_MOE), on_gpu)


def test_one_cpu_device_holds_weights_reference_grads_and_moments():
    full = _full(SMALL_MOE)
    need = _need(_cfg("deploy.backend=local"))
    assert need.device == 5 * full  # replica, reference, grads, two Adam moments
    assert need.host == full + 5 * full  # + the controller's copy, in the same RAM
    assert _need(_cfg("deploy.backend=local", "algo.kl_coef=0")).device == 4 * full
    # fully shared, the reference waits in host memory: on CPU that is the same RAM
    assert _need(_cfg("deploy.backend=local", "deploy.mode=fully_shared")).device == 5 * full


def test_on_a_gpu_the_moments_wait_on_the_host_while_generating():
    full = _full(SMALL_MOE)
    need = _need(_cfg("deploy.backend=local", "deploy.device=cuda"), on_gpu=True)
    assert need.device == 5 * full
    assert need.host == full + 2 * full  # the controller's copy + the offloaded moments


def test_expert_parallel_layout_trains_a_shard_but_generates_on_a_full_replica():
    counts = config_from_hf(SMALL_MOE).param_counts()
    full, experts = _full(SMALL_MOE), base_info.FP32_BYTES * counts["routed_experts"]
    shard = full - experts // 2
    need = _need(_cfg("deploy.num_devices=2", "deploy.train_ep=2"))
    rollout = full + full + shard + 2 * shard  # reference, replica, the shard, its moments (CPU: one RAM)
    train = full + 4 * shard  # reference, shard, grads, moments
    assert need.device == max(rollout, train)
    assert need.host == full + 2 * need.device


# ---- the refusal and its advice ------------------------------------------------------------

def _refusal(monkeypatch, cfg: TrainConfig, host: int, gpu: int | None = None) -> str:
    monkeypatch.setattr(base_fit, "host_memory", lambda: (host, f"this machine's {base_info.gib(host)} of RAM"))
    if gpu is not None:
        monkeypatch.setattr(base_fit, "_on_gpu", lambda cfg: True)
        monkeypatch.setattr(base_fit, "cuda_memory", lambda: (gpu, f"the {base_info.gib(gpu)} of one FakeGPU"))
    with pytest.raises(ValueError) as e:
        base_fit.check_fits(cfg, config_from_hf(SMALL_MOE), Path("m/config.json"), overlap=False)
    return str(e.value)


def _suggested(message: str) -> list[str]:
    """The keys a refusal says would make the run fit."""
    _, _, keys = message.partition("; a layout would fit: ")
    assert keys, message
    return keys.split()


def test_refusal_names_a_layout_that_fits_and_it_does(monkeypatch):
    cfg, ep2 = _cfg("deploy.num_devices=2"), _cfg("deploy.num_devices=2", "deploy.train_ep=2")
    assert _need(ep2).host < _need(cfg).host
    message = _refusal(monkeypatch, cfg, host=(_need(cfg).host + _need(ep2).host) // 2)
    assert message.startswith("m/config.json: 52,762,880 parameters, 0.2 GiB per float32 copy: this run "
                              "holds at least 2.2 GiB in host memory (the controller's copy + 2 device(s) x up "
                              "to 1.0 GiB), more than this machine's 1.9 GiB of RAM; "), message
    keys = _suggested(message)
    assert keys and all(k.startswith("deploy.train_") for k in keys)
    base_fit.check_fits(_cfg("deploy.num_devices=2", *keys), config_from_hf(SMALL_MOE), Path("m/config.json"),
                        overlap=False)


def test_refusal_without_a_layout_that_fits_says_why(monkeypatch):
    message = _refusal(monkeypatch, _cfg("deploy.backend=local"), host=_full(SMALL_MOE))
    assert "no layout (deploy.train_tp / train_ep / train_pp / train_fsdp / infer_ep) fits" in message


def test_gpu_memory_is_checked_per_device(monkeypatch):
    full = _full(SMALL_MOE)
    cfg = _cfg("deploy.num_devices=2", "deploy.device=cuda")
    message = _refusal(monkeypatch, cfg, host=100 * full, gpu=4 * full)
    assert f"its fullest device holds at least {base_info.gib(5 * full)}, more than the" in message
    assert "of one FakeGPU; " in message
    base_fit.check_fits(_cfg("deploy.num_devices=2", "deploy.device=cuda", *_suggested(message)),
                        config_from_hf(SMALL_MOE), Path("m/config.json"), overlap=False)


# ---- loading -------------------------------------------------------------------------------

def test_load_refuses_weights_beyond_memory_before_reading_them(tmp_path, monkeypatch):
    from rlfusion.model.checkpoint import load_base

    base = _hf_folder(tmp_path / "m", SMALL_MOE)
    (base / "model.safetensors").write_bytes(b"never read")
    monkeypatch.setattr(base_info, "host_memory", lambda: (GIB // 10, "this machine's 0.1 GiB of RAM"))
    with pytest.raises(ValueError, match=r"config.json: the model has [\d,]+ parameters, 0.2 GiB in float32, "
                                         r"more than this machine's 0.1 GiB of RAM"):
        load_base(base)


def test_loaded_model_has_real_tensors_and_the_tables_of_a_fresh_one(tmp_path):
    from rlfusion.model.checkpoint import load_base
    from rlfusion.model.hf import save_hf
    from rlfusion.model.transformer import MoETransformer

    torch.manual_seed(0)
    native = MoETransformer(config_from_hf(SMALL_MOE)).eval()
    save_hf(native, tmp_path / "m", family="qwen2_moe")
    loaded, _, _ = load_base(tmp_path / "m")
    tensors = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    assert not any(t.is_meta for t in tensors.values())
    assert all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in loaded.parameters())
    for name, t in native.named_buffers():
        torch.testing.assert_close(tensors[name], t, rtol=0, atol=0)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), native(ids))
