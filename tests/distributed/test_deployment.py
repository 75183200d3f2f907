"""Deployment modes on Ray device workers: placement, data-parallel updates equal to one process,
weight sync in separated mode, and a clear error when a worker dies."""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
import time

import pytest
import ray
import ray.cloudpickle
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.evaluate import greedy_completions
from rlfusion.model.checkpoint import find_base
from rlfusion.config import load_config
from rlfusion.model.checkpoint import load_checkpoint
from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan
from rlfusion.queue import DistQueue, split_balanced
from rlfusion.runtime import dataflow
from rlfusion.runtime.actor import ActorStage
from rlfusion.rl.trajectory import split_by_token_budget
from rlfusion.runtime.advantage_stage import compute_advantages
from rlfusion.runtime.reference_stage import ReferenceStage
from rlfusion.runtime.rollout_stage import RolloutStage
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer
from rlfusion.runtime.ray_devices import WorkerDiedError
from rlfusion.rl.tasks.arithmetic import ArithmeticTask


@pytest.mark.parametrize("mode, n, want", [
    ("separated", 2, {0: ("rollout", "reference", "reward"), 1: ("train",)}),
    ("separated", 4, {0: ("rollout", "reference", "reward"), 1: ("rollout", "reference", "reward"), 2: ("train",), 3: ("train",)}),
    ("colocated", 2, {0: ("rollout", "train", "reference", "reward"), 1: ("rollout", "train", "reference", "reward")}),
    ("colocated", 3, {0: ("rollout", "train"), 1: ("rollout", "train"), 2: ("reference", "reward")}),
    ("fully_shared", 3, {d: ("rollout", "train", "reference", "reward") for d in range(3)}),
    ("hybrid", 2, {0: ("rollout",), 1: ("rollout", "train", "reference", "reward")}),
    ("hybrid", 3, {0: ("rollout",), 1: ("rollout",), 2: ("rollout", "train", "reference", "reward")}),
])
def test_plan_roles(mode, n, want):
    plan = DeploymentPlan.build(DeployConfig(mode=mode, num_devices=n, backend="ray"))
    assert {d: plan.roles(d) for d in range(n)} == want
    assert plan.colocated_actor == (mode not in ("separated", "hybrid"))


@pytest.mark.parametrize("scorers, overlap, on_train", [
    ("auto", False, False), ("auto", True, True), ("rollout", True, False), ("train", False, True)])
def test_separated_scorers_sit_next_to_rollout_or_train(scorers, overlap, on_train):
    """StaleSync's overlap ("auto") moves reference and reward to the train devices, so the
    rollout devices only generate while the train devices score and update."""
    plan = DeploymentPlan.build(DeployConfig(mode="separated", num_devices=4, backend="ray", scorers=scorers),
                                overlap=overlap)
    assert plan.rollout == (0, 1) and plan.train == (2, 3)
    assert plan.reference == plan.reward == ((2, 3) if on_train else (0, 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "mixed"}, "deploy.mode"),
    ({"mode": "separated", "scorers": "ref"}, "deploy.scorers"),
    ({"mode": "colocated", "scorers": "train"}, "mode 'separated' only"),
    ({"mode": "separated", "num_devices": 1}, "needs >= 2"),
    ({"mode": "separated", "backend": "local"}, "needs >= 2"),
    ({"backend": "local", "num_devices": 2}, "exactly 1 device"),
    ({"backend": "mpi"}, "deploy.backend"),
    ({"train_tp": 0}, "deploy.train_tp"),
    ({"backend": "local", "train_fsdp": True}, "train_fsdp=true is invalid with backend 'local'"),
    ({"train_pp": 0}, "deploy.train_pp"),
    ({"train_vpp": 2}, "deploy.train_vpp=2 is invalid: must be >= 1, and 1 unless train_pp > 1"),
    ({"train_schedule": "dualpipe"}, "deploy.train_schedule='dualpipe' is invalid: allowed: 1f1b, interleaved, overlap_fb"),
    ({"train_pp": 2, "train_vpp": 2, "train_schedule": "1f1b"}, "train_schedule='1f1b' is invalid: needs train_vpp=1"),
    ({"train_pp": 2, "train_schedule": "interleaved"}, "train_schedule='interleaved' is invalid: needs train_vpp >= 2"),
    ({"train_schedule": "overlap_fb", "train_ep": 2}, "train_schedule='overlap_fb' is invalid: needs train_pp > 1, "
                                                      "train_vpp 1 or 2"),
    ({"train_pp": 2, "train_vpp": 3, "train_ep": 2, "train_schedule": "overlap_fb"}, "needs train_pp > 1, train_vpp 1 or 2"),
    ({"train_pp": 2, "train_schedule": "overlap_fb"}, "and train_ep > 1 \\(it overlaps the expert all-to-all\\)"),
    ({"mode": "hybrid", "num_devices": 1}, "mode 'hybrid' needs >= 2"),
    ({"mode": "hybrid", "num_devices": 4, "train_tp": 2}, "invalid with mode 'hybrid'"),
])
def test_bad_deploy_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeployConfig(**kwargs)


def _cfg(tmp_path, mode: str, **over) -> TrainConfig:
    items = [f"out_dir=\"{tmp_path}\"", f"base=\"{find_base()}\"", "deploy.backend=ray", "deploy.num_devices=2", f"deploy.mode={mode}",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=60", "max_steps=4",
             "eval_problems=8", "collapse_patience=0", "algo.dynamic_sampling=false"]
    return load_config(TrainConfig, None, items + [f"{k}={v}" for k, v in over.items()])


FIRST_TEST_GROUP = 1000  # the tests' own groups: clear of the ids a run's steps use (0, 1, ...)


_SAMPLES: dict[tuple, list] = {}  # one seeded rollout per (base, rollout, task, reference micro-batch, prompts)


def _sample(cfg, base, num_prompts: int):
    """Trajectories from the base policy on `num_prompts` task prompts (seeded), with their
    reference logprobs (the base model's, as a reference device would add them) and the
    per-row numbers the controller's advantage stage writes. Seeded, so the same for every test
    of the same settings: generated once per module, each test gets its own copy."""
    key = (str(base), repr(cfg.rollout), repr(cfg.task), cfg.optim.microbatch_tokens, num_prompts)
    if key not in _SAMPLES:
        _SAMPLES[key] = _generate(cfg, base, num_prompts)
    return copy.deepcopy(_SAMPLES[key])


def _generate(cfg, base, num_prompts: int):
    model, tokenizer, _ = load_checkpoint(base)
    rng = random.Random(3)
    task = ArithmeticTask(cfg.task)
    groups = list(range(FIRST_TEST_GROUP, FIRST_TEST_GROUP + num_prompts))
    trajs = RolloutStage(copy.deepcopy(model), tokenizer, cfg.rollout, seed=3).generate(
        [task.sample(rng) for _ in range(num_prompts)], groups, 0)
    ReferenceStage(model, cfg.rollout.temperature, cfg.optim.microbatch_tokens).logprobs(trajs)
    for t in trajs:
        t.correct = t.reward
    return trajs


# what the rows of an update carry when the advantage stage reads them: the rollout's columns
# and the scorers'
SCORED_COLUMNS = dataflow.ROLLOUT.writes + dataflow.REWARD.writes + dataflow.REFERENCE.writes


def _score(trajs, rewards: list[float]) -> None:
    """Set each sample's reward and task score, `rewards[i % len(rewards)]` for sample i."""
    for i, t in enumerate(trajs):
        t.reward = t.correct = rewards[i % len(rewards)]


def _put(trainer, trajs) -> list[int]:
    """`trajs` as scored rows of the trainer's queue, ready for an update; returns their row ids."""
    return trainer.devices.queue.put(dataflow.trajectory_columns(trajs, SCORED_COLUMNS),
                                     group_ids=[t.group_id for t in trajs],
                                     versions=[min(t.versions, default=0) for t in trajs])


def _advantaged(cfg, trajs) -> list:
    """What the first train device's advantage stage makes of `trajs`: copies in (group, sample)
    order with their advantages, the ones the update keeps."""
    rows = sorted(copy.deepcopy(trajs), key=lambda t: (t.group_id, t.sample))
    return compute_advantages(rows, cfg.algo, cfg.rollout.group_size)


def _shards(trainer, kept) -> list[list]:
    """The samples of each data-parallel rank, balanced by tokens (as the first train device splits)."""
    parts = split_balanced([t.num_tokens for t in kept], trainer.devices.plan.train_dp)
    return [[kept[i] for i in part] for part in parts]


def _assert_same_adam_step(got: torch.Tensor, want: torch.Tensor, atol: float, lr_sum: float, name: str) -> None:
    """Weights after the same Adam step(s), within `atol`. An element whose gradient is float
    noise (~1e-10: a sum in another order may even flip its sign) still takes Adam's full first
    step, m/sqrt(v) = ±1, so it may differ by up to twice the step sizes; at most 1% may."""
    diff = (got - want).abs()
    off = diff > atol
    assert not (diff > 2 * lr_sum * 1.01 + atol).any(), (name, float(diff.max()))
    assert int(off.sum()) <= max(1, off.numel() // 100), (name, int(off.sum()), off.numel())


def _update(trainer, trajs) -> dict[str, float]:
    """One update of the train devices on exactly `trajs` (through the queue, as in a step:
    advantages and the split on the first train device, the rows retire afterwards)."""
    _put(trainer, trajs)
    return trainer.devices.update(len(trajs))


def _kill(worker) -> None:
    """Kill a device worker and wait until Ray reports it dead (`ray.kill` returns at once; on
    a loaded machine the next call could otherwise still reach the live process)."""
    ray.kill(worker)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(worker.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("the killed worker still answers after 30 s")


def _worker_params(trainer, device):
    return trainer.devices.call([trainer.devices.workers[device].weights.remote()])[0]


@pytest.mark.parametrize("kwargs, match", [
    ({"num_devices": 2, "train_tp": 3}, "must divide the 2 train devices"),
    ({"mode": "colocated", "num_devices": 3, "train_tp": 2}, "spans every device"),
    ({"num_devices": 2, "train_tp": 2, "train_fsdp": True}, "data-parallel devices .* must be >= 2"),
    ({"mode": "colocated", "num_devices": 3, "train_fsdp": True}, "train_fsdp=true is invalid with 3 devices"),
    ({"mode": "fully_shared", "num_devices": 6, "train_pp": 4}, "train_pp=4 is invalid: train_pp x train_tp = 4 must divide the 6"),
    # separated: the layout spans the train devices (the second half)
    ({"mode": "separated", "num_devices": 2, "train_tp": 2}, "train_tp=2 is invalid: .* must divide the 1 train devices"),
    ({"mode": "separated", "num_devices": 4, "train_fsdp": True, "train_tp": 2}, "train_fsdp=true is invalid with 2 train devices"),
])
def test_bad_train_layout(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeploymentPlan.build(DeployConfig(backend="ray", **kwargs))


def test_train_layout_that_does_not_fit_the_model_is_refused_before_workers_start(tmp_path):
    cfg = _cfg(tmp_path, "fully_shared", **{"deploy.num_devices": 4, "deploy.train_tp": 4})  # 2 kv heads
    with pytest.raises(ValueError, match="deploy.train_tp=4 / train_ep=1 does not fit the model"):
        RLTrainer(cfg, tmp_path / "run", find_base())
    with pytest.raises(ValueError, match="algo.advantage=gae"):
        RLTrainer(_cfg(tmp_path, "colocated", **{"deploy.train_tp": 2, "algo.advantage": "gae"}),
                  tmp_path / "run", find_base())
    # 4 layers cannot be cut into pp x vpp = 8 pipeline stages
    with pytest.raises(ValueError, match=r"train_pp=2 / train_vpp=4 does not fit the model: .*pp\*vpp = 8 exceeds"):
        RLTrainer(_cfg(tmp_path, "colocated", **{"deploy.train_pp": 2, "deploy.train_vpp": 4}),
                  tmp_path / "run", find_base())


@pytest.mark.parametrize("over, match", [
    ({"optim.expert_balance": "true"}, "optim.expert_balance=true is invalid with deploy.train_ep=1"),
    ({"optim.recompute": "plan", "optim.activation_budget_mb": 1, "deploy.train_pp": 2},
     "optim.recompute=plan is invalid with deploy.train_pp=2"),
    ({"optim.recompute": "plan"}, "optim.activation_budget_mb=0.0 is invalid: must be > 0 with optim.recompute=plan"),
    ({"optim.recompute": "some"}, "optim.recompute='some' is invalid: allowed: none, selective, full, swap, plan"),
    ({"optim.dp_balance": "flops"}, "optim.dp_balance='flops' is invalid: allowed: tokens, cost"),
])
def test_training_options_that_cannot_apply_are_refused(tmp_path, over, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, "colocated", **over)


def test_plan_puts_pipeline_stages_first_and_groups_a_data_parallel_rank():
    """Train devices are ordered (pp, dp, tp): the devices of one data-parallel rank, across
    stages and TP ranks, see the same rows."""
    plan = DeploymentPlan.build(DeployConfig(backend="ray", mode="fully_shared", num_devices=8, train_pp=2, train_tp=2))
    assert plan.train_dp == 2
    assert [plan.dp_index(d) for d in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert plan.model_parallel_group(1) == [2, 3, 6, 7]
    assert "pp2 x tp2 x ep1 x dp2" in plan.describe()


@pytest.mark.parametrize("layout, pick", [
    # (each layout's plain form is a part of a case below: expert parallelism's of its
    # hierarchical, micro-batched and recomputed cases, FSDP's of its own, plain 1F1B's of the
    # separated pipeline and the pipeline x tensor parallel cases)
    ({"deploy.train_tp": 2}, None),
    # one device per node: the expert all-to-all goes node by node (hierarchical)
    ({"deploy.train_ep": 2, "deploy.ranks_per_node": 1}, None),
    # the three longest samples in 64-token micro-batches: one data-parallel rank gets two
    # (two micro-batches), the other one, which joins the first's second expert all-to-alls
    # with a pass that contributes nothing
    ({"deploy.train_ep": 2, "optim.microbatch_tokens": 64}, "3 longest"),
    # the expert all-to-all overlapped with computation, in chunks: with a rank that joins the
    # other's second micro-batch with a pass that contributes nothing; with whole layers
    # recomputed (the replay issues the chunks' transfers again)
    ({"deploy.train_ep": 2, "deploy.train_a2a_chunks": 3, "optim.microbatch_tokens": 64}, "3 longest"),
    ({"deploy.train_ep": 2, "deploy.train_a2a_chunks": 2, "optim.recompute": "full"}, None),
    # FSDP's all-gathers and reduce-scatters are collectives too: the rank with one micro-batch
    # joins the other's second with a pass that contributes nothing
    ({"deploy.train_fsdp": "true", "optim.microbatch_tokens": 64}, "3 longest"),
    ({"deploy.train_fsdp": "true", "deploy.train_ep": 2}, None),
    # off-policy minibatches (a proximal no-grad pass first) and the routers' bias update
    ({"deploy.train_fsdp": "true", "algo.minibatches": 2, "algo.ppo_epochs": 2,
      "optim.router_bias_update": "true"}, None),
    # pipeline stages on two devices (the loss's per-token inputs reach the last stage beside
    # the rows): interleaved (two model chunks per stage) with each layer's attention
    # recomputed; 1F1B over 64-token micro-batches (several per step) with off-policy
    # minibatches (a forward-only pipeline pass for the proximal logprobs) and the routers'
    # bias update (padding tokens are not counted)
    ({"deploy.train_pp": 2, "deploy.train_vpp": 2, "optim.recompute": "selective"}, None),
    ({"deploy.train_pp": 2, "optim.microbatch_tokens": 64, "algo.minibatches": 2, "algo.ppo_epochs": 2,
      "optim.router_bias_update": "true"}, None),
    # four devices: pipeline x tensor parallel, pipeline x expert parallel (data parallel 2)
    ({"deploy.num_devices": 4, "deploy.mode": "fully_shared", "deploy.train_pp": 2, "deploy.train_tp": 2}, None),
    ({"deploy.num_devices": 4, "deploy.mode": "fully_shared", "deploy.train_pp": 2, "deploy.train_ep": 2}, None),
    # Adaptive Pipe (two stages per device in a V, forward and backward of different
    # micro-batches overlapped); with whole layers recomputed and the chunked all-to-all in the
    # unpaired actions: a layer whose forward ran unpaired (warm-up) is replayed inside a pair's
    # backward half, and must split its all-to-all as its forward did
    ({"deploy.num_devices": 4, "deploy.mode": "fully_shared", "deploy.train_pp": 2, "deploy.train_ep": 2,
      "deploy.train_schedule": "overlap_fb"}, None),
    ({"deploy.num_devices": 4, "deploy.mode": "fully_shared", "deploy.train_pp": 2, "deploy.train_ep": 2,
      "deploy.train_schedule": "overlap_fb", "deploy.train_a2a_chunks": 2, "optim.recompute": "full"}, None),
    # three stages of the base's 4 layers: 1, 2 and 1 layers (the first one dense, the last
    # beside the head)
    ({"deploy.num_devices": 3, "deploy.mode": "fully_shared", "deploy.train_pp": 3}, None),
    # activations recomputed or swapped (the reference keeps them all): whole layers with
    # expert parallelism (the replay repeats the all-to-alls), swap with FSDP, the planner's
    # choice under a budget with TP
    ({"deploy.train_ep": 2, "optim.recompute": "full"}, None),
    ({"deploy.train_fsdp": "true", "optim.recompute": "swap"}, None),
    ({"deploy.train_tp": 2, "optim.recompute": "plan", "optim.activation_budget_mb": 0.5}, None),
    # expert balancing: experts migrate after the first update (margin 0: whenever the planned
    # placement differs); a second update runs in the migrated placement
    ({"deploy.train_ep": 2, "optim.expert_balance": "true", "optim.expert_balance_margin": 0.0}, "twice"),
    # separated on 4 devices: a pipeline over the 2 train devices, whose gathered weights go to
    # the 2 rollout devices after each update
    ({"deploy.num_devices": 4, "deploy.mode": "separated", "deploy.train_pp": 2}, None),
])
def test_train_layout_equals_one_process_and_switches_to_a_replica(ray_session, tmp_path, layout, pick):
    """`deploy.train_tp=2` / `train_ep=2` / `train_fsdp=true`: the actor trains on TP shards
    over both devices, or with its routed experts split over them, or with everything else
    sharded over them (FSDP; data parallel otherwise), and takes exactly the one-process step;
    each rollout runs on a full replica filled from the shards (bucketed reshard) and freed
    after it, within the zero-redundancy bound; checkpoints hold whole tensors and load back
    into the shards."""
    base = find_base()
    cfg = _cfg(tmp_path, "colocated", **{**layout, "deploy.bucket_mb": 0.25})
    trainer = RLTrainer(cfg, tmp_path / "run", base)
    try:
        model, tokenizer, _ = load_checkpoint(base)
        trajs = _sample(cfg, base, 4)
        if pick:  # one group of the three longest samples and the shortest
            by_length = sorted(trajs, key=lambda t: t.num_tokens)
            trajs = copy.deepcopy(by_length[:1] + by_length[-3:])
            for i, t in enumerate(trajs):
                t.group_id, t.sample = FIRST_TEST_GROUP + 100, i
        _score(trajs, [1.0, 0.0, 0.5, 0.0])
        kept = _advantaged(cfg, trajs)
        if pick:  # one rank's share takes two micro-batches, the other's one
            assert sorted(len(split_by_token_budget(s, 64)) for s in _shards(trainer, kept)) == [1, 2]
        plain = dataclasses.replace(cfg.optim, recompute="none", expert_balance=False)
        reference = ActorStage(model, cfg.algo, plain, cfg.rollout.temperature, total_updates=cfg.max_steps)
        want = reference.update(kept)
        got = _update(trainer, trajs)
        # several optimizer steps (minibatches x epochs): Adam's first step moves every entry whose
        # gradient is near zero by about +-lr whatever its float noise, so the later steps' norms
        # differ by a few 1e-4 from a different summation order (the first agrees to 1e-6)
        per_update = cfg.algo.minibatches * cfg.algo.ppo_epochs
        steps = per_update * (2 if pick == "twice" else 1)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4 if per_update == 1 else 2e-3)
        # the loss's metrics come from the device that computed them (in Adaptive Pipe's V, the
        # last stage sits on the first pipeline device)
        assert got["clip_fraction"] == pytest.approx(want["clip_fraction"], abs=1e-6)
        if cfg.deploy.train_ep > 1:  # the update's expert all-to-all, measured
            assert got["ep_a2a_mb"] > 0 and got["ep_a2a_exposed_s"] >= 0
            nodes = cfg.deploy.ranks_per_node > 0  # else one node: nothing crosses
            assert got["ep_a2a_hierarchical"] == float(nodes) and (got["ep_a2a_internode_mb"] > 0) == nodes
        if cfg.optim.recompute != "none" and not cfg.deploy.train_pp > 1:
            assert got["activation_mb"] > 0
        if cfg.deploy.train_schedule == "overlap_fb":  # (one pass: Adaptive Pipe still probes its order)
            assert got["overlap_fb_forward_first"] == -1.0
        if pick == "twice":
            assert got["expert_migrated_layers"] >= 1
            want = reference.update(copy.deepcopy(kept))
            got = _update(trainer, trajs)  # in the migrated placement
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=2e-3)
        gathered = trainer.devices.on_train_devices("weights")  # from both devices' shards
        for name, p in model.state_dict().items():
            _assert_same_adam_step(gathered[name], p, atol=1e-5 * (1 if steps == 1 else 4),
                                   lr_sum=sum(reference.lr_at(v) for v in range(steps)), name=name)
        # the rollout replica the switch fills from the layout (or, separated, the weights the
        # train devices gathered and broadcast) generates the greedy tokens a replica of the
        # one-process weights does, on every rollout device
        heldout, indices = ArithmeticTask(cfg.task).heldout(), list(range(8))
        engine = LLMEngine(copy.deepcopy(model), EngineConfig(max_num_seqs=8, seed=0))
        want_ids = [list(c.output_ids) for c in greedy_completions(engine, tokenizer, [heldout[i] for i in indices], 40)]
        module = sys.modules[__name__]
        ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import this test file
        try:
            rollout = [trainer.devices.workers[d] for d in trainer.devices.plan.rollout]
            got_ids = trainer.devices.call([w.__ray_call__.remote(_greedy_ids, indices, 40) for w in rollout])
        finally:
            ray.cloudpickle.unregister_pickle_by_value(module)
        assert all(ids == want_ids for ids in got_ids)

        m = trainer.train_step()  # rollout on the replica, then a TP update
        assert m["zero_redundancy_ok"] == 1.0
        if cfg.deploy.mode != "separated":
            assert m["time_switch_s"] > 0
            assert m["memory_peak_rollout_mb"] > m["memory_peak_train_mb"]  # the replica lives only for the rollout
        state = trainer.devices.state()  # whole tensors, gathered from the shards
        assert all(not isinstance(v, torch.distributed.tensor.DTensor)
                   for st in state["optimizer"]["state"].values() for v in st.values())
        _update(trainer, trajs)  # moves away from the saved state...
        trainer.devices.load_state(state)  # ...and back, into the shards
        again = trainer.devices.state()
        for name, t in state["model"].items():
            assert torch.equal(again["model"][name], t), name
        for i, st in state["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(again["optimizer"]["state"][i][k], v), (i, k)
    finally:
        trainer.close()


def test_colocated_data_parallel_update_equals_one_process(ray_session, tmp_path):
    """Two train devices, each with half the samples, take exactly the full-batch step (the
    routers' expert-bias update included: it sees the whole batch's load on every replica)."""
    base = find_base()
    cfg = _cfg(tmp_path, "colocated", **{"optim.router_bias_update": "true"})
    trainer = RLTrainer(cfg, tmp_path / "run", base)
    try:
        model, _, _ = load_checkpoint(base)
        trajs = _sample(cfg, base, 4)
        _score(trajs, [1.0, 0.0, 0.5, 0.0])
        kept = _advantaged(cfg, trajs)
        shards = _shards(trainer, kept)
        assert len(shards) == 2 and all(shards)  # each device trains on its half
        reference = ActorStage(model, cfg.algo, cfg.optim, cfg.rollout.temperature, total_updates=cfg.max_steps)
        want = reference.update(kept)
        got = _update(trainer, trajs)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        replicas = [_worker_params(trainer, d) for d in (0, 1)]
        bias = [k for k in replicas[0] if k.endswith("expert_bias")]
        assert bias and any(replicas[0][k].abs().sum() > 0 for k in bias)  # the bias did move
        for name, p in model.state_dict().items():
            assert torch.equal(replicas[0][name], replicas[1][name]), name  # replicas stay identical
            torch.testing.assert_close(replicas[0][name], p, rtol=0, atol=1e-6)
    finally:
        trainer.close()


def test_separated_mode_syncs_weights_and_learns_steps(ray_session, tmp_path):
    trainer = RLTrainer(_cfg(tmp_path, "separated"), tmp_path / "run", find_base())
    try:
        before = _worker_params(trainer, 0)
        for _ in range(2):
            m = trainer.train_step()
            assert m["generated_tokens"] > 0
        rollout, train = _worker_params(trainer, 0), _worker_params(trainer, 1)
        assert all(torch.equal(rollout[k], train[k]) for k in train)  # the rollout device got the update
        assert any(not torch.equal(before[k], train[k]) for k in train)
        num_bytes = sum(p.numel() * p.element_size() for p in trainer.model.state_dict().values())
        assert trainer.devices.weight_sync_bytes == num_bytes and trainer.version == 2
        phases = {d: {s.phase for s in trainer.timeline.spans if s.device == d} for d in ("device0", "device1")}
        # KV cache in, generate, out, score its samples, put the rows; weights in
        assert phases["device0"] == {"rollout", "switch", "reference", "reward", "queue", "transfer"}
        # advantages on the rows' numbers, read its rows, train; weights out
        assert phases["device1"] == {"advantage", "queue", "train", "transfer"}
        assert 0 < m["utilization_device0"] < 1 and 0 < m["utilization_device1"] < 1
    finally:
        trainer.close()


def test_fully_shared_takes_the_steps_colocated_takes(ray_session, tmp_path):
    """Fully shared differs from colocated only in where the reference weights wait (host, brought
    in for each reference pass), so its run takes the same steps: the same samples, rewards and
    weights (up to the reference pass's float noise when shared scoring splits the batch
    differently). With the colocated run's learning (tests/test_e2e_learning.py) this shows the
    fully shared run learns."""
    weights, metrics = {}, {}
    for mode in ("colocated", "fully_shared"):
        trainer = RLTrainer(_cfg(tmp_path, mode), tmp_path / mode, find_base())
        try:
            metrics[mode] = [trainer.train_step() for _ in range(2)]
            weights[mode] = _worker_params(trainer, 0)
        finally:
            trainer.close()
    for a, b in zip(metrics["colocated"], metrics["fully_shared"]):
        assert (a["generated_tokens"], a["reward_mean"], a["kept_fraction"]) == \
            (b["generated_tokens"], b["reward_mean"], b["kept_fraction"])
        # the reference weights stay on host outside its passes
        assert a["memory_peak_rollout_mb"] > b["memory_peak_rollout_mb"]
        assert a["memory_peak_train_mb"] > b["memory_peak_train_mb"]
    for name, w in weights["colocated"].items():
        torch.testing.assert_close(weights["fully_shared"][name], w, rtol=0, atol=1e-6, msg=name)


def test_killed_worker_names_its_device_and_roles(ray_session, tmp_path):
    trainer = RLTrainer(_cfg(tmp_path, "separated"), tmp_path / "run", find_base())
    try:
        _kill(trainer.devices.workers[1])
        with pytest.raises(WorkerDiedError, match=r"device 1 \(train\) died"):
            trainer.train_step()
    finally:
        trainer.close()


@pytest.mark.parametrize("layout", [{}, {"deploy.train_tp": 2, "deploy.train_ep": 2}, {"deploy.train_fsdp": "true"}])
def test_run_resumes_on_fresh_workers_after_a_worker_dies(ray_session, tmp_path, layout):
    from rlfusion.runtime.trainer import resume

    cfg = _cfg(tmp_path, "colocated", max_steps=2, checkpoint_every=1, eval_every=100, run_name="r", **layout)
    trainer = RLTrainer(cfg, tmp_path / "r", find_base())
    try:
        trainer.run(progress=False)  # 2 steps, checkpointed
        _kill(trainer.devices.workers[0])
        with pytest.raises(WorkerDiedError, match=r"device 0 \(rollout\+train\+reference\+reward\) died"):
            trainer.train_step()
    finally:
        trainer.close()
    again = resume(tmp_path / "r", {"max_steps": 3})
    try:
        assert again.step == 2 and again.version == 2
        # a layout's whole weights are gathered from every device's shards; replicas each hold them
        weights = [again.devices.on_train_devices("weights")] if layout else again.devices.call(
            [w.weights.remote() for w in again.devices.workers])
        saved = again.model.state_dict()  # the driver's copy, loaded from the checkpoint
        assert all(torch.equal(w[k], saved[k]) for w in weights for k in saved)
        result = again.run(progress=False)
        assert result.steps == 3
    finally:
        again.close()


def test_worker_dying_before_a_collective_is_reported_at_once(ray_session, tmp_path):
    """Device 0 would wait in the update's all-reduce for a peer that is gone; the driver must
    report the dead device instead of waiting with it."""
    base = find_base()
    cfg = _cfg(tmp_path, "colocated")
    trainer = RLTrainer(cfg, tmp_path / "run", base)
    try:
        trajs = _sample(cfg, base, 2)
        _score(trajs, [1.0, 0.0])
        _put(trainer, trajs)  # the rows wait in the queue
        _kill(trainer.devices.workers[1])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"device 1 \("):
            trainer.devices.update(len(trajs))
        assert time.monotonic() - start < 30
    finally:
        trainer.close()


def test_skipped_update_keeps_versions_and_checkpoints_with_offloaded_optimizer(ray_session, tmp_path):
    """A step whose groups all carry no signal skips the update while the optimizer state is
    still on host: the versions must move on everywhere and a checkpoint must still be whole."""
    from rlfusion.runtime import run_state

    base = find_base()
    cfg = _cfg(tmp_path, "colocated", run_name="skip", **{"algo.dynamic_sampling": "true"})
    trainer = RLTrainer(cfg, tmp_path / "skip", base)
    flat = _sample(cfg, base, 2)
    _score(flat, [1.0])  # every sample right: no group carries signal
    varied = copy.deepcopy(flat)
    for t in varied:
        t.group_id += 10
    _score(varied, [1.0, 0.0])
    try:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        assert trainer.train_step()["trained"] == 1  # the optimizer now has state
        devices = trainer.devices
        _put(trainer, flat)  # the next update's rows
        devices.rollout([100, 101], trainer.version)  # offloads it; these rows wait behind
        assert devices.update(len(flat))["trained"] == 0
        run_state.save(trainer)
        state = run_state.read_state(trainer.run_dir / "checkpoint" / run_state.STATE)
        moments = [v["exp_avg"] for v in state["optimizer"]["state"].values()]
        assert moments and all(m.untyped_storage().nbytes() > 0 for m in moments)
        versions = trainer.devices.call([w.state.remote() for w in trainer.devices.workers])
        assert [v["version"] for v in versions] == [2, 2] == [trainer.version] * 2
        _put(trainer, varied)
        devices.rollout([200, 201], trainer.version)  # offload again, twice in a row
        m = devices.update(16)  # groups 100, 101 and the varied ones: restores the optimizer state and trains
        assert trainer.version == 3 and m["trained"] == 1 and m["grad_norm"] > 0
    finally:
        trainer.close()


@pytest.mark.parametrize("layout", [{}, {"deploy.train_ep": 2, "optim.microbatch_tokens": 64},
                                    {"deploy.train_fsdp": "true", "optim.microbatch_tokens": 64}])
def test_non_finite_loss_on_one_train_device_stops_both(ray_session, tmp_path, layout):
    """A NaN on one data-parallel rank raises on every rank instead of leaving its peer waiting
    in the gradient sum (or, with experts split over the ranks, in the next all-to-all)."""
    base = find_base()
    cfg = _cfg(tmp_path, "colocated", **layout)
    trainer = RLTrainer(cfg, tmp_path / "run", base)
    try:
        trajs = _sample(cfg, base, 4)
        _score(trajs, [1.0, 0.0, 0.5, 0.0])
        trajs[0].behaviour_logprobs[0] = float("nan")  # only one device's share is bad
        shards = _shards(trainer, _advantaged(cfg, trajs))
        assert len(shards) == 2 and all(shards)  # the NaN sample is on one of two ranks
        with pytest.raises(Exception, match="loss became nan"):
            _update(trainer, trajs)
    finally:
        trainer.close()


def _rows(queue, count: int) -> list[tuple]:
    """Every row of `queue` as (group id, sample, response, reward, reference logprobs), sorted."""
    batch = queue.get("check", ["sample", "response_ids", "reward", "ref_logprobs"], count + 1)
    c = batch.columns
    return sorted(zip(batch.group_ids, c["sample"], c["response_ids"], c["reward"], c["ref_logprobs"]))


def _same_rows(got: list[tuple], want: list[tuple]) -> None:
    assert [r[:2] for r in got] == [r[:2] for r in want]
    for a, b in zip(got, want):
        assert a[2] == b[2] and a[3] == b[3], a[:2]
        torch.testing.assert_close(torch.tensor(a[4]), torch.tensor(b[4]), rtol=0, atol=1e-5)


def test_shared_scoring_takes_each_row_once_and_equals_unshared_scoring(tmp_path):
    """Shared scoring through the queue: the generating device puts samples unscored as they
    finish; an idle peer (a second worker on the same queue, on its own thread) takes the first
    chunk while the rollout still decodes, scores and writes it; the generating device scores
    the rest once its decoding is done. Every row is scored exactly once, identical to a rollout
    that scores its own samples before they go in."""
    import threading

    from rlfusion.queue.controller import row_runs
    from rlfusion.runtime.workers import DeviceWorker

    cfg = _cfg(tmp_path, "colocated", **{"deploy.num_devices": 1})
    plan = DeploymentPlan.build(cfg.deploy)
    groups = [10, 11, 12, 13]
    G = cfg.rollout.group_size
    plain = DeviceWorker(0, plan, cfg, str(find_base()), queue=DistQueue(dataflow.queue_config(G)))
    plain.connect(None)
    assert plain.generate(groups, 0, score_here=True)["rows"] == 16
    want = _rows(plain.ctx.queue, 16)
    assert [r[:2] for r in want] == [(g, i) for g in groups for i in range(G)]

    queue = DistQueue(dataflow.queue_config(G))
    worker = DeviceWorker(0, plan, cfg, str(find_base()), queue=queue)
    peer = DeviceWorker(0, plan, cfg, str(find_base()), queue=queue)
    for w in (worker, peer):
        w.connect(None)
    put, puts = worker.generator._put, []

    def put_then_let_the_peer_take(trajs, scored):  # the first chunk is the peer's, deterministically
        ids = put(trajs, scored)
        puts.append(len(ids))
        deadline = time.monotonic() + 60
        while len(puts) == 1 and queue.count_consumed("reward", groups) < len(ids) < 16:
            assert time.monotonic() < deadline, "the peer never took the first chunk"
            time.sleep(0.01)
        return ids
    worker.generator._put = put_then_let_the_peer_take
    helped: list[tuple[int, int]] = []
    helper = threading.Thread(target=lambda: helped.append(peer.scorer.score_shared(groups, set())))
    helper.start()
    out = worker.generate(groups, 0, score_here=True, share=row_runs(groups))
    helper.join(60)
    (peer_rows, peer_others), = helped
    assert sum(puts) == 16 and len(puts) >= 2  # put as they finished, a chunk at a time
    assert peer_rows >= 1 and peer_others == peer_rows  # the peer scored some of the generator's
    assert out["rows"] + peer_rows == 16 and out["peer_rows"] == 0
    assert len(queue) == 16 and queue.count_consumed("reward", groups) == 16
    _same_rows(_rows(queue, 16), want)


def test_colocated_rollout_with_shared_scoring_equals_one_without(ray_session, tmp_path):
    """Two devices, one with far more prompts (it keeps generating while the other is idle and
    scores its finished samples from the queue): the queue holds every sample once, with the
    same responses, rewards and reference logprobs."""
    from rlfusion.queue.controller import row_runs

    results = {}
    for share in (True, False):
        cfg = _cfg(tmp_path / str(share), "colocated", **{"deploy.share_scoring": str(share).lower()})
        trainer = RLTrainer(cfg, tmp_path / str(share) / "run", find_base())
        try:
            devices = trainer.devices
            step = row_runs(range(9)) if share else ()
            outs = devices._run([(0, "generate", (list(range(8)), 0, True, step)),
                                 (1, "generate", ([8], 0, True, step))])
            if share:
                # device 1 (one prompt) is idle long before device 0 (eight) is done and scores
                # some of its finished samples (how many depends on the machine's load)
                assert outs[1]["peer_rows"] >= 1 and outs[0]["peer_rows"] <= 4
            assert sum(o["rows"] for o in outs) == 36
            assert len(devices.queue) == 36
            results[share] = _rows(devices.queue, 36)
        finally:
            trainer.close()
    assert [r[:2] for r in results[True]] == [(g, i) for g in range(9) for i in range(4)]
    _same_rows(results[True], results[False])


def test_a_peer_failing_after_a_worker_died_reports_the_dead_worker(ray_session, tmp_path):
    """When a live device's task fails (as a survivor's collective does once its peer is gone),
    the driver names the dead device, not the survivor's error; with every device alive the
    task's own error comes through."""
    trainer = RLTrainer(_cfg(tmp_path, "colocated"), tmp_path / "run", find_base())
    try:
        workers = trainer.devices.workers
        with pytest.raises(ray.exceptions.RayTaskError, match="KeyError"):
            trainer.devices.call([workers[1].load_state.remote({})])  # KeyError on device 1
        _kill(workers[0])
        with pytest.raises(WorkerDiedError, match=r"device 0 \(rollout\+train\+reference\+reward\) died"):
            trainer.devices.call([workers[1].load_state.remote({})])
    finally:
        trainer.close()


def test_ppo_critic_on_two_devices_equals_one_process_and_resumes(ray_session, tmp_path):
    """PPO's value model on the Ray train devices: its data-parallel update (values, GAE
    whitened over both devices' samples, the value loss) equals the one-process update on the
    whole batch, a run trains it, and a checkpoint carries it."""
    from rlfusion.runtime.critic import CriticStage, gae_advantages
    from rlfusion.runtime.trainer import resume

    base = find_base()
    over = {"algo.advantage": "gae", "algo.kl_coef": 0, "max_steps": 2, "checkpoint_every": 1,
            "eval_every": 100, "run_name": "ppo"}
    cfg = _cfg(tmp_path, "colocated", **over)
    trainer = RLTrainer(cfg, tmp_path / "ppo", base)
    try:
        trajs = _sample(cfg, base, 3)
        for i, t in enumerate(trajs):
            t.reward = float(i % 2)
        model, _, _ = load_checkpoint(base)
        one = CriticStage(model, cfg.algo, cfg.optim)
        whole = copy.deepcopy(trajs)
        one.values(whole)
        gae_advantages(whole, cfg.algo)
        want = one.update(whole)
        got = _update(trainer, trajs)
        assert want and {k: got[k] for k in want} == pytest.approx(want, rel=1e-5)
        replicas = [trainer.devices.call([w.critic_state.remote()])[0]["model"] for w in trainer.devices.workers]
        for name, p in one.model.state_dict().items():
            assert torch.equal(replicas[0][name], replicas[1][name]), name
            torch.testing.assert_close(replicas[0][name], p, rtol=0, atol=1e-6)
        metrics = trainer.run(progress=False)
        assert metrics.steps == 2
        saved = trainer.devices.critic_state()["model"]
    finally:
        trainer.close()
    again = resume(tmp_path / "ppo", {"max_steps": 3})
    try:
        restored = again.devices.critic_state()["model"]
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
        assert "value_error" in again.train_step()
    finally:
        again.close()


def test_devices_that_cannot_be_placed_fail_fast_and_leave_nothing_behind(ray_session, tmp_path, monkeypatch):
    """More devices than the cluster has CPUs: a one-line error naming the numbers, and the
    placement group is removed (it would otherwise hold CPUs for the rest of the session)."""
    import rlfusion.runtime.ray_devices as rd

    monkeypatch.setattr(rd, "PLACEMENT_TIMEOUT_S", 0.5)  # the bundles can never be placed: any wait shows it
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        cpus = int(ray.cluster_resources()["CPU"])
        cfg = _cfg(tmp_path, "colocated", **{"deploy.num_devices": cpus + 1})
        with pytest.raises(RuntimeError, match=f"cannot place {cpus + 1} devices of 1 CPU"):
            rd.RayDevices(cfg, DeploymentPlan.build(cfg.deploy), str(find_base()))
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        if started:
            ray.shutdown()


def _greedy_ids(worker, indices: list[int], max_new_tokens: int) -> list[list[int]]:
    """(Run inside a device worker.) Greedy token ids of held-out problems from this device's
    rollout engine, inside the switch (collective in a training layout: every rollout device
    calls it at once)."""
    generator = worker.generator
    heldout = generator.task.heldout()
    model = generator.stage.engine.runner.model
    model.eval()
    try:
        with worker.ctx.switch.rollout("eval"):
            completions = greedy_completions(generator.stage.engine, generator.tokenizer,
                                             [heldout[i] for i in indices], max_new_tokens)
    finally:
        model.train()
    return [list(c.output_ids) for c in completions]


def _record_reads(worker) -> None:
    """(Run inside a device worker.) Keep each batch its update reads, as that device got it, and
    the advantages its actor trains with (they come with the update's split, not the batch)."""
    learner = worker.learner
    read, update = learner.reads.get_rows, learner.actor.update
    worker.batches_read, worker.advantages = [], []

    def get_rows(consumer, row_ids, columns, timeout=None):
        batch = read(consumer, row_ids, columns, timeout=timeout)
        worker.batches_read.append((list(batch.row_ids), list(batch.group_ids), batch.columns))
        return batch

    def actor_update(trajs):
        worker.advantages.append([t.advantage for t in trajs])
        return update(trajs)
    learner.reads.get_rows = get_rows
    learner.actor.update = actor_update


def _batches_read(worker) -> tuple[list, list]:
    return worker.batches_read, worker.advantages


@pytest.mark.parametrize("layout", ["deploy.train_tp", "deploy.train_pp"])
@pytest.mark.parametrize("hierarchical, requests", [("true", 1), ("false", 2)])
def test_model_parallel_devices_read_the_same_batch_once_with_hierarchical_reads(ray_session, tmp_path, layout,
                                                                                 hierarchical, requests):
    """`deploy.train_tp=2` / `train_pp=2`: both devices of the model-parallel group (the two TP
    ranks, or the two pipeline stages: the first needs the tokens, the last the loss's
    per-token inputs) train on the same rows. With `deploy.hierarchical_reads` one of them asks
    the queue and broadcasts the batch to the other (one get request per update); without,
    each asks itself (two)."""
    import ray.cloudpickle

    base = find_base()
    cfg = _cfg(tmp_path, "colocated", **{layout: 2, "deploy.hierarchical_reads": hierarchical})
    trainer = RLTrainer(cfg, tmp_path / "run", base)
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import this test file
    try:
        devices = trainer.devices
        assert devices.plan.train_dp == 1
        trajs = _sample(cfg, base, 2)
        _score(trajs, [1.0, 0.0, 0.5, 0.0])
        kept = _advantaged(cfg, trajs)
        devices.call([w.__ray_call__.remote(_record_reads) for w in devices.workers])
        ids = _put(trainer, trajs)
        before = devices.queue.stats.get_requests
        devices.update(len(trajs))
        # one request is the advantage stage's (the first train device reads the rows' numbers)
        assert devices.queue.stats.get_requests - before - 1 == requests
        (seen, advantages), (seen_1, advantages_1) = devices.call(
            [w.__ray_call__.remote(_batches_read) for w in devices.workers])
        assert len(seen) == len(seen_1) == 1
        assert seen == seen_1  # identical batches on both ranks
        row_ids, group_ids, columns = seen[0]
        assert row_ids == ids and group_ids == [t.group_id for t in trajs]
        assert sorted(columns) == sorted(dataflow.actor_reads(cfg))
        assert columns["response_ids"] == [t.response_ids for t in trajs]
        # the advantages came with the split, to both ranks
        assert advantages == advantages_1 and advantages[0] == pytest.approx([t.advantage for t in kept])
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
        trainer.close()
