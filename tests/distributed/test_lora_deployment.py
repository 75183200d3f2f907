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
    {},  # two colocated replicas (data parallel), the trained model generates with its adapters
    {"deploy.train_tp": 2},
    {"deploy.train_ep": 2, "deploy.train_a2a_chunks": 2, "optim.recompute": "full"},
    {"deploy.train_fsdp": "true", "deploy.train_ep": 2, "optim.lora_rollout": "merged"},
    {"deploy.train_pp": 2, "deploy.train_vpp": 2, "optim.lora_targets": "attn,experts,router"},
    # separated: a pipeline over the 2 train devices sends the 2 rollout devices the adapters,
    # which they fold into their weights
    {"deploy.num_devices": 4, "deploy.mode": "separated", "deploy.train_pp": 2, "optim.lora_rollout": "merged"},
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
        fresh = lora.adapter_state(_adapted_base(cfg)[0])
        assert max(float((p - fresh[n]).abs().max()) for n, p in adapters.items()) > 1e-4  # (not vacuous)
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
    finally:
        trainer.close()
