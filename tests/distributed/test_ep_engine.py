"""The rollout engine on a replica whose routed experts are split over devices (`deploy.infer_ep`),
on 4 gloo ranks: each rank decodes its own rows (attention data-parallel), every MoE layer
exchanges tokens across the expert-parallel group, and the group's engines step in lock-step —
a rank with nothing left (here rank 3 has no requests at all) joins every pass empty.

Checked against a full replica on the same rank (the same weights): greedy tokens equal and
per-token logprobs within LOGPROB_ATOL (the split experts sum in another order), with continuous
batching (3 slots for up to 5 requests: admissions while others decode), for ep2 (two groups),
ep4 and ep4 hierarchical over two nodes; and an abort after a few steps, resumed (with and without the kept cache rows), equals
the uninterrupted run.
"""

import copy

import pytest
import torch

from parallel_helpers import small_config
from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.fusion.reshard import split_experts
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout

LOGPROB_ATOL = 1e-4
REQUESTS_PER_RANK = (3, 5, 1, 0)
SLOTS = 3
NEW_TOKENS = 6
ABORT_AFTER = 3  # engine steps before the abort
EP_DEGREES = (2, 4)
# ep4 over 2 nodes of 2 ranks: each MoE layer's exchange hierarchical (one copy per token and node
# over the rail group, then inside the node)
LAYOUTS = {2: dict(dp=4, ep=2), 4: dict(dp=4, ep=4), "4 hierarchical": dict(dp=4, ep=4, ranks_per_node=2,
                                                                                hierarchical_a2a=True)}


def _requests(rank: int, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(100 + rank)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    out = []
    for i in range(REQUESTS_PER_RANK[rank]):
        n = int(torch.randint(2, 9, (1,), generator=g))
        out.append(Request(f"{rank}/{i}", torch.randint(3, vocab, (n,), generator=g).tolist(), params))
    return out


def _run(engine: LLMEngine, requests: list[Request]) -> dict[str, tuple[list[int], list[float]]]:
    done = {c.request_id: (c.output_ids, c.logprobs) for c in engine.generate(copy.deepcopy(requests))}
    return done


def _interrupted(engine: LLMEngine, requests: list[Request], keep_cache: bool) -> dict:
    for r in copy.deepcopy(requests):
        engine.add_request(r)
    done = {}
    for _ in range(ABORT_AFTER):  # every rank steps as often: the lock-step group's rule
        for c in engine.step():
            done[c.request_id] = (c.output_ids, c.logprobs)
    aborted = engine.abort({r.request_id for r in requests} - set(done), keep_cache=keep_cache)
    resumed = [Request(c.request_id, c.prompt_ids, c.params, c.output_ids, c.logprobs, c.versions) for c in aborted]
    done |= _run(engine, resumed)
    return done


def ep_engines() -> dict:
    cfg = small_config(max_seq_len=24)
    torch.manual_seed(0)
    model = MoETransformer(cfg).eval()
    rank = torch.distributed.get_rank()
    requests = _requests(rank, cfg.vocab_size)
    out = {"full": _run(LLMEngine(model, EngineConfig(max_num_seqs=SLOTS)), requests)}
    for ep, layout in LAYOUTS.items():
        replica = copy.deepcopy(model)
        mesh = split_experts(replica, ParallelLayout(**layout))
        assert (mesh.rail is not None) == ("hierarchical" in str(ep))
        kept = replica.layers[-1].mlp.experts.w_gate_EDF.shape[0]
        engine = LLMEngine(replica, EngineConfig(max_num_seqs=SLOTS))
        engine.lockstep = mesh.ep.group
        out[f"ep{ep}"] = _run(engine, requests)
        for keep in (False, True):
            out[f"ep{ep} aborted keep={keep}"] = _interrupted(engine, requests, keep)
        out[f"ep{ep} experts here"] = kept
        out[f"ep{ep} stats"] = engine.take_stats()
    return out


WORLD = (ep_engines, (), 120)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= LOGPROB_ATOL for x, y in zip(a, b))


@pytest.mark.parametrize("ep", list(LAYOUTS))
def test_ep_engine_generates_the_full_replicas_greedy_tokens_and_logprobs(world, ep):
    for rank, out in enumerate(world):
        assert out[f"ep{ep} experts here"] == small_config().num_experts // LAYOUTS[ep]["ep"]
        assert set(out[f"ep{ep}"]) == set(out["full"]) and len(out["full"]) == REQUESTS_PER_RANK[rank]
        for rid, (tokens, logprobs) in out["full"].items():
            got_tokens, got_logprobs = out[f"ep{ep}"][rid]
            assert got_tokens == tokens, (rank, rid)
            assert _close(got_logprobs, logprobs), (rank, rid, got_logprobs, logprobs)


@pytest.mark.parametrize("ep", list(LAYOUTS))
@pytest.mark.parametrize("keep", [False, True])
def test_an_abort_resumed_in_an_ep_engine_equals_the_uninterrupted_run(world, ep, keep):
    for out in world:
        run = out[f"ep{ep} aborted keep={keep}"]
        assert set(run) == set(out["full"])
        for rid, (tokens, logprobs) in out["full"].items():
            assert run[rid][0] == tokens
            assert _close(run[rid][1], logprobs)


@pytest.mark.parametrize("ep", EP_DEGREES)
def test_a_rank_without_rows_joins_its_groups_passes_empty(world, ep):
    idle = world[3][f"ep{ep} stats"]  # no requests of its own
    busy = world[1][f"ep{ep} stats"]  # the most
    assert idle["decode_rows"] == 0 and idle["idle_passes"] > 0
    # in ep4 it joins as many passes as the busiest member; in ep2 its partner has one request
    assert idle["idle_passes"] == (busy["decode_passes"] + busy["prefill_passes"] if ep == 4
                                   else world[2][f"ep{ep} stats"]["decode_passes"] + world[2][f"ep{ep} stats"]["prefill_passes"])
