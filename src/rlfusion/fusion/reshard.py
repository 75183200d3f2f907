"""Train ↔ inference switching: reshard the actor's weights from its training layout into the
rollout replica on the same ranks, bucket by bucket, and give the memory back afterwards.

Owns the switch itself: `train_to_infer` (offload optimizer state and grads, allocate the
replica, then per bucket gather each tensor from wherever the training layout keeps it and copy
it into the replica) and `infer_to_train` (free the replica, restore what was offloaded), the
replica's `release` / `materialize`, and the per-switch `SwitchStats`.

Where a tensor comes from in the training layout, for one bucket:
- DTensor shards (TP, FSDP) split evenly along one dim: several per all-gather (packed, as much
  as gathering the bucket's largest tensor would hold), each full tensor put back from its
  pieces; other DTensors (uneven splits) and a shard that batches alone: `full_tensor()` over
  that tensor's own mesh;
- routed-expert shards (EP): one `all_gather_single` over the EP group, straight into the
  bucket (experts are split along dim 0, so the shards land contiguously); when the replica
  is expert-parallel too, one `all_to_all_single` instead that sends each rank only the
  experts its replica keeps (no redundant expert bytes on the wire);
- pipeline stages: each stage fills the slots it owns, then every run of consecutive slots
  with one owner is broadcast over the `pp` group, so stages become replicas.
The replica is a plain `MoETransformer` per rank (inference pp1 / tp1, the dense weights
replicated), optionally with its routed experts split over a new EP group
(`build_inference_model`), in which case each rank keeps only its experts' rows of the bucket.

Memory: at most one bucket plus one gathered DTensor (`SwitchStats.peak_extra_bytes`) exists
beyond the training state and the replica; the full state dict is never materialized. It does
not know about RL, the rollout engine or how buckets are planned (`buckets.py`).

Legend: E experts, L experts on this rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rlfusion.fusion.buckets import Bucket, TensorSpec, empty_bucket, plan_buckets, slot_view
from rlfusion.fusion.offload import HostPool, OffloadStats, grad_tensors, optimizer_tensors
from rlfusion.model import lora
from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel.api import ParallelModel
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.layout import ParallelLayout
from rlfusion.parallel.mesh import ParallelMesh, build_mesh
from rlfusion.parallel.sharded import is_dtensor


@dataclass(frozen=True)
class SwitchStats:
    """One switch on this rank."""

    direction: str  # "train_to_infer" or "infer_to_train"
    num_buckets: int = 0
    largest_bucket_bytes: int = 0
    bytes_moved: int = 0  # bytes written into the replica (or freed from it, going back)
    recv_bytes: int = 0  # payload this rank received through collectives
    offload_bytes: int = 0  # optimizer state / grads / weights moved to or from host
    peak_extra_bytes: int = 0  # largest (bucket + gathered temporary) alive at once
    seconds: float = 0.0


@dataclass
class SwitchCounter:
    """Every switch of a run, in order."""

    history: list[SwitchStats] = field(default_factory=list)

    def record(self, stats: SwitchStats) -> SwitchStats:
        self.history.append(stats)
        return stats

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved for s in self.history)


# ---- the rollout replica ---------------------------------------------------------------------

def build_inference_model(cfg: ModelConfig, layout: ParallelLayout | None = None,
                          device: torch.device | str = "cpu",
                          dtype: torch.dtype | None = None) -> MoETransformer:
    """A rollout replica in eval mode: plain, or with routed experts over `layout.ep` ranks of
    the whole world (`split_experts`).

    The weights are placeholders until `train_to_infer` fills them. The inference layout must
    be pp1 × tp1 (dense weights replicated on every rank); `ep` may differ from training.
    """
    model = MoETransformer(cfg).to(device)
    if dtype is not None:
        model = model.to(dtype)
    if layout is not None:
        split_experts(model, layout)
    return model.eval()


def split_experts(model: MoETransformer, layout: ParallelLayout, ranks: list[int] | None = None
                  ) -> ParallelMesh | None:
    """Keep only this rank's routed experts of `model` (a replica, in place), split over
    `layout.ep` of `ranks` (default: the whole world; the expert-parallel groups are runs of
    `layout.ep` consecutive ones). Every rank of the world calls it, in the same order (process
    groups are created collectively); one outside `ranks` keeps its model whole. Returns the
    layout's groups on a rank whose experts were split, else None."""
    if layout.tp != 1 or layout.pp != 1:
        raise ValueError(f"inference layout {layout.describe()} is invalid: tp and pp must be 1 "
                         "(the replica keeps dense weights whole on every rank)")
    if layout.ep == 1:
        return None
    device = next(model.parameters()).device
    mesh = build_mesh(layout, model.config, device.type, ranks=ranks)
    if mesh is None:
        return None
    for block in model.layers:
        if block.is_moe:
            block.mlp.experts = ExpertParallelExperts(block.mlp.experts, mesh)
    return mesh


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict(keep_vars=True)


@torch.no_grad()
def release(model: nn.Module) -> int:
    """Free the storage of every state-dict tensor (the tensors stay, with 0 bytes behind them).
    Returns the bytes freed."""
    freed = 0
    for t in _state_tensors(model).values():
        storage = t.untyped_storage()
        freed += storage.nbytes()
        storage.resize_(0)
    return freed


@torch.no_grad()
def materialize(model: nn.Module) -> int:
    """Allocate storage again for released tensors (contents undefined until filled).
    Returns the bytes allocated."""
    allocated = 0
    for t in _state_tensors(model).values():
        need = (t.storage_offset() + t.numel()) * t.element_size()
        storage = t.untyped_storage()
        if storage.nbytes() < need:
            allocated += need - storage.nbytes()
            storage.resize_(need)
    return allocated


def resident_bytes(model: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in _state_tensors(model).values())


# ---- where each tensor lives ---------------------------------------------------------------

@dataclass
class _Source:
    """This rank's view of the training layout, by plain state-dict name."""

    tensors: dict[str, torch.Tensor]  # DTensor, expert shard or whole tensor (this stage only)
    experts: dict[str, ExpertParallelExperts]  # names that are expert-parallel shards
    owner: dict[str, int]  # name → pp coordinate of the stage holding it
    # Expert rows each training-EP-group member's replica keeps (None: everyone gets all).
    wants: list[slice] | None = None

    @classmethod
    def of(cls, pm: ParallelModel, replica_rows: slice | None) -> "_Source":
        tensors, experts = {}, {}
        for chunk in pm.chunks:
            modules = {id(p): m for m in chunk.modules() if isinstance(m, ExpertParallelExperts)
                       for p in m.parameters(recurse=False)}
            for name, t in chunk.state_dict(keep_vars=True).items():
                tensors[name] = t
                if id(t) in modules:
                    experts[name] = modules[id(t)]
        names: list = [list(tensors)]
        if pm.layout.pp > 1:
            names = [None] * pm.layout.pp
            dist.all_gather_object(names, list(tensors), group=pm.mesh.group("pp"))
        owner = {name: stage for stage, part in enumerate(names) for name in part}
        return cls(tensors, experts, owner, _wants(pm, replica_rows))


def _wants(pm: ParallelModel, replica_rows: slice | None) -> list[slice] | None:
    """With experts split in training and in the replica, who keeps which rows. Pipeline
    stages broadcast whole tensors, so with pp > 1 every rank gathers all experts instead."""
    if replica_rows is None or not pm.experts or pm.layout.pp > 1:
        return None
    group = pm.experts[0].ep
    wants: list = [None] * group.size
    dist.all_gather_object(wants, replica_rows, group=group.group)
    return wants


def _destinations(model: nn.Module) -> dict[str, tuple[torch.Tensor, slice | None]]:
    """Replica tensor by name, with the rows of the full tensor it keeps (its experts)."""
    rows = {id(p): slice(m.first_expert, m.first_expert + m.num_local)
            for m in model.modules() if isinstance(m, ExpertParallelExperts)
            for p in m.parameters(recurse=False)}
    out = {}
    for name, t in _state_tensors(model).items():
        if is_dtensor(t):
            raise ValueError(f"inference model tensor {name} is a DTensor: the replica must not "
                             "be tensor- or data-parallel (use build_inference_model)")
        out[name] = (t, rows.get(id(t)))
    return out


@torch.no_grad()
def load_whole(model: nn.Module, state: dict[str, torch.Tensor], part=None) -> None:
    """Copy a whole state dict (a checkpoint's) into a replica, which keeps only its experts'
    rows of an expert tensor where its experts are split (`split_experts`). `part`: which of
    the replica's names `state` holds (None: all; `lora.is_adapter`: its adapters)."""
    dst = {k: v for k, v in _destinations(model).items() if part is None or part(k)}
    if set(dst) != set(state):
        raise ValueError(f"state dict does not match the replica: {sorted(set(dst) ^ set(state))[:3]}")
    for name, (t, rows) in dst.items():
        t.copy_(state[name] if rows is None else state[name][rows])


def plan_switch(cfg: ModelConfig, infer_model: nn.Module, bucket_bytes: int) -> list[Bucket]:
    """Buckets over the plain model's state dict (full shapes), in the replica's dtypes."""
    with torch.device("meta"):
        plain = MoETransformer(cfg)
        if lora.spec_of(infer_model) is not None:  # the replica's adapters are filled too
            lora.attach(plain, lora.spec_of(infer_model))
        full = plain.state_dict()
    dst = _state_tensors(infer_model)
    missing = sorted(set(full) ^ set(dst))
    if missing:
        raise ValueError(f"inference model state dict differs from the plain model's: "
                         f"{missing[:3]}")
    return plan_buckets([TensorSpec(n, tuple(t.shape), dst[n].dtype) for n, t in full.items()],
                        bucket_bytes)


# ---- one bucket ------------------------------------------------------------------------------

def _gather_slot(out: torch.Tensor, t: torch.Tensor, experts: ExpertParallelExperts | None,
                 wants: list[slice] | None) -> tuple[int, int]:
    """Write the full tensor into `out` (a bucket view), or with `wants` only the expert rows
    this rank's replica keeps. Returns (received, temporary) bytes."""
    if is_dtensor(t):
        full = t.full_tensor()
        out.copy_(full)
        return full.nbytes - t._local_tensor.nbytes, full.nbytes
    if experts is None or experts.ep.size == 1:
        out.copy_(t)
        return 0, 0
    local_LDF = t.detach().to(out.dtype).contiguous()
    temp = local_LDF.nbytes if local_LDF.data_ptr() != t.data_ptr() else 0
    if wants is not None and experts.expert_to_slot_E is None:  # + the rows packed for sending
        return _redistribute_experts(out, local_LDF, experts, wants), temp + local_LDF.nbytes
    # (experts migrated by expert balancing sit in slot order: gathered whole, put back in logical
    # order, and a replica that splits its experts keeps its rows of that)
    dist.all_gather_single(out, local_LDF, group=experts.ep.group)
    if experts.expert_to_slot_E is not None:  # slot order → the replica's logical expert order
        out.copy_(out[experts.expert_to_slot_E.to(out.device)])
        temp += out.nbytes
    return out.nbytes - local_LDF.nbytes, temp


def _overlap(a: slice, b: slice) -> slice:
    return slice(max(a.start, b.start), max(min(a.stop, b.stop), max(a.start, b.start)))


def _redistribute_experts(out_EDF: torch.Tensor, local_LDF: torch.Tensor,
                          experts: ExpertParallelExperts, wants: list[slice]) -> int:
    """Zero-redundancy EP → EP: each member of the training EP group (which together holds all
    experts) sends every peer just the rows of the experts that peer's replica keeps."""
    L, me = experts.num_local, experts.ep.index
    held = [slice(j * L, (j + 1) * L) for j in range(experts.ep.size)]
    sends = [_overlap(held[me], w) for w in wants]
    recvs = [_overlap(h, wants[me]) for h in held]
    send_xDF = torch.cat([local_LDF[s.start - held[me].start:s.stop - held[me].start]
                          for s in sends])
    in_splits = [s.stop - s.start for s in sends]
    out_splits = [r.stop - r.start for r in recvs]
    dist.all_to_all_single(out_EDF[wants[me]], send_xDF, out_splits, in_splits,
                           group=experts.ep.group)
    row_bytes = local_LDF[0].nbytes
    return (sum(out_splits) - out_splits[me]) * row_bytes


def _owner_runs(bucket: Bucket, owner: dict[str, int]) -> list[tuple[int, int, int]]:
    """(start, end, owner) element ranges of consecutive slots held by one pipeline stage."""
    runs: list[tuple[int, int, int]] = []
    for slot in bucket.slots:
        stage, end = owner[slot.spec.name], slot.offset + slot.spec.numel
        if runs and runs[-1][2] == stage:
            runs[-1] = (runs[-1][0], end, stage)
        else:
            runs.append((slot.offset, end, stage))
    return runs


def _evenly_sharded(t: torch.Tensor) -> bool:
    """A DTensor split in equal pieces along one dim of a 1-D mesh (a TP shard)."""
    if not is_dtensor(t) or t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return False
    p = t.placements[0]
    return p.is_shard() and t.shape[p.dim] % t.device_mesh.size() == 0


def _gather_shards(bucket: Bucket, flat: torch.Tensor, src: _Source) -> tuple[set[str], int, int]:
    """The bucket's evenly sharded TP slots, several per all-gather instead of one each: local
    shards packed, gathered, and each full tensor written piece by piece into `flat`. A batch's
    packed and gathered buffers together stay within the bucket's largest tensor (what gathering
    that one tensor would hold); a slot that would batch alone is left to `_gather_slot`.
    Returns (the names done, received bytes, temporary bytes)."""
    limit = max(slot.spec.numel for slot in bucket.slots) * flat.element_size()
    batches: list[list] = []
    size = 0
    for slot in bucket.slots:
        t = src.tensors.get(slot.spec.name)
        if not _evenly_sharded(t):
            continue
        world = t.device_mesh.size()
        cost = slot.spec.numel * flat.element_size() * (world + 1) // world  # its packed + gathered bytes
        if batches and batches[-1][-1][1].device_mesh == t.device_mesh and size + cost <= limit:
            batches[-1].append((slot, t))
            size += cost
        else:
            batches.append([(slot, t)])
            size = cost
    done, recv, temp = set(), 0, 0
    for items in (b for b in batches if len(b) > 1):
        mesh = items[0][1].device_mesh
        world = mesh.size()
        send = torch.cat([t._local_tensor.reshape(-1).to(flat.dtype) for _, t in items])
        gathered = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        dist.all_gather_single(gathered, send, group=mesh.get_group())
        pieces_R = gathered.view(world, -1)
        offset = 0
        for slot, t in items:
            local, dim = t._local_tensor, t.placements[0].dim
            n, chunk = local.numel(), local.shape[dim]
            full = slot_view(flat, slot).view(t.shape)
            for r in range(world):
                full.narrow(dim, r * chunk, chunk).copy_(pieces_R[r, offset:offset + n].view(local.shape))
            offset += n
            done.add(slot.spec.name)
        recv += (world - 1) * send.nbytes
        temp = max(temp, send.nbytes + gathered.nbytes)
    return done, recv, temp


def _fill_bucket(bucket: Bucket, flat: torch.Tensor, src: _Source, pm: ParallelModel
                 ) -> tuple[int, int]:
    """Gather every slot of `bucket` into `flat` on every rank. Returns (received, temp) bytes."""
    done, recv, temp = _gather_shards(bucket, flat, src)
    for slot in bucket.slots:
        name = slot.spec.name
        if name in src.tensors and name not in done:  # this rank's pipeline stage holds it
            experts = src.experts.get(name)
            wants = src.wants if experts is not None else None
            r, t = _gather_slot(slot_view(flat, slot), src.tensors[name], experts, wants)
            recv, temp = recv + r, max(temp, t)
    if pm.layout.pp > 1:
        me, group = pm.mesh.coord("pp"), pm.mesh.group("pp")
        for start, end, stage in _owner_runs(bucket, src.owner):
            dist.broadcast(flat[start:end], group=group, group_src=stage)
            recv += (end - start) * flat.element_size() if stage != me else 0
    return recv, temp


def _copy_out(bucket: Bucket, flat: torch.Tensor,
              dst: dict[str, tuple[torch.Tensor, slice | None]]) -> int:
    written = 0
    for slot in bucket.slots:
        t, rows = dst[slot.spec.name]
        full = slot_view(flat, slot)
        t.copy_(full if rows is None else full[rows])
        written += t.nbytes
    return written


# ---- the two switches ------------------------------------------------------------------------

def _check(pm: ParallelModel, infer_model: nn.Module) -> None:
    cfg = getattr(infer_model, "config", None)
    if cfg != pm.config:
        raise ValueError("infer_model.config differs from the training model's config: "
                         "the replica must be built from the same ModelConfig")


@torch.no_grad()
def train_to_infer(pm: ParallelModel, infer_model: nn.Module, bucket_bytes: int, *,
                   optimizer: torch.optim.Optimizer | None = None, pool: HostPool | None = None,
                   offload_weights: bool = False,
                   counter: SwitchCounter | None = None) -> SwitchStats:
    """Training layout → rollout replica. Collective over the whole world.

    With a `pool`, the optimizer state and grads go to host first (so the replica's memory is
    what they gave back), and with `offload_weights` the training weights follow once copied.
    """
    _check(pm, infer_model)
    start = time.perf_counter()
    plan = plan_switch(pm.config, infer_model, bucket_bytes)
    offloaded = OffloadStats()
    if pool is not None:
        state = optimizer_tensors(optimizer) if optimizer is not None else []
        offloaded = pool.offload(state + grad_tensors(pm.parameters()))
    materialize(infer_model)
    dst = _destinations(infer_model)
    rows = {(r.start, r.stop) for _, r in dst.values() if r is not None}
    assert len(rows) <= 1, "every expert layer of the replica keeps the same experts"
    src = _Source.of(pm, slice(*rows.pop()) if rows else None)
    recv, peak, written = 0, 0, 0
    for bucket in plan:
        flat = empty_bucket(bucket, pm.device)
        r, temp = _fill_bucket(bucket, flat, src, pm)
        written += _copy_out(bucket, flat, dst)
        recv, peak = recv + r, max(peak, bucket.nbytes + temp)
        del flat
    if pool is not None and offload_weights:
        offloaded = _sum(offloaded, pool.offload(pm.parameters()))
    stats = SwitchStats("train_to_infer", len(plan), max(b.nbytes for b in plan), written, recv,
                        offloaded.bytes, peak, time.perf_counter() - start)
    return counter.record(stats) if counter is not None else stats


@torch.no_grad()
def infer_to_train(pm: ParallelModel, infer_model: nn.Module, *, pool: HostPool | None = None,
                   counter: SwitchCounter | None = None) -> SwitchStats:
    """Rollout replica → training: free the replica, then restore everything the pool holds
    (training weights are the source of truth, so nothing flows back from the replica)."""
    _check(pm, infer_model)
    start = time.perf_counter()
    freed = release(infer_model)
    restored = pool.restore() if pool is not None else OffloadStats()
    stats = SwitchStats("infer_to_train", bytes_moved=freed, offload_bytes=restored.bytes,
                        seconds=time.perf_counter() - start)
    return counter.record(stats) if counter is not None else stats


def _sum(a: OffloadStats, b: OffloadStats) -> OffloadStats:
    return OffloadStats(a.num_storages + b.num_storages, a.bytes + b.bytes, a.seconds + b.seconds)
