"""`rollout.backend=vllm` through the runtime, against the fake `vllm` module (tests/fake_vllm):
the switch puts vLLM to sleep while the actor trains and wakes it with the new weights loaded
in buckets, separated devices load what the bucketed broadcast brought, StaleSync's partial
rollouts abort and resume in it, and a missing vLLM is one line naming the extra."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hf_helpers import FAKE_VLLM_DIR, fake_vllm, make_hf_model  # noqa: E402
from rlfusion.cli import main  # noqa: E402
from rlfusion.config import load_config  # noqa: E402
from rlfusion.engine.vllm_backend import VLLMEngine  # noqa: E402
from rlfusion.model.checkpoint import find_base  # noqa: E402
from rlfusion.runtime.train_config import TrainConfig  # noqa: E402
from rlfusion.runtime.dataflow import ROLLOUT, to_trajectories  # noqa: E402
from rlfusion.runtime.trainer import RLTrainer  # noqa: E402
from rlfusion.stalesync.book import batch_rows  # noqa: E402

SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "eval_problems=4",
         "data.num_heldout=4", "algo.kl_coef=0.0"]


@pytest.fixture
def hf_run(tmp_path, monkeypatch):
    """An HF base (vLLM serves an HF family), a JSONL prompt set, and the fake as `vllm`."""
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    make_hf_model("qwen3_moe", tmp_path / "base")
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(16)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.fixture(scope="module")
def ray_with_fake_vllm():
    """One local Ray cluster for this module's Ray runs, started with the fake `vllm` (and this
    folder's reward functions) on its workers' PYTHONPATH: each run finds it up and leaves it so
    (a cluster start and stop fewer each); it stops after the module."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", f"{FAKE_VLLM_DIR}:{FAKE_VLLM_DIR.parent}:{os.environ.get('PYTHONPATH', '')}")
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            yield
        finally:
            ray.shutdown()


def _cfg(tmp_path, *extra):
    return load_config(TrainConfig, None, [f"base={tmp_path / 'base'}", f"data.path={tmp_path / 'p.jsonl'}",
                                           "rollout.backend=vllm", f"out_dir={tmp_path}", *SMALL, *extra])


def test_colocated_vllm_sleeps_for_training_and_wakes_with_the_new_weights(hf_run):
    cfg = _cfg(hf_run, "deploy.backend=local", "max_steps=3", "optim.lr=1e-3", "optim.warmup_steps=0",
               "reward=reward_fns:length_reward")
    trainer = RLTrainer(cfg, hf_run / "local", hf_run / "base")
    try:
        engine = trainer.devices.workers[0].generator.stage.engine
        assert isinstance(engine, VLLMEngine) and engine.llm.kwargs["skip_tokenizer_init"]
        ms = [trainer.train_step() for _ in range(3)]
    finally:
        trainer.close()
    events = engine.llm.events
    # asleep from the start; every rollout wakes it and loads the policy (it dropped the weights
    # at level 2 when the rollout before ended, since this device trains), then it sleeps again
    assert events[0] == "sleep1" and events[1:] == ["wake", "load", "sleep2"] * 3
    assert [m["engine_weight_loads"] for m in ms] == [1, 1, 1]
    assert all(m["trained"] for m in ms) and all(m["generated_tokens"] > 0 for m in ms)
    # the tokens came from the weights the actor trains: the behaviour logprobs vLLM reported
    # are the trainer's own (importance weights of 1), also after updates changed the policy
    for m in ms:
        assert m["behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_separated_stalesync_on_vllm_loads_broadcast_weights_and_resumes_partial_samples(ray_with_fake_vllm, hf_run,
                                                                                          monkeypatch):
    # the Ray workers import the fake as `vllm`, and the reward function from this folder
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_VLLM_DIR}:{FAKE_VLLM_DIR.parent}:{os.environ.get('PYTHONPATH', '')}")
    cfg = _cfg(hf_run, "deploy.backend=ray", "deploy.num_devices=2", "deploy.mode=separated",
               "stalesync.enabled=true", "stalesync.max_staleness=1", "max_steps=4",
               "rollout.lengths=replay", "rollout.replay_median=4", "reward=reward_fns:length_reward")
    trainer = RLTrainer(cfg, hf_run / "sep", hf_run / "base")
    partial, resumed = {}, []  # (group, sample) -> the aborted sample; (aborted, finished) pairs
    take, collect = trainer.stale.take_batch, trainer.stale.collect

    def watch(version):  # the rows of each batch, read from the queue before the update retires them
        groups, stats = take(version)
        rows = trainer.devices.queue.get_rows("test", batch_rows(groups), ROLLOUT.writes)
        resumed.extend((partial[t.group_id, t.sample], t) for t in to_trajectories(rows)
                       if (t.group_id, t.sample) in partial)
        return groups, stats

    def held(reports, dropped):  # after each rollout: the samples the rollout device holds paused
        collect(reports, dropped)
        for state in trainer.devices.paused():
            partial.update({(t.group_id, t.sample): t for s in state["samples"].values() for t in s
                            if t.finish_reason == "aborted" and t.response_ids})

    trainer.stale.take_batch, trainer.stale.collect = watch, held
    try:
        ms = [trainer.train_step() for _ in range(4)]
    finally:
        trainer.close()
    assert all(m["staleness_max"] <= 1 for m in ms) and [m["staleness_mean"] for m in ms][:2] == [0, 1]
    # every update is broadcast to the rollout device, which loads it into vLLM (in buckets)
    # before its next rollout, the first one included (the policy may differ from the folder)
    assert all(m["trained"] for m in ms) and [m["engine_weight_loads"] for m in ms] == [1, 1, 1, 1]
    # samples aborted at a rollout's end resume in vLLM in a later one: the finished sample
    # continues the partial one, tokens, logprobs and versions
    assert resumed
    for before, after in resumed:
        n = len(before.response_ids)
        assert len(after.response_ids) > n and after.response_ids[:n] == before.response_ids
        assert after.behaviour_logprobs[:n] == before.behaviour_logprobs and after.versions[:n] == before.versions
        assert after.versions == sorted(after.versions)


@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [
    ("colocated", ["deploy.train_ep=2"]),  # the replica filled from expert shards, then loaded into vLLM
    ("hybrid", ["stalesync.enabled=true", "stalesync.max_staleness=1"]),
])
def test_vllm_on_ray_in_a_training_layout_and_hybrid(ray_with_fake_vllm, hf_run, monkeypatch, mode, extra):
    monkeypatch.setenv("PYTHONPATH", f"{FAKE_VLLM_DIR}:{FAKE_VLLM_DIR.parent}:{os.environ.get('PYTHONPATH', '')}")
    cfg = _cfg(hf_run, "deploy.backend=ray", "deploy.num_devices=2", f"deploy.mode={mode}", "max_steps=3",
               "reward=reward_fns:length_reward", *extra)
    trainer = RLTrainer(cfg, hf_run / mode, hf_run / "base")
    try:
        ms = [trainer.train_step() for _ in range(3)]
    finally:
        trainer.close()
    assert all(m["trained"] and m["generated_tokens"] > 0 for m in ms)
    if mode == "colocated":
        # both devices wake vLLM with the weights gathered from the shards before every rollout,
        # and it generates from exactly those: the trainer's logprobs on its tokens are vLLM's
        assert [m["engine_weight_loads"] for m in ms] == [2, 2, 2]
        assert all(m["behaviour_logprob_gap"] < 1e-4 for m in ms)
    else:  # device 0 loads each broadcast; device 1 (it trains) reloads after each of its updates
        assert all(m["engine_weight_loads"] >= 1 for m in ms) and all(m["staleness_max"] <= 1 for m in ms)


def test_vllm_rollout_without_vllm_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    rc = main(["train", "rollout.backend=vllm", "deploy.backend=local", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'rlfusion[gpu]'" in err and err.count("\n") == 1


def test_vllm_refuses_a_base_it_cannot_serve(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    # the shipped tiny base routes with an expert bias that vLLM's Qwen MoE models do not have
    assert find_base() is not None
    rc = main(["train", "rollout.backend=vllm", "deploy.backend=local", f"out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot serve base" in err and "expert_bias" in err and err.count("\n") == 1
    rc = main(["train", "rollout.backend=sglang", f"out_dir={tmp_path}"])
    assert rc == 2 and "allowed: native, vllm" in capsys.readouterr().err


def test_vllm_rollout_state_is_not_resumed_bit_exactly(hf_run):
    """vLLM's sampler state is its own: a checkpoint stores an empty state for it."""
    cfg = _cfg(hf_run, "deploy.backend=local", "max_steps=1")
    trainer = RLTrainer(cfg, hf_run / "rng", hf_run / "base")
    try:
        states = trainer.devices.rng_state()
        assert all(isinstance(s, torch.Tensor) and s.numel() == 0 for s in states)
        trainer.devices.set_rng_state(states)
    finally:
        trainer.close()


def test_an_error_inside_a_rollout_is_not_hidden_by_the_switch_back(hf_run):
    cfg = _cfg(hf_run, "deploy.backend=local", "max_steps=1")
    trainer = RLTrainer(cfg, hf_run / "err", hf_run / "base")
    try:
        worker = trainer.devices.workers[0]
        engine = worker.generator.stage.engine
        with pytest.raises(ValueError, match="the body's own error"):
            with worker.ctx.switch.rollout():
                engine.add_request(__import__("rlfusion.engine.types", fromlist=["Request"]).Request(
                    "x", [0, 5], worker.generator.stage.params))
                raise ValueError("the body's own error")  # vLLM cannot sleep with a request open
    finally:
        trainer.close()
