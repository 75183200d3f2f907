"""The rollout's inference layout on the vLLM backend (`engine/vllm_backend.VLLMLayout`): which
`vllm.LLM` arguments and `VLLM_DP_*` variables each `deploy.infer_ep` / `infer_tp` gives an
engine, the layouts and vLLM versions it refuses, and weight loads into an expert-parallel
engine (against the fake `vllm` in `tests/fake_vllm`)."""

import os
import types
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import fake_vllm, make_hf_model  # noqa: E402
from rlfusion.engine.vllm_backend import (DP_ENV, VLLMEngine, VLLMLayout, check_layout_support,  # noqa: E402
                                          dp_ranks_per_group)
from rlfusion.model.hf import load_hf, state_to_hf  # noqa: E402

FAKE_VLLM = fake_vllm()
MASTER = ("10.0.0.7", 29600)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_hf_model("qwen3_moe", path)
    return path


@pytest.fixture(autouse=True)
def dp_env_restored():
    """A layout's engine sets `VLLM_DP_*` in this process: each test starts and ends without them."""
    saved = {k: os.environ.pop(k) for k in DP_ENV if k in os.environ}
    yield
    for k in DP_ENV:
        os.environ.pop(k, None)
    os.environ.update(saved)


def _engine(path, layout=None, vllm_module=FAKE_VLLM) -> VLLMEngine:
    native, _, meta = load_hf(path)
    return VLLMEngine(path, native.config, meta["family"], layout=layout, vllm_module=vllm_module)


@pytest.mark.parametrize("ep, tp, group", [(1, 1, 1), (2, 1, 2), (4, 1, 4), (1, 2, 1), (2, 2, 1), (4, 2, 2)])
def test_ranks_per_group_are_ep_over_tp(ep, tp, group):
    assert dp_ranks_per_group(ep, tp) == group


@pytest.mark.parametrize("ep, tp, match", [
    (2, 4, r"infer_ep=2 / infer_tp=4 is invalid .*\(allowed infer_tp: 1, 2\)$"),
    (4, 3, r"infer_tp must divide infer_ep \(allowed infer_tp: 1, 2, 4\)"),
    (0, 1, "both must be >= 1"),
])
def test_layouts_vllm_cannot_take_are_refused(ep, tp, match):
    with pytest.raises(ValueError, match=match):
        dp_ranks_per_group(ep, tp)
    with pytest.raises(ValueError, match=match):
        VLLMLayout(ep, tp)


def test_a_rank_outside_its_group_or_a_group_without_master_is_refused():
    with pytest.raises(ValueError, match=r"rank 2 is invalid: a group of infer_ep=4 / infer_tp=2 has ranks 0..1"):
        VLLMLayout(4, 2, rank=2, master=MASTER)
    with pytest.raises(ValueError, match="group of 4 ranks needs its rendezvous master"):
        VLLMLayout(4, 1, rank=1)
    VLLMLayout(2, 2)  # one rank per group (tensor parallel inside it): nothing to meet


# (infer_ep, infer_tp, rank) -> vllm.LLM layout arguments and VLLM_DP_* environment
CASES = [
    (1, 1, 0, {}, {}),
    (2, 1, 1, {"tensor_parallel_size": 1, "enable_expert_parallel": True},
     {"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "1"}),
    (4, 1, 3, {"tensor_parallel_size": 1, "enable_expert_parallel": True},
     {"VLLM_DP_SIZE": "4", "VLLM_DP_RANK": "3"}),
    (1, 2, 0, {"tensor_parallel_size": 2, "enable_expert_parallel": False}, {}),
    (2, 2, 0, {"tensor_parallel_size": 2, "enable_expert_parallel": True}, {}),
    (4, 2, 1, {"tensor_parallel_size": 2, "enable_expert_parallel": True},
     {"VLLM_DP_SIZE": "2", "VLLM_DP_RANK": "1"}),
]


@pytest.mark.parametrize("ep, tp, rank, kwargs, env", CASES)
def test_the_engine_is_built_with_its_layout(hf_dir, ep, tp, rank, kwargs, env):
    engine = _engine(hf_dir, VLLMLayout(ep, tp, rank=rank, master=MASTER))
    built = engine.llm.kwargs
    assert {k: built[k] for k in ("tensor_parallel_size", "enable_expert_parallel") if k in built} == kwargs
    assert "data_parallel_size" not in built  # LLM refuses it outside torchrun: the rank comes from VLLM_DP_*
    if env:  # local rank 0: the engine takes the GPU(s) this worker sees; the group's master for all
        env = {**env, "VLLM_DP_RANK_LOCAL": "0", "VLLM_DP_MASTER_IP": MASTER[0], "VLLM_DP_MASTER_PORT": str(MASTER[1])}
    assert engine.llm.dp_env == env
    assert built["logprobs_mode"] == "processed_logprobs" and built["enable_sleep_mode"]


def test_from_model_passes_the_layout(hf_dir):
    native, _, _ = load_hf(hf_dir)
    engine = VLLMEngine.from_model(native, hf_dir, layout=VLLMLayout(2, 1, rank=0, master=MASTER),
                                   vllm_module=FAKE_VLLM)
    assert engine.llm.kwargs["enable_expert_parallel"] and engine.llm.dp_env["VLLM_DP_RANK"] == "0"


@dataclass
class _OldEngineArgs:  # vLLM before expert parallelism and logprobs_mode
    model: str = ""
    tensor_parallel_size: int = 1


@pytest.mark.parametrize("module, match", [
    (types.SimpleNamespace(__version__="0.8.0", EngineArgs=_OldEngineArgs),
     r"needs vLLM >= 0\.10\.0 \(installed: 0\.8\.0; no enable_expert_parallel, logprobs_mode\)"),
    (types.SimpleNamespace(__version__="0.9.2", EngineArgs=FAKE_VLLM.EngineArgs),
     r"infer_ep=2 / infer_tp=1 needs vLLM >= 0\.10\.0 \(installed: 0\.9\.2\)$"),
])
def test_a_vllm_without_the_options_is_refused_before_building(hf_dir, module, match):
    layout = VLLMLayout(2, 1, rank=0, master=MASTER)
    with pytest.raises(ValueError, match=match):
        _engine(hf_dir, layout, vllm_module=module)  # no LLM in `module`: it must stop before building
    assert "VLLM_DP_SIZE" not in os.environ
    check_layout_support(module, VLLMLayout())  # the plain engine asks nothing more
    check_layout_support(types.SimpleNamespace(__version__="0.11.1.dev7+g1234", EngineArgs=FAKE_VLLM.EngineArgs),
                         layout)


def test_an_expert_parallel_engine_is_sent_every_tensor_whole(hf_dir):
    """vLLM's `load_weights` takes full checkpoint tensors and keeps its rank's experts itself."""
    engine = _engine(hf_dir, VLLMLayout(2, 1, rank=1, master=MASTER))
    native, _, meta = load_hf(hf_dir)
    sent = {}
    load = engine.llm.worker.load_hf_weights
    engine.llm.worker.load_hf_weights = lambda named: (sent.update(named), load(named))[1]
    assert engine.load_state(native.state_dict(), 64 * 1024) == len(sent)
    full = state_to_hf(native, meta["family"])
    assert {n: tuple(t.shape) for n, t in sent.items()} == {n: tuple(t.shape) for n, t in full.items()}
    for name, t in full.items():
        torch.testing.assert_close(sent[name].float(), t.float())
    assert engine.llm.worker.model_runner.model.reloads == 1
