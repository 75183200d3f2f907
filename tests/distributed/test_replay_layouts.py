"""Routing replay in training layouts, on 4 gloo ranks: every token's experts in the training
forward are the given (rollout's) ones, in every MoE layer, with the routed experts split over
2 ranks (`ep2`: the expert-parallel dispatch takes the replayed ids) and over 2 pipeline stages
(`pp2`: each micro-batch's routes ride the schedule to every stage); the router still gets a
gradient. The given routes are drawn at random, so they differ from the routers' own choices
(what a replay must override).
"""

import torch

from parallel_helpers import small_config
from rlfusion.model.moe import Router
from rlfusion.model.routes import NO_ROUTE, Routes
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, parallelize

ROWS, T = 4, 8


def _given(cfg, rank: int) -> torch.Tensor:
    """Random distinct experts per token and MoE layer `[ROWS, T, L * K]`, the last position of
    each row without a route (as a sample's last token)."""
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.rand(ROWS, T, cfg.num_moe_layers, cfg.num_experts, generator=g).argsort(-1)[..., :cfg.top_k]
    ids[:, -1] = NO_ROUTE
    return ids.flatten(2)


def _hooks(modules) -> list:
    """Each router call's experts routed to, in call order, per router."""
    calls: list = []
    for m in modules:
        for layer, router in enumerate(r for r in m.modules() if isinstance(r, Router)):
            router.register_forward_hook(lambda mod, args, out, layer=layer: calls.append((id(mod), out[0].detach())))
    return calls


def _check(calls, routers_in_order, given_NX: torch.Tensor, top_k: int) -> bool:
    """Every router's ids over all its calls (concatenated) equal the given routes of its layer."""
    ok = True
    for router, moe_index in routers_in_order:
        used = torch.cat([ids for rid, ids in calls if rid == id(router)])
        want = given_NX.view(len(given_NX), -1, top_k)[:, moe_index]
        fed = want[:, 0] != NO_ROUTE
        ok &= torch.equal(used[fed], want[fed])
    return ok


def _routers(pm) -> list:
    """(router, its index among the model's MoE layers) for the layers this rank holds."""
    out = []
    for chunk in pm.chunks:
        for name, m in chunk.named_modules():
            if isinstance(m, Router):
                layer = int(name.split(".")[1])
                out.append((m, layer - pm.config.num_dense_layers))
    return out


def replay_in_layouts() -> dict:
    cfg = small_config(max_seq_len=16)
    rank = torch.distributed.get_rank()
    out = {}
    # expert parallel: each rank its own rows, one forward (the dispatch is collective)
    torch.manual_seed(0)
    pm = parallelize(MoETransformer(cfg).train(), ParallelLayout(dp=4, ep=2))
    given = _given(cfg, rank)
    tokens = torch.randint(3, cfg.vocab_size, (ROWS, T), generator=torch.Generator().manual_seed(rank))
    calls = _hooks(pm.chunks)
    logits = pm.chunks[0](tokens, routes=Routes(given.view(ROWS * T, -1, cfg.top_k), replay=True))
    logits.float().pow(2).mean().backward()
    out["ep2 replayed"] = _check(calls, _routers(pm), given.view(ROWS * T, -1), cfg.top_k)
    out["ep2 router grad"] = all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r, _ in _routers(pm))
    # pipeline: 2 stages x 2 data-parallel ranks, 2 micro-batches; the same rows on both stages
    torch.manual_seed(0)
    pm = parallelize(MoETransformer(cfg).train(), ParallelLayout(pp=2, dp=2), n_microbatches=2)
    dp = pm.mesh.coord("dp")
    given, tokens = _given(cfg, dp), torch.randint(3, cfg.vocab_size, (ROWS, T), generator=torch.Generator().manual_seed(dp))
    calls = _hooks(pm.chunks)
    for chunk in pm.chunks:
        chunk.replay = True  # (what the actor's pipeline pass sets with algo.routing_replay=rollout)
    side = torch.zeros(ROWS, T, 1)
    pm.pipeline_pass(tokens, side, lambda logits, side: logits.float().pow(2).mean(), 2,
                     torch.ones(ROWS, T, dtype=torch.bool), backward=True, routes_BTX=given)
    out["pp2 replayed"] = _check(calls, _routers(pm), given.view(ROWS * T, -1), cfg.top_k)
    out["pp2 layers here"] = len(_routers(pm))
    out["pp2 router grad"] = all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r, _ in _routers(pm))
    return out


WORLD = (replay_in_layouts, (), 120)


def test_ep2_replays_every_tokens_experts_and_trains_the_router(world):
    assert all(r["ep2 replayed"] and r["ep2 router grad"] for r in world)


def test_pp2_replays_every_tokens_experts_on_each_stage(world):
    assert all(r["pp2 layers here"] > 0 for r in world)
    assert all(r["pp2 replayed"] and r["pp2 router grad"] for r in world)
