"""Unreadable or mismatched model and tokenizer files end an `rlfusion` command with exit code 2
and one stderr line naming the file and what is wrong, never a traceback (model/checkpoint.py
reads every model file; model/hf.py and model/hf_tokenizer.py name what does not fit)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlfusion import cli
from rlfusion.model.files import load_weights_into
from rlfusion.model.config import ModelConfig, get_preset
from rlfusion.model.hf import config_from_hf
from rlfusion.model.transformer import MoETransformer

pytest.importorskip("tokenizers")

BASE_TINY = Path(cli.__file__).parent / "assets" / "base-tiny"
HF_VOCAB = 320  # hf_helpers' tokenizer has 259 ids


# ---- running the CLI -----------------------------------------------------------------------

def _commands(ckpt: Path, tmp: Path) -> dict[str, list[str]]:
    train = [f"base={ckpt}", "deploy.backend=local", "max_steps=1", "eval_problems=2",
             "rollout.prompts_per_step=2", "rollout.group_size=2", f"out_dir={tmp / 'runs'}"]
    return {"eval": ["eval", "--ckpt", str(ckpt), "--n", "2"],
            "export-hf": ["export-hf", str(ckpt), str(tmp / "exported")],
            "train": ["train", *train]}


def _fails_in_one_line(capsys, argv: list[str], names: Path, *says: str) -> str:
    capsys.readouterr()
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"rlfusion {argv[0]}: error: ") and str(names) in lines[0], lines[0]
    for text in says:
        assert text in lines[0], lines[0]
    return lines[0]


# ---- rlfusion checkpoints ------------------------------------------------------------------

def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _edit_config(ckpt: Path, edit) -> None:
    meta = json.loads((ckpt / "config.json").read_text())
    edit(meta)
    (ckpt / "config.json").write_text(json.dumps(meta))


def _edit_weights(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def _widen(tensors: dict, name: str) -> None:
    rows, cols = tensors[name].shape
    tensors[name] = torch.zeros(rows, cols + 1)


# name -> (corrupt the checkpoint folder, the file the error names, what the error says)
CHECKPOINT_DEFECTS = {
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors"),
                          "model.safetensors", "not a readable safetensors file"),
    "pickle_as_weights": (lambda d: torch.save({"embed.weight": torch.zeros(2)}, d / "model.safetensors"),
                          "model.safetensors", "not a readable safetensors file"),
    "config_not_utf8": (lambda d: (d / "config.json").write_bytes(b'{"model": "\xff\xfe"}'),
                        "config.json", "not UTF-8"),
    "config_truncated": (lambda d: _truncate(d / "config.json"), "config.json", "not valid JSON"),
    "config_bad_value": (lambda d: _edit_config(d, lambda m: m["model"].update(num_heads="four")),
                         "config.json", "bad model config"),
    "weights_wrong_shape": (lambda d: _edit_weights(d / "model.safetensors", lambda t: _widen(t, "embed.weight")),
                            "model.safetensors", "tensor 'embed.weight' has shape [17, 129]"),
    "weights_missing_tensor": (lambda d: _edit_weights(d / "model.safetensors", lambda t: t.pop("norm.weight")),
                               "model.safetensors", "'norm.weight'"),
    "tokenizer_corrupt": (lambda d: _edit_config(d, lambda m: m.update(
        tokenizer={"kind": "hf", "tokenizer_json": '{"model": ', "special": {}})),
                          "config.json", "not a valid HF tokenizer"),
    "tokenizer_unknown_kind": (lambda d: _edit_config(d, lambda m: m.update(tokenizer={"kind": "bpe"})),
                               "config.json", "kind='bpe'"),
    "tokenizer_bigger_than_model": (lambda d: _edit_config(d, lambda m: m.update(
        tokenizer={"kind": "char", "alphabet": "abcdefghijklmnopqrstuvwxyz"})),
                                    "config.json", "vocab_size is 17"),
}


@pytest.mark.parametrize("defect", sorted(CHECKPOINT_DEFECTS))
def test_bad_rlfusion_checkpoint_fails_each_command_in_one_line(defect, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(BASE_TINY, ckpt)
    corrupt, file, says = CHECKPOINT_DEFECTS[defect]
    corrupt(ckpt)
    for argv in _commands(ckpt, tmp_path).values():
        _fails_in_one_line(capsys, argv, ckpt / file, says)


# ---- Hugging Face folders ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny llama folder written by `save_hf` (no transformers needed) with a BPE tokenizer."""
    from hf_helpers import make_tokenizer
    from rlfusion.model.hf import save_hf

    cfg = ModelConfig(vocab_size=HF_VOCAB, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, num_dense_layers=1, dense_ffn_dim=64, num_experts=0, top_k=0,
                      expert_ffn_dim=0, num_shared_experts=0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    save_hf(MoETransformer(cfg), path, family="llama")
    make_tokenizer(path)
    return path


def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _shard(d: Path, index: dict) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


HF_DEFECTS = {
    "truncated_weights": (lambda d: _truncate(d / "model.safetensors"),
                          "model.safetensors", "not a readable safetensors file"),
    "pickle_as_weights": (lambda d: torch.save({"lm_head.weight": torch.zeros(2)}, d / "model.safetensors"),
                          "model.safetensors", "not a readable safetensors file"),
    "config_not_utf8": (lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xc3("}'),
                        "config.json", "not UTF-8"),
    "config_truncated": (lambda d: _truncate(d / "config.json"), "config.json", "not valid JSON"),
    "config_missing_field": (lambda d: _edit_json(d / "config.json", lambda c: c.pop("hidden_size")),
                             "config.json", "'hidden_size' is missing"),
    "rope_scaling_beside_rope_parameters": (
        lambda d: _edit_json(d / "config.json", lambda c: c.update(
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            rope_scaling={"type": "linear", "factor": 4.0})),
        "config.json", "rope_scaling.type='linear' is not supported"),
    "embed_wrong_shape": (lambda d: _edit_weights(d / "model.safetensors",
                                                  lambda t: _widen(t, "model.embed_tokens.weight")),
                          "model.safetensors", "'model.embed_tokens.weight' has shape [320, 33]"),
    "tokenizer_truncated": (lambda d: _truncate(d / "tokenizer.json"),
                            "tokenizer.json", "not a valid HF tokenizer"),
    "tokenizer_json_not_a_tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"vocab": [1, 2]}'),
                                       "tokenizer.json", "not a valid HF tokenizer"),
    "tokenizer_config_truncated": (lambda d: _truncate(d / "tokenizer_config.json"),
                                   "tokenizer_config.json", "not valid JSON"),
    "tokenizer_config_unknown_eos": (lambda d: _edit_json(d / "tokenizer_config.json",
                                                          lambda c: c.update(eos_token="</s>")),
                                     "tokenizer_config.json", "eos_token='</s>' is not in the vocabulary"),
    "shard_index_without_weight_map": (lambda d: _shard(d, {"metadata": {}}),
                                       "model.safetensors.index.json", "weight_map"),
}


@pytest.mark.parametrize("defect", sorted(HF_DEFECTS))
def test_bad_hf_base_fails_train_in_one_line(defect, hf_folder, tmp_path, capsys):
    base = tmp_path / "hf"
    shutil.copytree(hf_folder, base)
    corrupt, file, says = HF_DEFECTS[defect]
    corrupt(base)
    _fails_in_one_line(capsys, _commands(base, tmp_path)["train"], base / file, says)


def test_good_hf_folder_loads(hf_folder):
    """The defects above are the only thing wrong with their folders."""
    from rlfusion.model.checkpoint import load_base

    model, tokenizer, meta = load_base(hf_folder)
    assert meta["family"] == "llama" and tokenizer.vocab_size == 259


# ---- RoPE fields ---------------------------------------------------------------------------

def _llama(**fields) -> dict:
    return {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64, **fields}


@pytest.mark.parametrize("fields,theta", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, 5e5),  # transformers 5
    ({"rope_scaling": None, "rope_theta": 2e4}, 2e4),  # transformers 4
    ({"rope_scaling": {"type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 3e4}}, 3e4),
    ({"rope_scaling": {"rope_type": None}, "rope_theta": 4e4}, 4e4),
])
def test_plain_rope_fields_are_honoured(fields, theta):
    assert config_from_hf(_llama(**fields), "x/config.json").rope_theta == theta


@pytest.mark.parametrize("fields,named", [
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling.rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type='linear'"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear'"),
])
def test_rope_scaling_is_refused_by_name(fields, named):
    with pytest.raises(ValueError) as e:
        config_from_hf(_llama(**fields), "x/config.json")
    assert str(e.value).startswith(f"x/config.json: {named} is not supported") and "\n" not in str(e.value)


# ---- load_weights_into ---------------------------------------------------------------------

def test_load_weights_into_refuses_another_architecture_in_one_line():
    torch.manual_seed(0)
    tiny = get_preset("tiny")
    source = MoETransformer(tiny)
    narrower = MoETransformer(tiny.replace(d_model=64, head_dim=16))
    with pytest.raises(ValueError) as e:
        load_weights_into(narrower, source.state_dict(), "ckpt/model.safetensors")
    assert str(e.value) == ("ckpt/model.safetensors does not fit this run's model: tensor 'embed.weight' "
                            f"has shape [{tiny.vocab_size}, {tiny.d_model}], the model needs "
                            f"[{tiny.vocab_size}, 64]")
    deeper = MoETransformer(tiny.replace(num_layers=tiny.num_layers + 1))
    with pytest.raises(ValueError, match=r"^run/checkpoint does not fit this run's model: \d+ tensors "
                                         rf"are missing \(e\.g\. 'layers\.{tiny.num_layers}\.") as e:
        load_weights_into(deeper, source.state_dict(), "run/checkpoint")
    with pytest.raises(ValueError, match=r"\d+ tensors are not in the model \(e\.g\. 'layers\.") as e:
        load_weights_into(source, deeper.state_dict(), "run/checkpoint")
    assert "\n" not in str(e.value)


def test_load_weights_into_copies_matching_weights():
    torch.manual_seed(0)
    source, target = MoETransformer(get_preset("tiny")), MoETransformer(get_preset("tiny"))
    load_weights_into(target, source.state_dict(), "ckpt")
    for name, t in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], t), name
