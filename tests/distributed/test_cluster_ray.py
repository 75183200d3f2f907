"""Multi-node launch: an RL job on a two-node Ray cluster (`ray.cluster_utils.Cluster`, one CPU
per node, so the two device workers must land on different nodes), joined the way a real
cluster is (`deploy.ray_address`), training a local HF MoE on a JSONL prompt set."""

import json
import time

import pytest

pytest.importorskip("transformers")

from hf_helpers import make_hf_model  # noqa: E402
from rlfusion.config import load_config  # noqa: E402
from rlfusion.obs.metrics import read_metrics  # noqa: E402
from rlfusion.runtime.ray_devices import _start_ray  # noqa: E402
from rlfusion.runtime.train_config import TrainConfig  # noqa: E402
from rlfusion.runtime.trainer import RLTrainer  # noqa: E402


@pytest.mark.slow
def test_two_node_ray_cluster_runs_a_short_rl_job(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    trainer = None
    try:
        make_hf_model("qwen3_moe", tmp_path / "base")
        rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(10)]
        (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = load_config(TrainConfig, None, [
            f"base={tmp_path / 'base'}", f"data.path={tmp_path / 'p.jsonl'}", "data.num_heldout=2",
            "deploy.backend=ray", "deploy.num_devices=2", "deploy.mode=colocated",
            f"deploy.ray_address={cluster.address}", "max_steps=2", "eval_problems=2",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
            f"out_dir={tmp_path}", "run_name=cluster"])
        trainer = RLTrainer(cfg, tmp_path / "cluster", tmp_path / "base")
        bundles = ray.util.placement_group_table(trainer.devices.pg)["bundles_to_node_id"]
        assert len(set(bundles.values())) == 2  # one device worker per node
        result = trainer.run(progress=False)
        assert result.steps == 2 and result.stopped == "max_steps"
        steps = [r for r in read_metrics(tmp_path / "cluster" / "metrics.jsonl") if "reward_mean" in r]
        assert [r["step"] for r in steps] == [1, 2]
        assert {"utilization_device0", "utilization_device1"} <= set(steps[-1])
        trainer.close()
        trainer = None
        ray.shutdown()
        # with this cluster still up (the machine's latest, as `ray start` leaves one), a run
        # without deploy.ray_address starts a single-node cluster of its own instead of joining it
        _start_ray(ray, "", 1)
        assert ray.get_runtime_context().gcs_address != cluster.address
    finally:
        if trainer is not None:
            trainer.close()
        ray.shutdown()
        cluster.shutdown()
    assert time.monotonic() - t0 < 60
