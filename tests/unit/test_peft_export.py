"""`rlfusion export-hf` of a LoRA checkpoint (model/peft_export.py): the merged Hugging Face
folder, and the PEFT adapters loaded on their exported base, compute the adapted model's logits."""

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from hf_helpers import make_hf_model  # noqa: E402
from parallel_helpers import nudge_adapters  # noqa: E402
from rlfusion.cli import main  # noqa: E402
from rlfusion.model import lora  # noqa: E402
from rlfusion.model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from rlfusion.model.config import get_preset  # noqa: E402
from rlfusion.model.hf import load_hf, read_safetensors, save_hf  # noqa: E402
from rlfusion.model.tokenizer import CharTokenizer  # noqa: E402
from rlfusion.model.transformer import MoETransformer  # noqa: E402

ATOL = 1e-5  # float32


def _tiny_base(path):
    """The native tiny preset (exports as Qwen2-MoE with no shared-expert gate: a doubled shared
    down projection; a folded routed_scaling_factor), saved as an rlfusion checkpoint."""
    torch.manual_seed(0)
    model = MoETransformer(get_preset("tiny").replace(routed_scaling_factor=2.5)).eval()
    with torch.no_grad():  # larger weights than the init: decisive routing, far-from-uniform logits
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    save_checkpoint(path, model, CharTokenizer.arithmetic())
    return model, CharTokenizer.arithmetic()


def _hf_base(family, path):
    """A random tiny HF model of `family` (tests/hf_helpers.py), the base as an HF folder."""
    make_hf_model(family, path)
    model, tok, _ = load_hf(path)
    return model, tok


def _nudge(model, seed=1):
    nudge_adapters(model, 0.2, seed)


@pytest.mark.parametrize("base", ["tiny", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_lora_export_merged_and_peft_match_ours(base, tmp_path):
    import transformers
    from peft import AutoPeftModelForCausalLM, PeftModel, get_peft_model_state_dict

    model, tok = _tiny_base(tmp_path / "base") if base == "tiny" else _hf_base(base, tmp_path / "base")
    targets = tuple(t for t in lora.TARGETS if t != "shared" or base != "qwen3_moe")  # qwen3_moe: none
    lora.attach(model, lora.LoraSpec(rank=4, alpha=6.0, targets=targets), base=tmp_path / "base")
    _nudge(model)
    save_checkpoint(tmp_path / "ckpt", model, tok)
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0

    ours, _, _ = load_checkpoint(tmp_path / "ckpt")
    ours.eval()
    tokens_BT = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    peft_dir = tmp_path / "out" / "peft"
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with warnings.catch_warnings():  # PEFT warns that rank_pattern matched no target *module*; it
        warnings.simplefilter("ignore")  # applies to the fused experts' target *parameter* (checked below)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(peft_dir / "base")
        hf_peft = PeftModel.from_pretrained(hf_base, peft_dir).eval()
        hf_auto = AutoPeftModelForCausalLM.from_pretrained(peft_dir).eval()  # base_model_name_or_path
    with torch.no_grad():
        adapted = ours(tokens_BT)
        with lora.base_only():
            unadapted = ours(tokens_BT)
        merged = MoETransformer.of_state(ours.config, lora.merged_state(ours)).eval()(tokens_BT)
        got = {"merged": merged, "hf merged": hf_merged(input_ids=tokens_BT).logits,
               "peft": hf_peft(input_ids=tokens_BT).logits, "auto peft": hf_auto(input_ids=tokens_BT).logits}
    assert (adapted - unadapted).abs().max() > 1e-3  # the adapters change the function
    assert adapted.abs().max() > 1.0
    for what, logits in got.items():
        torch.testing.assert_close(logits, adapted, atol=ATOL, rtol=0, msg=what)

    # every tensor written is one PEFT has, and it holds it as written
    written = load_file(peft_dir / "adapter_model.safetensors")
    held = get_peft_model_state_dict(hf_peft)
    assert sorted(written) == sorted(held)
    for name, t in written.items():
        torch.testing.assert_close(held[name], t, atol=0, rtol=0, msg=name)
    if "experts" in targets:
        experts = hf_peft.base_model.model.model.layers[-1].mlp.experts
        assert experts.base_layer.r["default"] == 8 and experts.base_layer.scaling["default"] == 1.5
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((peft_dir / "base").resolve())


def test_checkpoint_without_adapters_exports_as_before(tmp_path):
    model, tok = _tiny_base(tmp_path / "ckpt")
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    save_hf(model, tmp_path / "direct", tok)
    out, direct = tmp_path / "out", tmp_path / "direct"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in direct.iterdir())
    assert not (out / "peft").exists()
    exported, expected = read_safetensors(out), read_safetensors(direct)
    assert sorted(exported) == sorted(expected)
    for name, t in expected.items():
        torch.testing.assert_close(exported[name], t, atol=0, rtol=0, msg=name)
