"""Model: KV-cache decoding matches full forward, MoE routing, parameter counts, checkpoints."""

import pytest
import torch

from rlfusion.model.row_segments import SEGMENT_RATIO, SEGMENT_SLACK, read_cost, row_segments

from rlfusion.model.checkpoint import load_checkpoint, save_checkpoint
from rlfusion.model.config import get_preset
from rlfusion.model.kv_cache import CacheBatch
from rlfusion.model.moe import MoE
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer

# Incremental decoding reorders float32 sums (one token at a time vs a whole matmul); the
# observed difference is ~3e-7 on logits of magnitude ~1, so 1e-5 leaves margin without hiding bugs.
KV_ATOL = 1e-5


def _model(preset: str = "tiny", seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(get_preset(preset)).eval()


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_kv_cache_decoding_matches_full_forward(preset):
    model = _model(preset)
    tokens = torch.randint(3, 17, (3, 40))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(num_slots=5, max_len=64)
        # Rows 2..4 of the cache, a 12-token prefill then one token at a time.
        steps = [model(tokens[:, :12], CacheBatch(cache, 2, torch.zeros(3, dtype=torch.long)))]
        for t in range(12, 40):
            steps.append(model(tokens[:, t:t + 1], CacheBatch(cache, 2, torch.full((3,), t))))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=KV_ATOL, rtol=0)


@pytest.mark.parametrize("preset,lengths", [
    ("tiny", (5, 9, 14)),  # one run of rows
    ("tiny", (3, 100, 7, 180, 40, 130, 150)),  # far apart, out of order: several runs, some masked
    ("tiny-mla", (3, 100, 7, 180, 40, 130, 150)),
])
def test_decode_rows_at_different_positions_match_full_forward(preset, lengths):
    """Decode rows whose sequences have different lengths in one pass: every row's logits equal
    its own full forward, however the pass splits the rows into runs (`row_segments`)."""
    model = _model(preset)
    seqs = [torch.randint(3, 17, (n,)) for n in lengths]
    if len(lengths) > 3:
        assert len(row_segments([n - 1 for n in lengths])) >= 4
    with torch.no_grad():
        cache = model.new_kv_cache(len(seqs), max(lengths) + 20)
        for b, s in enumerate(seqs):
            model(s[None, :-1], CacheBatch(cache, b, torch.zeros(1, dtype=torch.long)))
        last = torch.stack([s[-1:] for s in seqs])
        step = model(last, CacheBatch(cache, 0, torch.tensor([len(s) - 1 for s in seqs])))
        for b, s in enumerate(seqs):
            torch.testing.assert_close(step[b, -1], model(s[None])[0, -1], atol=KV_ATOL, rtol=0)


def test_row_segments_cover_the_rows_within_their_bound():
    lengths = [1000, 990, 700, 12, 650, 400, 300, 280, 20, 10, 5]
    segments = row_segments(lengths)
    assert [s[0] for s in segments] == [0] + [s[1] for s in segments[:-1]] and segments[-1][1] == len(lengths)
    for start, end, positions in segments:
        rows = lengths[start:end]
        assert positions == max(rows)
        assert max(rows) <= SEGMENT_RATIO * min(rows) or max(rows) - min(rows) <= SEGMENT_SLACK
    # longest first reads less than the same rows in another order
    assert read_cost(sorted(lengths, reverse=True)) < read_cost(lengths)
    assert read_cost([1000] + [10] * 127) < 0.2 * 128 * 1000  # not every row to the longest


def _dense_moe_reference(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the router's (normalized) top-k weights."""
    ids, weights, _ = moe.router(x_ND)
    E = moe.experts.w_gate_EDF.shape[0]
    gate_NE = torch.zeros(x_ND.shape[0], E).scatter(1, ids, weights)
    y = sum(gate_NE[:, e:e + 1] * moe.experts.expert_forward(e, x_ND) for e in range(E))
    return y + moe.shared(x_ND)


@pytest.mark.parametrize("top_k", [2, 8])
def test_moe_matches_dense_expert_by_expert_reference(top_k):
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(top_k=top_k)
    moe = MoE(cfg).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 33, cfg.d_model)
    with torch.no_grad():
        out = moe(x).reshape(-1, cfg.d_model)
        ref = _dense_moe_reference(moe, x.reshape(-1, cfg.d_model))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_moe_small_batch_path_matches_the_reference_and_the_sorted_path(num_tokens):
    """Decode-sized batches (no grad, <= dense_max_tokens) compute every expert in one batched
    matmul; with grad the same tokens take the per-expert path. Both equal the reference."""
    torch.manual_seed(1)
    cfg = get_preset("tiny")
    moe = MoE(cfg).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(num_tokens, cfg.d_model)
    assert num_tokens <= moe.experts.dense_max_tokens
    with torch.no_grad():
        small = moe(x[None])[0]
        ref = _dense_moe_reference(moe, x)
    sorted_path = moe(x[None])[0]  # grad enabled: the per-expert path
    torch.testing.assert_close(small, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(small, sorted_path.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_topk_weights_are_normalized(score_func):
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(score_func=score_func, routed_scaling_factor=2.5)
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    ids, weights, _ = moe.router(torch.randn(64, cfg.d_model))
    assert ids.shape == (64, cfg.top_k)
    assert (ids.sort(-1).values[:, 1:] != ids.sort(-1).values[:, :-1]).all()  # distinct experts
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))


def test_expert_bias_steers_selection_toward_underloaded_experts():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(bias_update_rate=0.05)
    moe = MoE(cfg).train()
    torch.nn.init.normal_(moe.router.weight, std=0.3)
    x = torch.randn(512, cfg.d_model) + 2.0  # skewed inputs give a skewed load
    def imbalance():
        counts = torch.bincount(moe.router(x)[0].flatten(), minlength=cfg.num_experts).float()
        return (counts.max() / counts.mean()).item()
    before = imbalance()
    moe.router.tokens_per_expert.zero_()
    for _ in range(200):
        moe.router(x)
        moe.router.update_bias(cfg.bias_update_rate)
    assert imbalance() < before * 0.7, (before, imbalance())


def test_aux_loss_is_positive_and_differentiable():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(aux_loss_coef=0.01)
    model = MoETransformer(cfg).train()
    model(torch.randint(0, 17, (2, 16)))
    aux = model.aux_loss()
    assert aux.item() > 0
    aux.backward()
    assert model.layers[1].mlp.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_param_count_from_config_matches_instantiated_model(preset):
    cfg = get_preset(preset)
    counts = cfg.param_counts()
    assert MoETransformer(cfg).num_params() == counts["total"]
    assert counts["active"] < counts["total"]


def test_718b_preset_counts():
    counts = get_preset("pangu-ultra-moe-718b").param_counts()
    assert 715e9 < counts["total"] < 722e9
    assert 38e9 < counts["active_non_embedding"] < 41e9


def test_checkpoint_round_trip(tmp_path):
    model = _model("tiny-mla", seed=3)
    tok = CharTokenizer.arithmetic()
    save_checkpoint(tmp_path / "ck", model, tok, {"step": 7})
    loaded, tok2, extra = load_checkpoint(tmp_path / "ck")
    assert extra == {"step": 7} and tok2.to_dict() == tok.to_dict()
    assert loaded.config == model.config
    x = torch.randint(0, 17, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)


def test_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path / "ck", _model())
    (tmp_path / "ck" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text('{"architectures": ["Qwen2MoeForCausalLM"]}')
    with pytest.raises(ValueError, match="no 'model' table"):
        load_checkpoint(tmp_path / "ck")
    save_checkpoint(tmp_path / "other", _model().__class__(get_preset("tiny").replace(d_model=64, head_dim=16)))
    (tmp_path / "ck" / "config.json").write_text((tmp_path / "other" / "config.json").read_text())
    with pytest.raises(ValueError, match="does not match its config"):
        load_checkpoint(tmp_path / "ck")
