"""Unit tests of the RL algorithms against hand-computed values (advantages, PPO, KL, DAPO)."""

import math

import pytest
import torch

from rlfusion.rl.advantages import gae_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rlfusion.rl.dapo import dynamic_sampling_mask, overlong_penalty
from rlfusion.rl.kl import kl_estimate, kl_loss, kl_reward_penalty
from rlfusion.rl.policy_loss import entropy_bonus, entropy_from_logits, ppo_policy_loss, value_loss

LN2 = math.log(2.0)
R2 = math.sqrt(2.0)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---- advantages -------------------------------------------------------------------------------

def test_grpo_normalizes_by_population_std_and_zeroes_flat_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    # group 0: mean 1/3, population std sqrt(2)/3 -> (2/3) / (sqrt(2)/3) = sqrt(2), ...
    close(grpo_advantages(rewards), [[R2, -1 / R2, -1 / R2], [0.0, 0.0, 0.0]])


def test_dr_grpo_only_centers():
    rewards = torch.tensor([[1, 0, 0], [3, 1, 2]])  # integer rewards are accepted
    close(grpo_advantages(rewards, scale_by_std=False), [[2 / 3, -1 / 3, -1 / 3], [1.0, -1.0, 0.0]])


def test_rloo_uses_the_mean_of_the_others():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]])
    close(rloo_advantages(rewards), [[1.0, -0.5, -0.5], [1.5, -1.5, 0.0]])


def test_reinforce_pp_uses_one_global_baseline():
    close(reinforce_pp_advantages(torch.tensor([1.0, 1.0, 3.0, 3.0])), [-1.0, -1.0, 1.0, 1.0])


def test_gae_on_right_padded_rows():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.5, 0.5], [0.2, 0.4, float("inf")]])  # padding holds junk
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: deltas (0, 0, 0.5) -> A2 = .5, A1 = .5 * .5, A0 = .5 * .25
    # row 1: deltas (0.4 - 0.2, 1 - 0.4) = (0.2, 0.6) -> A1 = .6, A0 = .2 + .5 * .6
    close(adv, [[0.125, 0.25, 0.5], [0.5, 0.6, 0.0]])
    close(ret, [[0.625, 0.75, 1.0], [0.7, 1.0, 0.0]])


def test_gae_with_discount_and_lambda_one_is_discounted_return_minus_value():
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3),
                              gamma=0.5, lam=1.0)
    close(adv, [[0.25 - 0.5, 0.5 - 0.5, 1.0 - 0.5]])
    close(ret, [[0.25, 0.5, 1.0]])


# ---- PPO policy loss --------------------------------------------------------------------------
# Five tokens, two sequences (2 + 3 tokens); ratios chosen so tokens 0 and 3 are clipped at 0.2:
#   r    = 1.5  0.5  1.1  0.5  1.0      A = 1  1  -1  -1  -1
#   loss = -1.2 -0.5 1.1  0.8  1.0   (token 0: min(1.5, 1.2); token 3: min(-0.5, -0.8))
RATIOS = [1.5, 0.5, 1.1, 0.5, 1.0]


def batch(weights=(1.0, 1.0, 1.0, 1.0, 1.0)):
    proximal = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0])
    return dict(
        logprobs_N=(proximal + torch.log(torch.tensor(RATIOS))).requires_grad_(),
        proximal_logprobs_N=proximal.clone().requires_grad_(),
        behaviour_logprobs_N=(proximal - torch.log(torch.tensor(weights))).requires_grad_(),
        advantages_N=torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], requires_grad=True),
        mask_N=torch.ones(5),
        seq_idx_N=torch.tensor([0, 0, 1, 1, 1]),
    )


def test_ppo_token_and_seq_aggregation_and_metrics():
    loss, m = ppo_policy_loss(**batch())
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8 + 1.0) / 5)
    close(m["clip_fraction"], 2 / 5)
    close(m["ratio_mean"], 4.6 / 5)
    close(m["approx_kl"], sum(r - 1 - math.log(r) for r in RATIOS) / 5)
    close(m["behaviour_weight_mean"], 1.0)
    close(m["behaviour_weight_capped_fraction"], 0.0)
    close(m["behaviour_logprob_gap"], 0.0)
    seq_loss, _ = ppo_policy_loss(**batch(), agg="seq")
    close(seq_loss, ((-1.2 - 0.5) / 2 + (1.1 + 0.8 + 1.0) / 3) / 2)


def test_ppo_clip_higher_and_mask():
    loss, _ = ppo_policy_loss(**batch(), clip_high=0.6)  # token 0 now unclipped: -1.5
    close(loss, (-1.5 - 0.5 + 1.1 + 0.8 + 1.0) / 5)
    b = batch()
    b["mask_N"] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    junk = torch.where(b["mask_N"].bool(), b["logprobs_N"], float("inf")).detach()  # inf off-mask
    b["logprobs_N"] = junk.requires_grad_()
    loss, m = ppo_policy_loss(**b)
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8) / 4)
    close(m["clip_fraction"], 2 / 4)
    loss.backward()
    close(b["logprobs_N"].grad, [0.0, -0.5 / 4, 1.1 / 4, 0.0, 0.0])  # finite, and 0 off-mask


def test_ppo_truncated_behaviour_weight():
    loss, m = ppo_policy_loss(**batch(weights=(1.0, 3.0, 0.5, 1.0, 1.0)))  # 3.0 is capped to 2.0
    close(loss, (-1.2 - 0.5 * 2.0 + 1.1 * 0.5 + 0.8 + 1.0) / 5)
    close(m["behaviour_weight_mean"], (1 + 2 + 0.5 + 1 + 1) / 5)
    close(m["behaviour_weight_capped_fraction"], 1 / 5)
    close(m["behaviour_logprob_gap"], (0 + math.log(3.0) + math.log(2.0) + 0 + 0) / 5)  # |log w| per token


def test_ppo_with_fresh_samples_is_exactly_plain_ppo():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(7, generator=g) for _ in range(3))
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 0])
    loss, _ = ppo_policy_loss(logp, old, old, adv, mask, torch.tensor([0, 0, 0, 1, 1, 2, 2]), clip_high=0.28)
    ratio = (logp - old).exp()
    plain = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert torch.equal(loss, (plain * mask).sum() / mask.sum())


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_micro_batches_with_global_normalizers_add_up_to_the_full_batch(agg):
    g = torch.Generator().manual_seed(1)
    logp, prox, behav, adv = (torch.randn(9, generator=g) for _ in range(4))
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 0, 1])
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    full, _ = ppo_policy_loss(logp, prox, behav, adv, mask, seq, agg=agg)
    norms = dict(num_tokens=mask.sum(), num_seqs=4)
    parts = [ppo_policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], seq[s], agg=agg, **norms)[0]
             for s in (slice(0, 5), slice(5, 9))]  # split at a sequence boundary
    close(parts[0] + parts[1], full.item(), atol=1e-6)


def test_gradient_reaches_only_logprobs():
    b = batch()
    loss, _ = ppo_policy_loss(**b)
    loss.backward()
    # d(-r A w / 5)/d logp = -r A / 5 on unclipped tokens, 0 where the clip is active
    close(b["logprobs_N"].grad, [0.0, -0.5 / 5, 1.1 / 5, 0.0, 1.0 / 5])
    for name in ("proximal_logprobs_N", "behaviour_logprobs_N", "advantages_N"):
        assert b[name].grad is None, name


def test_ppo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'token', 'seq'"):
        ppo_policy_loss(**batch(), agg="mean")
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        ppo_policy_loss(**batch(), behaviour_weight_cap=0.5)
    b = batch()
    b["mask_N"] = torch.ones(4)
    with pytest.raises(ValueError, match="shape"):
        ppo_policy_loss(**b)


# ---- critic and entropy -----------------------------------------------------------------------

def test_value_loss_takes_the_pessimistic_clipped_error():
    values = torch.tensor([1.0, 0.0, 0.6], requires_grad=True)
    loss, m = value_loss(values, torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 0.0]), torch.ones(3))
    # clipped values 0.7, 0.3, 0.6 -> 0.5 * max: (1, 1.69) (0, 0.09) (0.36, 0.36)
    close(loss, (0.845 + 0.045 + 0.18) / 3)
    close(m["value_clip_fraction"], 2 / 3)
    loss.backward()
    close(values.grad, [0.0, 0.0, 0.6 / 3])  # clipped branches carry no gradient


def test_entropy_from_logits_handles_banned_tokens():
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -inf, -inf], [5.0, -inf, -inf, -inf]],
                          requires_grad=True)
    ent = entropy_from_logits(logits)
    close(ent, [2 * LN2, LN2, 0.0])
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_bonus():
    loss, m = entropy_bonus(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 0.0]), coef=0.1)
    close(loss, -0.15)
    close(m["entropy"], 1.5)


# ---- KL ---------------------------------------------------------------------------------------
LOGP = torch.zeros(3)
REF = torch.tensor([0.0, LN2, -LN2])  # ref - logp = d = 0, ln2, -ln2


def test_kl_estimators():
    close(kl_estimate(LOGP, REF, "k1"), [0.0, -LN2, LN2])
    close(kl_estimate(LOGP, REF, "k2"), [0.0, 0.5 * LN2**2, 0.5 * LN2**2])
    close(kl_estimate(LOGP, REF, "k3"), [0.0, 1.0 - LN2, LN2 - 0.5])  # exp(d) - d - 1


def test_kl_loss_gradient_reaches_only_logprobs():
    logp, ref = LOGP.clone().requires_grad_(), REF.clone().requires_grad_()
    loss, m = kl_loss(logp, ref, torch.tensor([1.0, 1.0, 0.0]), coef=0.1)
    close(loss, 0.1 * (1.0 - LN2) / 2)
    close(m["kl"], (1.0 - LN2) / 2)
    loss.backward()
    close(logp.grad, [0.0, 0.1 * (1.0 - 2.0) / 2, 0.0])  # d k3 / d logp = 1 - exp(d)
    assert ref.grad is None


def test_kl_reward_penalty_sums_each_sequence():
    rewards, m = kl_reward_penalty(torch.tensor([1.0, 0.0]), LOGP, REF, torch.tensor([0, 0, 1]), coef=0.5)
    close(rewards, [1.0 + 0.5 * LN2, -0.5 * LN2])  # k1 sums: -ln2 and ln2
    close(m["kl_seq_mean"], 0.0)
    masked, _ = kl_reward_penalty(torch.tensor([1.0, 0.0]), LOGP, REF, torch.tensor([0, 0, 1]), coef=0.5,
                                  mask_N=torch.tensor([1, 0, 1]))
    close(masked, [1.0, -0.5 * LN2])


def test_kl_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
        kl_estimate(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="seq_idx_N"):
        kl_reward_penalty(torch.zeros(2), LOGP, REF, torch.tensor([0, 1, 2]), coef=0.1)


# ---- DAPO -------------------------------------------------------------------------------------

def test_dynamic_sampling_keeps_groups_with_some_spread():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert dynamic_sampling_mask(rewards).tolist() == [False, True, False]


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])  # max_len 10, buffer 4: ramp starts after 6
    close(overlong_penalty(lengths, max_len=10, buffer_len=4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    halved = overlong_penalty(lengths, max_len=10, buffer_len=4, factor=0.5)
    close(halved, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


# ---- argument errors --------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda: grpo_advantages(torch.ones(3)), r"\[num_groups, group_size\]"),
    (lambda: rloo_advantages(torch.ones(2, 1)), "group_size >= 2"),
    (lambda: reinforce_pp_advantages(torch.ones(0)), "at least one"),
    (lambda: gae_advantages(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 2)), "shape"),
    (lambda: gae_advantages(torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), gamma=2), "gamma"),
    (lambda: overlong_penalty(torch.ones(2), max_len=10, buffer_len=0), "buffer_len"),
    (lambda: overlong_penalty(torch.ones(2), max_len=10, buffer_len=11), "buffer_len"),
    (lambda: dynamic_sampling_mask(torch.ones(3)), "rewards_GS"),
    (lambda: value_loss(torch.ones(2), torch.ones(2), torch.ones(2), torch.ones(2), clip=0.0), "clip"),
    (lambda: entropy_bonus(torch.ones(2), torch.ones(2), coef=-1.0), "coef"),
])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
