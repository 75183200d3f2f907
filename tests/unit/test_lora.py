"""LoRA adapters on the model: where they go, what trains, merging, the frozen base as reference,
and one-line errors for bad specs."""

import copy
import dataclasses

import pytest
import torch

from parallel_helpers import nudge_adapters
from rlfusion.model import lora
from rlfusion.model.config import get_preset
from rlfusion.model.transformer import MoETransformer
from rlfusion.runtime.train_config import OptimConfig

ATOL = 1e-5


def _model(preset="tiny", seed=0, **spec) -> MoETransformer:
    torch.manual_seed(seed)
    model = MoETransformer(get_preset(preset))
    return lora.attach(model, lora.LoraSpec(**{"rank": 4, "alpha": 8.0, **spec}))


def _nudge(model, seed=1):
    nudge_adapters(model, 0.05, seed)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_fresh_adapters_leave_the_model_equal_to_its_base(preset):
    torch.manual_seed(0)
    base = MoETransformer(get_preset(preset)).eval()
    adapted = lora.attach(copy.deepcopy(base), lora.LoraSpec(4, 8.0)).eval()
    tokens = torch.randint(3, 17, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(adapted(tokens), base(tokens), atol=0, rtol=0)


def test_only_adapters_train_and_every_target_gets_them():
    model = _model(targets=("attn", "mlp", "shared", "experts", "router"))
    names = [n for n, _ in lora.trained_parameters(model)]
    assert names and all(lora.is_adapter(n) for n in names)
    kinds = {"attn": ".attn.", "mlp": "mlp.gate.", "shared": ".mlp.shared.", "experts": "mlp.experts.lora_",
             "router": "mlp.router.lora_"}
    for kind, marker in kinds.items():
        assert any(marker in n for n in names), kind
    _nudge(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for _, p in lora.trained_parameters(model)], lr=1e-2)
    tokens = torch.randint(3, 17, (4, 24))
    model.train()
    model(tokens).logsumexp(-1).mean().backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(p.grad is not None for _, p in lora.trained_parameters(model))
    opt.step()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_merged_equals_unmerged_and_unmerge_restores(preset):
    model = _model(preset, targets=("attn", "mlp", "shared", "experts", "router")).eval()
    _nudge(model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(3, 17, (3, 18))
    with torch.no_grad():
        unmerged = model(tokens)
        # the decode path (few tokens: every expert batched) as well as the sorted one
        decode = model(tokens[:, :2])
        lora.merge(model)
        torch.testing.assert_close(model(tokens), unmerged, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(tokens[:, :2]), decode, atol=ATOL, rtol=0)
        lora.unmerge(model)
        torch.testing.assert_close(model(tokens), unmerged, atol=ATOL, rtol=0)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, base[k], atol=1e-6, rtol=0)
        # the merged state in a plain model (an export, a merged replica) gives the same logits
        torch.manual_seed(5)
        plain = MoETransformer(get_preset(preset)).eval()
        plain.load_state_dict(lora.merged_state(model))
        torch.testing.assert_close(plain(tokens), unmerged, atol=ATOL, rtol=0)


def test_base_only_is_the_base_in_this_thread():
    torch.manual_seed(0)
    base = MoETransformer(get_preset("tiny")).eval()
    model = lora.attach(copy.deepcopy(base), lora.LoraSpec(4, 8.0)).eval()
    _nudge(model)
    tokens = torch.randint(3, 17, (2, 16))
    with torch.no_grad():
        assert (model(tokens) - base(tokens)).abs().max() > 1e-3
        with lora.base_only():
            torch.testing.assert_close(model(tokens), base(tokens), atol=0, rtol=0)
        assert lora.active()


def test_every_process_draws_the_same_adapters():
    a, b = _model(seed=0), _model(seed=3)  # (other base weights, same adapter seed)
    for (na, ta), (nb, tb) in zip(lora.adapter_state(a).items(), lora.adapter_state(b).items()):
        assert na == nb and torch.equal(ta, tb)


@pytest.mark.parametrize("spec,message", [
    (dict(rank=200, targets=("attn", "experts")), "optim.lora_rank=200 is larger than the smallest targeted layer's side (64)"),
    (dict(targets=("shared",)), "names 'shared' (shared experts), which this model does not have"),
    (dict(targets=("bogus",)), "unknown target bogus"),
])
def test_bad_specs_are_one_line(spec, message):
    torch.manual_seed(0)
    model = MoETransformer(dataclasses.replace(get_preset("tiny"), num_shared_experts=0))
    with pytest.raises(ValueError) as e:
        lora.attach(model, lora.LoraSpec(**{"rank": 4, "alpha": 8.0, **spec}))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="optim.lora_targets"):
        OptimConfig(lora_rank=4, lora_targets="attn,heads")
    with pytest.raises(ValueError, match="optim.lora_rollout"):
        OptimConfig(lora_rank=4, lora_rollout="fused")
    assert OptimConfig(lora_rank=8).lora_spec(3) == lora.LoraSpec(8, 32.0, (), 3)
    assert OptimConfig(lora_rank=8, lora_targets="attn,router").lora_spec(3).targets == ("attn", "router")


def test_default_targets_are_those_the_model_has():
    torch.manual_seed(0)
    dense = MoETransformer(dataclasses.replace(get_preset("tiny"), num_dense_layers=4))
    assert lora.spec_of(lora.attach(dense, lora.LoraSpec(4, 8.0))).targets == ("attn", "mlp")
    assert lora.spec_of(_model()).targets == ("attn", "mlp", "shared", "experts")
    assert OptimConfig().lora_spec(0) is None


@pytest.mark.parametrize("over, match", [
    ("optim.router_bias_update=true", "is invalid with optim.router_bias_update=true"),
    ("optim.expert_balance=true deploy.train_ep=2 deploy.num_devices=2", "is invalid with optim.expert_balance=true"),
    ("algo.advantage=gae", "is invalid with algo.advantage=gae"),
    ("rollout.backend=vllm", "is invalid with rollout.backend=vllm"),
])
def test_combinations_lora_cannot_run_are_one_line(over, match):
    from rlfusion.config import load_config
    from rlfusion.runtime.train_config import TrainConfig

    with pytest.raises(ValueError, match=match) as e:
        load_config(TrainConfig, None, ["optim.lora_rank=8", *over.split()])
    assert "\n" not in str(e.value) and str(e.value).startswith("optim.lora_rank=8 ")


def test_a_rank_the_base_cannot_take_is_refused_before_any_device_starts(tmp_path):
    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import find_base
    from rlfusion.runtime.train_config import TrainConfig
    from rlfusion.runtime.trainer import RLTrainer

    cfg = load_config(TrainConfig, None, [f'out_dir="{tmp_path}"', "optim.lora_rank=100"])
    with pytest.raises(ValueError, match=r"optim.lora_rank=100 is larger than the smallest targeted layer's side"):
        RLTrainer(cfg, tmp_path / "run", find_base())


def test_where_adapters_are_merged_for_the_rollout():
    from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan, lora_merged

    plain = DeploymentPlan.build(DeployConfig(mode="colocated", num_devices=2, backend="ray"))
    layout = DeploymentPlan.build(DeployConfig(mode="colocated", num_devices=2, backend="ray", train_tp=2))
    separated = DeploymentPlan.build(DeployConfig(mode="separated", num_devices=2, backend="ray"))
    assert [lora_merged(plain, d, "auto") for d in (0, 1)] == [False, False]  # the trained model: exact
    assert [lora_merged(plain, d, "merged") for d in (0, 1)] == [True, True]
    assert [lora_merged(layout, d, "auto") for d in (0, 1)] == [True, True]  # the refilled replicas
    assert [lora_merged(separated, d, "auto") for d in (0, 1)] == [True, False]  # the rollout device only
    assert not any(lora_merged(p, d, "unmerged") for p in (plain, layout, separated) for d in (0, 1))


def test_a_lora_checkpoint_loads_on_its_base_and_serves_as_a_base_folded(tmp_path):
    """The checkpoint holds the adapters only and loads them onto its base (at the context length
    it was saved with); read as a base (`load_base`), it is the plain merged model, which a new
    run can adapt again."""
    from rlfusion.model.checkpoint import ADAPTERS, WEIGHTS, load_base, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    base = MoETransformer(dataclasses.replace(get_preset("tiny"), max_seq_len=96))
    save_checkpoint(tmp_path / "base", base)
    model = lora.attach(load_base(tmp_path / "base", max_seq_len=128)[0], lora.LoraSpec(4, 8.0), base=tmp_path / "base")
    _nudge(model)
    save_checkpoint(tmp_path / "run", model.eval())
    assert (tmp_path / "run" / ADAPTERS).is_file() and not (tmp_path / "run" / WEIGHTS).exists()
    loaded = load_checkpoint(tmp_path / "run")[0].eval()
    assert loaded.config.max_seq_len == 128 and lora.spec_of(loaded).rank == 4
    tokens = torch.randint(3, 17, (2, 20))
    with torch.no_grad():
        want = model(tokens)
        torch.testing.assert_close(loaded(tokens), want, atol=0, rtol=0)
        as_base = load_base(tmp_path / "run")[0].eval()
        assert lora.spec_of(as_base) is None and not any(lora.is_adapter(k) for k in as_base.state_dict())
        torch.testing.assert_close(as_base(tokens), want, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.attach(loaded, lora.LoraSpec(4, 8.0))
    lora.attach(as_base, lora.LoraSpec(2, 4.0), base=tmp_path / "run")  # a new run on the merged model
    # the base changed under the adapters: refused in one line
    torch.manual_seed(1)
    save_checkpoint(tmp_path / "base", MoETransformer(dataclasses.replace(get_preset("tiny"), max_seq_len=96)))
    with pytest.raises(ValueError, match=r"the adapters were trained on base .* but this base .* holds other weights"):
        load_checkpoint(tmp_path / "run")


def test_merging_twice_raises():
    model = _model().eval()
    lora.merge(model)
    with pytest.raises(RuntimeError, match="already merged"):
        lora.merge(model)
    with pytest.raises(RuntimeError, match="would add them twice"):
        lora.merged_state(model)
    lora.unmerge(model)
    with pytest.raises(RuntimeError, match="already unmerged"):
        lora.unmerge(model)


def test_lora_keys_without_a_rank_are_one_line():
    from rlfusion.config import load_config
    from rlfusion.runtime.train_config import TrainConfig

    for over in ("optim.lora_rollout=merged", "optim.lora_rollout=unmerged", "optim.lora_targets=attn"):
        with pytest.raises(ValueError, match=r"invalid with optim.lora_rank=0"):
            load_config(TrainConfig, None, [over])


@pytest.mark.parametrize("drop, field", [("fingerprint", "'fingerprint'"), ("base", "'base'"), ("rank", "rank")])
def test_a_lora_table_missing_a_field_is_one_line(tmp_path, drop, field):
    from rlfusion.model.checkpoint import lora_spec_of

    info = {"rank": 4, "alpha": 8.0, "targets": ["attn"], "seed": 0, "base": "/b", "fingerprint": "f"}
    with pytest.raises(ValueError, match="bad 'lora' table") as e:
        lora_spec_of({k: v for k, v in info.items() if k != drop}, tmp_path / "config.json")
    assert field in str(e.value) and "\n" not in str(e.value)
    assert lora_spec_of(info, tmp_path / "config.json").rank == 4
