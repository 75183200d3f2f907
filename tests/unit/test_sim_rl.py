"""Invariants of the discrete-event RL simulator."""

import pytest

from rlfusion.sim.calibration import cpu_default, load_calibration, save_calibration
from rlfusion.sim.rl_config import RLSimConfig
from rlfusion.sim.rl_sim import simulate

CAL = cpu_default()
SMALL = RLSimConfig(prompts_per_step=8, group_size=4, num_steps=4)


@pytest.mark.parametrize("mode", ["separated", "colocated", "fully_shared"])
@pytest.mark.parametrize("max_staleness,partial", [(0, False), (1, True), (2, True)])
def test_utilization_bounded_and_staleness_respected(mode, max_staleness, partial):
    cfg = SMALL.replace(mode=mode, max_staleness=max_staleness, partial_rollout=partial)
    result = simulate(cfg, CAL)
    assert result.updates == cfg.num_steps
    assert all(0.0 <= u <= 1.0 for u in result.utilization.values())
    assert result.staleness_max <= max_staleness
    assert result.tokens_per_s > 0


@pytest.mark.parametrize("mode", ["separated", "colocated", "fully_shared"])
def test_sync_never_overlaps_update_and_rollout_of_same_version(mode):
    result = simulate(SMALL.replace(mode=mode, max_staleness=0), CAL)
    updates = [e for e in result.timeline if e.role == "train"]
    rollouts = [e for e in result.timeline if e.role == "rollout"]
    assert updates and rollouts
    for u in updates:
        for r in rollouts:
            if r.version == u.version:
                assert r.end <= u.start + 1e-12 or r.start >= u.end - 1e-12


def test_stalesync_overlaps_rollout_with_update_when_separated():
    result = simulate(SMALL.replace(mode="separated", max_staleness=1, partial_rollout=True), CAL)
    updates = [e for e in result.timeline if e.role == "train"]
    rollouts = [e for e in result.timeline if e.role == "rollout"]
    assert any(r.start < u.end and u.start < r.end for u in updates for r in rollouts)


@pytest.mark.parametrize("mode", ["separated", "colocated"])
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_more_devices_never_reduce_throughput_ideal_network(mode, max_staleness):
    base = SMALL.replace(mode=mode, max_staleness=max_staleness, partial_rollout=max_staleness > 0)
    tputs = [simulate(base.replace(devices_per_supernode=d), CAL).tokens_per_s
             for d in (2, 4, 8)]
    assert tputs == sorted(tputs)


def test_decode_cost_interpolates_measured_points():
    assert CAL.decode_step_s(1) == pytest.approx(3.0e-3)
    assert CAL.decode_step_s(20) == pytest.approx((5.5 + (7.7 - 5.5) * 12 / 24) / 1e3)
    assert CAL.decode_step_s(256) == pytest.approx(19.1e-3)
    assert CAL.decode_step_s(0) == 0.0


def test_decode_cost_grows_with_the_longest_context():
    cal = CAL.replace(decode_context_ms=0.002, decode_reference_context=40, probe_s=1.0)
    assert cal.decode_step_s(20, 30) == CAL.decode_step_s(20)  # at or below the table's context
    assert cal.decode_step_s(20, 140) == pytest.approx(CAL.decode_step_s(20) + 20 * 100 * 0.002e-3)
    for context, steps in ((10, 5), (35, 12), (60, 30)):  # the closed form is the sum of steps
        want = sum(cal.decode_step_s(20, context + j) for j in range(steps))
        assert cal.decode_steps_s(20, context, steps) == pytest.approx(want)
    assert cal.at_probe_speed(2.0).decode_context_ms == pytest.approx(0.004)
    # a longer-context run takes longer in the simulator, all else equal
    long_prompts = SMALL.replace(prompt_len=150)
    assert simulate(long_prompts, cal).tokens_per_s < simulate(long_prompts, CAL).tokens_per_s


def test_decode_pass_reads_each_run_of_rows_up_to_its_own_longest():
    cal = CAL.replace(decode_context_ms=0.002, decode_reference_context=40, probe_s=1.0)
    assert cal.decode_pass_s([140] * 20) == pytest.approx(cal.decode_step_s(20, 140))  # one run
    longest_first = [1000, 900] + [100] * 30
    assert cal.decode_pass_s(longest_first) == pytest.approx(
        CAL.decode_step_s(32) + (2 * 960 + 30 * 60) * 0.002e-3)
    assert cal.decode_pass_s(longest_first) < cal.decode_step_s(32, 1000)  # not every row to 1000
    assert cal.decode_pass_s([]) == 0.0


@pytest.mark.parametrize("mode", ["separated", "colocated", "fully_shared"])
@pytest.mark.parametrize("model", ["samples", "runtime"])
def test_no_kl_term_runs_no_reference_pass(mode, model):
    cfg = SMALL.replace(mode=mode, max_staleness=1, partial_rollout=True, stalesync_model=model)
    with_ref, without = simulate(cfg, CAL), simulate(cfg.replace(reference=False), CAL)
    assert any(e.role == "ref" for e in with_ref.timeline)
    assert not any(e.role == "ref" for e in without.timeline)
    assert without.update_end_s[-1] < with_ref.update_end_s[-1]


def test_a_synchronous_batch_is_split_over_the_engines_by_group():
    """As the runtime splits a batch's prompt groups over its rollout devices, even when one
    engine's slots could hold the whole batch."""
    cfg = SMALL.replace(mode="colocated", num_steps=1, max_num_seqs=256, response_lengths=(10,) * 32)
    busy = {}
    for e in simulate(cfg, CAL).timeline:
        if e.role == "rollout":
            busy[e.device] = busy.get(e.device, 0.0) + e.end - e.start
    assert set(busy) == {"engine0", "engine1"} and busy["engine0"] == pytest.approx(busy["engine1"])


def test_calibration_round_trip(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(CAL, path)
    assert load_calibration(path) == CAL


def test_bad_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="mode.*allowed"):
        RLSimConfig(mode="mixed")
