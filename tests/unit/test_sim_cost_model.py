"""Hand-computed checks of the training cost model (FLOPs, memory, collectives, bubbles)."""

import pytest

from rlfusion.model.config import get_preset
from rlfusion.model.flops import attn_core_flops
from rlfusion.partition import partition
from rlfusion.sim import comm
from rlfusion.sim.costs import check_param_total, model_layers
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.memory import COMM_BUFFER_GB, FRAGMENTATION, RESERVED_GB, stage_memory
from rlfusion.sim.plan import ParallelPlan, TrainJob, in_flight
from rlfusion.sim.step import estimate_step, link_busy_s


def test_tiny_flops_by_hand():
    m = get_preset("tiny")  # d 128, 4 heads x 32, 2 kv heads, dense ffn 512, 8x128 experts top-2
    seq = 256
    dense, moe, head = model_layers(m, seq)[0], model_layers(m, seq)[1], model_layers(m, seq)[-1]
    attn_proj = 128 * 128 + 2 * 128 * 64 + 128 * 128  # q, k+v (2 kv heads), out
    assert dense.matmul_flops == 2 * attn_proj + 2 * 3 * 128 * 512
    # causal: each token sees seq/2 keys on average; QK^T and PV over 4 heads of 32
    assert attn_core_flops(m, seq) == 2 * (seq / 2) * 4 * (32 + 32)
    assert moe.expert_flops == 2 * 2 * 3 * 128 * 128
    assert moe.matmul_flops == 2 * attn_proj + 2 * 3 * 128 * 128 + 2 * 128 * 8
    assert head.matmul_flops == 2 * 128 * m.vocab_size


@pytest.mark.parametrize("name", ["tiny", "tiny-mla", "pangu-ultra-moe-718b"])
def test_layer_params_match_model_config(name):
    m = get_preset(name)
    assert check_param_total(m, 128) == m.param_counts()["total"]


def test_ring_volumes():
    assert comm.ring_volume("all_gather", 800, 8) == 700
    assert comm.ring_volume("reduce_scatter", 800, 8) == 700
    assert comm.ring_volume("all_reduce", 800, 8) == 1400
    assert comm.ring_volume("all_reduce", 800, 1) == 0
    link = get_cluster("910b", 8).intra
    expected = 2 * 7 * 5e-6 + 1400 / 196e9
    assert comm.ring_time("all_reduce", 800, 8, link) == pytest.approx(expected)


def test_hierarchical_all_to_all_sends_each_token_once_per_remote_domain():
    flat = comm.all_to_all_volume(1000, 10, top_k=8, ep=32, local=8, hierarchical=False)
    hier = comm.all_to_all_volume(1000, 10, top_k=8, ep=32, local=8, hierarchical=True)
    token_bytes = 1000 * 10 * 2
    assert flat.inter_bytes == pytest.approx(token_bytes * 8 * 24 / 32)
    assert hier.inter_bytes == pytest.approx(token_bytes * 3 * (1 - 0.75 ** 8))
    assert hier.inter_bytes < flat.inter_bytes


def test_pipeline_bubble_and_in_flight():
    job = TrainJob(get_preset("tiny"), seq_len=256, global_batch=32)
    cluster = get_cluster("cpu", 4)
    one = estimate_step(job, ParallelPlan(1, 4, 1, 1, 1, 1), cluster)
    assert one.num_microbatches == 32
    stage = (one.step_s - one.dp_comm_exposed_s - one.optimizer_s) / (32 + 3)
    assert one.bubble_s == pytest.approx(3 * stage)  # 1F1B: (p - 1) stage times
    plan = ParallelPlan(1, 4, 2, 1, 1, 1)
    assert in_flight(ParallelPlan(1, 4, 1, 1, 1, 1), 0, 32) == 4
    assert in_flight(plan, 0, 32) == pytest.approx(4 + 3 / 2)  # p + (p-1)/v
    assert in_flight(ParallelPlan(1, 4, 1, 1, 1, 1), 0, 2) == 2


def test_partition_balances_contiguously():
    owner = partition([1, 1, 1, 1, 4], 2)
    assert owner == [0, 0, 0, 0, 1]
    assert partition([1.0] * 5, 5) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("costs, parts, sizes", [
    # group sizes `sim.plan.partition` gave before it moved to `rlfusion.partition`
    ([3.0] * 3 + [2.0] * 58 + [5.0], 32, [2, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2]
     + [3] * 9 + [1]),
    ([float(i % 7 + 1) for i in range(40)], 6, [7, 7, 7, 7, 7, 5]),
    ([9216.0, 7936, 7936, 7936, 8480], 2, [2, 3]),
    ([0.5, 2, 0.25, 8, 1, 1, 3], 4, [1, 2, 1, 3]),
])
def test_partition_gives_what_it_gave_before_it_moved(costs, parts, sizes):
    owner = partition(costs, parts)
    assert [owner.count(g) for g in range(parts)] == sizes
    assert owner == sorted(owner)


@pytest.mark.parametrize("preset, seq, batch, cluster, plan, sizes", [
    # the planner's chunks (layers, then the head) before the partition moved: chunk c on stage c % PP
    ("pangu-ultra-moe-718b", 8192, 1024, ("910b", 512), ParallelPlan(8, 16, 2, 32, 4, 1), [1, 1] + [2] * 30),
    ("pangu-ultra-moe-718b", 8192, 1024, ("910b", 512), ParallelPlan(8, 8, 1, 64, 8, 1), [8] * 7 + [6]),
    ("pangu-ultra-moe-718b", 4096, 512, ("cm384", 384), ParallelPlan(4, 12, 1, 32, 8, 1), [3, 3] + [6] * 9 + [2]),
    ("tiny", 256, 16, ("cpu", 4), ParallelPlan(1, 4, 1, 1, 1, 1), [1, 1, 1, 2]),
    ("tiny", 256, 16, ("cpu", 4), ParallelPlan(1, 2, 2, 1, 2, 1), [1, 1, 1, 2]),
])
def test_planner_stages_are_what_they_were(preset, seq, batch, cluster, plan, sizes):
    from rlfusion.sim.step import _indexed_stages

    stages = _indexed_stages(TrainJob(get_preset(preset), seq, batch), plan, get_cluster(*cluster))
    runs = []  # (first item, items, stage) of each contiguous run of a stage's items: its chunks
    for s, stage in enumerate(stages):
        for i, _ in stage:
            if runs and runs[-1][2] == s and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, s)
            else:
                runs.append((i, 1, s))
    runs.sort()
    assert [n for _, n, _ in runs] == sizes
    assert [s for _, _, s in runs] == [c % plan.pp for c in range(plan.pp * plan.vpp)]


def test_memory_formulas():
    m = get_preset("tiny")
    job = TrainJob(m, seq_len=256, global_batch=8)
    layers = model_layers(m, 256)
    plain = ParallelPlan(1, 1, 1, 1, 1, 1, distributed_optimizer=False)
    mem, _ = stage_memory(layers, job, plain, 0, 8)
    total = m.param_counts()["total"]
    assert mem.weights_GB == pytest.approx(total * 2 / 1e9)
    assert mem.grads_GB == pytest.approx(total * 4 / 1e9)
    assert mem.optimizer_GB == pytest.approx(total * 12 / 1e9)
    sharded, _ = stage_memory(layers, job, ParallelPlan(1, 1, 1, 1, 1, 1), 0, 8)
    assert sharded.optimizer_GB == mem.optimizer_GB  # DP 1: nothing to shard over
    sel, _ = stage_memory(layers, job, ParallelPlan(1, 1, 1, 1, 1, 1, "selective"), 0, 8)
    full, _ = stage_memory(layers, job, ParallelPlan(1, 1, 1, 1, 1, 1, "full"), 0, 8)
    assert full.activations_GB < sel.activations_GB < mem.activations_GB
    assert full.activations_GB == pytest.approx(4 * 128 * 2 * 256 / 1e9)  # layer inputs only
    # overheads beyond model state: fp32 logits of the micro-batch and their gradient (one
    # process: no collective buffers), and the allocator's fragmentation share of it all
    logits = 2 * 256 * m.vocab_size * 4
    dispatch = 2 * 256 * m.top_k * m.d_model * 2  # MoE dispatch send + receive
    assert mem.buffers_GB == pytest.approx((logits + dispatch) / 1e9)
    allocated = mem.weights_GB + mem.grads_GB + mem.optimizer_GB + mem.activations_GB + mem.buffers_GB
    assert mem.reserved_GB == pytest.approx(RESERVED_GB + FRAGMENTATION * allocated)
    dp2, _ = stage_memory(layers, TrainJob(m, seq_len=256, global_batch=8), ParallelPlan(1, 1, 1, 1, 2, 1), 0, 4)
    assert dp2.buffers_GB == pytest.approx((logits + dispatch + COMM_BUFFER_GB * 1e9) / 1e9)  # + the collectives' buffers


def test_a_step_is_never_shorter_than_its_busiest_link():
    plan = ParallelPlan(8, 1, 1, 64, 16, 1, "selective")
    cluster = get_cluster("910b", 128)
    busy = link_busy_s(plan, cluster, tp_s=1.0, ep_s=2.0, pp_s=0.5, dp_s=3.0)
    # TP inside the 8-chip server; EP64, DP16 x TP8 and a pipeline neighbour TP x DP = 128
    # chips away span servers: the scale-out link
    assert busy == {"intra": 1.0, "inter": 5.5}
    job = TrainJob(get_preset("pangu-ultra-moe-718b"), seq_len=4096, global_batch=512)
    est = estimate_step(job, plan, cluster)
    rest = (est.compute_s + est.recompute_s + est.bubble_s + est.tp_comm_s + est.ep_comm_exposed_s
            + est.pp_comm_s + est.dp_comm_exposed_s + est.swap_exposed_s + est.optimizer_s)
    assert est.link_busy_s > 0 and est.step_s == pytest.approx(max(rest, est.link_busy_s))
    assert est.link_wait_s == pytest.approx(max(0.0, est.link_busy_s - rest))


def test_distributed_optimizer_shards_over_dp():
    m = get_preset("pangu-ultra-moe-718b")
    job = TrainJob(m, seq_len=4096, global_batch=512)
    cluster = get_cluster("910b", 1024)
    on = estimate_step(job, ParallelPlan(8, 16, 1, 8, 8, 1, "full"), cluster)
    off = estimate_step(job, ParallelPlan(8, 16, 1, 8, 8, 1, "full",
                                          distributed_optimizer=False), cluster)
    assert off.memory.optimizer_GB == pytest.approx(8 * on.memory.optimizer_GB, rel=0.3)
    assert 0 < on.mfu < 1


def test_invalid_plan_raises():
    job = TrainJob(get_preset("tiny"), seq_len=256, global_batch=8)
    with pytest.raises(ValueError, match="chips"):
        estimate_step(job, ParallelPlan(1, 1, 1, 1, 2, 1), get_cluster("cpu", 4))


def test_expert_all_to_all_hides_at_the_measured_efficiency():
    """The planner hides the EP all-to-all behind the layer's MoE compute only as far as
    `bench/ep_overlap.py` measured the overlapped execution hiding it (recorded beside the
    cost model), never more than the compute there is."""
    from rlfusion.sim.step import ep_exposed_s, ep_overlap_measurement

    eta = ep_overlap_measurement()["efficiency"]
    assert 0 < eta <= 1 and "bench/ep_overlap.py" in ep_overlap_measurement()["source"]
    assert ep_exposed_s(2.0, 5.0, overlap=False) == 2.0
    assert ep_exposed_s(2.0, 5.0, overlap=True) == pytest.approx(2.0 * (1 - eta))  # compute covers it
    assert ep_exposed_s(2.0, 0.5, overlap=True) == pytest.approx(2.0 - eta * 0.5)  # only 0.5 s to hide behind
