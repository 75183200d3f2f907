"""Gradient clipping over a training layout's shards (`parallel/data_parallel.clip_grad_norm`)."""

from __future__ import annotations

import pytest

from parallel_helpers import sharded_grad_norm

# what this module's ranks run in the folder's shared world (conftest.py: the `world` fixture)
WORLD = (sharded_grad_norm, (), 120)


def test_clip_grad_norm_over_dtensor_shards_of_a_2d_mesh_equals_the_whole_tensors(world):
    """One all-reduce per mesh and set of sharded dims (not per tensor) gives the same norm as
    the whole gradients, on every rank, and clipping scales them to `max_norm`."""
    for rank in world:
        assert rank["norm"] == pytest.approx(rank["want"], rel=1e-6)
        assert rank["want"] > 1.0 and rank["clipped"] == pytest.approx(1.0, rel=1e-5)


def test_shard_rows_balances_tokens_or_the_attention_aware_cost():
    """One named split for every data-parallel batch: by tokens the long sequence's rank gets
    as many tokens as the other but far more attention work; by a·n + b·n² the costs even out."""
    from rlfusion.parallel.data_parallel import shard_rows
    from rlfusion.parallel.seq_balance import SeqCost, max_over_mean, rank_costs

    lengths = [160, 80, 80, 40, 40, 40, 40, 40, 40]
    cost = SeqCost(a=1.0, b=0.05)
    by_tokens, by_cost = shard_rows(lengths, 2), shard_rows(lengths, 2, cost)
    assert sorted(i for part in by_cost for i in part) == list(range(9))  # nothing lost or repeated
    assert [sum(lengths[i] for i in p) for p in by_tokens] == [280, 280]
    assert max_over_mean(rank_costs(lengths, by_tokens, cost)) == pytest.approx(1.216, abs=1e-3)
    assert max_over_mean(rank_costs(lengths, by_cost, cost)) == pytest.approx(1.027, abs=1e-3)
    assert by_cost == [[0], [1, 2, 3, 4, 5, 6, 7, 8]]
