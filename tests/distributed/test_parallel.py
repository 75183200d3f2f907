"""Parallel layouts on 4 gloo ranks against a single-process reference.

One world runs every layout (spawning is the slow part on 2 cores): same seed init, same data,
2 SGD steps with the aux-loss-free router bias update (token counts summed over data parallel).
Tolerance: losses and every weight of the gathered full state dict within ATOL = 1e-5 in fp32
(observed ≤ 3e-7 on losses, ≤ 1e-8 on weights: TP/FSDP only reorder sums). The weights move by
~1e-2 over the steps, so the comparison is not vacuous.

Layout names follow the issue; `ep` in `ParallelLayout` is the total expert-sharding degree
carved out of dp×tp (tp2×ep2 = tp2 ranks × 2 data-parallel ranks splitting experts 4 ways).
"""

import pytest

from parallel_helpers import layouts_and_a2a, small_config
from rlfusion.parallel import ParallelLayout
from rlfusion.parallel.pipeline import stage_layers

ATOL = 1e-5
LORA = dict(rank=4, alpha=8.0, targets=("attn", "mlp", "shared", "experts"))
CASES = [
    # name, ParallelLayout kwargs, ModelConfig changes, micro-batches
    ("dp2×tp2", dict(dp=2, tp=2), {}, 1),
    ("dp2×tp2 mla", dict(dp=2, tp=2), dict(attention="mla"), 1),
    ("tp2×ep2", dict(dp=2, tp=2, ep=4), {}, 1),
    ("ep4", dict(dp=4, ep=4), {}, 1),
    ("tp4×ep4 aux loss", dict(tp=4, ep=4), dict(num_kv_heads=4, aux_loss_coef=0.01), 1),
    ("pp2×dp2 (1F1B)", dict(pp=2, dp=2), {}, 2),
    ("pp2×vpp2×tp2 (interleaved 1F1B)", dict(pp=2, vpp=2, tp=2), {}, 4),
    # layer counts pp*vpp does not divide: stages of uneven lengths (UNEVEN below)
    ("pp2×dp2 uneven (1F1B, 5 layers)", dict(pp=2, dp=2), dict(num_layers=5), 2),
    ("pp2×vpp2×tp2 uneven (interleaved 1F1B, 6 layers)", dict(pp=2, vpp=2, tp=2), dict(num_layers=6), 4),
    ("dp2×ep2 hierarchical a2a, 2 nodes", dict(dp=4, ep=2, ranks_per_node=1,
                                               hierarchical_a2a=True), {}, 1),
    ("ep4 hierarchical a2a, 2 nodes × 2 ranks", dict(dp=4, ep=4, ranks_per_node=2,
                                                     hierarchical_a2a=True), {}, 1),
    # Adaptive Pipe: two stages per rank in a V, forward and backward of different micro-batches
    # taking turns at the expert all-to-alls (parallel/overlap.py), beside interleaved 1F1B
    ("pp2×vpp2×ep2 (interleaved 1F1B)", dict(pp=2, vpp=2, dp=2, ep=2), {}, 4),
    ("pp2×vpp2×ep2 overlap_fb", dict(pp=2, vpp=2, dp=2, ep=2, overlap_fb=True), {}, 4),
    ("pp2×ep2 overlap_fb hierarchical a2a, 2 nodes", dict(pp=2, vpp=2, dp=2, ep=2, ranks_per_node=1,
                                                         hierarchical_a2a=True, overlap_fb=True), {}, 4),
    # LoRA (model/lora.py): only the adapters train, in every layout (FSDP over dp, TP placing
    # them with their Linears' shards, EP slicing per-expert adapters with their experts, PP)
    ("lora dp2×tp2", dict(dp=2, tp=2), dict(lora=LORA, bias_update_rate=0.0), 1),
    ("lora tp2×ep2 mla", dict(dp=2, tp=2, ep=4), dict(lora=LORA, bias_update_rate=0.0, attention="mla"), 1),
    ("lora ep4 router", dict(dp=4, ep=4), dict(lora={**LORA, "targets": ("attn", "experts", "router")},
                                                 bias_update_rate=0.0), 1),
    ("lora pp2×vpp2×ep2 overlap_fb", dict(pp=2, vpp=2, dp=2, ep=2, overlap_fb=True),
     dict(lora=LORA, bias_update_rate=0.0), 4),
]
# each overlap_fb case and the interleaved schedule's case of the same layout
FB_VS_INTERLEAVED = [("pp2×vpp2×ep2 overlap_fb", "pp2×vpp2×ep2 (interleaved 1F1B)")]
# the stages' layers in the uneven cases: (case, layers per stage)
UNEVEN = [("pp2×dp2 uneven (1F1B, 5 layers)", [2, 3]),
          ("pp2×vpp2×tp2 uneven (interleaved 1F1B, 6 layers)", [1, 2, 2, 1])]
# Flat vs hierarchical: ep4 over 2 nodes of 2 ranks, 16 experts, top-2 and top-8.
A2A_ARGS = ([dict(num_experts=16, top_k=2), dict(num_experts=16, top_k=8)], 4, 2, 8, 16)
# Overlapped (layout.a2a_chunks=3, over an emulated slow link) vs blocking expert all-to-all.
OVERLAP_CASES = [
    ("ep2", dict(dp=4, ep=2), {}, 1),
    ("ep4 hierarchical a2a, 2 nodes × 2 ranks", dict(dp=4, ep=4, ranks_per_node=2, hierarchical_a2a=True), {}, 1),
    ("tp2×ep2", dict(dp=2, tp=2, ep=4), {}, 1),
    ("pp2×ep2 (1F1B)", dict(pp=2, dp=2, ep=2), {}, 2),
    ("pp2×vpp2×ep2 (interleaved 1F1B)", dict(pp=2, vpp=2, dp=2, ep=2), {}, 4),
    # Adaptive Pipe with the chunked overlap in the actions it leaves unpaired (warm-up, cool-down)
    ("pp2×vpp2×ep2 overlap_fb", dict(pp=2, vpp=2, dp=2, ep=2, overlap_fb=True), {}, 4),
    ("ep4 gated shared experts, aux loss", dict(dp=4, ep=4), dict(shared_expert_gate=True, aux_loss_coef=0.01), 1),
]


# what this module's ranks run in the folder's shared world (conftest.py: the `world` fixture)
WORLD = (layouts_and_a2a, (CASES, A2A_ARGS, OVERLAP_CASES), 300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_layout_matches_single_process(world, name):
    for rank in world:
        r = rank["layouts"][name]
        assert not r["missing"], r["missing"]  # same state-dict keys as the plain model
        assert r["loss_diff"] <= ATOL, (r["losses"], r["ref_losses"])
        assert r["weight_diff"] <= ATOL, (r["worst"], r["weight_diff"])
        assert r["moved"] > 100 * ATOL
        if name.startswith("lora"):  # the frozen base stayed as it was, to the bit
            assert r["base_moved"] == 0.0, r["base_moved"]


@pytest.mark.parametrize("name", [c[0] for c in CASES if "overlap_fb" in c[0]])
def test_overlap_fb_pairs_take_turns_and_pick_an_order(world, name):
    """Adaptive Pipe ran pairs whose halves handed the turn over at expert all-to-alls, and after
    its probe passes every rank keeps the same order within a pair."""
    orders = {rank["layouts"][name]["overlap"]["overlap_fb_forward_first"] for rank in world}
    assert len(orders) == 1 and orders <= {0.0, 1.0}, orders
    assert all(rank["layouts"][name]["turn_switches"] > 0 for rank in world)
    report = world[0]["layouts"][name]["overlap"]
    assert report["overlap_fb_pair_s_forward_first"] > 0 and report["overlap_fb_pair_s_backward_first"] > 0


@pytest.mark.parametrize("fb, interleaved", FB_VS_INTERLEAVED)
def test_overlap_fb_equals_the_interleaved_schedule(world, fb, interleaved):
    for rank in world:
        a, b = rank["layouts"][fb], rank["layouts"][interleaved]
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= ATOL
        assert a["weight_diff"] + b["weight_diff"] <= 2 * ATOL  # both at the one-process weights
    # the weights the ranks hold (the memory ledger's count of their parameters, shards as held):
    # the V holds each stage once, as the looped placement does (DualPipe's two model copies
    # would double it); per rank they differ only by which stages hold the embedding and head
    fb_bytes = [rank["layouts"][fb]["weight_bytes"] for rank in world]
    interleaved_bytes = [rank["layouts"][interleaved]["weight_bytes"] for rank in world]
    assert sum(fb_bytes) == sum(interleaved_bytes)
    cfg = small_config()
    edge = 2 * cfg.vocab_size * cfg.d_model * 4  # embedding and head, fp32
    assert max(fb_bytes) - max(interleaved_bytes) <= edge


def test_no_transfer_outlives_its_step(world):
    """The expert all-to-all's transfer records are freed with their step (they once held their
    own outputs alive through their autograd nodes: every step of every EP run leaked)."""
    for rank in world:
        assert rank["alive"] == [0] * len(rank["alive"]), rank["alive"]


@pytest.mark.parametrize("name, lengths", UNEVEN)
def test_uneven_cases_cut_stages_of_different_lengths(name, lengths):
    _, layout_kw, changes, _ = next(c for c in CASES if c[0] == name)
    cfg = small_config(**changes)
    assert cfg.num_layers % ParallelLayout(**layout_kw).num_stages  # not a multiple
    assert [len(r) for r in stage_layers(cfg, ParallelLayout(**layout_kw).num_stages)] == lengths


def test_hierarchical_a2a_matches_flat_and_sends_fewer_internode_bytes(world):
    for rank in world:
        for r in rank["a2a"]:
            # Same expert order in every sum; only the grouping of rows in expert matmuls differs.
            assert r["logit_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, r
            assert r["hier_internode"] < r["flat_internode"], r
    top2, top8 = world[0]["a2a"]
    # 2 nodes: flat sends ~k/2 rows per token across, hierarchical at most one (+ ids/weights).
    assert 1 - top8["hier_internode"] / top8["flat_internode"] > 0.6
    assert 1 - top2["hier_internode"] / top2["flat_internode"] > 0.1


def test_expert_counters_see_cross_node_traffic_only_across_nodes(world):
    layouts = world[0]["layouts"]
    assert layouts["ep4"]["internode_bytes"] == 0  # ranks_per_node unset: one node
    assert layouts["ep4"]["sent_bytes"] > 0
    assert layouts["dp2×tp2"]["sent_bytes"] == 0  # no expert parallelism


@pytest.mark.parametrize("name", [c[0] for c in OVERLAP_CASES])
def test_overlapped_all_to_all_matches_blocking(world, name):
    for rank in world:
        r = rank["overlap"][name]
        assert r["names"]
        assert r["loss_diff"] <= ATOL, r
        assert r["grad_diff"] <= ATOL and r["grad_max"] > 100 * ATOL, r  # gradients are not all ~0
        # every chunk has its own dispatch and combine (one counts exchange per layer either way)
        assert r["overlapped_calls"] > r["blocking_calls"], r
