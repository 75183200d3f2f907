"""Separated mode's weight sync, shard to shard: every train rank sends each rollout rank only
the pieces of its own shards that rollout rank's replica keeps, and the rollout rank writes them
straight into its replica. No rank ever holds the whole model.

    train ranks (a ParallelModel each)            rollout ranks (a replica each)
      TP / FSDP DTensor shards ──┐                  plain: every tensor whole
      expert rows (any slot      ├─ isend ─────▶    or routed experts split over an
        order after balancing)   │  per piece       inference EP group (logical rows
      pipeline stages' tensors ──┘                   [first_expert, first_expert + L))

Plan (`plan_sync`, pure, built once and cached): every train rank describes what it holds as
boxes of the plain model's full tensors (a DTensor's region from its mesh coordinate, a run
of expert rows mapped from physical slots to logical experts, or a whole tensor) and every
rollout rank the box each replica tensor keeps. The distinct boxes of one tensor must tile it.
For each (rollout rank, tensor) the plan takes each overlapping box from ONE of its holders
(the one with the fewest bytes assigned so far, ties to the lowest rank), so a tensor
replicated over data-parallel, TP or pipeline copies travels once and the senders share the
load. Pieces are cut along dim 0 to at most `bucket_bytes`, then placed first-fit into global
rounds in which no rank sends, or receives, more than `bucket_bytes`.

Transport: point-to-point on the default group (`dist.batch_isend_irecv`, gloo and NCCL), one
round at a time; a rank waits for its round before the next. A piece goes out of (or into)
the resident tensor itself when that view is contiguous and already in the replica's dtype,
else through a staging buffer of the round (at most `bucket_bytes` per rank, the
`SyncStats.peak_extra_bytes`). Metadata (names, boxes, dtypes: never weights) travels as
pickled objects once, gathered on the first train rank and sent back to every member; after
that each `sync` costs one tiny flag exchange to learn whether any member's layout changed
(an expert migration moves rows between slots), in which case the plan is rebuilt. Ranks
outside the sync take no part in anything, and no process group is created. (With NCCL,
`batch_isend_irecv` must not be the default group's very first communication: the world's
start-up barrier comes first.)

It does not know how the layout was built, about optimizers or the rollout engine; the caller
marks the engine's weights stale afterwards.

Legend: a box is one `(start, stop)` per dim of the full tensor.
"""

from __future__ import annotations

import math
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfusion.model import lora
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.sharded import is_dtensor

Box = tuple[tuple[int, int], ...]
_ALIGN = 16  # staging offsets, so every dtype's view of the byte buffer is aligned


@dataclass(frozen=True)
class SyncStats:
    """One `sync` on this rank."""

    sent_bytes: int = 0  # payload this rank sent (train ranks)
    recv_bytes: int = 0  # payload this rank received (rollout ranks)
    peak_extra_bytes: int = 0  # largest staging buffer alive at once (<= bucket_bytes)
    num_rounds: int = 0  # rounds of the plan (every member's count)
    replanned: bool = False  # the plan was (re)built by this call
    seconds: float = 0.0


@dataclass(frozen=True)
class Held:
    """A block of full tensor `name` kept by a train rank: `box` of the full tensor, held in
    its local tensor at (full index - `origin`)."""

    name: str
    full_shape: tuple[int, ...]
    box: Box
    origin: tuple[int, ...]


@dataclass(frozen=True)
class Wanted:
    """The box of full tensor `name` a rollout rank's replica keeps, in the replica's dtype."""

    name: str
    box: Box
    dtype: torch.dtype


@dataclass(frozen=True)
class Transfer:
    """One piece of full tensor `name` from train rank `src` (which keeps it at full index -
    `origin` of its local tensor) to rollout rank `dst`, in the replica's `dtype`. `tag` is
    unique in the plan."""

    tag: int
    src: int
    dst: int
    name: str
    box: Box
    origin: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.box) * self.dtype.itemsize


@dataclass
class SyncPlan:
    rounds: list[list[Transfer]] = field(default_factory=list)

    def of_rank(self, rank: int) -> list[list[Transfer]]:
        """This rank's transfers per round (empty lists kept, so every member counts alike)."""
        return [[t for t in r if rank in (t.src, t.dst)] for r in self.rounds]


# ---- boxes -----------------------------------------------------------------------------------

def _numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _whole(shape) -> Box:
    return tuple((0, n) for n in shape)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _index(box: Box, start: tuple[int, ...]) -> tuple[slice, ...]:
    """The slices of `box` in a tensor whose element 0 sits at `start` of the full tensor."""
    return tuple(slice(a - s, b - s) for (a, b), s in zip(box, start))


def _row_chunks(box: Box, itemsize: int, bucket_bytes: int) -> list[Box]:
    """`box` cut along dim 0 into pieces of at most `bucket_bytes` (a row stays whole)."""
    if not box:
        return [box]
    row_bytes = _numel(box[1:]) * itemsize
    step = max(1, bucket_bytes // max(1, row_bytes))
    (a, b), rest = box[0], box[1:]
    return [((r, min(r + step, b)),) + rest for r in range(a, b, step)]


# ---- what each side holds ----------------------------------------------------------------------

def _dtensor_held(name: str, t: Any) -> Held:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t.to_local().shape):
        raise ValueError(f"training tensor {name} has a sharding ({t.placements}) whose local "
                         "shard is not one block of the full tensor; shard_sync cannot send it")
    box = tuple((o, o + n) for o, n in zip(offset, shape))
    return Held(name, tuple(t.shape), box, tuple(offset))


def _expert_held(name: str, t: torch.Tensor, m: ExpertParallelExperts) -> list[Held]:
    """Runs of local slots holding consecutive logical experts (after a migration slot order
    is not logical order: `expert_to_slot_E`)."""
    L, first, rest = m.num_local, m.first_expert, tuple(t.shape[1:])
    full = (L * m.ep.size,) + rest
    slot_to_expert = list(range(full[0]))
    if m.expert_to_slot_E is not None:
        for e, s in enumerate(m.expert_to_slot_E.tolist()):
            slot_to_expert[s] = e
    logical = [slot_to_expert[first + i] for i in range(L)]
    out, i = [], 0
    while i < L:
        j = i + 1
        while j < L and logical[j] == logical[j - 1] + 1:
            j += 1
        out.append(Held(name, full, ((logical[i], logical[j - 1] + 1),) + _whole(rest),
                        (logical[i] - i,) + (0,) * len(rest)))
        i = j
    return out


def held_by(pm: Any, adapters_only: bool = False) -> tuple[list[Held], dict[str, torch.Tensor]]:
    """A ParallelModel's blocks (its shards and stages), or a whole model's (a train rank that
    trains a full replica), and its local tensors by name (`adapters_only`: LoRA's only)."""
    held, local = [], {}
    for chunk in _chunks(pm):
        owner = {id(p): m for m in chunk.modules() if isinstance(m, ExpertParallelExperts)
                 for p in m.parameters(recurse=False)}
        for name, t in chunk.state_dict(keep_vars=True).items():
            if adapters_only and not lora.is_adapter(name):  # LoRA: the frozen base never travels
                continue
            if is_dtensor(t):
                held.append(_dtensor_held(name, t))
                local[name] = t.to_local().detach()
            elif id(t) in owner:
                held += _expert_held(name, t, owner[id(t)])
                local[name] = t.detach()
            else:
                held.append(Held(name, tuple(t.shape), _whole(t.shape), (0,) * t.dim()))
                local[name] = t.detach()
    return held, local


def _chunks(trained: Any) -> list[nn.Module]:
    """The modules a train rank holds: a ParallelModel's chunks, or the model itself."""
    return list(trained.chunks) if hasattr(trained, "chunks") else [trained]


def _device(trained: Any) -> torch.device:
    return trained.device if hasattr(trained, "chunks") else next(trained.parameters()).device


def wanted_by(replica: nn.Module, adapters_only: bool = False
              ) -> tuple[list[Wanted], dict[str, tuple[torch.Tensor, tuple]]]:
    """A replica's boxes and, by name, its tensor with the full-tensor index of its element 0
    (`adapters_only`: LoRA's only)."""
    first = {id(p): m.first_expert for m in replica.modules() if isinstance(m, ExpertParallelExperts)
             for p in m.parameters(recurse=False)}
    wanted, dest = [], {}
    for name, t in replica.state_dict(keep_vars=True).items():
        if adapters_only and not lora.is_adapter(name):
            continue
        if is_dtensor(t):
            raise ValueError(f"replica tensor {name} is a DTensor: the rollout replica must keep "
                             "dense tensors whole (build_inference_model)")
        start = (first.get(id(t), 0),) + (0,) * (t.dim() - 1) if t.dim() else ()
        wanted.append(Wanted(name, tuple((s, s + n) for s, n in zip(start, t.shape)), t.dtype))
        dest[name] = (t.detach(), start)
    return wanted, dest


# ---- the plan (pure) ---------------------------------------------------------------------------

def _holders(held: dict[int, list[Held]]) -> tuple[dict[str, dict[Box, list]], dict[str, tuple]]:
    """Per tensor: each distinct box and its holders `(train rank, origin)`; checks the boxes
    tile the tensor."""
    boxes: dict[str, dict[Box, list]] = {}
    shapes: dict[str, tuple] = {}
    for rank in sorted(held):
        for h in held[rank]:
            if shapes.setdefault(h.name, h.full_shape) != h.full_shape:
                raise ValueError(f"train ranks disagree on the shape of {h.name}: "
                                 f"{shapes[h.name]} vs {h.full_shape}")
            boxes.setdefault(h.name, {}).setdefault(h.box, []).append((rank, h.origin))
    for name, by_box in boxes.items():
        keys = sorted(by_box)
        overlap = any(_intersect(a, b) for i, a in enumerate(keys) for b in keys[i + 1:])
        if overlap or sum(map(_numel, keys)) != math.prod(shapes[name]):
            raise ValueError(f"the train ranks' pieces of {name} do not tile it exactly "
                             f"({len(keys)} distinct pieces); the training layout is inconsistent")
    return boxes, shapes


def plan_sync(held: dict[int, list[Held]], wanted: dict[int, list[Wanted]],
              bucket_bytes: int) -> SyncPlan:
    """Which train rank sends which piece to which rollout rank, in which round (see the
    module docstring). `held` / `wanted`: each train / rollout rank's blocks, by global rank."""
    boxes, shapes = _holders(held)
    load = {rank: 0 for rank in held}
    pieces: list[Transfer] = []
    for dst in sorted(wanted):
        names = {w.name for w in wanted[dst]}
        missing = sorted(set(boxes) - names)
        if missing:
            raise ValueError(f"rollout rank {dst}'s replica lacks {missing[0]} (and "
                             f"{len(missing) - 1} more) that training holds; build both from one ModelConfig")
        for w in wanted[dst]:
            if w.name not in boxes:
                raise ValueError(f"rollout rank {dst}'s replica has {w.name}, which no train rank holds")
            if len(w.box) != len(shapes[w.name]) or _intersect(w.box, _whole(shapes[w.name])) != w.box:
                raise ValueError(f"rollout rank {dst}'s {w.name} (box {w.box}) does not fit the "
                                 f"training shape {shapes[w.name]}; build both from one ModelConfig")
            for box, holders in sorted(boxes[w.name].items()):
                part = _intersect(box, w.box)
                if part is None:
                    continue
                src, origin = min(holders, key=lambda h: (load[h[0]], h[0]))
                for piece in _row_chunks(part, w.dtype.itemsize, bucket_bytes):
                    t = Transfer(len(pieces), src, dst, w.name, piece, origin, w.dtype)
                    pieces.append(t)
                    load[src] += t.nbytes
    return SyncPlan(_first_fit(pieces, bucket_bytes))


def _first_fit(pieces: list[Transfer], bucket_bytes: int) -> list[list[Transfer]]:
    """Each piece into the first round where its sender still sends, and its receiver still
    receives, at most `bucket_bytes` (a piece larger than that: alone at both ends)."""
    rounds: list[list[Transfer]] = []
    used: list[dict[int, int]] = []  # per round: bytes by rank (senders and receivers differ)
    full_before: dict[int, int] = {}  # per rank: the rounds before it have no room left

    def fits(k: int, rank: int, n: int) -> bool:
        have = used[k].get(rank, 0)
        return have == 0 or have + n <= bucket_bytes

    for t in pieces:
        k = max(full_before.get(t.src, 0), full_before.get(t.dst, 0))
        while k < len(rounds) and not (fits(k, t.src, t.nbytes) and fits(k, t.dst, t.nbytes)):
            k += 1
        if k == len(rounds):
            rounds.append([])
            used.append({})
        rounds[k].append(t)
        for rank in (t.src, t.dst):
            used[k][rank] = used[k].get(rank, 0) + t.nbytes
            j = full_before.get(rank, 0)
            while j < len(rounds) and used[j].get(rank, 0) >= bucket_bytes:
                j += 1
            full_before[rank] = j
    return rounds


# ---- one round on one rank ---------------------------------------------------------------------

def _run_round(transfers: list[Transfer], me: int, local: dict[str, torch.Tensor],
               dest: dict[str, tuple[torch.Tensor, tuple]]) -> tuple[int, int, int]:
    """Post this rank's sends and receives of one round, wait for them, and put the staged
    receives in place. Returns (sent, received, staging) bytes."""
    views = []
    for t in transfers:
        if t.src == me:
            view = local[t.name][_index(t.box, t.origin)]
            direct = view.dtype == t.dtype and view.is_contiguous()
        else:
            tensor, start = dest[t.name]
            view = tensor[_index(t.box, start)]
            direct = view.is_contiguous()
        views.append((t, view, direct))
    sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t, _, direct in views if not direct]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=views[0][1].device) if sizes else None
    ops, staged, offset, sent, recv = [], [], 0, 0, 0
    for t, view, direct in views:
        tensor = view
        if not direct:
            tensor = buf[offset:offset + t.nbytes].view(t.dtype).view(view.shape)
            offset += -(-t.nbytes // _ALIGN) * _ALIGN
        if t.src == me:
            if not direct:
                tensor.copy_(view)
            ops.append(dist.P2POp(dist.isend, tensor, t.dst, tag=t.tag))
            sent += t.nbytes
        else:
            if not direct:
                staged.append((view, tensor))
            ops.append(dist.P2POp(dist.irecv, tensor, t.src, tag=t.tag))
            recv += t.nbytes
    _wait(ops)
    for view, tensor in staged:
        view.copy_(tensor)
    return sent, recv, 0 if buf is None else buf.nbytes


# ---- the sync ----------------------------------------------------------------------------------

class ShardSync:
    """Train ranks' shards → rollout ranks' replicas (the module docstring says how). Build one
    per run on every member with the same arguments (global ranks; `bucket_bytes` bounds each
    rank's bytes in flight per round); then every member calls `sync` as often as the others:
    train ranks `sync(pm)` with their `ParallelModel`, rollout ranks `sync(replica=model)` with
    their resident replica (`reshard.build_inference_model`). The train and rollout ranks must
    be disjoint; other ranks of the world never call it. A train rank that trains a full replica
    passes the model itself as `pm` (every train rank then holds every tensor, and they share
    the sending)."""

    def __init__(self, train_ranks: list[int], rollout_ranks: list[int], bucket_bytes: int,
                 adapters_only: bool = False):
        train, rollout = list(train_ranks), list(rollout_ranks)
        if not train or not rollout or len(set(train + rollout)) != len(train) + len(rollout):
            raise ValueError(f"train_ranks={train} and rollout_ranks={rollout} are invalid: both "
                             "non-empty, without repeats, and disjoint (separated mode)")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: must be an integer >= 1")
        self.train, self.rollout, self.bucket_bytes = train, rollout, bucket_bytes
        self.adapters_only = adapters_only  # LoRA: only the adapters change, so only they travel
        self.plan: SyncPlan | None = None
        self._mine: list[list[Transfer]] = []
        self._fingerprint: int | None = None

    @torch.no_grad()
    def sync(self, pm: Any = None, replica: nn.Module | None = None) -> SyncStats:
        """One sync (collective over the members). Returns this rank's bytes and staging peak."""
        start, me = time.perf_counter(), dist.get_rank()
        meta, local, dest, device = self._describe(me, pm, replica)
        replanned = self._agree(me, meta, device)
        sent = recv = peak = 0
        for transfers in self._mine:
            if transfers:
                s, r, staging = _run_round(transfers, me, local, dest)
                sent, recv, peak = sent + s, recv + r, max(peak, staging)
        return SyncStats(sent, recv, peak, len(self.plan.rounds), replanned,
                         time.perf_counter() - start)

    def _describe(self, me: int, pm: Any, replica: nn.Module | None):
        """This member's metadata (errors in it are raised on every member, once exchanged),
        its local tensors (train) or replica tensors (rollout), and its device."""
        meta: dict[str, Any] = {"ranks": (self.train, self.rollout, self.bucket_bytes)}
        local: dict[str, torch.Tensor] = {}
        dest: dict[str, tuple[torch.Tensor, tuple]] = {}
        if me in self.train:
            if pm is None or replica is not None:
                raise ValueError(f"train rank {me} must call sync(pm) with its ParallelModel (or its whole "
                                 "model) only")
            meta |= {"role": "train", "config": pm.config}
            try:
                meta["pieces"], local = held_by(pm, self.adapters_only)
            except ValueError as e:
                meta["error"] = str(e)
            return meta, local, dest, _device(pm)
        if me not in self.rollout:
            raise ValueError(f"rank {me} is not a member of this ShardSync (train {self.train}, "
                             f"rollout {self.rollout}); only members call sync")
        if replica is None or pm is not None:
            raise ValueError(f"rollout rank {me} must call sync(replica=...) with its replica only")
        meta |= {"role": "rollout", "config": getattr(replica, "config", None)}
        try:
            meta["pieces"], dest = wanted_by(replica, self.adapters_only)
        except ValueError as e:
            meta["error"] = str(e)
        return meta, local, dest, next(replica.parameters()).device

    def _agree(self, me: int, meta: dict, device: torch.device) -> bool:
        """Rebuild the plan if any member's metadata changed since the last sync (or there is
        none yet): one flag from every member to the first train rank and the verdict back;
        then, only when needed, the metadata itself the same way."""
        fingerprint = zlib.crc32(pickle.dumps(meta))
        flag = torch.tensor([int(self.plan is None or fingerprint != self._fingerprint)], device=device)
        leader, others = self.train[0], [r for r in self.train + self.rollout if r != self.train[0]]
        if me == leader:
            flags = [torch.zeros_like(flag) for _ in others]
            _wait([dist.P2POp(dist.irecv, f, r) for f, r in zip(flags, others)])
            flag = torch.stack([flag] + flags).amax(0)
            _wait([dist.P2POp(dist.isend, flag, r) for r in others])
        else:
            _wait([dist.P2POp(dist.isend, flag, leader)])
            _wait([dist.P2POp(dist.irecv, flag, leader)])
        if not flag.item():
            return False
        self.plan = self._fingerprint = None  # (a plan that fails to build stays unbuilt everywhere)
        self.plan = _plan_of(_exchange(me, leader, others, meta, device), self.bucket_bytes)
        self._mine, self._fingerprint = self.plan.of_rank(me), fingerprint
        return True


def _exchange(me: int, leader: int, others: list[int], meta: dict, device: torch.device
              ) -> dict[int, dict]:
    """Every member's metadata on every member: gathered on the leader, then sent to each."""
    if me != leader:
        got: list = [None]
        dist.send_object_list([meta], dst=leader, device=device)
        dist.recv_object_list(got, src=leader, device=device)
        return got[0]
    metas = {me: meta}
    for r in others:
        got = [None]
        dist.recv_object_list(got, src=r, device=device)
        metas[r] = got[0]
    for r in others:
        dist.send_object_list([metas], dst=r, device=device)
    return metas


def _wait(ops: list) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _plan_of(metas: dict[int, dict], bucket_bytes: int) -> SyncPlan:
    """The plan from every member's metadata, after the checks every member makes alike."""
    ranks = metas[min(metas)]["ranks"]
    for r, m in sorted(metas.items()):
        if m["ranks"] != ranks:
            raise ValueError(f"rank {r} built its ShardSync with (train, rollout, bucket_bytes) = "
                             f"{m['ranks']}, rank {min(metas)} with {ranks}: build it alike everywhere")
        if "error" in m:
            raise ValueError(f"rank {r}: {m['error']}")
    config = next(m["config"] for m in metas.values() if m["role"] == "train")
    for r, m in sorted(metas.items()):
        if m["config"] != config:
            raise ValueError(f"rank {r}'s model config differs from the training model's: the "
                             "replica must be built from the same ModelConfig")
    held = {r: m["pieces"] for r, m in metas.items() if m["role"] == "train"}
    wanted = {r: m["pieces"] for r, m in metas.items() if m["role"] == "rollout"}
    return plan_sync(held, wanted, bucket_bytes)
