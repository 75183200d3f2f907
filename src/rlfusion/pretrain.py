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
from rlfusion.rl.tools.calculator import CALCULATOR_ENV
from rlfusion.rl.env import EnvConfig


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
    # the share of examples written as calculator episodes (`rl/tools/calculator.py`: the call,
    # its observation — no loss there — then the answer), for a base that knows the call format;
    # the tokenizer gains the call's "[" and "]" (an `init` base's vocabulary grows by them), and
    # held-out accuracy is measured in episodes with the calculator
    calculator_share: float = 0.0
    # of those, the share that call it on every term; the others on the first k (k uniform in
    # 2 .. terms - 1) and add the rest by hand
    calculator_all_terms: float = 0.5
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
            "calculator_share": (0 <= self.calculator_share <= 1, "must be in [0, 1]"),
            "calculator_all_terms": (0 <= self.calculator_all_terms <= 1, "must be in [0, 1]"),
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
    taken on response targets only (`loss_mask_N`), never on an observation's tokens."""

    tokens_1N: torch.Tensor
    targets_N: torch.Tensor
    loss_mask_N: torch.Tensor
    packed: PackedSeqs


@dataclass(frozen=True)
class Example:
    """A prompt and its response as `(text, is_observation)` pieces."""

    prompt: str
    pieces: tuple[tuple[str, bool], ...]

    @classmethod
    def of(cls, p: Problem) -> "Example":
        return cls(p.prompt, ((p.solution, False),))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + sum(len(text) for text, _ in self.pieces) + 2  # + bos + eos


def make_batch(examples: list, tokenizer: CharTokenizer) -> PackedExamples:
    """`examples`: `Example`s (or `Problem`s: their reference solutions)."""
    tokens, targets, mask, lengths = [], [], [], []
    for e in examples:
        e = Example.of(e) if isinstance(e, Problem) else e
        prompt = encode_prompt(tokenizer, e.prompt)
        ids, learn = list(prompt), []
        for text, observed in e.pieces:
            piece = tokenizer.encode(text)
            ids += piece
            learn += [0.0 if observed else 1.0] * len(piece)
        ids.append(tokenizer.eos_id)
        tokens += ids
        targets += ids[1:] + [tokenizer.pad_id]
        mask += [0.0] * (len(prompt) - 1) + learn + [1.0, 0.0]
        lengths.append(len(ids))
    return PackedExamples(torch.tensor(tokens).unsqueeze(0), torch.tensor(targets),
                          torch.tensor(mask), PackedSeqs.from_lengths(lengths))


def _step_problems(task: ArithmeticTask, rng: random.Random, cfg: PretrainConfig,
                   step: int) -> list[list[Example]]:
    """Examples for one optimizer step, length-sorted into micro-batches of ~`microbatch_tokens`
    (sorting keeps the padded view inside attention small); `calculator_share` of them are
    calculator episodes."""
    cap = min(task.config.max_terms, cfg.curriculum_start_terms + step // cfg.curriculum_steps)
    examples, tokens = [], 0
    while tokens < cfg.tokens_per_step:
        p = task.sample(rng, max_terms=cap)
        e = Example.of(p)
        if cfg.calculator_share and rng.random() < cfg.calculator_share:
            n = p.prompt.count("+") + 1
            k = n if n == 2 or rng.random() < cfg.calculator_all_terms else rng.randint(2, n - 1)
            e = Example(p.prompt, tuple(task.solve_with_calculator(p.prompt, k)))
        examples.append(e)
        tokens += e.num_tokens
    return split_by_token_budget(examples, cfg.microbatch_tokens, size=lambda e: e.num_tokens)


def grow_vocab(model: MoETransformer, vocab_size: int) -> None:
    """Add rows to the embedding (and output head) up to `vocab_size` ids: a base whose tokenizer
    gained characters at the end keeps every id it had; the new rows start like fresh ones."""
    old = model.config.vocab_size
    embed = torch.nn.Embedding(vocab_size, model.config.d_model)
    with torch.no_grad():
        torch.nn.init.normal_(embed.weight[old:], std=0.02)  # the model's own initialisation
        embed.weight[:old] = model.embed.weight
    model.embed = embed
    if model.lm_head is not None:
        head = torch.nn.Linear(model.config.d_model, vocab_size, bias=False)
        with torch.no_grad():
            torch.nn.init.normal_(head.weight[old:], std=0.02)
            head.weight[:old] = model.lm_head.weight
        model.lm_head = head
    model.config = replace(model.config, vocab_size=vocab_size)


def pretrain(cfg: PretrainConfig, out: Path, progress: bool = True) -> PretrainResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = CharTokenizer.arithmetic_calculator() if cfg.calculator_share else CharTokenizer.arithmetic()
    env = EnvConfig(CALCULATOR_ENV) if cfg.calculator_share else None
    if cfg.init:
        model, init_tokenizer, _ = load_base(resolve_base(cfg.init, "init"), max_seq_len=cfg.context_len or None)
        alphabet = getattr(init_tokenizer, "alphabet", None)
        if alphabet is None or not tokenizer.alphabet.startswith(alphabet):
            raise ValueError(f"init={cfg.init!r} is not a base of the built-in task (its tokenizer differs); "
                             f"allowed: a checkpoint made by `rlfusion pretrain`")
        if init_tokenizer.vocab_size < tokenizer.vocab_size:
            grow_vocab(model, tokenizer.vocab_size)
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
            result = evaluate(model, tokenizer, heldout, task.reward, model.config.max_seq_len, seed=cfg.seed, env=env)
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
    final = evaluate(model, tokenizer, heldout, task.reward, model.config.max_seq_len, seed=cfg.seed, env=env)
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
