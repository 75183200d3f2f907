"""Calibration inputs of the RL simulator: replayed lengths, contention, the colocated step by
hand, hardware-derived calibrations, projections and the validation replay of bench/simulator."""

import argparse
import dataclasses
import math

import pytest
from bench_helpers import load_bench

from rlfusion.model.config import get_preset
from rlfusion.sim.calibration import Calibration
from rlfusion.sim.cli import register_plan_command, register_simulate_command
from rlfusion.sim.cluster_calibration import (EngineAssumptions, decode_context_ms, decode_step_s,
                                              engine_slots, engine_weight_bytes_per_chip)
from rlfusion.sim.costs import model_layers
from rlfusion.sim.hardware import get_cluster
from rlfusion.sim.rl_config import RLSimConfig, expected_longest
from rlfusion.sim.rl_sim import simulate
from rlfusion.sim.rl_state import SimState

# Round numbers so a step can be computed by hand: decode 1 ms per step at any batch, no
# prefill, train 1000 tokens/s per device + 0.1 s, reference 2000 tokens/s, switch 0.01 s.
FLAT = Calibration(decode_batch_sizes=(1,), decode_step_ms=(1.0,), prefill_ms_per_token=0.0,
                   train_tokens_per_s_per_device=1000.0, train_step_overhead_s=0.1,
                   switch_s=0.01, transfer_GBps=1e9, weight_GB=0.0,
                   reference_tokens_per_s_per_device=2000.0)
# 2 devices, 2 prompts x 2 samples per step: engine0 gets group 0 (samples 0-1), engine1 group 1
TWO = RLSimConfig(mode="colocated", devices_per_supernode=2, prompts_per_step=2,
                  group_size=2, num_steps=2, prompt_len=10, max_num_seqs=2,
                  response_lengths=(10, 30, 20, 20), queue_bytes_per_token=0)


def _step_s(cfg, cal):
    ends = simulate(cfg, cal).update_end_s
    return ends[1] - ends[0]


def test_colocated_step_by_hand():
    # switch back 0.01; engine0: 30 decode steps (its longest) = 0.030 s, then reference over
    # (10+10)+(10+30) tokens = 60 / 2000 = 0.030 s -> 0.060; engine1: 0.020 + 60/2000 = 0.050.
    # The slower engine sets the pace; then switch 0.01, train 120 tokens / (2 x 1000) + 0.1.
    expected = 0.01 + 0.060 + 0.01 + 120 / 2000 + 0.1
    assert _step_s(TWO, FLAT) == pytest.approx(expected)


def test_a_synchronous_barrier_waits_for_the_slowest_device(monkeypatch):
    # as the step by hand, with engine1 at half speed (its decode and reference take twice as
    # long: 0.040 + 0.060 = 0.100 s) and the update's slowest train device at 1.5x
    cfg = TWO.replace(straggler_sigma=0.1)
    monkeypatch.setattr(SimState, "slow", lambda self, eng: 2.0 if eng.name == "engine1" else 1.0)
    monkeypatch.setattr(SimState, "slowest", lambda self, devices: 1.5)
    expected = 0.01 + 0.100 + 0.01 + (120 / 2000 + 0.1) * 1.5
    assert _step_s(cfg, FLAT) == pytest.approx(expected)


def test_straggler_factors_are_per_engine_and_version():
    sim = SimState(TWO.replace(straggler_sigma=0.2, num_supernodes=1), FLAT)
    a, b = sim.engines
    first = sim.slow(a)
    assert sim.slow(a) == first != sim.slow(b)  # drawn once per engine and version
    a.version += 1
    assert sim.slow(a) != first
    assert SimState(TWO, FLAT).slow(a) == 1.0 and SimState(TWO, FLAT).slowest(64) == 1.0
    assert sim.slowest(1) > 0 and sum(sim.slowest(64) for _ in range(20)) > sum(sim.slowest(1) for _ in range(20))
    with pytest.raises(ValueError, match="straggler_sigma"):
        TWO.replace(straggler_sigma=0.1, stalesync_model="runtime", max_staleness=1, partial_rollout=True)


def test_the_expected_longest_response_grows_with_the_draws():
    median, sigma = 1536.0, math.log(3.75) / 2.326
    assert expected_longest(1, median, sigma) == pytest.approx(median * math.exp(sigma ** 2 / 2), rel=1e-6)
    # two draws, by hand: E[max(L1, L2)] = 2 median e^(sigma^2/2) Phi(sigma / sqrt 2)
    phi = 0.5 * (1 + math.erf(sigma / math.sqrt(2) / math.sqrt(2)))
    assert expected_longest(2, median, sigma) == pytest.approx(2 * median * math.exp(sigma ** 2 / 2) * phi, rel=1e-6)
    longest = [expected_longest(n, median, sigma) for n in (2048, 4096, 8192)]
    assert longest == sorted(longest) and 9000 < longest[0] < longest[-1] < 16000


def test_advantage_work_is_charged_per_trained_sample_between_reference_and_update():
    # the same step plus 4 samples x 5 ms of the advantage stage, on the critical path
    with_advantage = FLAT.replace(advantage_s_per_sample=0.005)
    assert _step_s(TWO, with_advantage) == pytest.approx(_step_s(TWO, FLAT) + 4 * 0.005)


def test_replayed_lengths_are_the_trained_tokens():
    result = simulate(TWO, FLAT)
    assert result.tokens_per_s * result.makespan_s == pytest.approx(2 * (10 + 30 + 20 + 20))


def test_replayed_prompt_lengths_set_each_samples_context():
    # prompts 10, 10, 40, 40 instead of 10 each: engine1's reference pass covers 60 more tokens
    # (its samples 2-3), engine0's is unchanged; engine1 becomes the slower one
    spread = TWO.replace(prompt_lengths=(10, 10, 40, 40))
    expected = 0.01 + max(0.030 + 60 / 2000, 0.020 + 120 / 2000) + 0.01 + 180 / 2000 + 0.1
    assert _step_s(spread, FLAT) == pytest.approx(expected)
    context = FLAT.replace(decode_context_ms=0.001, decode_reference_context=0)
    assert _step_s(spread, context) > _step_s(TWO, context)  # longer contexts, slower decode passes
    with pytest.raises(ValueError, match="prompt_lengths"):
        TWO.replace(prompt_lengths=(0, 5))


def test_contention_slows_concurrent_work_only():
    slow = FLAT.replace(concurrent_speed=0.5)
    assert _step_s(TWO, slow) == pytest.approx(0.01 + 0.120 + 0.01 + 2 * (120 / 2000 + 0.1))
    separated = TWO.replace(mode="separated", max_num_seqs=4)  # one engine, one trainer
    assert _step_s(separated, slow) == pytest.approx(_step_s(separated, FLAT))


def test_lockstep_speed_slows_colocated_devices_and_not_separated_overlap():
    # colocated devices work in lock-step: lockstep_speed applies there (0 = concurrent_speed)
    both = FLAT.replace(concurrent_speed=0.8, lockstep_speed=0.5)
    assert _step_s(TWO, both) == pytest.approx(_step_s(TWO, FLAT.replace(concurrent_speed=0.5)))
    assert _step_s(TWO, FLAT.replace(concurrent_speed=0.5, lockstep_speed=0.0)) == \
        pytest.approx(_step_s(TWO, FLAT.replace(concurrent_speed=0.5)))
    # separated StaleSync: rollout and update overlap independently, concurrent_speed applies
    overlap = TWO.replace(mode="separated", max_num_seqs=4, max_staleness=1, num_steps=3)
    assert _step_s(overlap, both) == pytest.approx(_step_s(overlap, FLAT.replace(concurrent_speed=0.8)))
    with pytest.raises(ValueError, match="lockstep_speed"):
        FLAT.replace(lockstep_speed=1.5)


def test_each_kind_of_work_has_its_own_contention_speed():
    # lock-step speeds: decode 0.5, train (update and reference) 0.8; the step by hand of
    # test_colocated_step_by_hand with each part divided by its kind's speed: engine0 decodes 30
    # steps (0.030 / 0.5) and scores 60 tokens (0.030 / 0.8), the update 120 / (2 x 1000 x 0.8) +
    # 0.1 / 0.8
    kinds = FLAT.replace(concurrent_speed=0.9, lockstep_speed=0.7, decode_lockstep_speed=0.5,
                         train_lockstep_speed=0.8)
    expected = 0.01 + (0.060 + 0.0375) + 0.01 + (0.075 + 0.125)
    assert _step_s(TWO, kinds) == pytest.approx(expected)
    # a kind not measured (0) takes the whole workload's speed
    assert kinds.speed("context", lockstep=True) == 0.7 and kinds.speed("decode", lockstep=False) == 0.9
    busy = FLAT.replace(decode_context_ms=0.002, context_speed=0.25, lockstep_speed=0.5).contended(lockstep=False)
    assert busy.decode_context_ms == pytest.approx(0.008) and busy.decode_step_ms == (1.0,)
    assert busy.speed("train", lockstep=True) == 1.0  # nothing left to apply twice
    with pytest.raises(ValueError, match="context_lockstep_speed"):
        FLAT.replace(context_lockstep_speed=1.5)
    with pytest.raises(ValueError, match="unknown kind"):
        FLAT.speed("prefill", lockstep=True)


def test_attention_over_each_sequence_is_charged_by_its_squared_length():
    # TWO's sequences are 20, 40, 30 and 30 tokens: 3,800 squared; at 10 us per squared token the
    # update (over 2 devices) takes 3,800 x 10 us / 2 = 0.019 s longer; engine0 scores 20 + 40
    # (2,000 squared), at 5 us: 0.010 s longer, and it is the slower engine
    cal = FLAT.replace(train_context_ns=1e4, reference_context_ns=5e3)
    assert _step_s(TWO, cal) == pytest.approx(_step_s(TWO, FLAT) + 0.019 + 0.010)
    assert cal.train_s(120, 2, 3800) == pytest.approx(0.1 + 0.060 + 0.019)
    assert cal.reference_s(60, 1, 2000) == pytest.approx(0.030 + 0.010)
    assert cal.reference_s(60, 1, 2000, fixed=False) == cal.reference_s(60, 1, 2000)  # FLAT: no fixed cost
    slow = cal.replace(probe_s=1.0).at_probe_speed(2.0)
    assert (slow.train_context_ns, slow.reference_context_ns) == pytest.approx((2e4, 1e4))


def test_train_fraction_scales_only_the_update():
    half = _step_s(TWO.replace(train_fraction=0.5), FLAT)
    assert _step_s(TWO, FLAT) - half == pytest.approx(0.5 * 120 / 2000)


def test_fully_shared_mode_pays_the_reference_switch():
    cal = FLAT.replace(reference_switch_s=0.004)
    assert _step_s(TWO.replace(mode="fully_shared"), cal) == pytest.approx(_step_s(TWO, cal) + 0.004)


def test_calibration_formulas_and_errors():
    assert FLAT.replace(prefill_fixed_ms=2.0, prefill_ms_per_token=0.5).prefill_s(4) == \
        pytest.approx(0.004)
    assert FLAT.reference_s(4000, 2) == pytest.approx(1.0)
    assert FLAT.replace(reference_tokens_per_s_per_device=0.0).reference_s(3000, 1) == \
        pytest.approx(3000 / 1000 / 3)
    with pytest.raises(ValueError, match="concurrent_speed"):
        FLAT.replace(concurrent_speed=0.0)
    with pytest.raises(ValueError, match="train_fraction"):
        TWO.replace(train_fraction=1.5)
    with pytest.raises(ValueError, match="response_lengths"):
        TWO.replace(response_lengths=(3, 0))


def test_hardware_decode_step_reads_every_dense_weight_and_pays_per_message():
    model, cluster = get_preset("pangu-ultra-moe-718b"), get_cluster("cm384", 384)
    a = EngineAssumptions()
    bw, n = cluster.chip.memory_bandwidth_GBps * 1e9, a.devices_per_engine
    steps = [decode_step_s(model, cluster, b, a) for b in (1, 8, 64, 512)]
    assert steps == sorted(steps)
    layers = model_layers(model, a.context_len)
    dense = sum(x.dense_params for x in layers) * 2 / bw  # attention DP, no TP: every chip reads it all
    experts = sum(x.expert_params for x in layers) * 2 / n / bw  # its 1/32 of the experts
    touched = 1 - (1 - 1 / model.num_experts) ** model.top_k  # one token's 8 routings over 256 experts
    assert dense > 0.010 and dense < steps[0] < dense + experts * touched + 0.003  # + KV, all-to-alls, 1 ms host
    # every MoE layer's dispatch and combine pay one message per peer: min(31, rows per chip x top_k)
    more = dataclasses.replace(a, a2a_message_us=a.a2a_message_us + 10)
    assert decode_step_s(model, cluster, 512, more) - steps[3] == pytest.approx(model.num_moe_layers * 2 * 31 * 10e-6)
    assert decode_step_s(model, cluster, 64, more) - steps[2] == pytest.approx(model.num_moe_layers * 2 * 16 * 10e-6)
    one = decode_step_s(model, cluster, 1, more)
    assert one - steps[0] == pytest.approx(model.num_moe_layers * 2 * model.top_k * 10e-6)


def test_engine_slots_are_what_the_kv_memory_holds():
    model, cluster = get_preset("pangu-ultra-moe-718b"), get_cluster("cm384", 384)
    a = EngineAssumptions()
    layers = model_layers(model, a.context_len)
    weights = ((sum(x.dense_params for x in layers) + model.vocab_size * model.d_model)
               + sum(x.expert_params for x in layers) / 32) * 2
    assert engine_weight_bytes_per_chip(model, a) == pytest.approx(weights)
    kv = (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * 2 * model.num_layers  # MLA latent, per token
    per_chip = int((cluster.chip.memory_GB * 1e9 * 0.9 - weights) // (a.slot_context * kv))
    assert engine_slots(model, cluster, a) == per_chip * 32  # 32 attention data-parallel chips
    assert engine_slots(model, cluster, dataclasses.replace(a, slot_context=2 * a.slot_context)) < per_chip * 32
    # a longer context reads each sequence's KV once more per token, spread over the 32 chips
    assert decode_context_ms(model, cluster, a) == pytest.approx(kv / 32 / (cluster.chip.memory_bandwidth_GBps * 1e9) * 1e3)
    with pytest.raises(ValueError, match="do not fit an engine"):
        engine_slots(model, cluster, dataclasses.replace(a, devices_per_engine=4, tp=1))


def _parser():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register_plan_command(sub)
    register_simulate_command(sub)
    return parser


def test_simulate_cli_needs_something_to_do():
    args = _parser().parse_args(["simulate"])
    with pytest.raises(ValueError, match="CONFIG.*--calibrate.*--project"):
        args.func(args)
    args = _parser().parse_args(["simulate", "--project", "--cluster-kind", "cpu"])
    with pytest.raises(ValueError, match="--cluster-kind.*allowed"):
        args.func(args)


def test_plan_prints_assumptions(capsys):
    args = _parser().parse_args(["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq",
                                 "256", "--global-batch", "8", "--top", "2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "assumptions:" in out and "not modelled" in out and "assumed" in out


def _bench():
    return load_bench("simulator")


def test_validation_replays_each_measured_step():
    bench = _bench()
    steps = [bench.MeasuredStep(80, 1.0, (10, 30, 20, 20), 40, 100, {}),
             bench.MeasuredStep(40, 1.0, (10, 10, 10, 10), 40, 60, {})]
    case = bench.Case("colocated", TWO.replace(response_lengths=()), steps)
    pred = bench.predict(case, FLAT)
    # the first step is replayed twice (warm-up, then measured); the trained share is
    # token-weighted over the replayed steps: (100 + 100 + 60) / (120 + 120 + 80)
    f = 260 / 320
    t1 = 0.02 + 0.060 + 120 * f / 2000 + 0.1  # as in test_colocated_step_by_hand
    t2 = 0.02 + (0.010 + 40 / 2000) + 80 * f / 2000 + 0.1
    assert pred.step_s == pytest.approx([t1, t2])
    assert pred.tokens_per_s == pytest.approx((80 / t1 + 40 / t2) / 2)  # median of two
    assert case.measured_tokens_per_s == pytest.approx(60.0)


def test_stalesync_validation_compares_tokens_over_time_sums():
    # a StaleSync step may generate nothing (the update's groups had already finished): the
    # compared tokens/s is bench/stalesync.py's, sum of tokens over sum of step times
    bench = _bench()
    steps = [bench.MeasuredStep(n, t, (10,) * 4, 40, 100, {}) for n, t in ((90, 1.0), (0, 0.5), (60, 1.5))]
    case = bench.Case("stalesync", TWO.replace(stalesync_model="runtime", max_staleness=1, partial_rollout=True),
                      steps, warmup=1)
    assert case.measured_tokens_per_s == pytest.approx(150 / 3.0)
    pred = bench.predict(case, FLAT)
    r = pred.result  # the simulated run: the warm-up update, then the 3 measured ones
    assert len(r.update_end_s) == 4 and pred.step_s == pytest.approx(
        [b - a for a, b in zip(r.update_end_s, r.update_end_s[1:])])
    assert pred.tokens_per_s == pytest.approx(sum(r.generated_per_update[1:]) / (r.update_end_s[-1] - r.update_end_s[0]))


def test_separated_scores_where_generated():
    # one engine (4 slots), one trainer: decode to 30 steps plus reference passes as samples
    # finish (20 + 60 + 40 tokens at 2000/s), then train 120 / 1000 + 0.1; switch 0.01 first
    cfg = TWO.replace(mode="separated", max_num_seqs=4)
    assert _step_s(cfg, FLAT) == pytest.approx(0.01 + 0.030 + 0.060 + 0.12 + 0.1)
    on_trainer = cfg.replace(scorers="train")
    assert _step_s(on_trainer, FLAT) == pytest.approx(0.01 + 0.030 + 0.060 + 0.12 + 0.1)
    with pytest.raises(ValueError, match="scorers.*allowed"):
        cfg.replace(scorers="gpu")


def test_min_prefill_batch_delays_admission():
    one = TWO.replace(devices_per_supernode=1, response_lengths=(10, 30, 5, 5))
    # 1: slots refill at once (idx 2 at step 10, idx 3 at 15): the longest ends at 30 steps;
    # 2: the free slot waits for a second one (at 30), then both run 5 more steps
    assert _step_s(one.replace(min_prefill_batch=2), FLAT) - _step_s(one, FLAT) == \
        pytest.approx(0.005)


def test_probe_speed_scales_every_compute_cost():
    slower = FLAT.replace(probe_s=1.0).at_probe_speed(2.0)
    assert _step_s(TWO, slower) == pytest.approx(2 * _step_s(TWO, FLAT))
    with pytest.raises(ValueError, match="probe_s"):
        FLAT.at_probe_speed(2.0)  # no speed mark recorded


def test_config_file_type_errors_name_the_key(tmp_path):
    from rlfusion.sim.rl_config import load_rl_config

    path = tmp_path / "sim.toml"
    path.write_text('[simulate]\nnum_steps = "x"\n')
    with pytest.raises(ValueError, match="num_steps='x' must be an integer"):
        load_rl_config(path)
    path.write_text("[simulate]\nresponse_lengths = [3, 5]\ntrain_fraction = 1\n")
    cfg = load_rl_config(path)
    assert cfg.response_lengths == (3, 5) and cfg.train_fraction == 1


def test_advantage_cost_is_measured_on_the_runtimes_own_stage():
    """The calibration times the advantage stage the first train device runs per update (numbers
    per row through a DistQueue, the split), so it runs against the runtime's dataflow as it is."""
    from rlfusion.measure.calibrate import measure_advantage
    from rlfusion.model.checkpoint import find_base, load_base

    model, tokenizer, _ = load_base(find_base())
    assert 0 < measure_advantage(tokenizer, model.config.vocab_size, quick=True, n=64) < 0.01


def test_a_pass_cost_plane_through_short_and_long_batches():
    from rlfusion.measure.calibrate import _plane
    from rlfusion.measure.contention import probe_speeds

    # seconds = 0.01 + tokens / 8,000 + 1e-7 x squared lengths, at three batch shapes
    points = [(t, q, 0.01 + t / 8000 + 1e-7 * q) for t, q in ((3000, 2e5), (12000, 8e5), (11000, 5e6))]
    fixed, rate, square = _plane(points)
    assert (fixed, rate, square) == pytest.approx((0.01, 8000, 1e-7))
    # a negative fixed cost is 0; the rate and the squared term by least squares through the origin
    shifted = [(t, q, y - 0.05) for t, q, y in points]
    fixed, rate, square = _plane(shifted)
    assert fixed == 0.0 and 8000 < rate < 9000 and 0 < square < 1.1e-7
    # noise that makes the squared term negative: the line through the two short batches, no term
    fixed, rate, square = _plane(points[:2] + [(11000, 5e6, 0.5)])
    assert square == 0.0 and rate == pytest.approx((12000 - 3000) / (points[1][2] - points[0][2]))
    # probe samples -> each kind's speed: median alone / median together (or in lock-step)
    alone = [{"decode": 1.0, "context": 0.2, "train": 1.0, "total": 2.2}] * 3
    together = [{"decode": 1.25, "context": 0.4, "train": 1.0, "total": 2.65}] * 3
    lockstep = [{"decode": 2.0, "context": 0.4, "train": 1.25, "total": 3.65}] * 3
    speeds = probe_speeds(alone, together, lockstep)
    assert speeds == pytest.approx({"concurrent_speed": 2.2 / 2.65, "lockstep_speed": 2.2 / 3.65, "probe_s": 2.2,
                                    "decode_speed": 0.8, "decode_lockstep_speed": 0.5, "context_speed": 0.5,
                                    "context_lockstep_speed": 0.5, "train_speed": 1.0, "train_lockstep_speed": 0.8})
    Calibration(**{**dataclasses.asdict(FLAT), **{k: v for k, v in speeds.items()}})  # valid fields
    # a part noise left without a valid sample (long passes no slower than short ones: nan) is
    # not measured (0): the simulator then uses the whole workload's speed for that kind
    noisy = [{**x, "context": math.nan} for x in alone]
    assert probe_speeds(noisy, together, lockstep)["context_speed"] == 0.0


def test_each_run_of_rows_a_decode_pass_reads_apart_costs_its_own():
    from rlfusion.measure.calibrate import LONG_CONTEXT, segment_lengths
    from rlfusion.model.row_segments import row_segments

    # rows of 1,000 and 10 positions are read in two runs: the table, the reads beyond the
    # reference context (1,000 - 100 positions at 1 ns... here 0) and one run's extra cost
    cal = FLAT.replace(decode_segment_ms=0.5, decode_reference_context=100)
    assert cal.decode_pass_s([1000, 10]) == pytest.approx((1.0 + 0.5) / 1e3)
    assert cal.decode_pass_s([1000, 990]) == pytest.approx(1.0 / 1e3)  # one run
    assert cal.contended(lockstep=True).decode_segment_ms == 0.5  # FLAT: speed 1
    assert FLAT.replace(decode_segment_ms=0.5, decode_lockstep_speed=0.5).contended(lockstep=True) \
        .decode_segment_ms == pytest.approx(1.0)  # dispatch-bound: the decode kind's speed
    # the calibration's mixed pass: rows longest first in several runs, within the long context
    lengths = segment_lengths()
    assert lengths == sorted(lengths, reverse=True) and max(lengths) < LONG_CONTEXT
    assert len(row_segments(lengths)) >= 5


def test_colocation_bound_rises_with_device_concurrency():
    """bench/colocation_bound.py's model: colocated / separated grows as two busy devices slow
    each other down less, and stays below 2 (the rollout's tail runs on each device)."""
    from rlfusion.sim.calibration import cpu_default

    bound = load_bench("colocation_bound")
    cal = cpu_default()
    sim = RLSimConfig(devices_per_supernode=2, prompts_per_step=8, group_size=4, max_staleness=0,
                      max_num_seqs=16, max_new_tokens=64, response_lengths=tuple(range(4, 64, 2)),
                      prompt_len=15, num_steps=3)

    def ratio(speed: float, scale: float) -> float:
        c = bound.with_fixed_cost(cal.replace(concurrent_speed=speed, lockstep_speed=speed), scale)
        return bound.step_s(sim.replace(mode="separated"), c) / bound.step_s(sim.replace(mode="colocated"), c)
    assert bound.with_fixed_cost(cal, 1.0) == cal
    assert ratio(0.7, 1.0) < ratio(0.9, 1.0) < ratio(1.0, 1.0) < 2.0
    assert ratio(1.0, 0.1) < 2.0


def test_verl_publication_is_self_consistent_and_reproduced_from_hardware():
    from rlfusion.sim.external import PUBLISHED, reproduce, workload

    assert get_preset("qwen2.5-7b").param_counts()["total"] == pytest.approx(7.62e9, rel=2e-3)
    assert get_cluster("h20", 8).chip.peak_tflops == 148.0
    for p in PUBLISHED:  # gen + old logprob + update leave ~10 s of other work in each sync step
        assert 0 < p.sync_step_s - (p.sync_gen_s + p.sync_old_log_prob_s + p.sync_update_s) < 15
    sync, asyn = workload(64, False), workload(64, True)
    assert sync.samples_per_step == asyn.samples_per_step == 512 * 16 and sync.max_new_tokens == 28_672
    assert sync.reference and not asyn.reference  # the async trainer uses the rollout's logprobs
    assert asyn.mode == "separated" and asyn.rollout_fraction == 0.5 and asyn.partial_rollout
    (r,) = reproduce((64,))
    assert set(r.sync_phases) >= {"rollout", "ref", "train"} and r.async_step_s > 0
    assert r.sync_step_s == pytest.approx(sum(r.sync_phases.values()), rel=0.25)  # engine0 is busy most of the step


def test_verl_trainers_are_costed_from_their_own_settings():
    """The two published trainers differ only in what their scripts set: hand-computed offload
    traffic, FSDP collectives and micro-batch counts; full recompute costs one extra forward."""
    from rlfusion.sim.external import (ASYNC_TRAINER, ENGINE, SYNC_TRAINER, fsdp_comm_s, measured_step_floor_ms,
                                       micro_batches, offload_s, train_rate)

    assert (SYNC_TRAINER.fsdp_size, SYNC_TRAINER.param_offload, SYNC_TRAINER.optimizer_offload) == (2, True, True)
    assert (ASYNC_TRAINER.fsdp_size, ASYNC_TRAINER.param_offload, ASYNC_TRAINER.optimizer_offload) == (8, False, False)
    # 8e9 params over an FSDP group of 2: a 4e9 shard; fp32 in + out = 32 GB, Adam in + out = 64 GB at 50 GB/s
    assert offload_s(8e9, SYNC_TRAINER, 50.0) == pytest.approx((0.64, 0.64 + 1.28))
    assert offload_s(8e9, ASYNC_TRAINER, 50.0) == (0.0, 0.0)
    h20 = get_cluster("h20", 32)
    # group of 2 on NVLink (450 GB/s): all-gathers 2 x 1/2 x 16 GB + reduce-scatter 1/2 x 32 GB = 32 GB;
    # 16 replica groups across nodes (50 GB/s): 2 x 15/16 x 16 GB = 30 GB
    assert fsdp_comm_s(8e9, 32, SYNC_TRAINER, h20) == pytest.approx(32e9 / 450e9 + 30e9 / 50e9)
    # group of 8: 2 x 7/8 x 16 GB + 7/8 x 32 GB = 56 GB on NVLink; 2 replicas: 2 x 1/2 x 4 GB = 4 GB across
    assert fsdp_comm_s(8e9, 16, ASYNC_TRAINER, get_cluster("h20", 16)) == pytest.approx(56e9 / 450e9 + 4e9 / 50e9)
    # 18M tokens, 16 mini-batches: 140,625 tokens per sp group of 8 groups (one micro-batch under the
    # 61,440 x 4 budget), 281,250 per group of 4 groups (two)
    assert micro_batches(18e6, 32, SYNC_TRAINER) == 16 and micro_batches(18e6, 16, ASYNC_TRAINER) == 32
    assert SYNC_TRAINER.forward_fraction() == 0.25  # forward + recompute + backward = 4 forwards
    model, a = get_preset("qwen2.5-7b"), ENGINE
    full = train_rate(model, h20, SYNC_TRAINER, a)
    selective = train_rate(model, h20, dataclasses.replace(SYNC_TRAINER, gradient_checkpointing=False), a)
    assert 0.72 < full / selective < 0.8  # one extra forward of the three a train token costs
    assert train_rate(model, get_cluster("h20", 16), ASYNC_TRAINER, a) == pytest.approx(full, rel=0.01)
    # the independent small-batch measurement (3.65 ms, Mistral-7B TP4 on H100) less the cost model's step
    assert 1.0 < measured_step_floor_ms() < 1.6 and ENGINE.step_overhead_ms == round(measured_step_floor_ms(), 2)


def test_plan_scores_a_named_layout_and_ranks_it(capsys):
    from rlfusion.sim.cli import parse_layout

    plan = parse_layout("tp8,pp16,ep32,vpp2", 6144)
    assert (plan.tp, plan.pp, plan.vpp, plan.ep, plan.dp, plan.recompute) == (8, 16, 2, 32, 48, "selective")
    for bad, why in (("tp8,pq3", "'pq3' is not one of"), ("tp7", "does not divide 6144"),
                     ("tp2,recompute=most", "recompute='most'")):
        with pytest.raises(ValueError, match=why):
            parse_layout(bad, 6144)
    args = _parser().parse_args(["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq", "256",
                                 "--global-batch", "8", "--top", "3", "--layout", "ep2,recompute=none"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("named layout TP1 PP1 VPP1 EP2 DP2 mb1 non:"))
    assert "rank" in line and "plans that fit" in line
    args = _parser().parse_args(["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq", "256",
                                 "--global-batch", "8", "--layout", "ep3"])
    assert args.func(args) == 0 and "named layout TP1 PP1 VPP1 EP3 DP2 mb1 sel: invalid (EP3 must divide" in capsys.readouterr().out


def test_plan_searches_global_batches_by_time_per_sequence(capsys):
    args = _parser().parse_args(["plan", "--model", "tiny", "--cluster", "cpu:2", "--seq", "256",
                                 "--global-batch", "8,32", "--top", "2"])
    assert args.global_batch == (8, 32) and args.func(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("global batch search"):out.index("\n\n")].splitlines()[2:]
    per_seq = [float(row.split()[-3]) for row in table]
    assert len(table) == 2 and per_seq == sorted(per_seq)  # ranked by ms per sequence
    best = table[0].split()[0]
    assert f"global batch {best} sequences" in out  # the full report is the best batch's
    with pytest.raises(SystemExit):
        _parser().parse_args(["plan", "--global-batch", "8,0"])


def test_projection_prints_ranges_conventions_and_the_baseline():
    from rlfusion.sim.projection import SCENARIOS, format_projection, project

    rows, lines = project(supernodes=(1,), scenarios=SCENARIOS[1:2], advantage_s_per_sample=7e-6)
    assert {(r.mode, r.variant) for r in rows} == {(m, v) for m in ("colocated", "separated")
                                                   for v in ("sync", "stalesync")}
    assert all(r.all_tokens_per_s["central"] > r.tokens_per_s["central"] > 0 for r in rows)  # + prompts
    text = "\n".join(lines)
    assert "baseline 'separated'" in text and "prompt + response" in text and "expected longest" in text
    out = format_projection(rows, lines, 0.0)
    assert "central [lowest .. highest" in out and "StaleSync / sync" in out
