"""ParallelLayout validation (pure CPU, no process group): invalid layouts are one-line
ValueErrors naming the field, the value and what is allowed; the expert group lists follow the
stated convention."""

import pytest

from rlfusion.model.config import get_preset
from rlfusion.parallel import ParallelLayout
from rlfusion.parallel.mesh import expert_rank_lists

TINY = get_preset("tiny")  # 4 heads, 2 kv heads, 4 layers (1 dense), 8 experts


@pytest.mark.parametrize("kwargs, world, field, allowed", [
    (dict(tp=3), 3, "layout.tp=3", "must divide model.num_heads=4 (allowed: 1, 2, 4)"),
    (dict(tp=4), 4, "layout.tp=4", "must divide model.num_kv_heads=2"),
    (dict(pp=8), 8, "layout.pp=8", "exceeds model.num_layers=4"),
    (dict(pp=3), 3, "layout.pp=3", None),  # valid: stages of uneven layer counts
    (dict(pp=2, vpp=4), 2, "layout.pp=2", "pp*vpp = 8 exceeds model.num_layers=4"),
    (dict(vpp=2), 1, "layout.vpp=2", "must be 1 when pp=1"),
    (dict(dp=2, tp=2), 8, "layout.dp=2", "must equal the world size 8"),
    (dict(dp=4, ep=3), 4, "layout.ep=3", "must divide dp*tp = 4"),
    (dict(dp=2, tp=2, ep=2, ), 4, "layout.ep=2", None),  # valid: EP group = TP group
    (dict(dp=4, tp=1, ep=4, hierarchical_a2a=True), 4, "layout.ranks_per_node=0",
     "must be > 0 and divide ep=4"),
    (dict(dp=4, ep=4, ranks_per_node=3, hierarchical_a2a=True), 4, "layout.ranks_per_node=3",
     "must divide the world size 4"),
])
def test_invalid_layouts_name_field_value_and_allowed(kwargs, world, field, allowed):
    layout = ParallelLayout(**kwargs)
    if allowed is None:
        layout.validate(world, TINY)
        return
    with pytest.raises(ValueError) as err:
        layout.validate(world, TINY)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{field} is invalid") and allowed in msg, msg


def test_ep_must_be_a_multiple_of_tp():
    cfg = TINY.replace(num_kv_heads=4)
    with pytest.raises(ValueError, match=r"^layout.ep=2 is invalid: must be 1 or a multiple of tp=4"):
        ParallelLayout(dp=2, tp=4, ep=2).validate(8, cfg)


def test_experts_must_split_evenly():
    with pytest.raises(ValueError, match=r"layout.ep=16 .*num_experts=8"):
        ParallelLayout(dp=16, ep=16).validate(16, TINY)


@pytest.mark.parametrize("bad", [dict(dp=0), dict(tp=-1), dict(ep=1.5), dict(ranks_per_node=-1)])
def test_non_positive_fields_rejected_at_construction(bad):
    with pytest.raises(ValueError, match=rf"layout.{next(iter(bad))}="):
        ParallelLayout(**bad)


def test_pipeline_with_aux_loss_rejected():
    with pytest.raises(ValueError, match="layout.pp=2 .*aux_loss_coef"):
        ParallelLayout(pp=2).validate(2, TINY.replace(aux_loss_coef=0.01))


def test_expert_groups_follow_the_convention():
    # pp2 × dp2 × tp2, ep4: each stage's 4 ranks form one EP group (TP ranks also split experts).
    lists = expert_rank_lists(ParallelLayout(pp=2, dp=2, tp=2, ep=4))
    assert lists["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists["edp"] == [[0], [1], [2], [3], [4], [5], [6], [7]]
    # dp4 ep2 over 2-rank nodes: EP pairs replicated twice; hierarchical rails and nodes.
    lists = expert_rank_lists(ParallelLayout(dp=8, ep=4, ranks_per_node=2, hierarchical_a2a=True))
    assert lists["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lists["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["rail"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["node"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_describe():
    assert ParallelLayout(pp=2, vpp=2, tp=2).describe() == "tp2×pp2×vpp2"
    assert ParallelLayout().describe() == "single"


def test_a2a_chunks_must_be_a_count_and_needs_expert_parallelism():
    from rlfusion.parallel.layout import ParallelLayout
    from parallel_helpers import small_config

    with pytest.raises(ValueError, match=r"layout.a2a_chunks=-1 is invalid: must be an integer >= 0"):
        ParallelLayout(dp=2, ep=2, a2a_chunks=-1)
    with pytest.raises(ValueError, match=r"layout.a2a_chunks=2 is invalid: must be 0 unless ep > 1"):
        ParallelLayout(dp=2, a2a_chunks=2).validate(2, small_config())
    ParallelLayout(dp=2, ep=2, a2a_chunks=2).validate(2, small_config())


def test_emulated_link_serializes_transfers_and_adds_latency(monkeypatch):
    from rlfusion.parallel import expert_parallel

    now = [10.0]
    monkeypatch.setattr(expert_parallel.time, "perf_counter", lambda: now[0])
    link = expert_parallel.LinkModel(latency_s=0.5, bytes_per_s=100.0)
    assert link.arrival(100) == 10.0 + 1.0 + 0.5  # 1 s on the wire, then the latency
    assert link.arrival(200) == 11.0 + 2.0 + 0.5  # queued behind the first transfer
    now[0] = 20.0  # the link idle again: starts at once
    assert link.arrival(0) == 20.5


def test_a_wait_on_the_link_is_counted_and_long_ones_reach_the_timeline():
    import time

    import torch

    from rlfusion.parallel.expert_parallel import TRACE_MIN_WAIT_S, CommCounter, InFlight

    seen = []
    counter = CommCounter(on_wait=lambda start, end: seen.append(end - start))
    InFlight(torch.zeros(1), None, time.perf_counter() + 4 * TRACE_MIN_WAIT_S, counter).wait()
    InFlight(torch.zeros(1), None, 0.0, counter).wait()  # already arrived: no span
    assert len(seen) == 1 and seen[0] >= 3 * TRACE_MIN_WAIT_S
    assert counter.wait_s >= seen[0]
    counter.reset()
    assert counter.wait_s == 0 and counter.on_wait is not None  # the hook outlives a reset
