"""rlfusion's single-process RL loop vs TRL's `GRPOTrainer`: generated tokens/s and s per RL step.

Compared, identical on both sides:
  - the model: our tiny MoE, and on the TRL side its exact `Qwen2MoeForCausalLM` export
    (`rlfusion.model.hf_export`; logits agree to float rounding). The router's expert bias has no
    HF form, so the bench zeroes it in both copies and turns off its update
    (`bias_update_rate=0`): both sides then train the very same function;
  - the prompts: the built-in arithmetic task drawn from one seeded stream, 16 prompts per step
    in the same order on both sides (checked), each prompt `<bos>` + text;
  - sampling: group size 8, temperature 1.0, no top-p/top-k, at most 160 new tokens, stop at EOS
    (the EOS token counts as generated on both sides);
  - the reward: exact answer after '#' (`verify_arithmetic`);
  - the update: GRPO advantages (group mean / std), PPO clip 0.2, token-level loss, no KL
    (beta 0, no reference model), one AdamW step per RL step at constant lr 3e-4, grad clip 1.0,
    float32 on CPU with 2 torch threads.

TRL is run with its documented CPU settings and nothing that only costs time: `use_cpu=True`,
bf16/fp16 off, no vLLM (HF `generate`, dynamic KV cache, HF's default experts kernel),
`generation_batch_size` = 16 x 8 = 128 in one batch, then one optimizer step over 4 accumulated
micro-batches of 32 (its fastest split on this machine: 2.15 s/step vs 2.26-2.47 for 16, 64 or
128 per micro-batch), gradient checkpointing off (TRL turns it on by default; memory is no
concern here), no logging, reporting, saving, evaluation or progress bar.

What differs (each side's own design, which is what is measured):
  - generation: rlfusion's continuous-batching engine over a preallocated KV cache vs HF
    `generate` on a left-padded static batch that runs until its longest row ends;
  - training: rlfusion packs responses without padding into token-budgeted micro-batches; TRL
    pads all 128 rows to the step's longest prompt and longest completion;
  - the random streams: each side samples with its own generator, so responses (and their
    lengths) differ from step to step; tokens/s is the figure that does not depend on them.

Timing: both trainers are built once, then a warm-up step of each (not counted), then rounds of
K TRL steps followed by K rlfusion steps (the rlfusion segment runs from a TRL callback, so the
two alternate inside one process and see the same machine load). TRL's time is the wall clock
of its whole segment, from the end of the previous rlfusion segment to the end of its K-th
optimizer step; rlfusion's is the wall clock of `RLTrainer.train_step` calls.

The base model: `--base DIR`, else the pretrained base `rlfusion train` starts from
(`rlfusion.model.checkpoint.find_base`: the user's cache, then the checkpoint shipped with the package), else a
random tiny model (its rewards are all zero and its responses end at random; both sides still
generate, which is what is measured).

    python bench/vs_trl.py                   # 1 warm-up + 5 rounds x 2 steps per side
    python bench/vs_trl.py --quick           # 1 warm-up + 2 rounds x 1 step per side
    python bench/vs_trl.py --base DIR        # an rlfusion checkpoint folder
    python bench/vs_trl.py --smoke           # 1 warm-up + 1 step per side of 2 prompts x 2 samples, <= 8
                                             # tokens (a test runs it; without TRL, the rlfusion side alone)

Needs the bench extra: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlfusion.config import load_config
from rlfusion.model.checkpoint import default_base_path, find_base, load_checkpoint, save_checkpoint
from rlfusion.model.config import get_preset
from rlfusion.model.hf_export import EXTRA, hf_tokenizer, max_expert_bias, to_hf
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, verify_arithmetic
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS = 16, 8, 160
TEMPERATURE, LR, SEED, THREADS = 1.0, 3e-4, 0, 2
TRL_MICRO_BATCH = 32  # TRL's fastest of 16/32/64/128 sequences per forward/backward here


def use_smoke_sizes() -> None:
    """--smoke: 2 prompts x 2 samples of at most 8 new tokens, one TRL micro-batch. Both sides
    read the sizes above when they build, so this rebinds them before anything is built."""
    global PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS, TRL_MICRO_BATCH
    PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS, TRL_MICRO_BATCH = 2, 2, 8, 4


@dataclass
class SideStats:
    """Measured (not warm-up) steps of one side."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    rollout_s: float = 0.0
    max_len: int = 0  # longest response: a static batch decodes until it ends
    rewards: list[float] = field(default_factory=list)

    def add(self, tokens: int, seconds: float, steps: int, rollout_s: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps += steps
        self.rollout_s += rollout_s

    def merge(self, other: SideStats) -> None:
        self.add(other.tokens, other.seconds, other.steps, other.rollout_s)
        self.max_len = max(self.max_len, other.max_len)
        self.rewards += other.rewards

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def s_per_step(self) -> float:
        return self.seconds / self.steps


# ---- the shared base model -------------------------------------------------------------------

def load_base(base: str | None) -> tuple[MoETransformer, CharTokenizer, str]:
    path = Path(base) if base else find_base()
    if path is not None:
        model, tok, _ = load_checkpoint(path)
        if tok is None:
            raise ValueError(f"--base {path} has no tokenizer; use one from rlfusion pretrain")
        return model, tok, f"checkpoint {path}"
    torch.manual_seed(SEED)
    return (MoETransformer(get_preset("tiny")), CharTokenizer.arithmetic(),
            f"RANDOM tiny model (no base at {default_base_path()} nor shipped, no --base): "
            f"rewards will be zero")


def freeze_routing_bias(model: MoETransformer) -> float:
    """Zero the expert bias (HF has none) and stop its updates; returns the max |bias| dropped."""
    dropped = max_expert_bias(model)
    for router in model.routers():
        router.expert_bias.zero_()
    model.config = model.config.replace(bias_update_rate=0.0)
    return dropped


def problem_stream(num: int) -> list:
    # The same stream RLTrainer draws from: ArithmeticTask(cfg.task).sample(Random(cfg.seed)).
    task, rng = ArithmeticTask(ArithmeticConfig()), random.Random(SEED)
    return [task.sample(rng) for _ in range(num)]


# ---- rlfusion side ---------------------------------------------------------------------------

def build_rlfusion(checkpoint: Path, out_dir: Path) -> RLTrainer:
    # deploy.backend=local: the single-process loop with THREADS threads (the default deploy became
    # Ray workers on every core, 1 thread each, after this bench was written and measured)
    cfg = load_config(TrainConfig, None, [
        "deploy.backend=local", f"base='{checkpoint}'", f"out_dir='{out_dir}'", f"seed={SEED}",
        f"threads={THREADS}",
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.group_size={GROUP_SIZE}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"rollout.temperature={TEMPERATURE}",
        "algo.kl_coef=0", "algo.dynamic_sampling=false", "algo.advantage='grpo'",
        "algo.loss_agg='token'", "algo.ppo_epochs=1", "algo.minibatches=1", f"optim.lr={LR}",
    ])
    return RLTrainer(cfg, out_dir, checkpoint)


def rlfusion_steps(trainer: RLTrainer, num_steps: int, stats: SideStats | None) -> None:
    for _ in range(num_steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        if stats is not None:
            stats.add(int(m["generated_tokens"]), time.perf_counter() - t0, 1, m["time_rollout_s"])
            stats.max_len = max(stats.max_len, int(m["response_length_max"]))
            stats.rewards.append(m["reward_mean"])


# ---- TRL side --------------------------------------------------------------------------------

def build_trl(hf_model, tok: CharTokenizer, total_steps: int, out_dir: Path, callback):
    import datasets
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """Counts generated tokens and generation time; the computation is TRL's own."""

        gen_tokens, gen_seconds, max_len, prompts_seen, rewards = 0, 0.0, 0, [], []

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self.gen_seconds += time.perf_counter() - t0
            self.gen_tokens += sum(len(c) for c in completion_ids)
            self.max_len = max(self.max_len, *(len(c) for c in completion_ids))
            return completion_ids, logprobs

    def reward(prompts, completions, answer, **_):
        TimedGRPOTrainer.prompts_seen.extend(prompts[::GROUP_SIZE])
        rewards = [verify_arithmetic(c, a) for c, a in zip(completions, answer)]
        TimedGRPOTrainer.rewards.append(sum(rewards) / len(rewards))
        return rewards

    problems = problem_stream(PROMPTS_PER_STEP * total_steps)
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                          "answer": [p.answer for p in problems]})
    batch = PROMPTS_PER_STEP * GROUP_SIZE
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, seed=SEED,
        max_steps=total_steps, per_device_train_batch_size=TRL_MICRO_BATCH,
        gradient_accumulation_steps=batch // TRL_MICRO_BATCH, generation_batch_size=batch,
        num_generations=GROUP_SIZE, max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, router_aux_loss_coef=0.0,
        activation_checkpointing=False, gradient_checkpointing=False,
        shuffle_dataset=False, remove_unused_columns=False,
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(model=hf_model, reward_funcs=reward, args=args,
                               train_dataset=dataset, processing_class=hf_tokenizer(tok),
                               callbacks=[callback])
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict of metrics is noise here
    assert not trainer.model.is_activation_checkpointing
    return trainer


def make_interleaver(rlf: RLTrainer, steps_per_segment: int, trl_stats: SideStats,
                     rlf_stats: SideStats):
    """A TRL callback: after TRL's warm-up step and after every K measured TRL steps, it runs as
    many rlfusion steps, and it times TRL's segments around them."""
    from transformers import TrainerCallback

    class Interleaver(TrainerCallback):
        trainer = None  # set once the TRL trainer exists

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark, self.tokens0, self.gen0 = time.perf_counter(), 0, 0.0

        def on_step_end(self, args, state, control, **kwargs):
            assert torch.get_num_threads() == THREADS, torch.get_num_threads()
            if state.global_step == 1:  # warm-up: neither side counts it
                self.warmup_tokens = self.trainer.gen_tokens
                rlfusion_steps(rlf, 1, None)
                self.trainer.max_len = 0
            elif (state.global_step - 1) % steps_per_segment == 0:
                self.round((state.global_step - 1) // steps_per_segment)
            else:
                return  # inside a TRL segment
            self.tokens0, self.gen0 = self.trainer.gen_tokens, self.trainer.gen_seconds
            self.mark = time.perf_counter()

        def round(self, index: int) -> None:
            trl_seg, rlf_seg = SideStats(), SideStats()
            trl_seg.add(self.trainer.gen_tokens - self.tokens0, time.perf_counter() - self.mark,
                        steps_per_segment, self.trainer.gen_seconds - self.gen0)
            trl_seg.max_len, self.trainer.max_len = self.trainer.max_len, 0
            rlfusion_steps(rlf, steps_per_segment, rlf_seg)
            trl_stats.merge(trl_seg)
            rlf_stats.merge(rlf_seg)
            side = lambda s: (f"{s.tokens_per_s:5.0f} tok/s {s.s_per_step:5.2f} s/step "
                              f"max len {s.max_len:3d}")
            print(f"  round {index}: TRL {side(trl_seg)} | rlfusion {side(rlf_seg)} | ratio "
                  f"{rlf_seg.tokens_per_s / trl_seg.tokens_per_s:.2f}", flush=True)

    return Interleaver()


# ---- report ------------------------------------------------------------------------------------

def report(trl: SideStats, rlf: SideStats) -> None:
    print(f"\n{'':10} {'tokens':>8} {'steps':>6} {'s/step':>8} {'rollout s/step':>15} "
          f"{'tokens/s':>9}")
    for name, s in (("TRL", trl), ("rlfusion", rlf)):
        print(f"{name:10} {s.tokens:8d} {s.steps:6d} {s.s_per_step:8.2f} "
              f"{s.rollout_s / s.steps:15.2f} {s.tokens_per_s:9.0f}")
    print(f"tokens/s rlfusion / TRL: {rlf.tokens_per_s / trl.tokens_per_s:.2f}; "
          f"s/step TRL / rlfusion: {trl.s_per_step / rlf.s_per_step:.2f}")
    ratio = rlf.tokens_per_s / trl.tokens_per_s
    print(f"target rlfusion_vs_trl_tokens_per_s: {ratio:.2f} (goal >= 2.0)")


def run_interleaved(model: MoETransformer, tok: CharTokenizer, rounds: int, per_segment: int
                    ) -> tuple[SideStats, SideStats]:
    total_steps = 1 + rounds * per_segment
    with tempfile.TemporaryDirectory(prefix="rlf-vs-trl-") as tmp:
        checkpoint = save_checkpoint(Path(tmp) / "base", model, tok)
        rlf = build_rlfusion(checkpoint, Path(tmp) / "rlfusion")
        trl_stats, rlf_stats = SideStats(), SideStats()
        callback = make_interleaver(rlf, per_segment, trl_stats, rlf_stats)
        trainer = build_trl(to_hf(model), tok, total_steps, Path(tmp) / "trl", callback)
        callback.trainer = trainer
        trainer.train()
    assert trl_stats.tokens == trainer.gen_tokens - callback.warmup_tokens, "uncounted TRL step"
    expected = [p.prompt for p in problem_stream(PROMPTS_PER_STEP * total_steps)]
    assert trainer.prompts_seen == expected, "TRL did not see the prompts in rlfusion's order"
    mean = lambda xs: sum(xs) / len(xs)
    print(f"same prompts on both sides: {len(expected)} in the same order; reward mean over "
          f"measured steps: TRL {mean(trainer.rewards[1:]):.3f}, "
          f"rlfusion {mean(rlf_stats.rewards):.3f}")
    return trl_stats, rlf_stats


def run_rlfusion_alone(model: MoETransformer, tok: CharTokenizer, steps: int) -> SideStats:
    """The rlfusion side as `run_interleaved` builds it, without TRL: a warm-up step, then `steps`."""
    with tempfile.TemporaryDirectory(prefix="rlf-vs-trl-") as tmp:
        checkpoint = save_checkpoint(Path(tmp) / "base", model, tok)
        rlf = build_rlfusion(checkpoint, Path(tmp) / "rlfusion")
        rlfusion_steps(rlf, 1, None)
        stats = SideStats()
        rlfusion_steps(rlf, steps, stats)
    print(f"rlfusion: {stats.tokens} tokens in {stats.steps} steps, {stats.s_per_step:.2f} s/step "
          f"({stats.rollout_s / stats.steps:.2f} s rollout), {stats.tokens_per_s:.0f} tokens/s")
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step per side")
    parser.add_argument("--smoke", action="store_true", help="1 tiny step per side, in seconds; without TRL "
                        "installed, the rlfusion side alone")
    parser.add_argument("--base", default=None, help="rlfusion checkpoint folder of the base model")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
        use_smoke_sizes()
    try:
        import transformers
        import trl
    except ImportError:
        if not args.smoke:
            raise SystemExit(f"bench/vs_trl.py needs TRL and transformers: pip install -e '.[{EXTRA}]'")
        trl = None  # the smoke still checks the rlfusion side (CI has no bench extra)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(THREADS)
    rounds, per_segment = (1, 1) if args.smoke else (2, 1) if args.quick else (5, 2)

    model, tok, origin = load_base(args.base)
    dropped = freeze_routing_bias(model)
    print(f"base: {origin}; expert bias zeroed (max |bias| was {dropped:.3g}), bias updates off")
    if trl is None:
        print(f"TRL side skipped: trl is not installed (pip install -e '.[{EXTRA}]'); the rlfusion side "
              f"runs alone, so there is no target")
        run_rlfusion_alone(model, tok, rounds * per_segment)
        return
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5.x renames
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl.__version__}, {THREADS} threads; {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} "
          f"samples, <= {MAX_NEW_TOKENS} new tokens; 1 warm-up + {rounds} rounds x {per_segment} "
          f"steps per side")
    report(*run_interleaved(model, tok, rounds, per_segment))


if __name__ == "__main__":
    main()
