"""bench/stalesync.py's own logic: ad-hoc variants (`--add`), the staleness bound of a variant,
and the ceiling of any schedule — per seed against that seed's baseline, and the loosest form."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("ray")  # the bench imports it

from bench_helpers import load_bench  # noqa: E402
from rlfusion.config import load_config  # noqa: E402
from rlfusion.obs.timeline import Span  # noqa: E402
from rlfusion.runtime.train_config import TrainConfig  # noqa: E402


@pytest.fixture
def bench():
    yield load_bench("stalesync")  # fresh each test: `--add` registers variants in its VARIANTS
    del sys.modules["bench_stalesync"]


def test_add_registers_a_variant_and_rejects_bad_specs(bench):
    name = bench.add_variant("sep s=1 256=separated|stalesync.enabled=true|rollout.max_num_seqs=256")
    assert name == "sep s=1 256"  # '=' in a name, like the built-in ones
    assert bench.VARIANTS[name] == ("separated", ["stalesync.enabled=true", "rollout.max_num_seqs=256"])
    assert bench.is_stalesync(name) and not bench.is_stalesync(bench.add_variant("sync 256=colocated"))
    for bad, why in [("=separated", "no NAME"), ("x=mixed", "MODE 'mixed' is not one of"),
                     ("a/b=colocated", "may not contain '/'"), ("x=separated|novalue", "'novalue' is not KEY=VALUE"),
                     ("x=separated|=b", "'=b' is not KEY=VALUE"), ("sync colocated=colocated", "is taken"),
                     ("sync_colocated=colocated", "another variant's folder"),
                     ("x=separated|stalesync.bogus=1", "unknown config key 'stalesync.bogus'"),
                     ("x=separated|stalesync.max_staleness=abc", "must be int")]:
        with pytest.raises(SystemExit, match=why):
            bench.add_variant(bad)
        assert "x" not in bench.VARIANTS


def test_bound_reads_the_override_else_the_default(bench):
    assert bench.bound("stalesync s=2 colocated") == 2
    bench.add_variant("plain=separated|stalesync.enabled=true")
    assert bench.bound("plain") == TrainConfig().stalesync.max_staleness


NO_CONTEXT = {"floor_context": 20.0, "context_s_per_position": 0.0}  # reads cost nothing beyond the floor


def _run(tokens: int, step_s: float, work: dict[str, float]) -> tuple[list[dict], list[Span]]:
    """One timed update of `tokens` generated tokens and `step_s` seconds, with device spans of
    `work` (phase -> seconds); rollout and idle spans must not count as work."""
    spans = [Span("device0", "rollout", 0.0, 5.0, step=2), Span("device1", "idle", 0.0, 5.0, step=2)]
    spans += [Span("device1", phase, 0.0, s, step=2) for phase, s in work.items()]
    return [{"generated_tokens": tokens, "time_step_s": step_s, "response_length_mean": 100.0}], spans


def test_ceiling_takes_the_least_work_and_the_floors(bench):
    rollout = bench.rollout_config()  # the workload's batch
    samples = rollout.prompts_per_step * rollout.group_size
    col, col_spans = _run(1000, 1.0, {"train": 0.2, "reference": 0.05, "switch": 0.3})
    sep, sep_spans = _run(1000, 2.0, {"train": 0.1, "reference": 0.05, "transfer": 0.4})
    floor = {"decode_s_per_token": 50e-6, "prefill_s_per_token": 30e-6, "prompt_tokens": 2.0, **NO_CONTEXT}
    c = bench.ceiling_of({"sync colocated": col, "sync separated": sep},
                         {"sync colocated": col_spans, "sync separated": sep_spans}, floor, speed=0.8)
    assert c["least"] == "sync separated"  # 150 us per token (switch and transfer left out)
    assert c["work"]["sync colocated"] == pytest.approx(250e-6)
    per_token = 150e-6 + 50e-6 + samples * 2.0 / 1000 * 30e-6
    assert c["tok_s"] == pytest.approx(2 * 0.8 / per_token)
    assert c["ratio"] == pytest.approx(c["tok_s"] / 1000.0)  # the baseline: 1000 tokens in 1 s


def test_ceiling_counts_each_tokens_cache_reads_at_the_workloads_mean_context(bench):
    """A generated token at a longer context than the floor's reads more cache: the ceiling adds
    the cost per position beyond the floor's context, at the workload's mean context."""
    from rlfusion.rl.replay import replay_length

    col, col_spans = _run(1000, 1.0, {"train": 0.2})
    floor = {"decode_s_per_token": 50e-6, "prefill_s_per_token": 30e-6, "prompt_tokens": 2.0, **NO_CONTEXT}
    reads = {**floor, "context_s_per_position": 300e-9}
    free, paid = (bench.ceiling_of({"sync colocated": col}, {"sync colocated": col_spans}, f, speed=1.0)
                  for f in (floor, reads))
    r = bench.rollout_config()  # the replay workload: its drawn lengths
    lengths = [replay_length(g, i, r.replay_median, r.replay_sigma, r.replay_between, r.max_new_tokens)
               for g in range(2000) for i in range(r.group_size)]
    context = 2.0 + sum(n * (n - 1) / 2 for n in lengths) / sum(lengths)
    assert paid["context"] == pytest.approx(context) and context > 2.0 + r.replay_median
    assert 1 / paid["tok_s"] - 1 / free["tok_s"] == pytest.approx((context - 20.0) * 300e-9 / 2)
    # a natural-length workload: the measured mean length bounds the mean context from below
    task = bench.WORKLOADS["task"]
    assert bench.mean_context(load_config(TrainConfig, task).rollout, 2.0, 41.0) == pytest.approx(2.0 + 20.0)


def test_ceiling_counts_the_prompts_of_the_configured_batch(bench, monkeypatch):
    """`--prompts N` sets every variant's batch, and the ceiling's prompt prefill follows it."""
    col, col_spans = _run(1000, 1.0, {"train": 0.2})
    floor = {"decode_s_per_token": 50e-6, "prefill_s_per_token": 30e-6, "prompt_tokens": 2.0, **NO_CONTEXT}
    default = bench.ceiling_of({"sync colocated": col}, {"sync colocated": col_spans}, floor, speed=1.0)
    monkeypatch.setattr(sys, "argv", ["stalesync.py", "--prompts", "4", "--updates", "2"])
    with pytest.raises(SystemExit, match="need >= 4 updates"):  # stops before Ray starts
        bench.main()
    assert bench.rollout_config().prompts_per_step == 4
    small = bench.ceiling_of({"sync colocated": col}, {"sync colocated": col_spans}, floor, speed=1.0)
    replay = load_config(TrainConfig, bench.REPLAY).rollout  # the default workload's batch
    assert default["prompts_per_token"] == pytest.approx(replay.prompts_per_step * replay.group_size * 2.0 / 1000)
    assert small["prompts_per_token"] == pytest.approx(4 * replay.group_size * 2.0 / 1000)
    monkeypatch.setattr(sys, "argv", ["stalesync.py", "--prompts", "0"])
    with pytest.raises(SystemExit, match="--prompts=0: must be >= 1"):
        bench.main()


def test_steady_tokens_per_s_holds_the_pool_level(bench):
    """A pool that fills (more generated than trained) has not paid to train what it generated:
    the steady rate charges rollout per generated token and the rest per trained token."""
    def run(generated, trained, wall, rollout_s, train_s):
        updates = [{"generated_tokens": generated, "response_tokens": trained, "time_step_s": wall}]
        spans = [Span("device0", "rollout", 0.0, rollout_s, step=2), Span("device1", "train", 0.0, train_s, step=2),
                 Span("device1", "idle", 0.0, 1.0, step=2), Span("driver", "train", 0.0, 5.0, step=2)]
        return updates, spans

    sync = run(1000, 1000, 2.0, 3.0, 1.0)  # generated = trained: the plain rate
    assert bench.steady_tokens_per_s(*sync) == pytest.approx(1000 / 2.0)
    # 2000 generated in 3 device-s (1.5 ms each), 1000 trained in 1 device-s (1 ms each), 4 busy
    # device-s per 2 s of wall: 2 device-s per s / 2.5 ms per token = 800 tokens/s
    filling = run(2000, 1000, 2.0, 3.0, 1.0)
    assert bench.steady_tokens_per_s(*filling) == pytest.approx(800.0)
    assert bench.trained_tokens_per_s(filling[0]) < 800.0 < bench.tokens_per_s(filling[0])
    assert bench.steady_tokens_per_s(*run(0, 0, 2.0, 3.0, 1.0)) == 0.0


def test_per_seed_ceilings_pair_each_seed_with_its_own_baseline(bench, capsys):
    floor = {"decode_s_per_token": 50e-6, "prefill_s_per_token": 30e-6, "prompt_tokens": 2.0, "decode_rows": 512,
             **NO_CONTEXT}
    quick = {**floor, "decode_s_per_token": 40e-6}  # a quiet moment's floor
    seeds = []
    for seed, step_s in ((3, 1.0), (4, 2.0), (5, 1.5)):  # seed 4's baseline ran at half the speed
        t, s = _run(1000, step_s, {"train": 0.15})
        seeds.append({"seed": seed, "timed": {"sync colocated": t}, "spans": {"sync colocated": s}})
    conditions = [[(floor, 0.8), (quick, 1.0)], [(floor, 0.8), (floor, 0.8)], [(floor, 0.9), (floor, 0.9)]]
    bench.print_ceilings(seeds, conditions)
    out = capsys.readouterr().out
    ratios = [bench.ceiling_of(seeds[0]["timed"], seeds[0]["spans"],  # the means of before and after
                               {**floor, "decode_s_per_token": 45e-6}, 0.9)["ratio"],
              bench.ceiling_of(seeds[1]["timed"], seeds[1]["spans"], floor, 0.8)["ratio"],
              bench.ceiling_of(seeds[2]["timed"], seeds[2]["spans"], floor, 0.9)["ratio"]]
    # the same work and floors against a baseline half as fast: twice the ratio
    assert ratios[1] == pytest.approx(2 * bench.ceiling_of(seeds[0]["timed"], seeds[1]["spans"], floor, 0.8)["ratio"])
    for seed, r in zip((3, 4, 5), ratios):  # labelled by seed number
        assert f"seed {seed}: ceiling" in out and f"= {r:.2f}x its sync colocated" in out
    assert f"median of the seeds {sorted(ratios)[1]:.2f}x" in out
    loosest = max(bench.ceiling_of(run["timed"], run["spans"], quick, 1.0)["ratio"] for run in seeds)
    assert f"loosest form {loosest:.2f}x" in out and loosest >= max(ratios)


def test_the_workload_flag_picks_the_config_and_its_ladder(bench, monkeypatch):
    """`--workload task` runs the built-in task at the defaults; the replay workload is the
    default, with the StaleSync ladder from s=0 up."""
    assert bench.rollout_config().lengths == "replay" and bench.rollout_config().max_new_tokens == 1000
    assert bench.LADDER["replay"][:5] == ["sync colocated", "stalesync s=0 colocated",
                                          "stalesync s=1 colocated no partial", "stalesync s=1 colocated",
                                          "stalesync s=2 colocated"]
    assert bench.bound("stalesync s=0 colocated") == 0
    monkeypatch.setattr(sys, "argv", ["stalesync.py", "--workload", "task", "--updates", "2"])
    with pytest.raises(SystemExit, match="need >= 4 updates"):
        bench.main()
    assert bench.rollout_config() == TrainConfig().rollout
    monkeypatch.setattr(sys, "argv", ["stalesync.py", "--workload", "bogus"])
    with pytest.raises(SystemExit):
        bench.main()
