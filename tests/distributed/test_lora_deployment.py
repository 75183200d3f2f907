"""LoRA RL on Ray device workers: in each layout an update changes only the adapters and equals
the one-process LoRA update; the rollout replica after the switch (or sync) generates the greedy
tokens of the merged one-process model; separated and hybrid runs send only the adapters;
checkpoints hold only the adapters and a run resumes from them."""

from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.evaluate import greedy_completions
from rlfusion.model import lora
from rlfusion.model.checkpoint import find_base, load_checkpoint
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.tasks.arithmetic import ArithmeticTask
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.trainer import RLTrainer

import test_deployment as td

LORA = {"optim.lora_rank": 8, "optim.lr": 1e-3}


def _adapted_base(cfg):
    """The base with the run's adapters (every device draws the same from `cfg.seed`)."""
    model, tokenizer, _ = load_checkpoint(find_base())
    return lora.attach(model, cfg.optim.lora_spec(cfg.seed)), tokenizer


def _merged(model) -> MoETransformer:
    plain = MoETransformer(model.config)
    plain.load_state_dict(lora.merged_state(model))
    return plain.eval()


def _greedy_on_rollout_devices(trainer, indices, max_new_tokens):
    module = sys.modules[td.__name__]
    ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import the test files
    try:
        rollout = [trainer.devices.workers[d] for d in trainer.devices.plan.rollout]
        return trainer.devices.call([w.__ray_call__.remote(td._greedy_ids, indices, max_new_tokens)
                                     for w in rollout])
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)


@pytest.mark.parametrize("layout", [
    # two colocated replicas (data parallel): the trained model generates with its adapters
    # beside its weights (lora_rollout=auto), or merged into them for each rollout
    {},
    {"optim.lora_rollout": "merged"},
    # training layouts: the replica the switch fills generates merged (auto), or unmerged
    {"deploy.train_tp": 2},
    {"deploy.train_ep": 2, "deploy.train_a2a_chunks": 2, "optim.recompute": "full"},
    {"deploy.train_fsdp": "true", "deploy.train_ep": 2, "optim.lora_rollout": "unmerged"},
    {"deploy.train_pp": 2, "deploy.train_vpp": 2, "optim.lora_targets": "attn,experts,router"},
    # separated: a pipeline over the 2 train devices sends the 2 rollout devices the adapters,
    # which they keep folded into their weights (taken out and put back around each sync)
    {"deploy.num_devices": 4, "deploy.mode": "separated", "deploy.train_pp": 2},
])
def test_lora_update_equals_one_process_and_the_replica_generates_its_tokens(ray_session, tmp_path, layout):
    cfg = td._cfg(tmp_path, "colocated", **{**LORA, **layout, "deploy.bucket_mb": 0.25})
    trainer = RLTrainer(cfg, tmp_path / "run", find_base())
    try:
        model, tokenizer = _adapted_base(cfg)
        trajs = td._sample(cfg, find_base(), 4)
        td._score(trajs, [1.0, 0.0, 0.5, 0.0])
        kept = td._advantaged(cfg, trajs)
        frozen = {k: v.clone() for k, v in model.state_dict().items() if not lora.is_adapter(k)}
        reference = ActorStage(model, cfg.algo, cfg.optim, cfg.rollout.temperature, total_updates=cfg.max_steps)
        assert all(lora.is_adapter(n) for n, p in model.named_parameters() if p.requires_grad)
        want = reference.update(kept)
        got = td._update(trainer, trajs)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["clip_fraction"] == pytest.approx(want["clip_fraction"], abs=1e-6)
        # only the adapters changed (one process), and the devices hold exactly the same adapters
        assert all(torch.equal(model.state_dict()[k], v) for k, v in frozen.items())
        gathered = trainer.devices.on_train_devices("weights")
        adapters = lora.adapter_state(model)
        assert set(gathered) == set(adapters)
        fresh = {k: v.detach() for k, v in lora.adapter_state(_adapted_base(cfg)[0]).items()}
        assert max(float((p.detach() - fresh[n]).abs().max()) for n, p in adapters.items()) > 1e-4  # (not vacuous)
        for name, p in adapters.items():
            td._assert_same_adam_step(gathered[name], p.detach(), atol=1e-5, lr_sum=reference.lr_at(0), name=name)
        if cfg.deploy.mode == "separated":  # the update's adapters went to the rollout devices, and only they
            assert trainer.devices.weight_sync_bytes == sum(t.numel() * t.element_size() for t in adapters.values())
        # the rollout replica (the switch's, or the trained model itself) generates what the
        # merged one-process model generates
        heldout, indices = ArithmeticTask(cfg.task).heldout(), list(range(8))
        engine = LLMEngine(_merged(model), EngineConfig(max_num_seqs=8, seed=0))
        want_ids = [list(c.output_ids) for c in greedy_completions(engine, tokenizer, [heldout[i] for i in indices], 40)]
        got_ids = _greedy_on_rollout_devices(trainer, indices, 40)
        assert all(ids == want_ids for ids in got_ids)
        # a second switch (or sync) applies the same adapters again (merged: once, not twice)
        if cfg.deploy.mode == "separated":
            trainer.devices.sync_rollout_weights()
        assert all(ids == want_ids for ids in _greedy_on_rollout_devices(trainer, indices, 40))
    finally:
        trainer.close()


def test_hybrid_lora_run_syncs_adapters_checkpoints_them_and_resumes(ray_session, tmp_path):
    """Hybrid (the train device also generates): each update broadcasts only the adapters to the
    rollout device; the checkpoint holds only the adapters (and the base's path and fingerprint),
    optimizer state for them alone; a resumed run picks them up and goes on."""
    from rlfusion.runtime.trainer import resume

    cfg = td._cfg(tmp_path, "hybrid", max_steps=2, checkpoint_every=1, eval_every=100, run_name="r",
                  **{**LORA, "stalesync.enabled": "true", "stalesync.max_staleness": 1})
    trainer = RLTrainer(cfg, tmp_path / "r", find_base())
    try:
        trainer.run(progress=False)
        adapters = lora.adapter_state(trainer.model)
        assert trainer.devices.weight_sync_bytes == sum(t.numel() * t.element_size() for t in adapters.values())
        rollout, train = (td._worker_params(trainer, d) for d in (0, 1))
        assert set(rollout) == set(adapters) and all(torch.equal(rollout[k], train[k]) for k in train)
    finally:
        trainer.close()
    ckpt = tmp_path / "r" / "checkpoint"
    assert (ckpt / "adapters.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert len(state["optimizer"]["state"]) == len(adapters)  # the adapters' moments only
    loaded, _, _ = load_checkpoint(ckpt)
    assert lora.spec_of(loaded) == lora.spec_of(trainer.model)  # (the default targets, resolved)
    assert all(torch.equal(lora.adapter_state(loaded)[k], v.cpu()) for k, v in adapters.items())
    again = resume(tmp_path / "r", {"max_steps": 3})
    try:
        assert again.step == 2
        assert all(torch.equal(lora.adapter_state(again.model)[k], v) for k, v in adapters.items())
        assert again.run(progress=False).steps == 3
    finally:
        again.close()


def test_resuming_with_other_lora_settings_is_one_line(ray_session, tmp_path):
    from rlfusion.runtime.trainer import resume

    cfg = td._cfg(tmp_path, "colocated", max_steps=1, checkpoint_every=1, eval_every=100, run_name="r",
                  **{**LORA, "deploy.num_devices": 1, "deploy.backend": "local"})
    trainer = RLTrainer(cfg, tmp_path / "r", find_base())
    try:
        trainer.run(progress=False)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"was written with optim.lora_rank=8 .*, this run has optim.lora_rank=4 ") as e:
        resume(tmp_path / "r", {"optim": {"lora_rank": 4}, "max_steps": 2})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over", [
    # fully shared: no reference copy to bring in from host (the policy's base is the reference)
    {"deploy.backend": "local", "deploy.num_devices": 1, "deploy.mode": "fully_shared"},
    # rollout devices whose replica splits its experts (infer_ep): their forwards are collectives in
    # the engine's lock-step, so the reference keeps a whole copy (3 groups over 2 devices: each
    # scores a different number of samples)
    {"deploy.num_devices": 3, "deploy.mode": "separated", "deploy.infer_ep": 2, "rollout.prompts_per_step": 3,
     "rollout.group_size": 2, "optim.microbatch_tokens": 64},
])
def test_lora_reference_where_the_policy_cannot_serve_as_it(ray_session, tmp_path, over):
    cfg = td._cfg(tmp_path, "colocated", **{**LORA, "max_steps": 2, "eval_every": 100, **over})
    trainer = RLTrainer(cfg, tmp_path / "run", find_base())
    try:
        first, second = trainer.train_step(), trainer.train_step()
        # the first step's policy is its base (B = 0), the second's is not: the KL to the base moved
        assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 1e-6
    finally:
        trainer.close()
