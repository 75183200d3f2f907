"""Process groups of a `ParallelLayout`: the (pp, dp, tp) DeviceMesh plus the expert groups.

Owns group construction (every rank creates every group in the same order, as c10d requires)
and the small `A2AGroup` record the expert all-to-all needs (which peers sit on another
node). It does not know about modules; `api.parallelize` hands these groups to the parts that
apply TP/EP/PP/FSDP.

Requires an initialized default process group (gloo on CPU, nccl on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


def _groups(rank: int, rank_lists: list[list[int]], ranks_per_node: int, pos: dict[int, int]) -> A2AGroup | None:
    """Create one group per list of global ranks (on every rank); return the one holding
    `rank`. `pos`: each member's position in the layout's world (nodes count from it)."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            me = node_of(pos[rank], ranks_per_node)
            mine = A2AGroup(group, ranks, ranks.index(rank),
                            [node_of(pos[r], ranks_per_node) != me for r in ranks])
    return mine


def expert_rank_lists(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """Rank lists (positions in the layout's world) of every EP, EDP, rail and node group
    (pure; no communication)."""
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


def build_mesh(layout: ParallelLayout, cfg: ModelConfig, device_type: str = "cpu",
               ranks: list[int] | None = None) -> ParallelMesh | None:
    """Validate `layout` against its ranks and `cfg`, then create all groups. `ranks`: the
    global ranks the layout spans, in layout order (default: the whole world). Every rank of
    the world calls this (c10d creates groups collectively); one outside `ranks` gets None."""
    if ranks is None:
        layout.validate(dist.get_world_size(), cfg)
        device_mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp),
                                       mesh_dim_names=("pp", "dp", "tp"))
        ranks = list(range(dist.get_world_size()))
    else:
        layout.validate(len(ranks), cfg)
        device_mesh = DeviceMesh(device_type, torch.tensor(ranks).view(layout.pp, layout.dp, layout.tp),
                                 mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    lists, rpn = expert_rank_lists(layout), layout.ranks_per_node
    # node boundaries are positions in the layout's world (ranks_per_node consecutive members)
    pos = {g: i for i, g in enumerate(ranks)}
    glob = {kind: [[ranks[i] for i in group] for group in groups] for kind, groups in lists.items()}
    mine = pos.get(rank)
    ep = _groups(rank, glob["ep"], rpn, pos)
    edp = _groups(rank, glob["edp"], rpn, pos)
    rail = _groups(rank, glob["rail"], rpn, pos) if lists["rail"] else None
    node = _groups(rank, glob["node"], rpn, pos) if lists["node"] else None
    if mine is None:
        return None
    return ParallelMesh(layout, device_mesh, rank, ep, edp.group, rail, node)
