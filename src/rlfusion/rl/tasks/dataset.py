"""A task backed by a prompt set on disk, and `make_task`: the one place a run's task is chosen.

Owns turning loaded rows into the text the model sees (prompt template, system prompt, the
tokenizer's chat template), the check that every prompt leaves room for the response in the
model's context, the train / held-out split and grading by the configured verifier. Has the
same methods as `ArithmeticTask` (`sample`, `heldout`, `reward`), so the RL loop and
evaluation do not know which one they run.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace

from rlfusion.model.tokenizer import Tokenizer
from rlfusion.rl.datasets import DataConfig, load_problems
from rlfusion.rl.problem import Problem
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from rlfusion.rl.verifiers import VERIFIERS, math_reward


class DatasetTask:
    """Problems of `cfg.path`, shuffled once with `cfg.seed`; the last `num_heldout` are held out."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer | None = None,
                 max_prompt_tokens: int | None = None) -> None:
        self.config = cfg
        self.verifier = VERIFIERS[cfg.verifier]
        if cfg.verifier == "math":
            self.verifier = functools.partial(math_reward, fallback=cfg.math_fallback)
        loaded = load_problems(cfg)
        problems = [(where, replace(p, prompt=render_prompt(p.prompt, cfg, tokenizer)))
                    for where, p in loaded]
        if tokenizer is not None:  # a prompt the tokenizer cannot encode fails here, not mid-run
            # 1 + : the BOS the rollout puts first
            lengths = [1 + len(_encode(tokenizer, p.prompt, raw.prompt, where, cfg))
                       for (where, raw), (_, p) in zip(loaded, problems)]
            if max_prompt_tokens is not None:
                problems = _fit_context(problems, lengths, max_prompt_tokens, cfg)
        if len(problems) <= cfg.num_heldout:
            raise ValueError(f"data.num_heldout={cfg.num_heldout} is invalid: {cfg.path} has "
                             f"{len(problems)} usable rows; hold out fewer so some remain to train on")
        order = list(range(len(problems)))
        random.Random(f"data:{cfg.seed}").shuffle(order)
        split = len(order) - cfg.num_heldout
        self._train = [problems[i][1] for i in order[:split]]
        self._heldout = [problems[i][1] for i in order[split:]]

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)

    def train_problems(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def reward(self, response: str, problem: Problem) -> float:
        return self.verifier(response, problem.answer)


def render_prompt(prompt: str, cfg: DataConfig, tokenizer: Tokenizer | None) -> str:
    """The text the model is given: the template around the prompt, then the system prompt and
    chat template (or, without a chat template, the system prompt as a first paragraph)."""
    text = cfg.prompt_template.replace("{prompt}", prompt)
    if not cfg.chat_template:
        return f"{cfg.system_prompt}\n\n{text}" if cfg.system_prompt else text
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(f"data.chat_template=true needs an HF tokenizer with a chat template; the "
                         f"base model's tokenizer is {type(tokenizer).__name__}")
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}])


def _encode(tokenizer: Tokenizer, text: str, row_prompt: str, where: str, cfg: DataConfig) -> list[int]:
    """`tokenizer.encode(text)`, with a failure blamed on the row or config string it came from."""
    try:
        return tokenizer.encode(text)
    except ValueError as e:
        bad = next((ch for ch in text if not _encodes(tokenizer, ch)), None)
        if bad is None:
            raise ValueError(f"{where}: the tokenizer cannot encode the prompt ({e})") from None
        source = (f"{where}: prompt" if bad in row_prompt else
                  "data.system_prompt" if bad in cfg.system_prompt else
                  "data.prompt_template" if bad in cfg.prompt_template else "the chat template")
        alphabet = getattr(tokenizer, "alphabet", None)
        allowed = f"; allowed: {alphabet!r}" if alphabet else ""
        raise ValueError(f"{source} has character {bad!r} the tokenizer does not know{allowed}") from None


def _encodes(tokenizer: Tokenizer, ch: str) -> bool:
    try:
        tokenizer.encode(ch)
    except ValueError:
        return False
    return True


def _fit_context(problems: list[tuple[str, Problem]], lengths: list[int], limit: int,
                 cfg: DataConfig) -> list[tuple[str, Problem]]:
    kept = []
    for (where, p), n in zip(problems, lengths):
        if n <= limit:
            kept.append((where, p))
        elif cfg.long_prompts == "error":
            raise ValueError(f"{where}: prompt is {n} tokens but only {limit} fit (model max_seq_len "
                             f"minus rollout.max_new_tokens); set data.long_prompts=drop to skip "
                             f"such rows, or lower rollout.max_new_tokens")
    if not kept:
        raise ValueError(f"{cfg.path}: no prompt fits in {limit} tokens (model max_seq_len minus "
                         f"rollout.max_new_tokens)")
    return kept


def make_task(task: ArithmeticConfig, data: DataConfig, tokenizer: Tokenizer | None = None,
              max_prompt_tokens: int | None = None) -> ArithmeticTask | DatasetTask:
    """The run's task: the prompt set of `data.path`, else the built-in arithmetic task."""
    if not data.path:
        return ArithmeticTask(task)
    return DatasetTask(data, tokenizer, max_prompt_tokens)
