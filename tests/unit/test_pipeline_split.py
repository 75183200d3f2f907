"""The pipeline's layer split (`parallel.pipeline.stage_layers`, pure CPU, no process group):
contiguous, non-empty ranges covering every layer once, as cheap at the costliest stage as any
contiguous cut can be, for layer counts that `pp*vpp` does not divide; the 718B preset runs its
own layout (tp8, pp16, ep32, vpp2: 61 layers in 32 stages)."""

import pytest

from rlfusion.model.config import get_preset
from rlfusion.parallel import ParallelLayout
from rlfusion.parallel.pipeline import layer_costs, stage_indices, stage_layers
from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan

PANGU = get_preset("pangu-ultra-moe-718b")  # 61 layers, the first 3 dense


def best_max_cost(costs: list[float], parts: int) -> float:
    """The least possible cost of the costliest of `parts` contiguous non-empty groups (exact,
    by dynamic programming over (first i items, k groups))."""
    n, inf = len(costs), float("inf")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[inf] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(1, n + 1):
        for k in range(1, min(i, parts) + 1):
            best[i][k] = min(max(best[j][k - 1], prefix[i] - prefix[j]) for j in range(k - 1, i))
    return best[n][parts]


def check_split(cfg, num_stages: int) -> list[range]:
    layers = stage_layers(cfg, num_stages)
    assert len(layers) == num_stages and all(len(r) >= 1 for r in layers)
    assert [i for r in layers for i in r] == list(range(cfg.num_layers))  # contiguous, each once
    costs = layer_costs(cfg)
    worst = max(sum(costs[i] for i in r) for r in layers)
    assert worst == pytest.approx(best_max_cost(costs, num_stages), rel=1e-6)
    return layers


@pytest.mark.parametrize("num_layers, num_dense, stages", [
    (5, 1, 2), (6, 1, 4), (7, 1, 4), (4, 1, 3), (9, 3, 4), (13, 0, 6), (8, 8, 3), (5, 1, 5),
])
def test_uneven_splits_are_contiguous_complete_and_balanced(num_layers, num_dense, stages):
    cfg = get_preset("tiny").replace(num_layers=num_layers, num_dense_layers=num_dense)
    check_split(cfg, stages)


def test_even_splits_of_the_tiny_model_are_unchanged():
    tiny = get_preset("tiny")  # the split every pp / vpp test so far ran: one or two layers a stage
    assert stage_layers(tiny, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(tiny, 4) == [range(i, i + 1) for i in range(4)]


def test_718b_layout_passes_the_runtime_validation():
    plan = DeploymentPlan.build(DeployConfig(mode="fully_shared", num_devices=512, train_tp=8, train_pp=16,
                                             train_vpp=2, train_ep=32))
    layout = plan.parallel_layout()
    assert (layout.tp, layout.pp, layout.vpp, layout.ep, layout.dp) == (8, 16, 2, 32, 4)
    layout.validate(len(plan.train), PANGU)  # 61 % 32 != 0: no longer refused
    assert PANGU.num_layers % layout.num_stages


def test_718b_stages_are_contiguous_complete_and_cost_balanced():
    layers = check_split(PANGU, 32)
    costs = layer_costs(PANGU)
    # dense and MoE layers cost about the same (the 3 dense FFNs are as wide as 9 experts); the
    # head costs ~1.9 layers, so the last stage keeps one layer and the others two, except two
    # more one-layer stages where 61 layers leave room: the costliest stage is the head's,
    # which no cut can avoid
    assert [len(r) for r in layers] == [1, 1] + [2] * 29 + [1]
    assert max(range(32), key=lambda s: sum(costs[i] for i in layers[s])) == 31
    assert sum(costs[i] for i in layers[31]) == pytest.approx(max(costs))
    # the cut by counts alone, stage s = layers [s*L//S, (s+1)*L//S), puts two layers beside
    # the head: a third more on the costliest stage
    assert sum(costs[59:]) > 1.3 * sum(costs[i] for i in layers[31])
    # each pipeline rank holds stages p and p + 16, three or four layers
    held = [sum(len(layers[s]) for s in stage_indices(16, 2, p)) for p in range(16)]
    assert sum(held) == 61 and set(held) == {3, 4}


def test_more_stages_than_layers_names_the_keys():
    with pytest.raises(ValueError, match=r"^layout.pp=16 is invalid: pp\*vpp = 64 exceeds "
                                         r"model.num_layers=61 \(every pipeline stage needs at least one layer\)$"):
        ParallelLayout(tp=8, pp=16, vpp=4, ep=32, dp=4).validate(512, PANGU)


def test_718b_stages_hold_the_layers_the_planner_scored():
    """`rlfusion plan` prices tp8, pp16, ep32, vpp2 with its own per-layer seconds (the head an
    item of its own); training cuts by FLOPs; both put the same layers on each pipeline rank."""
    from rlfusion.sim.hardware import get_cluster
    from rlfusion.sim.plan import ParallelPlan, TrainJob
    from rlfusion.sim.step import _indexed_stages

    plan = ParallelPlan(tp=8, pp=16, vpp=2, ep=32, dp=4, micro_batch=1)
    scored = _indexed_stages(TrainJob(PANGU, 8192, 1024), plan, get_cluster("910b", 512))
    layers = stage_layers(PANGU, 32)
    for p in range(16):
        held = [i for s in stage_indices(16, 2, p) for i in layers[s]]
        assert held == [i for i, _ in scored[p] if i < PANGU.num_layers]
