"""Pretraining stage: the loss falls, a checkpoint is written and evaluates through the CLI."""

import torch

from rlfusion.cli import main
from rlfusion.config import load_config
import pytest

from rlfusion.model.checkpoint import load_base, load_checkpoint, resolve_base, shipped_bases
from rlfusion.pretrain import PretrainConfig, make_batch, pretrain
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.rl.problem import Problem


def test_make_batch_packs_without_padding_and_masks_only_the_response():
    tok = CharTokenizer.arithmetic()
    problems = [Problem("1+2=", "3", "1+2=3;#3"), Problem("10+5+7=", "22", "10+5=15;15+7=22;#22")]
    b = make_batch(problems, tok)
    lengths = [1 + len(p.prompt) + len(p.solution) + 1 for p in problems]  # bos ... eos
    assert b.tokens_1N.shape == (1, sum(lengths)) and b.packed.lengths.tolist() == lengths
    targets = tok.decode(b.targets_N[b.loss_mask_N.bool()].tolist(), skip_special=False)
    assert targets == "1+2=3;#3<eos>10+5=15;15+7=22;#22<eos>"


def test_short_pretraining_learns_and_saves(tmp_path, capsys):
    cfg = load_config(PretrainConfig, None, ["max_steps=60", "eval_every_steps=60", "eval_below_loss=10",
                                             "eval_problems=20", "threads=1", "tokens_per_step=1024",
                                             "microbatch_tokens=1024"])
    result = pretrain(cfg, tmp_path / "base", progress=False)
    assert result.steps == 60 and len(result.history) == 1
    assert result.history[-1]["loss"] < 2.0  # uniform over 17 tokens is ln 17 = 2.83
    model, tok, extra = load_checkpoint(tmp_path / "base")
    assert tok is not None and "heldout_accuracy" in extra
    assert main(["eval", "--ckpt", str(tmp_path / "base"), "--n", "10"]) == 0
    assert "held-out greedy accuracy" in capsys.readouterr().out


def test_pretraining_continues_from_a_shipped_base_at_a_longer_context(tmp_path):
    """`init=` starts from a checkpoint (here the shipped base, by name) and `context_len=` builds
    it at that context; the checkpoint records the task it was trained on."""
    cfg = load_config(PretrainConfig, None, ["init=tiny", "context_len=320", "task.max_terms=20", "max_steps=2",
                                             "eval_every_steps=100", "eval_problems=5", "threads=1",
                                             "tokens_per_step=512", "microbatch_tokens=512"])
    result = pretrain(cfg, tmp_path / "long", progress=False)
    model, _, extra = load_checkpoint(tmp_path / "long")
    base, _, _ = load_base(resolve_base("tiny"))
    assert result.steps == 2 and model.config.max_seq_len == 320
    assert extra["init"] == "tiny" and extra["task"]["max_terms"] == 20
    changed = [n for (n, a), b in zip(model.state_dict().items(), base.state_dict().values()) if not torch.equal(a, b)]
    assert changed  # the base's tensors, trained on


def test_shipped_bases_resolve_by_name_and_a_bad_name_is_refused(tmp_path):
    assert {"tiny", "tiny-long"} <= set(shipped_bases())
    _, _, extra = load_checkpoint(resolve_base("tiny-long"))
    # the learn workload's config trains the task its base was pretrained on
    from rlfusion.runtime.train_config import TrainConfig
    from pathlib import Path
    learn = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "configs" / "learn.toml", [])
    assert learn.base == "tiny-long"
    assert {k: extra["task"][k] for k in ("min_terms", "max_terms", "p_stop", "max_value")} == {
        "min_terms": learn.task.min_terms, "max_terms": learn.task.max_terms, "p_stop": learn.task.p_stop,
        "max_value": learn.task.max_value}
    assert resolve_base(str(tmp_path)) == tmp_path  # a folder is taken as it is
    with pytest.raises(ValueError, match="neither a checkpoint folder nor a shipped base; shipped: tiny, tiny-long"):
        resolve_base("tiny-longer")
    with pytest.raises(ValueError, match="init='nope' is neither"):
        pretrain(load_config(PretrainConfig, None, ["init=nope", "max_steps=1"]), tmp_path / "x", progress=False)


def test_pretraining_from_a_base_must_name_its_folder(tmp_path, monkeypatch, capsys):
    """The cached default base is what every run starts from: a long-context or continued base
    does not silently replace it."""
    monkeypatch.setenv("RLFUSION_CACHE", str(tmp_path))
    assert main(["pretrain", "init=tiny", "max_steps=1"]) != 0
    assert "needs out=DIR" in capsys.readouterr().err
    assert not (tmp_path / "base-tiny").exists()
