"""Gradient clipping over a training layout's shards (`parallel/data_parallel.clip_grad_norm`)."""

from __future__ import annotations

import pytest

from parallel_helpers import run_world_checked, sharded_grad_norm


def test_clip_grad_norm_over_dtensor_shards_of_a_2d_mesh_equals_the_whole_tensors():
    """One all-reduce per mesh and set of sharded dims (not per tensor) gives the same norm as
    the whole gradients, on every rank, and clipping scales them to `max_norm`."""
    for rank in run_world_checked(sharded_grad_norm, 4, timeout=120):
        assert rank["norm"] == pytest.approx(rank["want"], rel=1e-6)
        assert rank["want"] > 1.0 and rank["clipped"] == pytest.approx(1.0, rel=1e-5)
