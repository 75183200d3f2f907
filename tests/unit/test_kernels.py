"""Kernel efficiency: the useful FLOPs of a pass (`model.flops.forward_flops`), the positions the
engine's decode rows attend (its `decode_context` stat), the machine's matmul peak
(`obs.peak`) and the host-bound share (`measure.kernels`)."""

import time

import pytest
import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.measure.kernels import dispatch_floor_s, host_bound_share
from rlfusion.model.config import get_preset
from rlfusion.model.flops import attention_flops_per_position, causal_positions, forward_flops, token_matmul_flops
from rlfusion.model.moe import GroupedExperts, Router
from rlfusion.model.transformer import MoETransformer
from rlfusion.obs.peak import matmul_peak_flops
from rlfusion.runtime.trainer import _engine_metrics


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_a_tokens_matmul_flops_are_twice_the_weights_it_multiplies(preset):
    """Counted from the model's own modules: every matmul weight once (the embedding is a
    lookup), the routed experts top_k / num_experts of theirs."""
    cfg = get_preset(preset)
    model = MoETransformer(cfg)
    weights = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weights += module.weight.numel()
        elif isinstance(module, Router):
            weights += module.weight.numel()
        elif isinstance(module, GroupedExperts):
            weights += sum(p.numel() for p in module.parameters()) * cfg.top_k / cfg.num_experts
    assert token_matmul_flops(cfg) == pytest.approx(2 * weights)
    d_qk = cfg.head_dim if cfg.attention == "gqa" else cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    d_v = cfg.head_dim if cfg.attention == "gqa" else cfg.mla.v_head_dim
    assert attention_flops_per_position(cfg) == 2 * cfg.num_heads * (d_qk + d_v) * cfg.num_layers
    assert forward_flops(cfg, 3, 10) == pytest.approx(3 * 2 * weights + 10 * attention_flops_per_position(cfg))
    assert causal_positions([1, 3]) == 1 + 6


def test_the_engine_counts_the_positions_its_decode_rows_attend():
    """Prompts of 5 and 7 tokens, 4 new tokens each: prefill makes the first, three decode
    passes the rest, attending 6, 7, 8 and 8, 9, 10 positions."""
    model = MoETransformer(get_preset("tiny")).eval()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, seed=0))
    for i, n in enumerate((5, 7)):
        engine.add_request(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(temperature=1.0, max_new_tokens=4)))
    while engine.has_unfinished():
        engine.step()
    st = engine.take_stats()
    assert (st["decode_passes"], st["decode_rows"], st["decode_context"]) == (3, 6, 6 + 7 + 8 + 8 + 9 + 10)
    metrics = _engine_metrics([st], model.config)
    flops = forward_flops(model.config, 6, 48)
    assert metrics["engine_decode_gflop_per_s"] == pytest.approx(flops / st["decode_s"] / 1e9)


def test_host_bound_share_of_pure_python_and_of_a_large_matmul():
    torch.set_num_threads(1)
    floor = dispatch_floor_s()
    assert 0 < floor < 1e-4

    def python_only():
        time.sleep(0.002)

    share, wall, kernel = host_bound_share(python_only, repeats=5, floor_s=floor, rounds=1)
    assert share > 0.95 and kernel < 0.05 * wall
    a = torch.randn(512, 512)
    share, wall, kernel = host_bound_share(lambda: a @ a, repeats=10, floor_s=floor, rounds=3)
    assert share < 0.2
    # a 512 x 512 product runs at the machine's matmul peak (the same measurement)
    assert 2 * 512 ** 3 / wall == pytest.approx(matmul_peak_flops(), rel=0.5)



def test_a_run_records_its_devices_peak_and_the_share_of_it_its_passes_reach(tmp_path):
    """A local 2-step run: every step's metrics carry the device's measured matmul peak, the
    useful FLOP/s of the busiest engine's decode passes and of the update, and each one's share
    of that peak (the update's from its own rows: 3 forwards of prompt + response)."""
    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import find_base
    from rlfusion.obs.metrics import read_metrics
    from rlfusion.runtime.train_config import TrainConfig
    from rlfusion.runtime.trainer import RLTrainer

    base = find_base()
    cfg = load_config(TrainConfig, None, [
        f'base="{base}"', f'out_dir="{tmp_path}"', "run_name=k", "max_steps=2", "eval_every=100",
        "checkpoint_every=100", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=12", "threads=1", "deploy.backend=local", "collapse_patience=0"])
    RLTrainer(cfg, tmp_path / "k", base).run(progress=False)
    steps = [r for r in read_metrics(tmp_path / "k" / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 2
    for m in steps:
        peak = m["device_matmul_peak_gflop_per_s"]
        assert 1 < peak < 1e5
        assert m["engine_decode_peak_share"] == pytest.approx(m["engine_decode_gflop_per_s"] / peak, rel=1e-6)
        if m.get("kept_fraction", 0) > 0:
            assert 0 < m["update_peak_share"] < 1.5
            assert m["update_peak_share"] == pytest.approx(m["update_gflop_per_s"] / peak, rel=1e-6)
