"""Supervised pretraining of the tiny base model on the built-in task, on CPU, in minutes.

Learning on this task has a phase change whose timing depends on the seed (measured over seeds on 2 cores), so
the stage stops on a *measured* held-out accuracy (`target_accuracy`) rather than a fixed step
count, with a wall-clock budget as the backstop. A curriculum over the number of terms starts
on short problems, where the carry rules are learned fastest. The checkpoint is written at the
end (and whenever held-out accuracy improves), so an interrupted run keeps its best model.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from rlfusion.config import check_fields
from rlfusion.errors import RunError
from rlfusion.evaluate import EvalResult, encode_prompt, evaluate
from rlfusion.model.checkpoint import load_base, resolve_base, save_checkpoint
from rlfusion.model.config import ModelConfig, get_preset
from rlfusion.model.kv_cache import PackedSeqs
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import split_by_token_budget
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


@dataclass(frozen=True)
class PretrainConfig:
    model: str = "tiny"
    out: str = ""  # checkpoint folder; empty = the default base-model cache
    seed: int = 0
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    tokens_per_step: int = 2048  # more, smaller steps reached the phase change on fewer tokens
    microbatch_tokens: int = 4096  # >= tokens_per_step: one packed micro-batch per step
    time_budget_s: float = 600.0  # backstop; the stop is target_accuracy (~6 min for seed 0)
    max_steps: int = 0  # 0 = no step limit (time budget and target accuracy decide)
    target_accuracy: float = 0.45  # stop once greedy held-out accuracy reaches this
    eval_every_steps: int = 40
    # Held-out evals start once the loss EMA is below this: before the phase change the model
    # cannot add yet (accuracy ~0) and its greedy outputs often run to the length limit, so
    # evaluating it only costs time.
    eval_below_loss: float = 0.25
    eval_problems: int = 200
    curriculum_start_terms: int = 3  # max terms at step 0; +1 every `curriculum_steps`
    curriculum_steps: int = 25
    threads: int = 0  # torch threads; 0 = leave as is
    context_len: int = 0  # the model's context (prompt + response); 0 = the preset's (or init's)
    # a checkpoint to continue from ("" = random weights of `model`'s preset), e.g. the shipped
    # base on a longer variant of its task; the name of a shipped base works too
    init: str = ""
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig)

    def __post_init__(self) -> None:
        check_fields("pretrain", {
            "lr": (self.lr > 0, "must be > 0"),
            "warmup_steps": (self.warmup_steps >= 1, "must be >= 1"),
            "weight_decay": (self.weight_decay >= 0, "must be >= 0"),
            "grad_clip": (self.grad_clip > 0, "must be > 0"),
            "curriculum_steps": (self.curriculum_steps >= 1, "must be >= 1"),
            "tokens_per_step": (self.tokens_per_step >= 64, "must be >= 64"),
            "microbatch_tokens": (self.microbatch_tokens >= 64, "must be >= 64"),
            "time_budget_s": (self.time_budget_s > 0, "must be > 0"),
            "max_steps": (self.max_steps >= 0, "must be >= 0 (0 = no limit)"),
            "target_accuracy": (0 < self.target_accuracy <= 1, "must be in (0, 1]"),
            "eval_every_steps": (self.eval_every_steps >= 1, "must be >= 1"),
            "eval_below_loss": (self.eval_below_loss > 0, "must be > 0"),
            "eval_problems": (1 <= self.eval_problems <= self.task.num_heldout,
                              f"must be in [1, task.num_heldout={self.task.num_heldout}]"),
            "curriculum_start_terms": (self.task.min_terms <= self.curriculum_start_terms,
                                       f"must be >= task.min_terms={self.task.min_terms}"),
            "context_len": (self.context_len == 0 or self.context_len >= 64, "must be 0 (the preset's) or >= 64"),
        }, self)
        self.model_config()

    def model_config(self) -> ModelConfig:
        preset = get_preset(self.model)
        return replace(preset, max_seq_len=self.context_len) if self.context_len else preset


@dataclass
class PretrainResult:
    path: Path
    steps: int
    seconds: float
    tokens: int
    eval: EvalResult
    history: list[dict]


@dataclass
class PackedExamples:
    """Supervised examples concatenated with no padding (`tokens_1N` + `cu_seqlens`); the loss is
    taken on response targets only (`loss_mask_N`)."""

    tokens_1N: torch.Tensor
    targets_N: torch.Tensor
    loss_mask_N: torch.Tensor
    packed: PackedSeqs


def make_batch(problems: list[Problem], tokenizer: CharTokenizer) -> PackedExamples:
    tokens, targets, mask, lengths = [], [], [], []
    for p in problems:
        prompt = encode_prompt(tokenizer, p.prompt)
        ids = prompt + tokenizer.encode(p.solution) + [tokenizer.eos_id]
        tokens += ids
        targets += ids[1:] + [tokenizer.pad_id]
        mask += [0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt)) + [0.0]
        lengths.append(len(ids))
    return PackedExamples(torch.tensor(tokens).unsqueeze(0), torch.tensor(targets),
                          torch.tensor(mask), PackedSeqs.from_lengths(lengths))


def _step_problems(task: ArithmeticTask, rng: random.Random, cfg: PretrainConfig,
                   step: int) -> list[list[Problem]]:
    """Problems for one optimizer step, length-sorted into micro-batches of ~`microbatch_tokens`
    (sorting keeps the padded view inside attention small)."""
    cap = min(task.config.max_terms, cfg.curriculum_start_terms + step // cfg.curriculum_steps)
    problems, tokens = [], 0
    while tokens < cfg.tokens_per_step:
        p = task.sample(rng, max_terms=cap)
        problems.append(p)
        tokens += _num_tokens(p)
    return split_by_token_budget(problems, cfg.microbatch_tokens, size=_num_tokens)


def _num_tokens(p: Problem) -> int:
    return len(p.prompt) + len(p.solution) + 2  # + bos + eos


def pretrain(cfg: PretrainConfig, out: Path, progress: bool = True) -> PretrainResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = CharTokenizer.arithmetic()
    if cfg.init:
        model, init_tokenizer, _ = load_base(resolve_base(cfg.init, "init"), max_seq_len=cfg.context_len or None)
        if init_tokenizer is None or init_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"init={cfg.init!r} is not a base of the built-in task (its tokenizer differs); "
                             f"allowed: a checkpoint made by `rlfusion pretrain`")
    else:
        model = MoETransformer(cfg.model_config())
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model {cfg.model!r} has vocab_size {model.config.vocab_size} < the "
                         f"tokenizer's {tokenizer.vocab_size}")
    task = ArithmeticTask(cfg.task)
    heldout = task.heldout()[:cfg.eval_problems]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    start, step, tokens, history = time.monotonic(), 0, 0, []
    best = EvalResult(0.0, 0, 0.0)
    bar = tqdm(total=round(cfg.time_budget_s), unit="s", disable=not progress,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s [{elapsed}<{remaining}] {postfix}")
    loss_avg = math.nan
    while time.monotonic() - start < cfg.time_budget_s and not (cfg.max_steps and step >= cfg.max_steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, n = _train_step(model, opt, _step_problems(task, rng, cfg, step), tokenizer, cfg)
        model.update_router_bias()
        step, tokens = step + 1, tokens + n
        loss_avg = loss if math.isnan(loss_avg) else 0.9 * loss_avg + 0.1 * loss
        if not math.isfinite(loss):
            raise RunError(f"pretraining loss became {loss} at step {step}; lower the learning rate, lr= "
                           f"(now {cfg.lr}); the best checkpoint so far is kept in {out}")
        if step % cfg.eval_every_steps == 0 and loss_avg < cfg.eval_below_loss:
            result = evaluate(model, tokenizer, heldout, task.reward, model.config.max_seq_len, seed=cfg.seed)
            history.append({"step": step, "seconds": time.monotonic() - start,
                            "loss": loss_avg, "accuracy": result.accuracy})
            if result.accuracy > best.accuracy:
                best = result
                save_checkpoint(out, model, tokenizer, {"pretrain_step": step, "task": asdict(cfg.task), "init": cfg.init,
                                                        "heldout_accuracy": result.accuracy})
            if result.accuracy >= cfg.target_accuracy:
                break
        bar.set_postfix_str(f"step {step} loss {loss_avg:.3f} acc {best.accuracy:.1%}")
        bar.update(min(round(time.monotonic() - start), bar.total) - bar.n)
    bar.close()
    seconds = time.monotonic() - start
    final = evaluate(model, tokenizer, heldout, task.reward, model.config.max_seq_len, seed=cfg.seed)
    if final.accuracy >= best.accuracy:
        best = final
        save_checkpoint(out, model, tokenizer, {"pretrain_step": step, "task": asdict(cfg.task), "init": cfg.init,
                                                "heldout_accuracy": final.accuracy})
    return PretrainResult(out, step, seconds, tokens, best, history)


def _train_step(model, opt, micro_batches, tokenizer, cfg) -> tuple[float, int]:
    model.train()
    opt.zero_grad(set_to_none=True)
    batches = [make_batch(mb, tokenizer) for mb in micro_batches]
    num_targets = sum(float(b.loss_mask_N.sum()) for b in batches)
    total = 0.0
    for b in batches:
        logits_NV = model(b.tokens_1N, packed=b.packed)[0].float()
        nll_N = torch.nn.functional.cross_entropy(logits_NV, b.targets_N, reduction="none")
        share = float(b.loss_mask_N.sum()) / num_targets
        loss = (nll_N * b.loss_mask_N).sum() / num_targets + model.aux_loss() * share
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return total, sum(b.tokens_1N.numel() for b in batches)
