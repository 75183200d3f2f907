"""The vLLM rollout backend (engine/vllm_backend.py) against a fake `vllm` module
(`tests/fake_vllm/vllm`: the native engine behind vLLM's offline API surface, whose worker
rebuilds a native model from the HF-named tensors it is sent, so a wrong name or layout in a
weight update changes what it generates)."""

import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import fake_vllm, make_hf_model  # noqa: E402
from rlfusion.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from rlfusion.engine.types import Request, SamplingParams  # noqa: E402
from rlfusion.engine.vllm_backend import VLLMEngine, WeightLoaderExtension  # noqa: E402
from rlfusion.fusion.buckets import pack, plan_buckets, specs_of  # noqa: E402
from rlfusion.model.hf import load_hf  # noqa: E402




@pytest.fixture
def hf_dir(tmp_path):
    make_hf_model("qwen3_moe", tmp_path)
    return tmp_path


FAKE_VLLM = fake_vllm()


def _engine(path) -> tuple[VLLMEngine, torch.nn.Module]:
    native, _, meta = load_hf(path)
    return VLLMEngine(path, native.config, meta["family"], vllm_module=FAKE_VLLM), native


def _requests(n=3, max_new=10):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_ids=(2,))
    return [Request(str(i), [0] + [5 + i, 40, 41 + i], params) for i in range(n)]


def _native_greedy(model, requests):
    return LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(requests)


def test_vllm_is_not_imported_and_its_absence_is_one_clear_error(hf_dir):
    assert "vllm" not in sys.modules  # importing the backend module does not import vllm
    native, _, meta = load_hf(hf_dir)
    if "vllm" not in sys.modules:
        try:
            import vllm  # noqa: F401
        except ImportError:
            with pytest.raises(ImportError, match=r"pip install 'rlfusion\[gpu\]'"):
                VLLMEngine(hf_dir, native.config, meta["family"])


def test_generate_matches_the_native_engine_with_logprobs_and_versions(hf_dir):
    engine, native = _engine(hf_dir)
    kwargs = engine.llm.kwargs
    assert kwargs["enable_sleep_mode"] and kwargs["logprobs_mode"] == "processed_logprobs"
    got, want = engine.generate(_requests()), _native_greedy(native, _requests())
    for g, w in zip(got, want):
        assert (g.output_ids, g.finish_reason, g.prompt_ids) == (w.output_ids, w.finish_reason, w.prompt_ids)
        torch.testing.assert_close(g.logprobs, w.logprobs)
        assert g.versions == [0] * len(g.output_ids)


def test_abort_then_resume_continues_where_it_stopped(hf_dir):
    engine, native = _engine(hf_dir)
    for r in _requests():
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    partial = engine.abort(["0", "1", "2"])
    assert all(c.finish_reason == "aborted" and 0 < len(c.output_ids) < 10 for c in partial)
    assert not engine.has_unfinished()
    resumed = engine.generate([Request.resume(c) for c in partial])
    for r, w in zip(resumed, _native_greedy(native, _requests())):
        assert r.output_ids == w.output_ids and len(r.logprobs) == len(r.output_ids)


def test_update_weights_from_buckets_changes_the_policy(hf_dir):
    engine, _ = _engine(hf_dir)
    new, _, _ = load_hf(hf_dir)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    state = new.state_dict()
    buckets = plan_buckets(specs_of(state), 64 * 1024)
    assert len(buckets) > 3
    loaded = engine.update_weights((b, pack(b, state)) for b in buckets)
    fake_model = engine.llm.worker.model_runner.model
    assert loaded == len(fake_model.expected) and fake_model.reloads == 1
    got, want = engine.generate(_requests()), _native_greedy(new, _requests())
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert all(g.versions == [1] * len(g.output_ids) for g in got)


def test_sleep_and_wake(hf_dir):
    engine, _ = _engine(hf_dir)
    engine.add_request(_requests(1)[0])
    with pytest.raises(RuntimeError, match="cannot sleep with 1 unfinished requests"):
        engine.sleep()
    engine.abort(["0"])
    engine.sleep(level=1)
    assert engine.llm.sleeping == 1
    with pytest.raises(RuntimeError, match=r"asleep: call wake_up\(\) before add_request"):
        engine.add_request(_requests(1)[0])
    with pytest.raises(ValueError, match="sleep level=3"):
        engine.wake_up() or engine.sleep(level=3)
    assert engine.llm.sleeping is None
    assert len(engine.generate(_requests(1))[0].output_ids) > 0
    # level 2 drops the weights: generating needs a full weight load first
    native, _, _ = load_hf(hf_dir)
    engine.sleep(level=2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="without a full weight update"):
        engine.generate(_requests(1))
    engine.abort(["0"])
    assert engine.load_state(native.state_dict(), 64 * 1024) > 0
    assert engine.generate(_requests(1))[0].output_ids == _native_greedy(native, _requests(1))[0].output_ids


def test_worker_extension_moves_tensors_to_the_model_device():
    received = []
    ext = WeightLoaderExtension()
    model = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]),
                                  load_weights=lambda weights: received.extend(weights))
    ext.model_runner = types.SimpleNamespace(model=model)
    assert ext.load_hf_weights([("a", torch.ones(2))]) == 1
    assert received[0][0] == "a" and received[0][1].device.type == "cpu"


def test_stop_tokens_and_host_tensors_reach_vllm(hf_dir):
    engine, native = _engine(hf_dir)
    seen = []
    core = engine.llm.llm_engine
    add = core.add_request
    core.add_request = lambda rid, prompt, params: (seen.append(params), add(rid, prompt, params))
    forced = SamplingParams(temperature=1.0, max_new_tokens=4, stop_ids=())  # a replayed length
    engine.generate([Request("a", [0, 5], forced), Request("b", [0, 6], _requests(1)[0].params)])
    assert [p.ignore_eos for p in seen] == [True, False]  # no stop tokens: not vLLM's EOS either
    sent = []
    load = engine.llm.worker.load_hf_weights
    engine.llm.worker.load_hf_weights = lambda named: (sent.extend(named), load(named))[1]
    engine.load_state(native.state_dict(), 1 << 20)
    assert sent and all(t.device.type == "cpu" for _, t in sent)


def test_a_weight_load_sends_every_tensor_the_export_writes():
    """After a level-2 sleep vLLM has no weights left: a load must bring back every HF tensor,
    also those the native model has no tensor for (Qwen2-MoE's zero shared-expert gate)."""
    from rlfusion.model.checkpoint import find_base, load_base
    from rlfusion.model.hf import HFNames, infer_family, state_to_hf

    model, _, _ = load_base(find_base())
    for router in model.routers():
        router.expert_bias.zero_()
    family = infer_family(model.config)
    assert family == "qwen2_moe" and not model.config.shared_expert_gate
    names = HFNames(model.config, family)
    loaded = dict(pair for native, t in model.state_dict().items() for pair in names.tensors(native, t))
    exported = state_to_hf(model, family)
    assert set(loaded) == set(exported)
    for name, t in exported.items():
        torch.testing.assert_close(loaded[name].float(), t)
