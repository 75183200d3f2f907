"""Process groups of a `ParallelLayout`: the (pp, dp, tp) DeviceMesh plus the expert groups.

Owns group construction (every rank creates every group in the same order, as c10d requires)
and the small `A2AGroup` record the expert all-to-all needs (which peers sit on another
node). It does not know about modules; `api.parallelize` hands these groups to the parts that
apply TP/EP/PP/FSDP.

Requires an initialized default process group (gloo on CPU, nccl on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlfusion.model.config import ModelConfig
from rlfusion.parallel.layout import ParallelLayout


@dataclass
class A2AGroup:
    """A process group for all-to-all plus, per member, whether it is on another node."""

    group: dist.ProcessGroup | None
    ranks: list[int]  # global ranks, in group order
    index: int  # this rank's position in `ranks`
    remote: list[bool]  # remote[j]: member j is on another node than this rank

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelMesh:
    layout: ParallelLayout
    device_mesh: DeviceMesh  # dims ("pp", "dp", "tp")
    rank: int
    ep: A2AGroup  # this rank's expert-parallel group (size layout.ep)
    edp_group: dist.ProcessGroup | None  # ranks holding the same expert shard
    rail: A2AGroup | None  # hierarchical a2a: same local index on each node of the EP group
    node: A2AGroup | None  # hierarchical a2a: the EP-group members on this rank's node

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(axis)

    def coord(self, axis: str) -> int:
        return self.device_mesh.get_local_rank(axis)

    def size(self, axis: str) -> int:
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(axis))


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node if ranks_per_node else 0


def _groups(rank: int, rank_lists: list[list[int]], ranks_per_node: int) -> A2AGroup | None:
    """Create one group per list (on every rank); return the one holding `rank`."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            me = node_of(rank, ranks_per_node)
            mine = A2AGroup(group, ranks, ranks.index(rank),
                            [node_of(r, ranks_per_node) != me for r in ranks])
    return mine


def expert_rank_lists(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """Global rank lists of every EP, EDP, rail and node group (pure; no communication)."""
    grid, ep, rpn = layout.dp * layout.tp, layout.ep, layout.ranks_per_node
    out: dict[str, list[list[int]]] = {"ep": [], "edp": [], "rail": [], "node": []}
    for stage in range(layout.pp):
        base = stage * grid
        blocks = [[base + g * ep + i for i in range(ep)] for g in range(grid // ep)]
        out["ep"] += blocks
        out["edp"] += [[block[i] for block in blocks] for i in range(ep)]
        if layout.hierarchical_a2a:
            nodes = ep // rpn
            for block in blocks:
                out["rail"] += [[block[m * rpn + i] for m in range(nodes)] for i in range(rpn)]
                out["node"] += [block[m * rpn:(m + 1) * rpn] for m in range(nodes)]
    return out


def build_mesh(layout: ParallelLayout, cfg: ModelConfig, device_type: str = "cpu") -> ParallelMesh:
    """Validate `layout` against the world and `cfg`, then create all groups."""
    layout.validate(dist.get_world_size(), cfg)
    rank = dist.get_rank()
    device_mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp),
                                   mesh_dim_names=("pp", "dp", "tp"))
    lists, rpn = expert_rank_lists(layout), layout.ranks_per_node
    ep = _groups(rank, lists["ep"], rpn)
    edp = _groups(rank, lists["edp"], rpn)
    rail = _groups(rank, lists["rail"], rpn) if lists["rail"] else None
    node = _groups(rank, lists["node"], rpn) if lists["node"] else None
    return ParallelMesh(layout, device_mesh, rank, ep, edp.group, rail, node)
