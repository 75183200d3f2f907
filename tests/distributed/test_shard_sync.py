"""Separated mode's shard-to-shard weight sync (`fusion/shard_sync.py`): ranks 0, 1 train in a
layout, ranks 2, 3 hold rollout replicas (plain, or with experts split over an ep2 group of
their own), in the folder's shared 4-rank world; plus pure-CPU tests of the plan.

Per case: one AdamW step on the train side (and, where named, an expert migration), then a sync,
then a second sync. Checked:
(a) every replica tensor equals the expected rows of `full_state_dict()` (gathered on the test
    side only), bitwise, in the replica's dtype;
(b) each rollout rank received exactly the bytes its replica holds (nothing twice), and the
    train ranks sent exactly what the rollout ranks received;
(c) no rank's staging exceeds one bucket;
(d) the plan is built once and reused; an expert migration after it is noticed and the plan
    rebuilt;
(e) a replica from another config fails on every rank with one line.
"""

import pytest
import torch
import torch.distributed as dist

from parallel_helpers import make_batches, small_config
from rlfusion.fusion.shard_sync import Held, ShardSync, Wanted, plan_sync
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, parallelize
from rlfusion.parallel.balance import migrate_experts
from rlfusion.parallel.expert_parallel import ExpertParallelExperts
from rlfusion.parallel.mesh import build_mesh

TRAIN, ROLLOUT = [0, 1], [2, 3]
SMALL, LARGE = 4096, 1 << 20  # SMALL < one expert weight stack (16 KiB): pieces are cut
MIGRATION = [4, 1, 6, 3, 0, 5, 2, 7]  # slot → logical expert: half the experts change rank
TRAININGS = {  # training layout on TRAIN, parallelize kwargs
    "ep2": (dict(dp=2, ep=2), {}),  # FSDP dense weights, experts split over 2
    "tp2": (dict(tp=2), {}),
    "pp2": (dict(pp=2), dict(n_microbatches=2)),  # stages of unequal size
    "fsdp2": (dict(dp=2), {}),  # experts FSDP-sharded too
    "dp2 replicas": (dict(dp=2), dict(fsdp=False)),  # every tensor on both train ranks
}
CASES = [
    # name, training, inference ep (1: plain replica), bucket bytes, replica dtype
    ("ep2 → ep2", "ep2", 2, SMALL, torch.float32),
    ("ep2 → plain", "ep2", 1, SMALL, torch.float32),
    ("ep2 → ep2 bf16", "ep2", 2, SMALL, torch.bfloat16),
    ("tp2 → ep2", "tp2", 2, SMALL, torch.float32),
    ("pp2 → plain", "pp2", 1, LARGE, torch.float32),
    ("fsdp2 → ep2", "fsdp2", 2, SMALL, torch.float32),
    ("dp2 replicas → plain", "dp2 replicas", 1, SMALL, torch.float32),
]


# ---- pure CPU ------------------------------------------------------------------------------

def _whole(name, shape):
    return Held(name, shape, tuple((0, n) for n in shape), (0,) * len(shape))


def test_replicated_tensor_is_sent_once_per_receiver_and_senders_share_the_load():
    held = {0: [_whole("a", (4, 4)), _whole("b", (4, 4))], 1: [_whole("a", (4, 4)), _whole("b", (4, 4))]}
    wanted = {r: [Wanted("a", ((0, 4), (0, 4)), torch.float32), Wanted("b", ((0, 4), (0, 4)), torch.float32)]
              for r in (2, 3)}
    plan = plan_sync(held, wanted, bucket_bytes=1 << 20)
    transfers = [t for r in plan.rounds for t in r]
    assert sorted((t.dst, t.name) for t in transfers) == [(2, "a"), (2, "b"), (3, "a"), (3, "b")]
    assert [sum(t.nbytes for t in transfers if t.src == s) for s in (0, 1)] == [128, 128]


def test_pieces_fit_the_bucket_and_rounds_bound_each_rank():
    held = {0: [Held("e", (8, 4), ((0, 4), (0, 4)), (0, 0))], 1: [Held("e", (8, 4), ((4, 8), (0, 4)), (4, 0))]}
    wanted = {2: [Wanted("e", ((2, 6), (0, 4)), torch.float32)]}
    plan = plan_sync(held, wanted, bucket_bytes=32)  # two rows
    transfers = [t for r in plan.rounds for t in r]
    assert [(t.src, t.box[0]) for t in transfers] == [(0, (2, 4)), (1, (4, 6))]
    for r in plan.rounds:
        assert sum(t.nbytes for t in r if t.dst == 2) <= 32
    assert len(plan.rounds) == 2


def test_plan_refuses_gaps_and_mismatched_replicas():
    gap = {0: [Held("e", (8, 4), ((0, 4), (0, 4)), (0, 0))]}
    with pytest.raises(ValueError, match="do not tile it exactly"):
        plan_sync(gap, {2: [Wanted("e", ((0, 4), (0, 4)), torch.float32)]}, 64)
    held = {0: [_whole("e", (8, 4))]}
    with pytest.raises(ValueError, match="does not fit the training shape"):
        plan_sync(held, {2: [Wanted("e", ((0, 8), (0, 5)), torch.float32)]}, 64)
    with pytest.raises(ValueError, match="lacks e"):
        plan_sync(held, {2: []}, 64)
    with pytest.raises(ValueError, match="disjoint"):
        ShardSync([0, 1], [1, 2], 64)


# ---- 4 gloo ranks --------------------------------------------------------------------------

def _replica(cfg, ep, dtype, seed=1):
    """A rollout replica on every rank (the group creation is every rank's), kept on ROLLOUT."""
    mesh = build_mesh(ParallelLayout(dp=2, ep=ep), cfg, ranks=ROLLOUT) if ep > 1 else None
    torch.manual_seed(seed)  # placeholder weights, unlike the trained ones
    model = MoETransformer(cfg).to(dtype)
    if mesh is not None:
        for block in model.layers:
            if block.is_moe:
                block.mlp.experts = ExpertParallelExperts(block.mlp.experts, mesh)
    return model.eval() if dist.get_rank() in ROLLOUT else None


def _trained(cfg, layout_kw, kw):
    """One AdamW step of the layout on TRAIN (None elsewhere, which only joins group creation)."""
    layout = ParallelLayout(**layout_kw)
    if dist.get_rank() not in TRAIN:
        build_mesh(layout, cfg, ranks=TRAIN)
        return None, None
    torch.manual_seed(0)
    pm = parallelize(MoETransformer(cfg).train(), layout, ranks=TRAIN, **kw)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    tokens = make_batches(cfg, 1, 8, 12)[0]
    split = pm.shard_batch if kw.get("fsdp", True) else (lambda x: x)  # replicas: the same rows
    pm.forward_backward(split(tokens[:, :-1]), split(tokens[:, 1:]))
    opt.step()
    return pm, opt


def _expected(pm):
    """The full state dict, gathered on TRAIN and handed to every rank (the test's side only)."""
    full = [pm.full_state_dict() if pm is not None else None]
    dist.broadcast_object_list(full, src=TRAIN[0])
    return full[0]


def _compare(replica, full):
    if replica is None:
        return {}
    rows = {id(p): slice(m.first_expert, m.first_expert + m.num_local) for m in replica.modules()
            if isinstance(m, ExpertParallelExperts) for p in m.parameters(recurse=False)}
    got = replica.state_dict(keep_vars=True)
    mismatch = [n for n, t in got.items()
                if not torch.equal(t.detach(), full[n][rows.get(id(t), slice(None))].to(t.dtype))]
    return {"mismatch": mismatch, "replica_bytes": sum(t.nbytes for t in got.values())}


def _sync_twice(pm, full, infer_ep, bucket_bytes, dtype):
    replica = _replica(pm.config if pm is not None else small_config(), infer_ep, dtype)
    sync = ShardSync(TRAIN, ROLLOUT, bucket_bytes)
    stats = [sync.sync(pm, replica) for _ in range(2)]
    return {"stats": stats, **_compare(replica, full)}


def _migrated(pm, opt, full):
    """Sync, migrate every layer's experts (half change rank), sync again: the plan notices."""
    replica = _replica(small_config(), 2, torch.float32)
    sync = ShardSync(TRAIN, ROLLOUT, SMALL)
    stats = [sync.sync(pm, replica)]
    if pm is not None:
        for experts in pm.experts:
            migrate_experts(experts, MIGRATION, opt)
    stats.append(sync.sync(pm, replica))
    return {"stats": stats, **_compare(replica, full)}  # a migration keeps the logical weights


def _mismatch(pm):
    replica = _replica(small_config(expert_ffn_dim=8), 2, torch.float32)
    try:
        ShardSync(TRAIN, ROLLOUT, SMALL).sync(pm, replica)
    except ValueError as e:
        return str(e)
    return None


def sync_cases(cases) -> dict:
    """Per training layout: one step, the expected weights, then each case's replica synced."""
    cfg, out = small_config(), {}
    for key, (layout_kw, kw) in TRAININGS.items():
        pm, opt = _trained(cfg, layout_kw, kw)
        full = _expected(pm)
        for name, training, ep, bucket, dtype in cases:
            if training == key:
                out[name] = _sync_twice(pm, full, ep, bucket, dtype)
        if key == "ep2":
            out["mismatch"] = _mismatch(pm)
            out["migrated"] = _migrated(pm, opt, full)
    return out


# what this module's ranks run in the folder's shared world (conftest.py: the `world` fixture)
WORLD = (sync_cases, (CASES,), 60)
NAMES = [c[0] for c in CASES] + ["migrated"]


@pytest.mark.parametrize("name", NAMES)
def test_replica_equals_full_state_dict_rows_bitwise(world, name):
    for r in ROLLOUT:
        assert world[r][name]["mismatch"] == [], world[r][name]["mismatch"][:3]


@pytest.mark.parametrize("name", NAMES)
def test_each_receiver_gets_exactly_what_its_replica_holds(world, name):
    for stats in zip(*(world[r][name]["stats"] for r in range(4))):
        for r in ROLLOUT:
            assert stats[r].recv_bytes == world[r][name]["replica_bytes"] and stats[r].sent_bytes == 0
        assert sum(stats[r].sent_bytes for r in TRAIN) == sum(stats[r].recv_bytes for r in ROLLOUT)
        assert all(stats[r].recv_bytes == 0 for r in TRAIN)


@pytest.mark.parametrize("name", NAMES)
def test_staging_stays_within_one_bucket(world, name):
    bucket = next((c[3] for c in CASES if c[0] == name), SMALL)
    for rank in world:
        assert all(s.peak_extra_bytes <= bucket for s in rank[name]["stats"])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_plan_is_built_once(world, name):
    for rank in world:
        first, second = rank[name]["stats"]
        assert first.replanned and not second.replanned
        assert (first.sent_bytes, first.recv_bytes, first.num_rounds) == \
            (second.sent_bytes, second.recv_bytes, second.num_rounds)


def test_expert_migration_rebuilds_the_plan(world):
    assert all([s.replanned for s in rank["migrated"]["stats"]] == [True, True] for rank in world)


def test_replicated_weights_are_shared_between_senders(world):
    sent = [world[r]["dp2 replicas → plain"]["stats"][0].sent_bytes for r in TRAIN]
    assert min(sent) > 0.4 * sum(sent), sent  # each replica sends about half


def test_cut_pieces_with_small_buckets_and_staging_where_views_are_strided(world):
    # tp2 shards some weights by column: their pieces land in strided views, so receivers stage
    assert any(world[r]["tp2 → ep2"]["stats"][0].peak_extra_bytes > 0 for r in ROLLOUT)
    # bf16 replicas: the senders convert, through their staging buffers
    assert all(world[r]["ep2 → ep2 bf16"]["stats"][0].peak_extra_bytes > 0 for r in TRAIN)


def test_config_mismatch_fails_on_every_rank_in_one_line(world):
    messages = [rank["mismatch"] for rank in world]
    assert all(m == messages[0] for m in messages) and messages[0] is not None
    assert "config differs" in messages[0] and "\n" not in messages[0]
