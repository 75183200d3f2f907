"""The run's data plane: samples move between the devices through DistQueue, the controller sends
commands and row ids; the local and Ray backends run the same commands on the same rows."""

from __future__ import annotations

import copy
import time

import pytest
import ray
import torch

from rlfusion.config import load_config
from rlfusion.model.checkpoint import find_base, load_checkpoint
from rlfusion.rl.tasks import make_task
from rlfusion.runtime import dataflow
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer


def _cfg(tmp_path, backend: str, **over) -> TrainConfig:
    items = [f"out_dir=\"{tmp_path}\"", f"base=\"{find_base()}\"", f"deploy.backend={backend}",
             f"deploy.num_devices={2 if backend == 'ray' else 1}", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "rollout.max_new_tokens=40", "max_steps=4", "eval_problems=8",
             "collapse_patience=0", "algo.dynamic_sampling=false", "algo.kl_coef=0"]
    return load_config(TrainConfig, None, items + [f"{k}={v}" for k, v in over.items()])


def _samples(cfg: TrainConfig, num_prompts: int) -> list:
    """Trajectories from the base policy (seeded), with fixed rewards, as queue rows take them."""
    model, tokenizer, _ = load_checkpoint(find_base())
    task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
    groups = list(range(1000, 1000 + num_prompts))
    trajs = RolloutStage(model, tokenizer, cfg.rollout, seed=3).generate(
        [dataflow.group_problem(task, cfg.seed, g) for g in groups], groups, 0)
    for i, t in enumerate(trajs):
        t.reward = t.correct = [1.0, 0.0, 0.5, 0.0][i % 4]
    return trajs


def _put(trainer: RLTrainer, trajs: list) -> list[int]:
    names = dataflow.ROLLOUT.writes + dataflow.REWARD.writes
    return trainer.devices.queue.put(dataflow.trajectory_columns(trajs, names),
                                     group_ids=[t.group_id for t in trajs], versions=[0] * len(trajs))


def test_ray_and_local_backends_take_the_same_update_from_the_same_rows(ray_session, tmp_path):
    """The same scored rows, put into each run's queue: one local device and two Ray devices
    (the first computes the advantages and splits the rows, each reads its half by row id) end
    with the same weights."""
    weights = {}
    for backend in ("local", "ray"):
        cfg = _cfg(tmp_path, backend)
        trainer = RLTrainer(cfg, tmp_path / backend, find_base())
        try:
            ids = _put(trainer, _samples(cfg, 4))
            metrics = trainer.devices.update(len(ids))  # advantages and the split on the first train device
            assert metrics["grad_norm"] > 0  # a real step ran
            assert len(trainer.devices.queue) == 0  # the rows retired
            trainer.sync_model()
            weights[backend] = copy.deepcopy(trainer.model.state_dict())
        finally:
            trainer.close()
    base, _, _ = load_checkpoint(find_base())
    assert any(not torch.equal(weights["local"][k], v) for k, v in base.state_dict().items())
    for k, v in weights["local"].items():
        torch.testing.assert_close(weights["ray"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_step_whose_devices_die_leaves_no_half_written_row(ray_session, tmp_path):
    """The device workers die before the step (each hosts the queue shard of the rows it makes,
    so the storage goes with them): the step fails with an error, and the queue holds no row a
    reader could take (writes are reserve → store → commit, and a failed store gives its rows
    up). A storage write that fails on a live device: `test_queue_ray.py`'s
    `test_ray_failed_shard_write_or_read_loses_and_blocks_nothing`."""
    cfg = _cfg(tmp_path, "ray")
    trainer = RLTrainer(cfg, tmp_path / "run", find_base())
    try:
        queue = trainer.devices.queue
        for shard in queue.shards:  # the device workers
            ray.kill(shard)
        with pytest.raises(Exception):
            trainer.train_step()
        # the step fails on the first device's error; another device may still be between
        # reserving its rows and giving them up, so its reservations go within a moment
        deadline = time.monotonic() + 30
        while ray.get(queue.controller.num_live.remote()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.get(queue.controller.num_live.remote()) == 0
        assert ray.get(queue.controller.get_stats.remote()).rows_served == 0
    finally:
        trainer.close()


def test_a_failed_advantage_stage_stops_every_train_device(ray_session, tmp_path):
    """The first train device's advantage stage waits for rows that never come: it fails with the
    timeout named, and the other train device, waiting for the split, learns of it instead of
    hanging; both then answer the next command."""
    from rlfusion.errors import RunError

    cfg = _cfg(tmp_path, "ray", **{"deploy.queue_timeout_s": 2})
    trainer = RLTrainer(cfg, tmp_path / "run", find_base())
    try:
        _put(trainer, _samples(cfg, 2))  # 8 rows; the update asks for 16
        with pytest.raises(RunError, match="waited 2 s for 16 scored rows and the queue had 8"):
            trainer.devices.update(16)
        assert set(trainer.devices.reports()) == {0, 1}
    finally:
        trainer.close()
