"""The train-inference mismatch of an MoE policy, and what rollout routing replay (R3) does to it.

The shipped tiny base samples responses to the built-in task's prompts with the native engine
in bf16 (autocast: matmuls in bf16, as an accelerator's rollout kernels run), recording each fed
token's routed experts per MoE layer; the trainer's fp32 forward then scores the same tokens
twice, routing by its own router and replaying the rollout's experts (`algo.routing_replay`).
Per variant, over the response tokens:

    mismatch KL      token-level KL(rollout || train), the k3 estimate on the sampled tokens
                     (mean of r - 1 - log r, r = p_train / p_rollout), and mean |dlogprob|
    agreement        the share of the trainer's own top-k experts that were the rollout's, per
                     MoE layer, and the share of tokens routed differently in at least one layer

`r3_mismatch_kl_reduction` = KL without replay / KL with it, on the shipped base; the same shape
with a 64-expert top-8 router (random init, not a trained policy) shows where routing flips are
common, as in large MoE models. Routes cost `route_bytes_per_token`
(MoE layers x top-k, one byte each up to 256 experts; reported, no goal); the same for the 718B
preset's MoE layers and top-k is printed beside it. A second rollout in fp32 (the trainer's precision) shows the
floor: the engine's kernels and batch shapes alone.

    python bench/mismatch.py           # 3 seeds of 128 prompts x 4 samples
    python bench/mismatch.py --quick   # 1 seed
    python bench/mismatch.py --smoke   # 8 prompts x 2 samples (a test runs it)
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.evaluate import encode_prompt
from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.model.config import get_preset
from rlfusion.model.routes import route_dtype
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.mismatch import MismatchMeter
from rlfusion.rl.tasks import make_task
from rlfusion.rl.trajectory import Trajectory, batch_routes, pack, token_logprobs
from rlfusion.runtime.train_config import TrainConfig

MAX_NEW = 64


def rollout(model, tokenizer, task, prompts: int, samples: int, dtype, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    problems = [task.sample(rng) for _ in range(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, stop_ids=(tokenizer.eos_id,))
    requests = [Request(f"{i}/{j}", encode_prompt(tokenizer, p.prompt), params)
                for i, p in enumerate(problems) for j in range(samples)]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=128, seed=seed, compute_dtype=dtype, record_routes=True))
    return [Trajectory.of_completion(c) for c in engine.generate(requests)]


@torch.no_grad()
def score(model, trajs: list[Trajectory], replay: bool) -> dict[str, float]:
    """The fp32 trainer's mismatch metrics on `trajs`, routing by its own router or replaying."""
    meter = MismatchMeter()
    for start in range(0, len(trajs), 64):
        part = trajs[start:start + 64]
        batch = pack(part)
        routes = batch_routes(batch, model.config.top_k, replay)
        logprobs_N, _ = token_logprobs(model, batch, routes=routes)
        stale_N = torch.zeros(len(batch.tokens_N), dtype=torch.bool)
        meter.add_tokens(logprobs_N, batch.behaviour_logprobs_N, batch.loss_mask_N, stale_N)
        meter.add_routes(routes, stale_N)
    return meter.metrics()


def measure(model, tokenizer, task, prompts: int, samples: int, seeds) -> dict[str, dict[str, float]]:
    """Per variant (fp32 rollout, bf16 rollout, bf16 rollout + replay), the median metrics."""
    rows: dict[str, list] = {name: [] for name in ("fp32 rollout", "bf16 rollout", "bf16 rollout + replay")}
    for seed in seeds:
        for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            trajs = rollout(model, tokenizer, task, prompts, samples, dtype, seed)
            rows[f"{precision} rollout"].append(score(model, trajs, replay=False))
            if precision == "bf16":
                rows["bf16 rollout + replay"].append(score(model, trajs, replay=True))
        print(f"seed {seed}: " + ", ".join(f"{k} KL {v[-1]['mismatch_kl']:.2e}" for k, v in rows.items()), flush=True)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    # replay's reduction on the same samples, per seed (the KL's heavy tail differs between seeds)
    med["reductions"] = [a["mismatch_kl"] / max(b["mismatch_kl"], 1e-30)
                         for a, b in zip(rows["bf16 rollout"], rows["bf16 rollout + replay"])]
    return med


def table(title: str, cfg, med: dict) -> float:
    """Print the variants' metrics; returns the KL reduction replay gives (the median of the
    seeds' reductions)."""
    reductions = med.pop("reductions")
    layers = [f"router_agreement_layer{i}" for i in range(cfg.num_moe_layers)]
    print(f"\n## {title}: {cfg.num_moe_layers} MoE layers x top-{cfg.top_k} of {cfg.num_experts} experts")
    print("| trainer (fp32) on | mismatch KL | mean abs dlogprob | router agreement | " +
          " | ".join(f"layer {i}" for i in range(cfg.num_moe_layers)) + " | tokens routed differently |")
    print("|---|---|---|---|" + "---|" * cfg.num_moe_layers + "---|")
    for name, x in med.items():
        print(f"| {name} | {x['mismatch_kl']:.2e} | {x['mismatch_logprob_abs']:.2e} | {x['router_agreement']:.4f} | "
              + " | ".join(f"{x[k]:.4f}" for k in layers) + f" | {x['routed_differently_share']:.2%} |")
    reduction = statistics.median(reductions)
    print(f"what replay removes, per seed: KL / KL with replay {', '.join(f'{r:.2f}' for r in reductions)} (median "
          f"{reduction:.2f}: {1 - 1 / reduction:.0%} of the KL was routing); the engine's own floor at the "
          f"trainer's precision {med['fp32 rollout']['mismatch_kl']:.2e}")
    return reduction


def wide_router_model(cfg):
    """The tiny base's shape with a router as wide as large MoE models' (64 experts, top-8), at
    random init: where many tokens change experts under bf16, as in the published measurements."""
    torch.manual_seed(0)
    wide = cfg.replace(num_experts=64, top_k=8, expert_ffn_dim=max(8, cfg.expert_ffn_dim // 4))
    return MoETransformer(wide).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest sizes, in seconds")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    torch.set_num_threads(1)
    prompts, samples = (8, 2) if args.smoke else (128, 4)
    seeds = range(1 if args.smoke or args.quick else 3)
    model, tokenizer, _ = load_base(find_base())
    model.eval()
    run = TrainConfig()  # the default run's task
    task = make_task(run.task, run.data, tokenizer, model.config.max_seq_len - MAX_NEW)
    cfg = model.config
    reduction = table(f"the shipped base, {prompts} prompts x {samples} samples, temperature 1, median of "
                      f"{len(seeds)} seed(s)", cfg, measure(model, tokenizer, task, prompts, samples, seeds))
    wide = wide_router_model(cfg)
    wide_reduction = table("the same shape with a 64-expert top-8 router at random init (not a trained policy)",
                           wide.config, measure(wide, tokenizer, task, prompts, samples, seeds))
    print(f"\nKL reduction by replay: shipped base {reduction:.2f}x, wide router {wide_reduction:.2f}x")
    per_token = cfg.num_moe_layers * cfg.top_k * torch.tensor([], dtype=route_dtype(cfg.num_experts)).element_size()
    big = get_preset("pangu-ultra-moe-718b")
    big_bytes = big.num_moe_layers * big.top_k * torch.tensor([], dtype=route_dtype(big.num_experts)).element_size()
    print(f"routes: {per_token} bytes per token here; the 718B preset ({big.num_moe_layers} MoE layers x top-{big.top_k} "
          f"of {big.num_experts} experts) {big_bytes} bytes per token, {big_bytes * 8192 / 2**20:.1f} MiB per 8k-token sample")
    print(f"target r3_mismatch_kl_reduction: {reduction:.2f} (goal >= 3)")
    print(f"target route_bytes_per_token: {per_token} (goal >= 0)")


if __name__ == "__main__":
    main()
