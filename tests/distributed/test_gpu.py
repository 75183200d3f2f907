"""GPU checks (`pytest -m gpu`; skipped without CUDA, so never in CPU CI): the native engine and
the actor compute on CUDA what they compute on the CPU, the train↔rollout switch really returns
GPU memory, `rlfusion train deploy.device=cuda` runs (one GPU in process; two over NCCL under
Ray), and, where vLLM is installed, its logprobs agree with the trainer's on the same tokens.
`bench/gpu_check.py` runs these beside two short RL runs."""

import contextlib
import json

import pytest
import torch

from rlfusion.config import load_config
from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.obs.metrics import read_metrics
from rlfusion.rl.trajectory import Trajectory, pack, token_logprobs
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig, TrainConfig
from rlfusion.runtime.trainer import RLTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)


def _base(device):
    model, tok, _ = load_base(find_base(), device=device)
    return model, tok


def _requests(tok, n=6, new=24):
    params = SamplingParams(temperature=0.0, max_new_tokens=new, stop_ids=(tok.eos_id,))
    return [Request(str(i), [tok.bos_id] + tok.encode(f"{i}+{i * 7}="), params) for i in range(n)]


def test_native_engine_on_cuda_matches_the_cpu():
    outs = {}
    for device in ("cpu", CUDA):
        model, tok = _base(device)
        outs[str(device)] = LLMEngine(model.eval(), EngineConfig(max_num_seqs=8)).generate(_requests(tok))
    for c, g in zip(outs["cpu"], outs[str(CUDA)]):
        n = next((i for i, (a, b) in enumerate(zip(c.output_ids, g.output_ids)) if a != b), len(c.output_ids))
        assert n >= len(c.output_ids) // 2  # greedy paths agree (a near-tie may flip late)
        torch.testing.assert_close(torch.tensor(g.logprobs[:n]), torch.tensor(c.logprobs[:n]), atol=2e-3, rtol=0)


def _trajs(tok, model):
    engine = LLMEngine(model.eval(), EngineConfig(max_num_seqs=8))
    done = engine.generate([Request(r.request_id, r.prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=16))
                            for r in _requests(tok)])
    out = []
    for i, c in enumerate(done):
        t = Trajectory.of_completion(c)
        t.advantage = 1.0 if i % 2 else -1.0
        out.append(t)
    return out


def test_actor_update_on_cuda_matches_the_cpu():
    cpu_model, tok = _base("cpu")
    trajs = _trajs(tok, cpu_model)
    deltas, metrics = {}, {}
    for device in ("cpu", CUDA):
        model, _ = _base(device)
        before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        actor = ActorStage(model, AlgoConfig(kl_coef=0.0), OptimConfig(lr=1e-3, warmup_steps=0), 1.0)
        metrics[str(device)] = actor.update([Trajectory(**{**t.__dict__}) for t in trajs])
        deltas[str(device)] = {n: p.detach().cpu() - before[n] for n, p in model.named_parameters()}
    assert metrics[str(CUDA)]["grad_norm"] == pytest.approx(metrics["cpu"]["grad_norm"], rel=1e-2)
    for name, d in deltas["cpu"].items():
        torch.testing.assert_close(deltas[str(CUDA)][name], d, atol=2e-5, rtol=0.05)


def test_the_switch_returns_gpu_memory():
    model, tok = _base(CUDA)
    actor = ActorStage(model, AlgoConfig(kl_coef=0.0), OptimConfig(warmup_steps=0), 1.0)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=64))
    switch = DeviceSwitch(0, model, model, engine, 4 << 20, False, lambda phase: contextlib.nullcontext(), CUDA)
    switch.attach(optimizer=actor.optimizer)
    with switch.train():
        actor.update(_trajs(tok, model))
    torch.cuda.synchronize()
    trained = torch.cuda.memory_allocated()
    optimizer_bytes = sum(t.numel() * t.element_size() for st in actor.optimizer.state.values()
                          for t in st.values() if torch.is_tensor(t) and t.is_cuda)
    with switch.rollout():
        in_rollout = torch.cuda.memory_allocated()
        cache = engine.cache_bytes
    assert cache > 0 and in_rollout <= trained - optimizer_bytes + cache  # optimizer state on host
    switch.enter_train()
    assert torch.cuda.memory_allocated() == trained  # back, and the KV cache gone
    memory = switch.memory()
    assert {"allocator_peaks/train", "allocator_peaks/rollout", "allocator_peaks/switch"} <= set(memory)
    assert memory["offloads"] == memory["restores"] == 1


def _run(tmp_path, name, *over):
    cfg = load_config(TrainConfig, None, ["deploy.device=cuda", "max_steps=2", "rollout.prompts_per_step=8",
                                          "eval_problems=16", f"out_dir={tmp_path}", f"run_name={name}", *over])
    trainer = RLTrainer(cfg, tmp_path / name, find_base())
    try:
        result = trainer.run(progress=False)
    finally:
        trainer.close()
    return result, [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "reward_mean" in r]


def test_rl_on_one_gpu_in_process(tmp_path):
    result, steps = _run(tmp_path, "local", "deploy.backend=local")
    assert result.steps == 2 and all(s["generated_tokens"] > 0 for s in steps)
    assert all(s["memory_allocated_peak_train_mb"] > 0 and s["zero_redundancy_ok"] for s in steps)
    assert all(s["behaviour_logprob_gap"] < 0.01 for s in steps)  # one engine, one model, one device


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_rl_on_two_gpus_over_nccl(tmp_path):
    result, steps = _run(tmp_path, "ray", "deploy.backend=ray", "deploy.num_devices=2", "deploy.mode=colocated")
    assert result.steps == 2 and {"utilization_device0", "utilization_device1"} <= set(steps[-1])
    config = json.loads((tmp_path / "ray" / "config.json").read_text())
    assert config["deploy"]["device"] == "cuda"


def test_vllm_logprobs_agree_with_the_trainer():
    pytest.importorskip("vllm")
    from rlfusion.engine.vllm_backend import VLLMEngine

    model, tok = _base(CUDA)
    for router in model.routers():  # vLLM's Qwen MoE has no expert bias
        router.expert_bias.zero_()
    engine = VLLMEngine.from_model(model, seed=0, max_num_seqs=16, gpu_memory_utilization=0.3)
    done = engine.generate([Request(r.request_id, r.prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=24))
                            for r in _requests(tok, n=16)])
    trajs = [Trajectory.of_completion(c) for c in done]
    batch = pack(trajs, CUDA)
    with torch.no_grad():
        trainer_N, _ = token_logprobs(model.eval(), batch, 1.0)
    mask = batch.loss_mask_N.bool()
    gap = (trainer_N[mask] - batch.behaviour_logprobs_N[mask]).abs().mean().item()
    assert gap < 0.05  # vLLM computes in bf16, the trainer in fp32
