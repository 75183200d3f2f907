"""`deploy.precision=bf16`: every role's passes under bf16 autocast with fp32 master weights (the
GPU setting; autocast runs on the CPU too, so it is tested here)."""

import pytest
import torch

from rlfusion.config import load_config
from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer


def _requests(tok, n=8):
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_ids=(tok.eos_id,))
    return [Request(str(i), [tok.bos_id] + tok.encode(f"{i}+{i * 7}="), params) for i in range(n)]


def test_the_engine_decodes_in_bf16_with_fp32_weights():
    model, tok, _ = load_base(find_base())
    model.eval()
    fp32 = LLMEngine(model, EngineConfig(max_num_seqs=8)).generate(_requests(tok))
    bf16 = LLMEngine(model, EngineConfig(max_num_seqs=8, compute_dtype=torch.bfloat16)).generate(_requests(tok))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    agree = sum(a.output_ids == b.output_ids for a, b in zip(fp32, bf16))
    assert agree >= 6  # the same greedy answers, bar a near-tie
    gaps = [abs(x - y) for a, b in zip(fp32, bf16) if a.output_ids == b.output_ids for x, y in zip(a.logprobs, b.logprobs)]
    assert 1e-4 < max(gaps) < 0.2  # bf16 really computed, and close


def _run(tmp_path, precision):
    cfg = load_config(TrainConfig, None, [f"deploy.precision={precision}", "deploy.backend=local", "max_steps=2",
                                          "rollout.prompts_per_step=8", "eval_problems=8", f"out_dir={tmp_path}"])
    trainer = RLTrainer(cfg, tmp_path / precision, find_base())
    try:
        ms = [trainer.train_step() for _ in range(2)]
        worker = trainer.devices.workers[0]
        state = worker.learner.actor.optimizer.state
        dtypes = {p.dtype for p in worker.learner.train_model.parameters()} | {
            t.dtype for st in state.values() for t in st.values() if torch.is_tensor(t) and t.dim()}
    finally:
        trainer.close()
    return ms, dtypes


@pytest.mark.slow
def test_rl_in_bf16_keeps_fp32_master_weights_and_its_engine_agrees_with_its_trainer(tmp_path):
    bf16, dtypes = _run(tmp_path, "bf16")
    fp32, _ = _run(tmp_path, "fp32")
    assert dtypes == {torch.float32}  # weights and AdamW state: the master copy
    assert all(m["trained"] and m["generated_tokens"] > 0 for m in bf16)
    gap = max(m["behaviour_logprob_gap"] for m in bf16)
    # the engine (bf16 decode) and the trainer (bf16 packed pass) agree closely, not bitwise
    assert max(m["behaviour_logprob_gap"] for m in fp32) < 1e-4 < gap < 0.05
