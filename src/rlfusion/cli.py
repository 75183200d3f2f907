"""The `rlfusion` command: parse, build, run, close. User mistakes end in one error line, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfusion.errors import RunError
from rlfusion.runtime.stop import RunInterrupted


MAX_PASS_K = 64  # samples per problem for pass@k


def cmd_info(args: argparse.Namespace) -> None:
    import dataclasses

    from rlfusion.model.config import get_preset

    cfg = get_preset(args.model)
    print(f"model {args.model}")
    for key, value in dataclasses.asdict(cfg).items():
        print(f"  {key:<22} {value}")
    counts = cfg.param_counts()
    print("parameters")
    for key, value in counts.items():
        print(f"  {key:<22} {value:>18,}  ({_human(value)})")


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def cmd_pretrain(args: argparse.Namespace) -> None:
    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import default_base_path
    from rlfusion.pretrain import PretrainConfig, pretrain

    cfg = load_config(PretrainConfig, args.config, args.overrides)
    if not cfg.out and (cfg.init or cfg.context_len):
        raise ValueError(f"pretraining with init= or context_len= needs out=DIR: the default, "
                         f"{default_base_path(cfg.model)}, is the base every run starts from")
    out = Path(cfg.out) if cfg.out else default_base_path(cfg.model)
    result = pretrain(cfg, out)
    print(f"pretrained {cfg.model}: {result.steps} steps, {result.tokens:,} tokens in "
          f"{result.seconds:.0f}s ({result.tokens / result.seconds:,.0f} tokens/s); "
          f"held-out greedy accuracy {result.eval.accuracy:.1%} on {result.eval.num_problems} "
          f"problems; checkpoint {result.path}")


def cmd_train(args: argparse.Namespace) -> None:
    import dataclasses
    import time

    from rlfusion.config import parse_override
    from rlfusion.model.checkpoint import SHIPPED_BASE, default_base_path, resolve_base
    from rlfusion.runtime.report import finish_run
    from rlfusion.runtime.deployment import DeploymentPlan, check_machine
    from rlfusion.runtime import run_state
    from rlfusion.runtime.base_fit import check_base
    from rlfusion.runtime.trainer import RLTrainer, resume, stalesync_overlaps, write_run_config

    if args.resume is not None:
        if not args.resume.strip():
            raise ValueError("--resume needs the run folder to continue, e.g. --resume runs/NAME")
        if args.config:
            raise ValueError(f"--resume continues a run with its own config.json; drop {args.config!r}")
        if args.restart:
            raise ValueError("--restart starts a run over and --resume continues it: pass one of them")
        overrides = dict(parse_override(o) for o in args.overrides)
        for key in overrides:
            if key not in ("max_steps", "time_budget_s"):
                raise ValueError(f"--resume accepts only max_steps=/time_budget_s= overrides, got {key!r}")
        run_dir = Path(args.resume)
        if (run_dir / "model.safetensors").is_file():
            raise ValueError(f"{run_dir} is a model checkpoint, not a run folder; resume the run folder that "
                             f"holds it (e.g. --resume {run_dir.parent})")
        if not (run_dir / "config.json").is_file():
            raise FileNotFoundError(f"{run_dir} is not an rlfusion run folder (no config.json)")
        lock = run_state.lock_run_dir(run_dir)  # held until this process exits
        trainer = resume(run_dir, overrides)
    else:
        cfg = _load_train_config(args)
        check_machine(cfg.deploy)  # a config for another cluster is refused before anything starts
        base = resolve_base(cfg.base)
        if base is None:
            raise ValueError(f"no base model: none pretrained into {default_base_path()} and none shipped "
                             f"at {SHIPPED_BASE}; run `rlfusion pretrain` (about 3 minutes) or pass base=DIR")
        print(f"base model: {base}")
        cfg = dataclasses.replace(cfg, base=str(base.resolve()))
        check_base(cfg, base, stalesync_overlaps(cfg))  # a base too large is refused before the run folder exists
        run_dir = Path(cfg.out_dir) / (cfg.run_name or time.strftime("grpo-%Y%m%d-%H%M%S"))
        if (run_dir / "model.safetensors").exists():  # checked before the lock adds a file there
            raise ValueError(f"{run_dir} holds a model checkpoint, not an rlfusion run; pick another "
                             f"run_name= or out_dir=")
        lock = run_state.lock_run_dir(run_dir)  # before anything starts: one process per run folder
        _take_run_folder(run_dir, args.restart)
        write_run_config(run_dir, cfg)
        print(f"deployment: {DeploymentPlan.build(cfg.deploy, overlap=stalesync_overlaps(cfg)).describe()} "
              f"({cfg.deploy.backend})")
        trainer = RLTrainer(cfg, run_dir, base)
    try:
        result = trainer.run()
        print(finish_run(trainer, result))
    finally:
        trainer.close()
        lock.close()


def _take_run_folder(run_dir: Path, restart: bool) -> None:
    """Make `run_dir` ready for a new run: a run that started there (any of its outputs) is never
    started over unless `--restart` asks, and then its files move aside, never deleted."""
    from rlfusion.runtime import run_state

    if run_state.has_checkpoint(run_dir) and not restart:
        raise ValueError(f"run folder {run_dir} already exists; pick another run_name=, continue it with "
                         f"--resume {run_dir}, or start it over with --restart (its files move aside)")
    if (run_dir / "config.json").exists() and not run_state.is_run_folder(run_dir):
        raise ValueError(f"{run_dir} holds a config.json that is not an rlfusion run's; "
                         f"pick another run_name= or out_dir=")
    if restart:
        aside = run_state.move_aside(run_dir)
        if aside is not None:
            print(f"--restart: the earlier run's files are now in {aside}")
        return
    held = run_state.outputs(run_dir)
    if held:
        raise ValueError(f"run folder {run_dir} holds a run that started ({', '.join(held)}) and no trainer state; "
                         f"it is never started over: pick another run_name=, or pass --restart to move its files "
                         f"to {run_dir}/replaced-DATE/ first (--resume {run_dir} says how to go on from its weights)")
    if (run_dir / "config.json").exists():
        print(f"run folder {run_dir} has no checkpoint (an earlier start stopped before its first "
              f"step): starting it again")


def _load_train_config(args: argparse.Namespace):
    """The run's `TrainConfig`; a `pretrain` section (`rlfusion pretrain`'s keys) is named as such."""
    from rlfusion.config import load_config
    from rlfusion.runtime.train_config import TrainConfig

    try:
        return load_config(TrainConfig, args.config, args.overrides)
    except ValueError as e:
        if not str(e).startswith("unknown config key 'pretrain'"):
            raise
        raise ValueError("unknown config key 'pretrain': `rlfusion train` starts from a base checkpoint "
                         "(base=DIR; default: the one you pretrained, else the shipped one); pretraining "
                         "keys go to `rlfusion pretrain`, e.g. `rlfusion pretrain seed=1`") from None


def cmd_eval(args: argparse.Namespace) -> None:
    from rlfusion.evaluate import evaluate
    from rlfusion.model.checkpoint import find_base, load_checkpoint
    from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    if args.ckpt is not None and not args.ckpt.strip():
        raise ValueError("--ckpt is empty; name a checkpoint folder, or leave --ckpt out for the base model")
    if not 0 <= args.k <= MAX_PASS_K:
        raise ValueError(f"--k={args.k} must be in [0, {MAX_PASS_K}] (0 = no pass@k)")
    path = Path(args.ckpt) if args.ckpt else find_base()
    if path is None:
        raise ValueError("no base model found; pass --ckpt DIR or run `rlfusion pretrain` first")
    model, tokenizer, _ = load_checkpoint(path)
    if tokenizer is None:
        raise ValueError(f"checkpoint {path} has no tokenizer; it was not saved by rlfusion pretrain")
    task = ArithmeticTask(ArithmeticConfig(seed=args.task_seed))
    if not 1 <= args.n <= task.config.num_heldout:
        raise ValueError(f"--n={args.n} must be in [1, {task.config.num_heldout}]")
    result = evaluate(model, tokenizer, task.heldout()[:args.n], task.reward, k=args.k)
    line = (f"held-out greedy accuracy {result.accuracy:.1%} on {result.num_problems} problems "
            f"(mean response {result.mean_response_tokens:.1f} tokens)")
    if result.pass_at_k is not None:
        line += f"; pass@{args.k} {result.pass_at_k:.1%}"
    print(line)
    if args.json:
        print(json.dumps(result.__dict__))


def cmd_export_hf(args: argparse.Namespace) -> None:
    from rlfusion.model import lora
    from rlfusion.model.checkpoint import load_checkpoint
    from rlfusion.model.hf import save_hf
    from rlfusion.model.peft_export import BASE_DIR, PEFT_DIR, save_lora_hf

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty folder; export-hf writes a new folder "
                         f"and never overwrites one (a checkpoint could be lost)")
    model, tokenizer, _ = load_checkpoint(args.ckpt)
    adapted = lora.spec_of(model) is not None
    # a LoRA checkpoint: the merged model, and beside it the adapters in PEFT's format with their base
    out = (save_lora_hf if adapted else save_hf)(model, out, tokenizer, family=args.family)
    print(f"wrote Hugging Face folder {out} (model_type "
          f"{json.loads((out / 'config.json').read_text())['model_type']})")
    if adapted:
        print(f"wrote PEFT adapters {out / PEFT_DIR} for the base {out / PEFT_DIR / BASE_DIR} (merged: {out})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfusion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print a model preset and its parameter counts")
    p.add_argument("--model", default="tiny")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("pretrain", help="train the tiny base model on the built-in task")
    p.add_argument("config", nargs="?", help="TOML file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=1 time_budget_s=120")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("train", help="RL-train the base model (GRPO on the built-in task by default)")
    p.add_argument("config", nargs="?", help="TOML file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.kl_coef=0 max_steps=50")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--restart", action="store_true",
                   help="start over in a run folder that holds a run: its files move to RUN/replaced-DATE/")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="held-out greedy accuracy of a checkpoint")
    p.add_argument("--ckpt", help="checkpoint folder (default: the cached base model)")
    p.add_argument("--n", type=int, default=500, help="number of held-out problems")
    p.add_argument("--k", type=int, default=0, help="also report pass@k with k samples")
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export-hf", help="write an rlfusion checkpoint as a Hugging Face folder "
                                         "(a LoRA checkpoint: merged, plus its PEFT adapters in OUT/peft)")
    p.add_argument("ckpt", help="rlfusion checkpoint folder, e.g. RUN_DIR/final")
    p.add_argument("out", help="output folder")
    p.add_argument("--family", help="llama, qwen2, qwen3, qwen2_moe, qwen3_moe or deepseek_v3 "
                                    "(default: inferred from the model config)")
    p.set_defaults(func=cmd_export_hf)

    _register_optional(sub)
    return parser


def _register_optional(sub) -> None:
    """Commands of packages that may be absent in a trimmed install (the planner/simulator)."""
    try:
        from rlfusion.sim import cli as sim_cli
    except ImportError:
        return
    for name in ("register_plan_command", "register_simulate_command"):
        if hasattr(sim_cli, name):
            getattr(sim_cli, name)(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("pretrain", "train") and args.config and "=" in args.config:
        args.overrides.insert(0, args.config)  # first override taken for the optional TOML path
        args.config = None
    try:
        rc = args.func(args)
    except RunInterrupted as e:  # stopped on a signal, with a checkpoint
        print(f"rlfusion {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, FileNotFoundError, RunError) as e:
        print(f"rlfusion {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # the machine refused a read or write (read-only folder, disk full)
        where = f"{e.filename}: " if e.filename else ""
        print(f"rlfusion {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rlfusion {args.command}: interrupted", file=sys.stderr)
        return 130
    return rc or 0


def _one_line(e: BaseException) -> str:
    """An error's message on one line (a message from a library may span several)."""
    return " ".join(str(e).split()) if "\n" in str(e) else str(e)


if __name__ == "__main__":
    sys.exit(main())
