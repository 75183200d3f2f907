"""Parallel layouts for the MoE model: `ParallelLayout`, `parallelize` (TP, EP with flat or
hierarchical all-to-all, PP with 1F1B / interleaved 1F1B, FSDP2) and the `ParallelModel` step
handle. The model package stays parallelism-free; everything here is applied from outside."""

from rlfusion.parallel.api import ParallelModel, lm_loss, parallelize
from rlfusion.parallel.expert_parallel import CommCounter
from rlfusion.parallel.layout import ParallelLayout

__all__ = ["CommCounter", "ParallelLayout", "ParallelModel", "lm_loss", "parallelize"]
