"""The data-parallel split that prefers rows already on a rank (`data_parallel.shard_rows` with
homes): it never lets a rank go above its bound, keeps every row home when the balance allows,
and falls back to the plain longest-first split; the advantage stage reports the local share."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from rlfusion.config import load_config
from rlfusion.parallel.data_parallel import LOCAL_SLACK, local_bound, shard_rows
from rlfusion.queue import Batch, split_balanced
from rlfusion.runtime.advantage_stage import advantage_stage
from rlfusion.runtime.train_config import TrainConfig


def _loads(weights, parts):
    return [sum(weights[i] for i in p) for p in parts]


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=40), ranks=st.integers(1, 4),
       seed=st.integers(0, 2**16), cost=st.booleans())
def test_the_bound_holds_and_every_row_is_placed_once(lengths, ranks, seed, cost):
    rng = random.Random(seed)
    homes = [rng.choice([None, *range(ranks)]) for _ in lengths]
    fn = (lambda n: n + n * n / 1000) if cost else None
    parts = shard_rows(lengths, ranks, fn, homes)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(p == sorted(p) for p in parts)
    weights = [fn(n) for n in lengths] if cost else lengths
    plain = split_balanced(weights, ranks)
    even = sum(weights) / ranks
    # no rank above max((1 + LOCAL_SLACK) x an even share, the plain split's busiest rank)
    assert max(_loads(weights, parts)) <= max((1 + LOCAL_SLACK) * even, max(_loads(weights, plain))) * (1 + 1e-9)
    assert max(_loads(weights, parts)) <= local_bound(weights, plain)


def test_every_row_stays_home_when_the_balance_allows():
    rng = random.Random(0)
    lengths = [rng.randint(50, 600) for _ in range(64)]
    homes = [i % 2 for i in range(64)]
    while abs(sum(lengths[0::2]) - sum(lengths[1::2])) > 0.004 * sum(lengths) / 2:  # within 0.4 %
        lengths[rng.randrange(64)] = rng.randint(50, 600)
    parts = shard_rows(lengths, 2, homes=homes)
    assert parts == [list(range(0, 64, 2)), list(range(1, 64, 2))]  # all local
    assert parts != split_balanced(lengths, 2)


def test_rows_that_would_unbalance_their_home_go_to_the_lightest_rank():
    lengths = [100] * 10
    parts = shard_rows(lengths, 2, homes=[0] * 10)  # every row lives on rank 0
    assert _loads(lengths, parts) == [500, 500]
    assert len([i for i in parts[0]]) == 5


def test_falls_back_to_the_plain_split():
    # longest first, rows 4 and 0 (8, 7) go home to rank 0 and rows 1 and 3 (9, 9) to rank 1;
    # the 4s then leave rank 1 at 22 above the bound (max(1.005 x 20.5, 21) = 21): the plain split
    lengths, homes = [7, 9, 4, 9, 8, 4], [0, 1, 1, 1, 0, 1]
    plain = split_balanced(lengths, 2)
    assert shard_rows(lengths, 2, homes=homes) == plain and _loads(lengths, plain) == [21, 20]
    assert shard_rows([3, 2, 1], 2, homes=None) == split_balanced([3, 2, 1], 2)
    assert shard_rows([], 2, homes=[]) == [[], []]


def test_a_home_out_of_range_is_no_home():
    assert shard_rows([5, 5], 2, homes=[7, None]) == split_balanced([5, 5], 2)


class _Queue:
    """The advantage stage's read: 8 scored rows of 2 groups, rows 0-3 on device 0, 4-7 on device 1."""

    def __init__(self, shards):
        self.shards = shards

    def get(self, consumer, columns, count, policy, block, timeout):
        cols = {"reward": [1.0, 0.0] * 4, "correct": [1.0, 0.0] * 4, "reward_failed": [0] * 8,
                "sample": [0, 1, 2, 3] * 2, "num_tokens": [40, 30, 20, 10] * 2, "response_len": [8] * 8,
                "truncated": [0] * 8}
        return Batch(list(range(8)), [0] * 4 + [1] * 4, [0] * 8, cols, self.shards)


@pytest.mark.parametrize("shards", [[0] * 4 + [1] * 4, None])
def test_the_advantage_stage_splits_rows_onto_their_devices(shards):
    cfg = load_config(TrainConfig, None, ["rollout.group_size=4", "algo.kl_coef=0"])
    _, split, out = advantage_stage(_Queue(shards), cfg, 8, 2, rank_of={0: 0, 1: 1})
    if shards is None:  # the in-process queue names no shard: the plain split, no locality figure
        assert "split_local_fraction" not in out
        return
    assert [sorted(part.row_ids) for part in split] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert out["split_local_fraction"] == 1.0
