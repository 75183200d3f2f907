"""Rollout engine: scheduler plans (no model), sampling, determinism, abort/resume, batching."""

import pytest
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.sampling import sample
from rlfusion.engine.scheduler import Scheduler, SchedulerConfig
from rlfusion.engine.static import generate_static
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.model.config import get_preset
from rlfusion.model.transformer import MoETransformer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=30, stop_ids=(2,))
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=8, max_new_tokens=30, stop_ids=(2,))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MoETransformer(get_preset("tiny")).eval()
    with torch.no_grad():  # make EOS likely-ish so lengths vary
        m.lm_head.weight[2] += 0.05 * torch.randn_like(m.lm_head.weight[2])
    return m


def _requests(n: int, params: SamplingParams, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", [1] + torch.randint(3, 17, (3 + (i * 7) % 11,), generator=g).tolist(), params)
            for i in range(n)]


# ---- scheduler: pure Python -----------------------------------------------------------------

def test_scheduler_admits_up_to_limits_and_keeps_slots_contiguous():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100, max_seq_len=50))
    for i in range(5):
        sched.add(Request(f"r{i}", [1] * 10))
    plan = sched.schedule()
    assert [s.request_id for s in plan.prefill] == ["r0", "r1", "r2"] and not plan.decode
    assert [s.slot for s in plan.prefill] == [0, 1, 2]
    sched.finish(plan.prefill[0])  # r0 leaves slot 0; r2 moves from slot 2 into it
    plan = sched.schedule()
    assert plan.moves == [(2, 0)]
    assert [(s.request_id, s.slot) for s in plan.decode] == [("r2", 0), ("r1", 1)]
    assert [(s.request_id, s.slot) for s in plan.prefill] == [("r3", 2)]


def test_scheduler_respects_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=25, max_seq_len=50))
    for i in range(4):
        sched.add(Request(f"r{i}", [1] * 10))
    assert len(sched.schedule().prefill) == 2  # 20 of 25 tokens; a third would need 30
    plan = sched.schedule()  # two decode tokens + 10 + 10 prefill = 22
    assert len(plan.decode) == 2 and len(plan.prefill) == 2 and plan.num_tokens <= 25


def test_scheduler_abort_from_waiting_and_running():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_seq_len=50))
    for i in range(4):
        sched.add(Request(f"r{i}", [1] * 5))
    sched.schedule()
    removed = sched.abort({"r0", "r3"})
    assert sorted(s.request_id for s in removed) == ["r0", "r3"]
    assert [s.request_id for s in sched.running] == ["r1"] and sched.running[0].slot == 0
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_scheduler_rejects_requests_that_cannot_fit_or_reuse_a_live_id():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_seq_len=16))
    with pytest.raises(ValueError, match="KV cache holds 16"):
        sched.add(Request("long", [1] * 16))
    sched.add(Request("a", [1, 2]))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add(Request("a", [3]))
    sched.abort({"a"})
    sched.add(Request("a", [3]))  # the id is free again once the request left


def test_scheduler_orders_rows_longest_first_when_it_cuts_reads():
    """An admitted batch takes its slots longest first; a short row moved into a long row's hole
    goes back behind the long ones in one permutation; rows that only grow keep their order."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2000, max_seq_len=1000))
    for i, n in enumerate([10, 600, 10, 600, 10]):
        sched.add(Request(f"r{i}", [1] * n))
    plan = sched.schedule()
    assert [s.request_id for s in plan.prefill] == ["r1", "r3", "r0", "r2", "r4"]
    assert [s.slot for s in plan.prefill] == [0, 1, 2, 3, 4]
    sched.finish(plan.prefill[0])  # r1 leaves slot 0; r4 (short) moves into it
    plan = sched.schedule()
    assert plan.moves == [(4, 0)] and plan.permutation == [1, 0, 2, 3]
    assert [(s.request_id, s.slot) for s in plan.decode] == [("r3", 0), ("r4", 1), ("r0", 2), ("r2", 3)]
    assert sched.schedule().permutation is None


def test_reordered_rows_generate_what_each_request_generates_alone(model):
    """Prompts far apart in length in one batch: the scheduler permutes the rows' cache (counted)
    and every output equals the request generated alone."""
    g = torch.Generator().manual_seed(3)
    requests = lambda: [Request(f"r{i}", [1] + torch.randint(3, 17, (n,), generator=g).tolist(), GREEDY)
                        for i, n in enumerate([4, 150, 6, 9, 120, 5, 90, 7])]
    batch = requests()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, min_prefill_batch=1))
    permutations = []
    permute = engine.runner.cache.permute_slots
    engine.runner.cache.permute_slots = lambda order, n: (permutations.append(order), permute(order, n))
    for req in batch[:4]:  # two waves: the second admits long prompts behind decoding short rows
        engine.add_request(req)
    done = {c.request_id: c for c in engine.step()}
    for req in batch[4:]:
        engine.add_request(req)
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert permutations, "test needs a batch the scheduler reorders"
    g.manual_seed(3)
    for req in requests():
        alone = LLMEngine(model, EngineConfig(max_num_seqs=1)).generate([req])[0]
        assert done[req.request_id].output_ids == alone.output_ids
        torch.testing.assert_close(torch.tensor(done[req.request_id].logprobs),
                                   torch.tensor(alone.logprobs), atol=1e-4, rtol=0)


# ---- sampling ----------------------------------------------------------------------------

def test_sampling_filters_and_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 2000)
    g = torch.Generator().manual_seed(0)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 2000, g)[0]
    assert set(top_k.tolist()) == {2, 3}
    top_p = sample(logits, [SamplingParams(top_p=0.5)] * 2000, g)[0]  # p(3)=0.64 alone reaches 0.5
    assert set(top_p.tolist()) == {3}
    tokens, logprobs = sample(logits[:1], [SamplingParams(temperature=0.5)], g)
    expected = (logits[0] / 0.5).log_softmax(-1)[tokens[0]]
    torch.testing.assert_close(logprobs[0], expected)
    greedy, _ = sample(logits[:1], [SamplingParams(temperature=0.0)])
    assert greedy.item() == 3


# ---- engine with a model ------------------------------------------------------------------

def test_engine_is_deterministic_under_a_seed(model):
    run = lambda seed: [c.output_ids for c in LLMEngine(model, EngineConfig(max_num_seqs=4, seed=seed))
                        .generate(_requests(10, SAMPLED))]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_continuous_batching_matches_generating_each_request_alone(model):
    batched = LLMEngine(model, EngineConfig(max_num_seqs=4)).generate(_requests(12, GREEDY))
    lengths = {len(c.output_ids) for c in batched}
    assert len(lengths) > 1, "test needs requests of different lengths to exercise slot moves"
    for req, got in zip(_requests(12, GREEDY), batched):
        alone = LLMEngine(model, EngineConfig(max_num_seqs=1)).generate([req])[0]
        assert got.output_ids == alone.output_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(alone.logprobs),
                                   atol=1e-4, rtol=0)
        assert got.finish_reason == alone.finish_reason


def test_static_batching_gives_the_same_greedy_outputs(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4)).generate(_requests(9, GREEDY))
    static = generate_static(model, _requests(9, GREEDY), batch_size=4)
    assert [c.output_ids for c in engine] == [c.output_ids for c in static]
    assert [c.finish_reason for c in engine] == [c.finish_reason for c in static]


def test_abort_then_resume_equals_uninterrupted_greedy(model):
    reference = LLMEngine(model, EngineConfig(max_num_seqs=4)).generate(_requests(6, GREEDY))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4))
    for req in _requests(6, GREEDY):
        engine.add_request(req)
    done = {}
    for _ in range(5):
        done.update({c.request_id: c for c in engine.step()})
    engine.policy_version = 1
    partial = engine.abort([f"r{i}" for i in range(6) if f"r{i}" not in done])
    assert partial and all(c.finish_reason == "aborted" for c in partial)
    assert not engine.has_unfinished()
    resumed = LLMEngine(model, EngineConfig(max_num_seqs=2)).generate([Request.resume(c) for c in partial])
    done.update({c.request_id: c for c in resumed})
    for ref in reference:
        got = done[ref.request_id]
        assert got.output_ids == ref.output_ids and got.finish_reason == ref.finish_reason
    assert any(len(c.output_ids) > 0 for c in partial), "abort should return partial tokens"


def test_resume_from_a_kept_cache_row_equals_uninterrupted_and_skips_the_prefill(model):
    """abort(keep_cache=True) saves the running rows; the resumed requests decode on from them
    (no prefill of prompt + partial output) and, with the same weights, generate exactly what
    the uninterrupted run does, token and logprob alike — through a sleep (the cache released
    and restored zeroed) and with finished rows' moves pending when the abort came."""
    reference = LLMEngine(model, EngineConfig(max_num_seqs=4, seed=5)).generate(_requests(6, GREEDY))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, seed=5))
    for req in _requests(6, GREEDY):
        engine.add_request(req)
    done = {}
    while len(done) < 1 or not engine.scheduler.running:  # a finish leaves a move pending
        done.update({c.request_id: c for c in engine.step()})
    for _ in range(3):
        done.update({c.request_id: c for c in engine.step()})
    running = {s.request_id for s in engine.scheduler.running}
    partial = engine.abort([f"r{i}" for i in range(6) if f"r{i}" not in done], keep_cache=True)
    assert set(engine.runner.saved) == running and engine.saved_bytes > 0
    engine.sleep()
    engine.wake_up()
    engine.take_stats()
    for c in partial:
        engine.add_request(Request.resume(c))
    assert engine.drop_saved() == 0  # every saved row is in use
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    stats = engine.take_stats()
    kept = [c for c in partial if c.request_id in running]
    assert stats["restored_tokens"] == sum(len(c.prompt_ids) + len(c.output_ids) - 1 for c in kept)
    fresh = [c for c in partial if c.request_id not in running]  # waiting when aborted: prefilled
    assert stats["prefill_tokens"] == sum(len(c.prompt_ids) + len(c.output_ids) for c in fresh)
    for ref in reference:
        got = done[ref.request_id]
        assert got.output_ids == ref.output_ids and got.finish_reason == ref.finish_reason
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert not engine.runner.saved


def test_a_saved_row_that_no_longer_fits_its_request_is_dropped(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4))
    engine.add_request(_requests(1, GREEDY)[0])
    for _ in range(3):
        engine.step()
    (c,) = engine.abort(["r0"], keep_cache=True)
    assert "r0" in engine.runner.saved
    engine.add_request(Request("r0", c.prompt_ids, GREEDY))  # the same id, started over
    assert "r0" not in engine.runner.saved
    engine.take_stats()
    engine.step()
    stats = engine.take_stats()
    assert stats["restored_tokens"] == 0 and stats["prefill_tokens"] == len(c.prompt_ids)
    engine.abort(["r0"], keep_cache=True)
    engine.add_request(Request("other", [1, 4], GREEDY))
    assert engine.drop_saved() == 1 and not engine.runner.saved


def test_scheduler_restores_saved_rows_into_the_running_block():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100, max_seq_len=50))
    sched.add(Request("a", [1] * 10))
    sched.schedule()
    sched.add(Request("b", [1] * 4, output_ids=[5, 6], logprobs=[0.0, 0.0], versions=[0, 0]), cached=5)
    sched.add(Request("c", [1] * 3))
    plan = sched.schedule()
    assert [(s.request_id, slot) for s, slot in plan.restores] == [("b", 1)]
    assert [s.request_id for s in plan.decode] == ["a", "b"] and [s.request_id for s in plan.prefill] == ["c"]
    with pytest.raises(ValueError, match="all but the last"):
        sched.add(Request("d", [1] * 4), cached=4)


def test_policy_versions_are_stamped_per_token(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))
    engine.add_request(_requests(1, SamplingParams(temperature=0.0, max_new_tokens=6))[0])
    engine.step()
    engine.step()
    engine.policy_version = 3
    while engine.has_unfinished():
        out = engine.step()
    assert out[0].versions == [0, 0, 3, 3, 3, 3]
    assert out[0].finish_reason == "length"


def test_engine_rejects_bad_config(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        LLMEngine(model, EngineConfig(max_seq_len=10_000))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_token_budget_counts_the_packed_prefill():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=30, max_seq_len=50))
    for n in (4, 12, 4, 12):
        sched.add(Request(f"r{n}-{len(sched.waiting)}", [1] * n))
    plan = sched.schedule()  # packed: 4 + 12 + 4 = 20 tokens (padded it would be 3 x 12 = 36); + 12 = 32
    assert len(plan.prefill) == 3 and plan.num_tokens == 20 <= 30


def test_packed_prefill_equals_one_sequence_at_a_time():
    """A prefill of sequences of very different lengths, packed into one pass, gives each the
    logits and cache entries it gets alone, and decoding continues from them."""
    from rlfusion.model.kv_cache import CacheBatch, PackedSeqs

    for attention in ("gqa", "mla"):
        torch.manual_seed(0)
        model = MoETransformer(get_preset("tiny" if attention == "gqa" else "tiny-mla")).eval()
        seqs = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in (3, 40, 7)]
        packed_cache, alone_cache = model.new_kv_cache(5, 64), model.new_kv_cache(5, 64)
        with torch.inference_mode():
            tokens = torch.tensor([[t for s in seqs for t in s]])
            got = model(tokens, CacheBatch(packed_cache, 2, torch.zeros(3, dtype=torch.long)),
                        packed=PackedSeqs.from_lengths([len(s) for s in seqs]))[0]
            ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
            for i, s in enumerate(seqs):
                want = model(torch.tensor([s]), CacheBatch(alone_cache, 2 + i, torch.zeros(1, dtype=torch.long)))[0, -1]
                torch.testing.assert_close(got[ends[i]], want, rtol=1e-4, atol=1e-5)
            for packed_buf, alone_buf in zip((b for layer in packed_cache.layers for b in layer),
                                             (b for layer in alone_cache.layers for b in layer)):
                torch.testing.assert_close(packed_buf, alone_buf, rtol=1e-4, atol=1e-5)
            nxt = torch.tensor([[1], [2], [3]])
            start = torch.tensor([len(s) for s in seqs])
            torch.testing.assert_close(model(nxt, CacheBatch(packed_cache, 2, start)),
                                       model(nxt, CacheBatch(alone_cache, 2, start)), rtol=1e-4, atol=1e-5)


def test_scheduler_batches_admissions_once_enough_slots_are_free():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_seq_len=50,
                                      min_prefill_batch=2))
    for r in _requests(7, SamplingParams(max_new_tokens=5)):
        sched.add(r)
    assert len(sched.schedule().prefill) == 4  # nothing running: admit at once
    sched.finish(sched.running[0])
    plan = sched.schedule()
    assert not plan.prefill and len(plan.decode) == 3  # one free slot < 2: keep decoding
    sched.finish(sched.running[0])
    assert len(sched.schedule().prefill) == 2  # two free: one prefill pass for both
    for seq in list(sched.running)[:3]:
        sched.finish(seq)
    assert len(sched.schedule().prefill) == 1  # the last waiting one fits: no point waiting
    with pytest.raises(ValueError, match="min_prefill_batch"):
        SchedulerConfig(min_prefill_batch=0)
