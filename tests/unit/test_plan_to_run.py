"""The planner feeds the run: `rlfusion plan --emit-config FILE` writes a config `rlfusion train`
loads, with the layout the planner scored; a config for a cluster this machine is not is
refused in one line before anything starts; `deploy.ranks_per_node` reaches the training
layout and refuses values its nodes cannot take."""

import pytest

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.model.checkpoint import SHIPPED_BASE
from rlfusion.model.config import get_preset
from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.sim.emit_config import plan_config, ranks_per_node
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.plan import ParallelPlan, TrainJob

SMALL_PLAN = ["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq", "128", "--global-batch", "8", "--top", "1"]


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_emitted_config_loads_and_its_layout_fits_the_model(tmp_path, capsys):
    path = tmp_path / "run.toml"
    assert main([*SMALL_PLAN, "--layout", "ep2,mb2,recompute=full", "--emit-config", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    cfg = load_config(TrainConfig, path)  # the run's loader: every key known, every value allowed
    deploy = cfg.deploy
    assert (deploy.num_devices, deploy.mode, deploy.device) == (2, "fully_shared", "cpu")
    assert (deploy.train_tp, deploy.train_pp, deploy.train_vpp, deploy.train_ep) == (1, 1, 1, 2)
    assert deploy.train_fsdp and deploy.ranks_per_node == 0  # dp2; one node
    assert (cfg.optim.microbatch_tokens, cfg.optim.recompute) == (256, "full")
    plan = DeploymentPlan.build(deploy)
    plan.parallel_layout().validate(len(plan.train), get_preset("tiny"))


def test_best_plan_is_emitted_without_a_layout(tmp_path, capsys):
    path = tmp_path / "best.toml"
    assert main([*SMALL_PLAN, "--emit-config", str(path)]) == 0
    cfg = load_config(TrainConfig, path)
    assert cfg.deploy.num_devices == 2
    DeploymentPlan.build(cfg.deploy).parallel_layout().validate(2, get_preset("tiny"))


def test_emit_config_never_overwrites(tmp_path, capsys):
    path = tmp_path / "taken.toml"
    path.write_text("seed = 1\n")
    assert main([*SMALL_PLAN, "--emit-config", str(path)]) == 2
    assert "already exists" in _one_error_line(capsys)
    assert path.read_text() == "seed = 1\n"


def test_a_named_layout_the_planner_refuses_is_not_written(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    assert main([*SMALL_PLAN, "--layout", "ep3", "--emit-config", str(path)]) == 2
    assert "invalid" in _one_error_line(capsys) and not path.exists()


def test_nodes_are_the_clusters_fast_domains():
    plan = ParallelPlan(tp=8, pp=16, vpp=2, ep=32, dp=48, micro_batch=1, recompute="selective")
    assert ranks_per_node(plan, get_cluster("910b", 6144)) == (8, "")
    assert ranks_per_node(plan, get_cluster("cm384", 6144)) == (384, "")
    text = plan_config(plan, TrainJob(get_preset("pangu-ultra-moe-718b"), 8192, 1536),
                       get_cluster("h100", 6144), "pangu-ultra-moe-718b")
    assert 'device = "cuda"' in text and "ranks_per_node = 8" in text and "microbatch_tokens = 8192" in text


def test_a_config_for_another_cluster_is_refused_before_anything(tmp_path, capsys):
    path = tmp_path / "p.toml"
    assert main(["plan", "--model", "pangu-ultra-moe-718b", "--cluster", "910b:6144", "--seq", "8192",
                 "--layout", "tp8,pp16,ep32,vpp2", "--top", "1", "--emit-config", str(path)]) == 0
    cfg = load_config(TrainConfig, path)
    assert (cfg.deploy.num_devices, cfg.deploy.train_ep, cfg.deploy.ranks_per_node) == (6144, 32, 8)
    # the rollout's inference layout too: the replica (dense whole, experts over infer_ep devices, bf16)
    # within 3/4 of a 64 GB chip, and both layouts valid for the 718B model on these devices
    assert cfg.deploy.infer_ep == 128
    plan = DeploymentPlan.build(cfg.deploy)
    plan.parallel_layout().validate(len(plan.train), get_preset("pangu-ultra-moe-718b"))
    plan.inference_layout().validate(len(plan.rollout), get_preset("pangu-ultra-moe-718b"))
    capsys.readouterr()
    assert main(["train", str(path), f"out_dir={tmp_path / 'runs'}"]) == 2
    err = _one_error_line(capsys)
    assert "deploy.num_devices=6144 needs 6144" in err and "this machine has" in err
    assert not (tmp_path / "runs").exists()


# ---- deploy.ranks_per_node ----

def test_ranks_per_node_reaches_the_training_layout():
    plan = DeploymentPlan.build(DeployConfig(mode="fully_shared", num_devices=4, train_ep=4, ranks_per_node=2))
    layout = plan.parallel_layout()
    assert (layout.ranks_per_node, layout.hierarchical_a2a) == (2, True)
    layout.validate(4, get_preset("tiny"))
    assert "hierarchical expert all-to-all over nodes of 2 device(s)" in plan.describe()
    # an expert group inside one node: flat, the nodes only count the bytes that cross
    inside = DeploymentPlan.build(DeployConfig(mode="fully_shared", num_devices=4, train_ep=2, ranks_per_node=2))
    assert not inside.parallel_layout().hierarchical_a2a
    assert not DeploymentPlan.build(DeployConfig(num_devices=2, train_ep=2)).parallel_layout().hierarchical_a2a


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="fully_shared", num_devices=6, train_ep=2, ranks_per_node=3),
     "deploy.ranks_per_node=3 is invalid with train_ep=2: an expert-parallel group lies inside one node or "
     "spans whole nodes, so it must divide train_ep or be a multiple of it (allowed: 0, 1, 2, 6)"),
    (dict(mode="separated", num_devices=6, ranks_per_node=2),
     "deploy.ranks_per_node=2 is invalid: must divide the 6 devices and the index 3 of the first train device"),
])
def test_ranks_per_node_that_cuts_a_group_is_refused(kwargs, message):
    with pytest.raises(ValueError) as e:
        DeploymentPlan.build(DeployConfig(**kwargs))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["deploy.ranks_per_node=-1"], "deploy.ranks_per_node=-1 is invalid: must be >= 0 (0 = every device on one node)"),
    (["deploy.backend=ray", "deploy.num_devices=2", "deploy.train_ep=2", "deploy.ranks_per_node=3"],
     "deploy.ranks_per_node=3 is invalid: must divide the 2 devices, so the train devices fill whole nodes "
     "(allowed: 0, 1, 2)"),
])
def test_bad_ranks_per_node_is_one_line(tmp_path, capsys, overrides, message):
    capsys.readouterr()
    assert main(["train", f"base={SHIPPED_BASE}", f"out_dir={tmp_path / 'runs'}", "deploy.backend=local",
                 "max_steps=1", *overrides]) == 2
    assert message in _one_error_line(capsys)
    assert not (tmp_path / "runs").exists()
