"""Padding-free training: packed sequences give the same loss and gradients as padded ones."""

import pytest
import torch

from rlfusion.model.config import get_preset
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.policy_loss import ppo_policy_loss
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory, pack, split_by_token_budget, token_logprobs


def _trajs(n: int, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P, R = 3 + i % 4, 2 + (i * 5) % 13
        out.append(Trajectory(
            group_id=i // 2, problem=Problem("1+1=", "2"),
            prompt_ids=torch.randint(3, 17, (P,), generator=g).tolist(),
            response_ids=torch.randint(3, 17, (R,), generator=g).tolist(),
            behaviour_logprobs=(-torch.rand(R, generator=g)).tolist(), versions=[0] * R,
            finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


def _padded_loss(model, trajs, num_tokens):
    """Reference: right-padded [S, T] batch, causal attention, per-row targets."""
    T = max(t.num_tokens for t in trajs)
    tokens = torch.zeros(len(trajs), T, dtype=torch.long)
    for s, t in enumerate(trajs):
        tokens[s, :t.num_tokens] = torch.tensor(t.prompt_ids + t.response_ids)
    logprobs_ST = model(tokens)[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    total = 0.0
    for s, t in enumerate(trajs):
        P, R = len(t.prompt_ids), len(t.response_ids)
        lp = logprobs_ST[s, P - 1:P - 1 + R]
        behaviour = torch.tensor(t.behaviour_logprobs)
        ratio = torch.exp(lp - lp.detach())
        weight = torch.exp(lp.detach() - behaviour).clamp(max=2.0)
        total = total + (-(ratio * t.advantage) * weight).sum()
    return total / num_tokens


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_packed_loss_and_grads_match_padded(preset):
    torch.manual_seed(0)
    model = MoETransformer(get_preset(preset))
    trajs = _trajs(7)
    num_tokens = sum(len(t.response_ids) for t in trajs)

    model.zero_grad()
    _padded_loss(model, trajs, num_tokens).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_loss = _padded_loss(model, trajs, num_tokens).item()

    model.zero_grad()
    loss_total = 0.0
    for micro in split_by_token_budget(trajs, max_tokens=40):  # several micro-batches
        batch = pack(micro)
        logprobs_N, _ = token_logprobs(model, batch)
        loss, _ = ppo_policy_loss(logprobs_N, logprobs_N.detach(), batch.behaviour_logprobs_N,
                                  batch.advantages_N, batch.loss_mask_N, batch.seq_idx_N,
                                  num_tokens=num_tokens)
        loss.backward()
        loss_total += loss.item()
    assert loss_total == pytest.approx(ref_loss, abs=1e-5)
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pack_layout():
    trajs = _trajs(3)
    batch = pack(trajs)
    assert batch.tokens_N.numel() == sum(t.num_tokens for t in trajs)
    assert batch.num_response_tokens == sum(len(t.response_ids) for t in trajs)
    start = 0
    for s, t in enumerate(trajs):
        P, R = len(t.prompt_ids), len(t.response_ids)
        seg = slice(start, start + t.num_tokens)
        mask = batch.loss_mask_N[seg]
        # The target of position P-1 is the first response token.
        assert batch.targets_N[seg][P - 1:P - 1 + R].tolist() == t.response_ids
        assert mask[P - 1:P - 1 + R].sum() == R and mask.sum() == R
        assert (batch.seq_idx_N[seg] == s).all()
        start += t.num_tokens


def test_split_by_token_budget_keeps_every_trajectory_once():
    trajs = _trajs(20)
    micro = split_by_token_budget(trajs, max_tokens=50)
    flat = [t for mb in micro for t in mb]
    assert sorted(map(id, flat)) == sorted(map(id, trajs))
    assert all(sum(t.num_tokens for t in mb) <= 50 or len(mb) == 1 for mb in micro)
    with pytest.raises(ValueError, match="token budget"):
        split_by_token_budget(trajs, 0)


def test_one_micro_batch_of_mixed_lengths_attends_in_length_buckets_and_matches_padded():
    """One long response among short ones: the packed view is split into length buckets (so the
    short ones are not padded to the long one), and logprobs still equal the padded reference."""
    from rlfusion.model.kv_cache import BUCKET_LENGTH_RATIO, AttnContext, _length_buckets

    torch.manual_seed(0)
    model = MoETransformer(get_preset("tiny"))
    trajs = _trajs(9)
    trajs[4].response_ids = trajs[4].response_ids * 6  # the long one
    trajs[4].behaviour_logprobs = trajs[4].behaviour_logprobs * 6
    batch = pack(trajs)
    ctx = AttnContext.build(1, batch.tokens_N.numel(), None, torch.device("cpu"), packed=batch.packed)
    assert len(ctx.unpad_SL) > 1
    lengths = [t.num_tokens for t in trajs]
    buckets = _length_buckets(torch.tensor(lengths))
    assert sorted(i for b in buckets for i in b.tolist()) == list(range(len(trajs)))
    for b in buckets:
        ls = [lengths[i] for i in b.tolist()]
        assert max(ls) <= BUCKET_LENGTH_RATIO * min(ls)
    packed_N, _ = token_logprobs(model, batch)
    T = max(lengths)
    tokens = torch.zeros(len(trajs), T, dtype=torch.long)
    for s, t in enumerate(trajs):
        tokens[s, :t.num_tokens] = torch.tensor(t.prompt_ids + t.response_ids)
    lp_ST = model(tokens)[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    want = torch.cat([lp_ST[s, len(t.prompt_ids) - 1:t.num_tokens - 1] for s, t in enumerate(trajs)])
    torch.testing.assert_close(packed_N[batch.loss_mask_N.bool()], want, atol=1e-5, rtol=1e-4)
