"""Pretraining stage: the loss falls, a checkpoint is written and evaluates through the CLI."""

import torch

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.model.checkpoint import load_checkpoint
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
