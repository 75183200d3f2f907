"""Rollout routing replay (R3) on one process, the shipped tiny base: the engine records each fed
token's experts per MoE layer; the training forward compares them with its own router's choice
and, with replay, routes by them.

- routes are recorded for every fed position (prompt and all responses but the last token), in
  the narrowest integer type, and survive an abort and resume (kept cache or re-prefilled);
- at the engine's precision the trainer's own routing agrees with the recorded one, so replay
  changes nothing: equal logprobs and gradients with and without it;
- a bf16 rollout routes some tokens differently from the fp32 trainer; with replay every token's
  experts in the training forward are the recorded ones, and the router still gets a gradient.
"""

import copy

import pytest
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.model.routes import NO_ROUTE, Routes
from rlfusion.rl.trajectory import Trajectory, batch_routes, pack, token_logprobs

NEW = 12


@pytest.fixture(scope="module")
def base():
    model, tokenizer, _ = load_base(find_base())
    return model.eval(), tokenizer


def _requests(tokenizer, n=6, temperature=0.0):
    params = SamplingParams(temperature=temperature, max_new_tokens=NEW)
    prompts = [f"{a}+{b}=" for a, b in zip(range(3, 3 + n), range(40, 40 + n))]
    return [Request(str(i), tokenizer.encode(p), params) for i, p in enumerate(prompts)]


def _generate(model, requests, dtype=None, seed=0):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, seed=seed, compute_dtype=dtype, record_routes=True))
    return engine.generate(copy.deepcopy(requests))


def _trajs(completions):
    return [Trajectory.of_completion(c) for c in completions]


def _forward(model, trajs, replay, record=False):
    batch = pack(trajs)
    routes = batch_routes(batch, model.config.top_k, replay)
    routes.record = record
    logprobs_N, _ = token_logprobs(model, batch, routes=routes)
    return batch, routes, logprobs_N


def test_routes_cover_every_fed_position_in_the_narrowest_type(base):
    model, tokenizer = base
    cfg = model.config
    for c in _generate(model, _requests(tokenizer)):
        assert c.routes.dtype == torch.uint8  # one byte per expert id
        assert c.routes.shape == (len(c.prompt_ids) + len(c.output_ids) - 1, cfg.num_moe_layers * cfg.top_k)
        assert int(c.routes.min()) >= 0 and int(c.routes.max()) < cfg.num_experts


@pytest.mark.parametrize("keep_cache", [False, True])
def test_routes_survive_an_abort_and_resume(base, keep_cache):
    model, tokenizer = base
    requests = _requests(tokenizer)
    whole = {c.request_id: c for c in _generate(model, requests)}
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, record_routes=True))
    for r in copy.deepcopy(requests):
        engine.add_request(r)
    done = {}
    for _ in range(5):
        done |= {c.request_id: c for c in engine.step()}
    aborted = engine.abort({r.request_id for r in requests} - set(done), keep_cache=keep_cache)
    assert aborted and all(c.routes is not None for c in aborted if c.output_ids)  # (waiting ones: none yet)
    done |= {c.request_id: c for c in engine.generate([Request.resume(c) for c in aborted])}
    for rid, c in whole.items():
        assert done[rid].output_ids == c.output_ids
        assert torch.equal(done[rid].routes, c.routes)


def test_same_precision_replay_changes_nothing(base):
    model, tokenizer = base
    trajs = _trajs(_generate(model, _requests(tokenizer)))
    m = copy.deepcopy(model).train()
    _, own, own_lp = _forward(m, trajs, replay=False)
    assert own.agreement() and all(a == 1.0 for a in own.agreement().values())
    _, _, replay_lp = _forward(m, trajs, replay=True)
    assert torch.equal(own_lp, replay_lp)


def test_a_bf16_rollout_differs_and_replay_routes_by_it_with_a_router_gradient(base):
    model, tokenizer = base
    trajs = _trajs(_generate(model, _requests(tokenizer, n=32, temperature=1.0), dtype=torch.bfloat16))
    m = copy.deepcopy(model).train()
    top_k = m.config.top_k
    _, own, _ = _forward(m, trajs, replay=False)
    agreement = own.agreement()
    assert min(agreement.values()) < 1.0  # bf16 matmuls flip some of the fp32 router's choices
    assert own.differs_N.any()
    batch, replayed, logprobs_N = _forward(m, trajs, replay=True, record=True)
    used_NLK = replayed.recorded_NLK()
    given_NLK = batch.routes_NX.view(len(batch.tokens_N), -1, top_k)
    fed_N = given_NLK[:, 0, 0] != NO_ROUTE
    assert torch.equal(used_NLK[fed_N], given_NLK[fed_N])  # every fed token, every MoE layer
    (logprobs_N * batch.loss_mask_N).sum().backward()
    router_grads = [r.weight.grad for r in m.routers()]
    assert all(g is not None and g.abs().sum() > 0 for g in router_grads)


def test_routes_compare_only_where_recorded():
    routes = Routes(torch.tensor([[[0, 1]], [[NO_ROUTE, NO_ROUTE]]]), replay=False)
    routes.observe(0, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 4]]))
    assert routes.agreement() == {0: 0.5}  # one token compared, one of its two experts shared
    assert routes.differs_N.tolist() == [True, False]


def test_the_reference_replays_the_rollouts_routes_when_asked(base):
    from rlfusion.runtime.reference_stage import ReferenceStage

    model, tokenizer = base
    trajs = _trajs(_generate(model, _requests(tokenizer, n=32, temperature=1.0), dtype=torch.bfloat16))
    _, _, replayed_N = _forward(model, trajs, replay=True)
    _, _, own_N = _forward(model, trajs, replay=False)
    batch = pack(trajs)
    for replay, want_N in ((True, replayed_N), (False, own_N)):
        ReferenceStage(copy.deepcopy(model), 1.0, 1 << 20, replay=replay).logprobs(trajs)
        got = torch.tensor([x for t in trajs for x in t.ref_logprobs])
        assert torch.allclose(got, want_N[batch.loss_mask_N.bool()].detach(), atol=1e-6)


@pytest.mark.parametrize("items, match", [
    (["algo.routing_replay_reference=true"], "reference replays the routes the actor replays"),
    (["algo.routing_replay=rollout", "rollout.backend=vllm"], "recorded by the native engine"),
    (["algo.routing_replay=sometimes"], "allowed: none, rollout"),
])
def test_bad_replay_settings_are_one_line(items, match):
    from rlfusion.config import load_config
    from rlfusion.runtime.train_config import TrainConfig

    with pytest.raises(ValueError, match=match):
        load_config(TrainConfig, None, items)


def test_a_resume_across_a_policy_version_keeps_the_routes_tokens_were_sampled_with(base):
    """Aborted, the weights change (a new policy version), resumed by re-prefilling: the
    positions fed before the abort keep the routes of the version that fed them; the ones fed
    after carry the new version's."""
    model, tokenizer = base
    m = copy.deepcopy(model)
    engine = LLMEngine(m, EngineConfig(max_num_seqs=8, record_routes=True))
    for r in _requests(tokenizer, n=6, temperature=1.0):
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    aborted = [c for c in engine.abort({str(i) for i in range(6)}) if c.output_ids]
    before = {c.request_id: c.routes.clone() for c in aborted}
    with torch.no_grad():
        for router in m.routers():  # the next version routes differently
            router.weight.copy_(torch.randn_like(router.weight))
    engine.policy_version = 1
    for c in engine.generate([Request.resume(c) for c in aborted]):
        old = before[c.request_id]
        assert torch.equal(c.routes[:len(old)], old)
        assert len(c.routes) == len(c.prompt_ids) + len(c.output_ids) - 1 and c.versions[-1] == 1


def test_same_precision_replayed_and_unreplayed_gradients_are_equal(base):
    model, tokenizer = base
    trajs = _trajs(_generate(model, _requests(tokenizer)))
    grads = []
    for replay in (False, True):
        m = copy.deepcopy(model).train()
        batch, _, logprobs_N = _forward(m, trajs, replay=replay)
        (logprobs_N * batch.loss_mask_N).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
