"""Train ↔ inference switching (RL Fusion) on 4 gloo ranks, plus pure-CPU bucket/offload tests.

One world runs every training layout (spawning is the slow part on 2 cores). Per layout: one
AdamW step (so there are grads and optimizer state), then for each bucket size a full switch
to the rollout replica and back, with optimizer state, grads and training weights offloaded
to the host pool in between. Checked:
(a) training weights, grads and AdamW state bitwise identical after the round trip, and their
    device storage freed while offloaded;
(b) the replica built bucket by bucket equals `full_state_dict()` bitwise (experts: this
    rank's rows when the replica is expert-parallel, "→ epN"), for buckets smaller than the
    largest tensor (4 KiB < 16 KiB expert stacks) and larger (64 KiB); EP → EP sends only the
    experts a replica lacks;
(c) greedy decoding with the replica equals the training-layout forward: argmax exactly at
    every generated position, logits within LOGIT_ATOL (TP only reorders sums; observed ≤ 1e-6);
(d) per-switch stats: buckets, bytes moved, bytes received, peak extra bytes, seconds.
"""

import pytest
import torch
import torch.distributed as dist

from parallel_helpers import make_batches, small_config
from rlfusion.fusion.buckets import TensorSpec, pack, plan_buckets, unpack
from rlfusion.fusion.offload import HostPool, device_bytes, grad_tensors, optimizer_tensors
from rlfusion.fusion.reshard import (SwitchCounter, build_inference_model, infer_to_train,
                                     release, resident_bytes, train_to_infer)
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, parallelize
from rlfusion.parallel.expert_parallel import ExpertParallelExperts

LOGIT_ATOL = 1e-5
BUCKET_SIZES = (4096, 65536)
NEW_TOKENS = 4
CASES = [
    # name, training layout, micro-batches, inference layout (None = plain replica per rank)
    ("dp2×tp2", dict(dp=2, tp=2), 1, None),
    ("dp2×tp2 → ep4", dict(dp=2, tp=2), 1, dict(dp=4, ep=4)),
    ("tp2×ep2", dict(dp=2, tp=2, ep=4), 1, None),
    ("pp2×dp2", dict(pp=2, dp=2), 2, None),
    ("pp2×dp2 → ep2", dict(pp=2, dp=2), 2, dict(dp=4, ep=2)),
    ("ep4", dict(dp=4, ep=4), 1, None),
    ("ep4 → ep2", dict(dp=4, ep=4), 1, dict(dp=4, ep=2)),
    ("ep2 → ep4", dict(dp=4, ep=2), 1, dict(dp=4, ep=4)),  # to a larger EP degree (the seed's EP32 → EP64)
    ("pp2×ep2 → ep4", dict(pp=2, dp=2, ep=2), 2, dict(dp=4, ep=4)),
]


# ---- pure CPU ------------------------------------------------------------------------------

def test_plan_keeps_order_bounds_size_and_isolates_large_tensors():
    specs = [TensorSpec("a", (10,), torch.float32), TensorSpec("b", (20,), torch.float32),
             TensorSpec("big", (100,), torch.float32), TensorSpec("c", (5,), torch.float32),
             TensorSpec("h", (4,), torch.bfloat16)]
    plan = plan_buckets(specs, bucket_bytes=128)
    assert [b.names for b in plan] == [["a", "b"], ["big"], ["c"], ["h"]]
    assert [s.offset for s in plan[0].slots] == [0, 10]
    assert plan[0].nbytes == 120 and plan[1].nbytes == 400 and plan[3].dtype == torch.bfloat16
    assert [n for b in plan_buckets(specs, 1 << 20) for n in b.names] == [s.name for s in specs]


def test_pack_unpack_round_trip_and_bad_input():
    tensors = {"w": torch.randn(3, 4), "v": torch.randn(5)}
    plan = plan_buckets([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], 1024)
    flat = pack(plan[0], tensors)
    assert all(torch.equal(unpack(plan[0], flat)[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets([], 0)
    with pytest.raises(ValueError, match="does not match bucket"):
        unpack(plan[0], flat[:-1])


def test_host_pool_round_trip_is_bitwise_and_frees_device_storage():
    model = MoETransformer(small_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 17, (2, 6))).sum().backward()
    opt.step()
    tensors = optimizer_tensors(opt) + grad_tensors(model.parameters()) + list(model.parameters())
    before = [t.clone() for t in tensors]
    nbytes = device_bytes(tensors)
    pool = HostPool()
    stats = pool.offload(tensors)
    assert stats.bytes == nbytes == pool.host_bytes and device_bytes(tensors) == 0
    assert pool.restore().bytes == nbytes and pool.host_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_replica_release_and_config_mismatch():
    cfg = small_config()
    replica = build_inference_model(cfg)
    total = resident_bytes(replica)
    assert release(replica) == total and resident_bytes(replica) == 0

    class Fake:
        config = cfg.replace(d_model=16)

    with pytest.raises(ValueError, match="config differs"):
        train_to_infer(Fake(), replica, 4096)


# ---- 4 gloo ranks --------------------------------------------------------------------------

def _train_forward(pm, tokens_BT):
    """Logits of the training layout (pp: stage 0 sends hidden states to its stage-1 peer);
    None on ranks that do not hold the last stage."""
    if pm.layout.pp == 1:
        return pm.chunks[0](tokens_BT)
    peer_offset = pm.layout.dp * pm.layout.tp
    if pm.mesh.coord("pp") == 0:
        dist.send(pm.chunks[0](tokens_BT).contiguous(), dst=dist.get_rank() + peer_offset)
        return None
    hidden_BTD = torch.empty(*tokens_BT.shape, pm.config.d_model)
    dist.recv(hidden_BTD, src=dist.get_rank() - peer_offset)
    return pm.chunks[0](hidden_BTD)


def _greedy(model, prompt_BT, new_tokens):
    tokens_BT = prompt_BT
    for _ in range(new_tokens):
        next_B = model(tokens_BT)[:, -1].argmax(-1)
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], 1)
    return tokens_BT


def _expected(replica, full):
    """The full state dict restricted to what the replica keeps (its experts' rows)."""
    out = dict(full)
    for name, m in replica.named_modules():
        if isinstance(m, ExpertParallelExperts):
            rows = slice(m.first_expert, m.first_expert + m.num_local)
            for p in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
                out[f"{name}.{p}"] = full[f"{name}.{p}"][rows]
    return out


def _local(tensors):
    return [(t._local_tensor if hasattr(t, "_local_tensor") else t).clone() for t in tensors]


def _one_layout(layout_kw, n_micro, infer_kw):
    cfg = small_config()
    torch.manual_seed(0)
    pm = parallelize(MoETransformer(cfg).train(), ParallelLayout(**layout_kw),
                     n_microbatches=n_micro)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    tokens = make_batches(cfg, 1, 8, 12)[0]
    pm.forward_backward(pm.shard_batch(tokens[:, :-1]), pm.shard_batch(tokens[:, 1:]))
    opt.step()  # grads kept: the pool must carry them too
    full = pm.full_state_dict()
    replica = build_inference_model(cfg, ParallelLayout(**infer_kw) if infer_kw else None)
    release(replica)  # training phase: the replica holds no memory
    training = optimizer_tensors(opt) + grad_tensors(pm.parameters()) + list(pm.parameters())
    before, train_bytes = _local(training), device_bytes(training)
    prompt_BT = make_batches(cfg, 1, 4, 5, seed=2)[0]  # 4 rows × 6 tokens
    counter, out = SwitchCounter(), {"runs": []}
    for bucket_bytes in BUCKET_SIZES:
        pool = HostPool()
        stats = train_to_infer(pm, replica, bucket_bytes, optimizer=opt, pool=pool,
                               offload_weights=True, counter=counter)
        expected = _expected(replica, full)
        got = replica.state_dict()
        run = {"bucket_bytes": bucket_bytes, "stats": stats,
               "mismatch": [k for k in expected if not torch.equal(got[k], expected[k])],
               "offloaded_left": device_bytes(training), "host_bytes": pool.host_bytes,
               "train_bytes": train_bytes, "replica_bytes": resident_bytes(replica)}
        if bucket_bytes == BUCKET_SIZES[0]:
            with torch.no_grad():
                run["greedy_BT"] = _greedy(replica, prompt_BT, NEW_TOKENS)
                run["replica_logits"] = replica(run["greedy_BT"])
        back = infer_to_train(pm, replica, pool=pool, counter=counter)
        run |= {"back": back, "replica_after": resident_bytes(replica),
                "restored_equal": all(torch.equal(a, b) for a, b in zip(_local(training), before))}
        out["runs"].append(run)
    pm.train(False)
    with torch.no_grad():
        logits = _train_forward(pm, out["runs"][0]["greedy_BT"])
    out["train_logits"] = logits
    out["history"] = counter.history
    return out


def switch_layouts(cases) -> dict:
    return {name: _one_layout(kw, n_micro, infer) for name, kw, n_micro, infer in cases}


# what this module's ranks run in the folder's shared world (conftest.py: the `world` fixture)
WORLD = (switch_layouts, (CASES,), 240)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_replica_equals_full_state_dict_for_every_bucket_size(world, name):
    for rank in world:
        for run in rank[name]["runs"]:
            assert not run["mismatch"], (run["bucket_bytes"], run["mismatch"][:3])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_round_trip_restores_training_state_bitwise_and_frees_memory(world, name):
    for rank in world:
        for run in rank[name]["runs"]:
            assert run["restored_equal"]
            assert run["offloaded_left"] == 0  # grads, AdamW state, weights: all on host
            assert run["host_bytes"] == run["train_bytes"] == run["stats"].offload_bytes
            assert run["back"].offload_bytes == run["train_bytes"]
            assert run["replica_after"] == 0 and run["back"].bytes_moved == run["replica_bytes"]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_replica_greedy_decode_matches_training_layout(world, name):
    checked = 0
    for rank in world:
        r = rank[name]
        if r["train_logits"] is None:  # pipeline stage without the LM head
            continue
        run = r["runs"][0]
        diff = (r["train_logits"] - run["replica_logits"]).abs().max().item()
        assert diff <= LOGIT_ATOL, diff
        prompt_len = run["greedy_BT"].shape[1] - NEW_TOKENS
        generated = run["greedy_BT"][:, prompt_len:]
        assert torch.equal(r["train_logits"][:, prompt_len - 1:-1].argmax(-1), generated)
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_switch_stats(world, name):
    for rank in world:
        history = rank[name]["history"]
        assert [s.direction for s in history] == ["train_to_infer", "infer_to_train"] * 2
        small, large = history[0], history[2]
        assert small.num_buckets > large.num_buckets >= 1
        largest_tensor = 8 * 32 * 16 * 4  # one expert weight stack, fp32
        assert small.largest_bucket_bytes == largest_tensor  # oversize tensor: own bucket
        assert large.largest_bucket_bytes <= BUCKET_SIZES[1]
        for s in (small, large):
            assert s.bytes_moved == rank[name]["runs"][0]["replica_bytes"] and s.seconds > 0
            # one bucket plus at most one gathered tensor beyond the replica and training state
            assert s.peak_extra_bytes <= s.largest_bucket_bytes + largest_tensor
        assert small.recv_bytes > 0  # every training layout here shards something


def test_expert_parallel_replica_receives_only_its_experts(world):
    # 3 MoE layers × 3 weights × 8 experts × (32×16) fp32. Training ep4: rank r holds experts
    # {2r, 2r+1}. A plain replica receives the 6 it lacks; an ep2 replica keeps 4 experts
    # (ranks 0, 2: experts 0-3; ranks 1, 3: experts 4-7) and receives only those it lacks.
    expert_bytes = 3 * 3 * 8 * 32 * 16 * 4
    for r, rank in enumerate(world):
        plain, ep2 = rank["ep4"]["history"][0], rank["ep4 → ep2"]["history"][0]
        lacks = len(set(range(r % 2 * 4, r % 2 * 4 + 4)) - {2 * r, 2 * r + 1})
        assert plain.recv_bytes - ep2.recv_bytes == expert_bytes * (6 - lacks) // 8
