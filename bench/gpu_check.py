"""GPU check: what has to hold on a machine with a CUDA GPU, in under 10 minutes on one GPU.

1. The GPU-marked tests (`pytest -m gpu`): the native engine and the actor on CUDA against the
   CPU, the switch returning GPU memory, RL in process on one GPU (and over NCCL on two, where
   there are two), vLLM's logprobs against the trainer's (where vLLM is installed).
2. A short RL run with the native engine on CUDA (`deploy.device=cuda deploy.backend=local
   deploy.precision=bf16`, 4 updates of 32 prompts x 8 samples) from the shipped tiny base with its routers' expert bias
   zeroed (a base vLLM can serve too, so both runs start from the same weights).
3. Where vLLM is installed, the same run with `rollout.backend=vllm`.

Rollout tokens/s is the median over the updates after the first (warm-up, compilation and
CUDA-graph capture). The logprob gap is `behaviour_logprob_gap`: the mean |logprob| difference
between what the engine reported for each sampled token and what the trainer computes for the
same token before the update (fresh samples, so only the engines differ: both compute in bf16,
in different kernels and orders; the same check on the CPU reads under 0.05).

    python bench/gpu_check.py           # ~5 minutes on one GPU
    python bench/gpu_check.py --quick   # 2 updates per run, the GPU tests without the slow ones
    python bench/gpu_check.py --smoke   # 1 update of 2 prompts x 2 samples per run (a test runs it); without a
                                        # GPU only the native run, on the CPU, to check the script: no targets
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rlfusion.model.checkpoint import find_base, load_base, save_checkpoint
from rlfusion.obs.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CPU_ROLLOUT_TOKENS_PER_S = 3000  # the default run's rollout on 2 CPU cores (docs/benchmarks.md): a GPU must beat it
# --smoke: each run's smallest step; responses this short rarely score, so dynamic sampling would
# drop every group and skip the update whose logprob gap the run reports
SMOKE_RUN = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval_problems=4",
             "algo.dynamic_sampling=false"]


def gpu_tests_cmd(quick: bool) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "gpu" + (" and not slow" if quick else ""), "-q", "-rfE",
            "-p", "no:cacheprovider", str(ROOT / "tests")]


def gpu_tests(quick: bool) -> int:
    """Run the GPU-marked tests; returns how many failed (or errored)."""
    cmd = gpu_tests_cmd(quick)
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    print(out.stdout[-4000:], out.stderr[-2000:], sep="\n", flush=True)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    failed = sum(int(word) for word, kind in zip(summary.split(), summary.split()[1:])
                 if word.isdigit() and kind.rstrip(",") in ("failed", "error", "errors"))
    return failed if out.returncode in (0, 1) else max(failed, 1)


def servable_base(folder: Path) -> Path:
    """The shipped tiny base with its routers' expert bias zeroed (vLLM's Qwen MoE has none)."""
    model, tokenizer, meta = load_base(find_base())
    for router in model.routers():
        router.expert_bias.zero_()
    return save_checkpoint(folder / "base", model, tokenizer, extra={"from": "tiny, expert bias zeroed"})


def rl_run(base: Path, out: Path, name: str, steps: int, *extra: str, device: str = "cuda") -> dict[str, float]:
    cmd = [sys.executable, "-m", "rlfusion.cli", "train", f"base={base}", f"deploy.device={device}",
           "deploy.backend=local", "deploy.precision=bf16", f"max_steps={steps}", "eval_problems=32", "eval_every=1000",
           f"out_dir={out}", f"run_name={name}", *extra]
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if done.returncode != 0:
        print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", flush=True)
        raise SystemExit(f"gpu_check: the {name} run failed (exit {done.returncode}); its output is above")
    rows = [r for r in read_metrics(out / name / "metrics.jsonl") if "reward_mean" in r]
    timed = rows[1:] or rows
    result = {"rollout_tokens_per_s": statistics.median(r["rollout_tokens_per_s"] for r in timed),
              "behaviour_logprob_gap": statistics.mean(r["behaviour_logprob_gap"] for r in rows),
              "memory_allocated_peak_train_mb": max(r.get("memory_allocated_peak_train_mb", 0.0) for r in rows)}
    print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 updates per run; GPU tests without slow ones")
    parser.add_argument("--smoke", action="store_true", help="1 tiny update per run; without a GPU, only the "
                        "native run on the CPU (no targets), to check the script")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    gpu = torch.cuda.is_available()
    if not gpu and not args.smoke:
        raise SystemExit(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a machine "
                         f"with a GPU and a CUDA build of torch")
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", flush=True)
        failed = gpu_tests(args.quick or args.smoke)
    steps = 1 if args.smoke else 2 if args.quick else 4
    extra = SMOKE_RUN if args.smoke else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        base = servable_base(out)
        native = rl_run(base, out, "native", steps, *extra, device="cuda" if gpu else "cpu")
        if not gpu:  # CPU figures are no GPU's: no targets
            print(f"no CUDA GPU found: ran the native run on the CPU only; on a GPU this also runs "
                  f"`{shlex.join(gpu_tests_cmd(True))}`, the native run on CUDA, the vLLM run and the targets")
            return
        has_vllm = importlib.util.find_spec("vllm") is not None
        vllm = rl_run(base, out, "vllm", steps, *extra, "rollout.backend=vllm") if has_vllm else None
    print(f"target gpu_tests_failed: {failed} (goal <= 0)")
    print(f"target gpu_native_rollout_tokens_per_s: {native['rollout_tokens_per_s']:.0f} "
          f"(goal >= {CPU_ROLLOUT_TOKENS_PER_S})")
    print(f"target gpu_native_logprob_gap: {native['behaviour_logprob_gap']:.4f} (goal <= 0.05)")
    if vllm is None:
        print("vLLM is not installed (pip install 'rlfusion[gpu]'): the vLLM run was skipped")
        return
    print(f"target gpu_vllm_vs_native_rollout_tokens_per_s: "
          f"{vllm['rollout_tokens_per_s'] / native['rollout_tokens_per_s']:.2f} (goal >= 1.0)")
    print(f"target gpu_vllm_logprob_gap: {vllm['behaviour_logprob_gap']:.4f} (goal <= 0.05)")


if __name__ == "__main__":
    main()
