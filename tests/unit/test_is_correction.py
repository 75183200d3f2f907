"""`algo.is_correction`: the behaviour weight each mode gives (none, tis, mis, seq_mask), by hand
on five tokens, its metrics and config checks, and a short `rlfusion train` run per mode."""

import json
import math

import pytest
import torch

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.rl.policy_loss import ppo_policy_loss, token_mean
from rlfusion.runtime.train_config import AlgoConfig, TrainConfig

# Five tokens, two sequences (2 + 3 tokens), as in test_rl_algorithms.py; tokens 0 and 3 are clipped:
#   r    = 1.5  0.5  1.1  0.5  1.0      A = 1  1  -1  -1  -1
#   loss = -1.2 -0.5 1.1  0.8  1.0   (before the behaviour weight)
RATIOS = [1.5, 0.5, 1.1, 0.5, 1.0]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, -1.0]
UNWEIGHTED = [-1.2, -0.5, 1.1, 0.8, 1.0]
UNCLIPPED = [0.0, 1.0, 1.0, 0.0, 1.0]


def close(a, b, atol=1e-5):
    a = a.detach() if torch.is_tensor(a) else torch.tensor(a, dtype=torch.float64)
    assert torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), atol=atol), (a, b)


def batch(weights, mask=(1.0, 1.0, 1.0, 1.0, 1.0)):
    """Behaviour logprobs set so that exp(proximal - behaviour) is `weights` token by token."""
    proximal = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
    return dict(
        logprobs_N=(proximal + torch.log(torch.tensor(RATIOS))).requires_grad_(),
        proximal_logprobs_N=proximal.clone().requires_grad_(),
        behaviour_logprobs_N=(proximal - torch.log(torch.tensor(weights))).requires_grad_(),
        advantages_N=torch.tensor(ADVANTAGES, requires_grad=True),
        mask_N=torch.tensor(mask),
        seq_idx_N=torch.tensor([0, 0, 1, 1, 1]),
    )


def expected_loss(w):
    return sum(x * wi for x, wi in zip(UNWEIGHTED, w)) / 5


# mode, kwargs, raw weights, the weights each token should get, and the metrics:
# (weight mean, capped fraction, masked fraction, masked sequence fraction)
CASES = {
    # 3.0 is capped to 2.0; 0.4 and 1.5 are kept as they are
    "tis": ({}, (1.0, 3.0, 0.4, 1.5, 1.0), (1.0, 2.0, 0.4, 1.5, 1.0), (5.9 / 5, 1 / 5, 0.0, 0.0)),
    # 3.0 > 2.0 and 0.4 < 0.5 leave the band [0.5, 2]: no loss; the rest keep their raw weight
    "mis": ({}, (1.0, 3.0, 0.4, 1.5, 1.0), (1.0, 0.0, 0.0, 1.5, 1.0), (3.5 / 5, 0.0, 2 / 5, 0.0)),
    # sequence 0: sqrt(3 * 2) = 2.45 > 2, dropped whole; sequence 1: (0.4 * 3 * 1)^(1/3) = 1.06,
    # kept with TIS weights (its 3.0 is capped to 2.0)
    "seq_mask": ({}, (3.0, 2.0, 0.4, 3.0, 1.0), (0.0, 0.0, 0.4, 2.0, 1.0), (3.4 / 5, 1 / 5, 2 / 5, 1 / 2)),
    # the low side: sequence 0's sqrt(0.3 * 0.4) = 0.35 < 1/2; sequence 1 inside a threshold of 2
    "seq_mask_low": ({}, (0.3, 0.4, 1.0, 1.5, 1.0), (0.0, 0.0, 1.0, 1.5, 1.0), (3.5 / 5, 0.0, 2 / 5, 1 / 2)),
    # a tighter band and threshold
    "mis_tight": ({"is_mask": (0.9, 1.2)}, (1.0, 1.1, 0.8, 1.5, 1.0), (1.0, 1.1, 0.0, 0.0, 1.0),
                  (3.1 / 5, 0.0, 2 / 5, 0.0)),
    "seq_mask_tight": ({"seq_mask_threshold": 1.2}, (1.0, 1.3, 1.2, 1.3, 1.3), (1.0, 1.3, 0.0, 0.0, 0.0),
                       (2.3 / 5, 0.0, 3 / 5, 1 / 2)),  # seq 0: 1.14 kept; seq 1: 1.27 > 1.2 dropped
    # no correction: w = 1 whatever the behaviour policy was
    "none": ({}, (1.0, 3.0, 0.4, 1.5, 1.0), (1.0,) * 5, (1.0, 0.0, 0.0, 0.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_mode_weights_tokens_by_hand(case):
    kwargs, raw, w, (mean, capped, masked, seq_masked) = CASES[case]
    b = batch(raw)
    loss, m = ppo_policy_loss(**b, is_correction=case.removesuffix("_low").removesuffix("_tight"), **kwargs)
    close(loss, expected_loss(w))
    close(m["behaviour_weight_mean"], mean)
    close(m["behaviour_weight_capped_fraction"], capped)
    close(m["is_masked_fraction"], masked)
    close(m["is_seq_masked_fraction"], seq_masked)
    close(m["behaviour_logprob_gap"], sum(abs(math.log(x)) for x in raw) / 5)
    loss.backward()
    # d(-r A w / 5)/d logp = -r A w / 5 on unclipped tokens, 0 where the clip is active
    close(b["logprobs_N"].grad, [-r * a * wi * u / 5 for r, a, wi, u in zip(RATIOS, ADVANTAGES, w, UNCLIPPED)])
    for name in ("proximal_logprobs_N", "behaviour_logprobs_N", "advantages_N"):
        assert b[name].grad is None, name


def test_seq_mask_with_per_sequence_aggregation_keeps_dropped_sequences_in_the_count():
    loss, _ = ppo_policy_loss(**batch((3.0, 2.0, 0.4, 3.0, 1.0)), is_correction="seq_mask", agg="seq")
    close(loss, (0.0 + (1.1 * 0.4 + 0.8 * 2.0 + 1.0) / 3) / 2)


def test_off_mask_tokens_do_not_count_toward_a_sequence_or_the_metrics():
    # token 1 is off the mask with an infinite weight (behaviour logprob -inf): sequence 0 is
    # token 0 alone (weight 1), kept; nothing non-finite reaches the loss or the gradient
    for mode in ("tis", "mis", "seq_mask", "none"):
        b = batch((1.0, math.inf, 1.0, 1.0, 1.0), mask=(1.0, 0.0, 1.0, 1.0, 1.0))
        loss, m = ppo_policy_loss(**b, is_correction=mode)
        close(loss, (-1.2 + 1.1 + 0.8 + 1.0) / 4)
        loss.backward()
        assert torch.isfinite(b["logprobs_N"].grad).all()
        close(m["is_masked_fraction"], 0.0)
        close(m["is_seq_masked_fraction"], 0.0)
        close(m["behaviour_weight_mean"], 1.0)


def test_none_is_plain_ppo_against_the_proximal_policy():
    g = torch.Generator().manual_seed(0)
    logp, prox, behav, adv = (torch.randn(7, generator=g) for _ in range(4))
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 0])
    loss, m = ppo_policy_loss(logp, prox, behav, adv, mask, torch.tensor([0, 0, 0, 1, 1, 2, 2]),
                              clip_high=0.28, is_correction="none")
    ratio = (logp - prox).exp()
    plain = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert torch.equal(loss, (plain * mask).sum() / mask.sum())
    assert m["behaviour_weight_mean"] == 1.0 and m["behaviour_logprob_gap"] > 0


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_tis_is_the_default_and_bitwise_the_former_truncated_weight(agg):
    g = torch.Generator().manual_seed(2)
    logp, prox, adv = (torch.randn(9, generator=g) for _ in range(3))
    behav = prox + torch.randn(9, generator=g)  # weights from ~0.2 to ~5: some capped
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0, 1])
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    args = (logp, prox, behav, adv, mask, seq)
    default, m = ppo_policy_loss(*args, agg=agg, behaviour_weight_cap=1.5)
    tis, _ = ppo_policy_loss(*args, agg=agg, behaviour_weight_cap=1.5, is_correction="tis")
    assert torch.equal(default, tis)
    # the weight as it was computed before the corrections (min(exp(prox - behav), cap))
    valid = mask.bool()
    ratio = torch.where(valid, logp - prox, 0.0).exp()
    raw = torch.where(valid, prox - behav, 0.0).exp()
    loss_N = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * raw.clamp(max=1.5)
    if agg == "token":
        assert torch.equal(default, token_mean(loss_N, mask))
    capped = float(((raw > 1.5) & valid).sum()) / float(valid.sum())
    assert 0 < m["behaviour_weight_capped_fraction"] == pytest.approx(capped)
    assert m["is_masked_fraction"] == 0.0 and m["is_seq_masked_fraction"] == 0.0


def test_fresh_samples_are_plain_ppo_in_every_mode():
    b = batch((1.0,) * 5)
    losses = [ppo_policy_loss(**b, is_correction=mode)[0] for mode in ("none", "tis", "mis", "seq_mask")]
    assert all(torch.equal(losses[0], x) for x in losses[1:])


def test_bad_arguments_name_what_is_allowed():
    b = batch((1.0,) * 5)
    with pytest.raises(ValueError, match="'none', 'tis', 'mis', 'seq_mask'"):
        ppo_policy_loss(**b, is_correction="veto")
    with pytest.raises(ValueError, match="is_mask"):
        ppo_policy_loss(**b, is_correction="mis", is_mask=(1.1, 2.0))
    with pytest.raises(ValueError, match="seq_mask_threshold"):
        ppo_policy_loss(**b, is_correction="seq_mask", seq_mask_threshold=0.5)


@pytest.mark.parametrize("key, value, allowed", [
    ("is_correction", "rs", "allowed: none, tis, mis, seq_mask"),
    ("is_mask_low", 1.5, "must be in [0, 1]"),
    ("is_mask_low", -0.1, "must be in [0, 1]"),
    ("is_mask_high", 0.9, "must be >= 1"),
    ("seq_mask_threshold", 0.5, "must be >= 1"),
])
def test_config_checks_are_one_line(key, value, allowed):
    with pytest.raises(ValueError) as e:
        load_config(TrainConfig, None, [f"algo.{key}={value}"])
    assert str(e.value).startswith(f"algo.{key}={value!r} is invalid: {allowed}")
    assert "\n" not in str(e.value)


def test_config_defaults_keep_existing_runs_unchanged():
    algo = AlgoConfig()
    assert (algo.is_correction, algo.is_mask_low, algo.is_mask_high, algo.seq_mask_threshold) == ("tis", 0.5, 2.0, 2.0)


# ---- a short `rlfusion train` per mode -----------------------------------------------------------
SMALL = ["deploy.backend=local", "deploy.num_devices=1", "max_steps=2", "checkpoint_every=25", "eval_every=25",
         "eval_problems=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
         "collapse_patience=0", "threads=1", "algo.dynamic_sampling=false"]
# bf16 rollouts against fp32 training: logprobs differ by ~0.002 per token, so a band of +-0.1%
# masks some tokens but not all; a sequence's mean log weight averages signed differences that
# partly cancel, so its threshold is tighter still
TIGHT = ["rollout.precision=bf16", "algo.is_mask_low=0.999", "algo.is_mask_high=1.001",
         "algo.seq_mask_threshold=1.0001"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "tis", "mis", "seq_mask"])
def test_a_short_run_per_mode_reports_its_metrics(base, tmp_path, mode):
    assert main(["train", f"base={base}", f"out_dir={tmp_path}", f"run_name={mode}", *SMALL, *TIGHT,
                 f"algo.is_correction={mode}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "trained" in r]
    assert len(steps) == 2 and all(r["trained"] == 1.0 for r in steps)
    assert all(r["behaviour_logprob_gap"] > 0 for r in steps)  # the bf16 engine's logprobs differ
    masked = [r["is_masked_fraction"] for r in steps]
    seq_masked = [r["is_seq_masked_fraction"] for r in steps]
    capped = [r["behaviour_weight_capped_fraction"] for r in steps]
    means = [r["behaviour_weight_mean"] for r in steps]
    if mode in ("none", "tis"):
        assert masked == seq_masked == capped == [0.0, 0.0]
        assert all(abs(m - 1) < 0.01 for m in means)  # tis: ~1, nothing reaches the cap of 2
    if mode == "none":
        assert means == [1.0, 1.0]
    if mode == "mis":
        assert all(0 <= x < 1 for x in masked) and max(masked) > 0 and seq_masked == [0.0, 0.0]
    if mode == "seq_mask":
        assert all(0 <= x <= 1 for x in seq_masked) and max(seq_masked) > 0 and max(masked) > 0
