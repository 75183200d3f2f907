"""LoRA against full fine-tuning: optimizer memory, the train → rollout weight sync, and how a
rollout applies the adapters (unmerged beside the weights, or merged into them).

1. Optimizer state: AdamW's bytes after one real step (forward, backward, step) over what it
   updates — every weight, or with `optim.lora_rank=16` (alpha 32, the default targets:
   attention, dense MLPs, shared experts, routed experts per expert) only the adapters — on two
   models: a Qwen3-30B-A3B-shaped one (its layer widths: d_model 2048, 32 query / 4 KV heads of
   128, routed experts of width 768; 16 experts, 2 layers, a 4096-token vocabulary so the
   embeddings do not dwarf the layers) and the shipped tiny base (d_model 128: rank 16 is an
   eighth of every width there, so its adapters are a quarter of its weights).
2. Separated-mode sync: the bytes `fusion.shard_sync.ShardSync` (what the device workers run
   after each update) moves from a train rank to a rollout rank over gloo, whole model vs
   adapters only (`adapters_only`), and its wall time, on both models; plus, on the tiny base,
   the bytes a real separated `rlfusion` step reports (`weight_sync_bytes`, 2 Ray devices).
3. Rollout: greedy decoding of 64 held-out problems by the tiny base with rank-16 adapters
   (their B moved off zero), unmerged (two low-rank matmuls beside each adapted one) vs merged
   (`lora.merge`, a plain forward), interleaved repetitions, median tokens/s ratio; and what a
   merge plus unmerge costs against one such rollout.

    python bench/lora.py            # 5 repetitions
    python bench/lora.py --quick    # 3 repetitions
    python bench/lora.py --smoke    # smallest sizes (a test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

RANK, ALPHA = 16, 32.0


def wide_config(smoke: bool):
    from rlfusion.model.config import ModelConfig

    return ModelConfig(vocab_size=4096, d_model=2048 if not smoke else 256, num_layers=2 if not smoke else 1,
                       num_heads=32 if not smoke else 4, num_kv_heads=4, head_dim=128 if not smoke else 64,
                       num_dense_layers=0, dense_ffn_dim=768, num_experts=16 if not smoke else 4, top_k=4,
                       expert_ffn_dim=768 if not smoke else 128, num_shared_experts=0, max_seq_len=64)


def _model(cfg, adapters: bool):
    from rlfusion.model import lora
    from rlfusion.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(cfg)
    return lora.attach(model, lora.LoraSpec(RANK, ALPHA)) if adapters else model


def optimizer_bytes(cfg, adapters: bool) -> tuple[int, int]:
    """AdamW's state bytes after one step, and the model's weight bytes."""
    from rlfusion.fusion.offload import optimizer_tensors
    from rlfusion.model import lora

    model = _model(cfg, adapters).train()
    opt = torch.optim.AdamW([p for _, p in lora.trained_parameters(model)], lr=1e-4)
    tokens = torch.randint(3, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return state, weights


def sync_world(cfg, adapters: bool, bucket_bytes: int) -> dict:
    """(On both ranks of a 2-rank gloo world.) Rank 0 trains, rank 1 generates: one sync."""
    import torch.distributed as dist

    from rlfusion.fusion.shard_sync import ShardSync

    model = _model(cfg, adapters)
    sync = ShardSync([0], [1], bucket_bytes, adapters_only=adapters)
    sync.sync(model) if dist.get_rank() == 0 else sync.sync(replica=model)  # plans, warms up
    start = time.perf_counter()
    stats = sync.sync(model) if dist.get_rank() == 0 else sync.sync(replica=model)
    return {"recv": stats.recv_bytes, "sent": stats.sent_bytes, "seconds": time.perf_counter() - start}


def sync_bytes(cfg, adapters: bool) -> dict:
    from rlfusion.parallel.launch import run_world

    ranks = run_world(sync_world, 2, cfg, adapters, 64 << 20, timeout=600)
    return ranks[1]


def separated_run_bytes(adapters: bool, smoke: bool) -> int:
    """Bytes one real separated step (2 Ray devices) syncs to its rollout device."""
    from rlfusion.config import load_config
    from rlfusion.model.checkpoint import find_base
    from rlfusion.runtime.train_config import TrainConfig
    from rlfusion.runtime.trainer import RLTrainer

    with tempfile.TemporaryDirectory() as out:
        items = [f'out_dir="{out}"', "deploy.backend=ray", "deploy.num_devices=2", "deploy.mode=separated",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "max_steps=1", "eval_problems=8",
                 "algo.dynamic_sampling=false"] + ([f"optim.lora_rank={RANK}"] if adapters else [])
        if smoke:
            items += ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16"]
        trainer = RLTrainer(load_config(TrainConfig, None, items), tempfile.mkdtemp(dir=out), find_base())
        try:
            trainer.train_step()
            return trainer.devices.weight_sync_bytes
        finally:
            trainer.close()


def rollout_speed(reps: int, n: int, max_new: int) -> tuple[float, float]:
    """Median of (merged tokens/s / unmerged tokens/s) over interleaved repetitions, and the
    median merge + unmerge time over the median unmerged rollout time."""
    from rlfusion.engine.engine import EngineConfig, LLMEngine
    from rlfusion.evaluate import greedy_completions
    from rlfusion.model import lora
    from rlfusion.model.checkpoint import load_base, resolve_base
    from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    model, tokenizer, _ = load_base(resolve_base("tiny"))
    lora.attach(model, lora.LoraSpec(RANK, ALPHA))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora.adapter_state(model).items():
            if name.rpartition(".")[2].startswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    model.eval()
    problems = ArithmeticTask(ArithmeticConfig()).heldout()[:n]

    def rollout() -> tuple[float, int]:
        engine = LLMEngine(model, EngineConfig(max_num_seqs=n, seed=0))
        t0 = time.perf_counter()
        done = greedy_completions(engine, tokenizer, problems, max_new)
        return time.perf_counter() - t0, sum(len(c.output_ids) for c in done)

    rollout()  # warm-up
    ratios, switch, plain = [], [], []
    for _ in range(reps):
        s_unmerged, tok_unmerged = rollout()
        t0 = time.perf_counter()
        lora.merge(model)
        merge_s = time.perf_counter() - t0
        s_merged, tok_merged = rollout()
        t0 = time.perf_counter()
        lora.unmerge(model)
        switch.append(merge_s + time.perf_counter() - t0)
        plain.append(s_unmerged)
        ratios.append((tok_merged / s_merged) / (tok_unmerged / s_unmerged))
        print(f"  unmerged {tok_unmerged / s_unmerged:,.0f} tok/s, merged {tok_merged / s_merged:,.0f} tok/s "
              f"({tok_unmerged} / {tok_merged} tokens), merge + unmerge {switch[-1] * 1000:.1f} ms")
    return statistics.median(ratios), statistics.median(switch) / statistics.median(plain)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        print("smoke run: sizes too small for the figures to mean anything")
    torch.set_num_threads(2)
    from rlfusion.model.base_info import base_config
    from rlfusion.model.checkpoint import resolve_base

    tiny = base_config(resolve_base("tiny"))[0]  # (its config.json: no weights read)
    wide = wide_config(args.smoke)
    models = {"qwen3-30b-a3b-shaped": wide, "tiny": tiny}
    print(f"LoRA rank {RANK}, alpha {ALPHA:g}, default targets")
    opt_ratio = {}
    for name, cfg in models.items():
        full, weights = optimizer_bytes(cfg, False)
        adapted, _ = optimizer_bytes(cfg, True)
        opt_ratio[name] = adapted / full
        print(f"optimizer state, {name} ({weights / 1e6:,.1f} MB of weights): full {full / 1e6:,.1f} MB, "
              f"LoRA {adapted / 1e6:,.2f} MB, ratio {opt_ratio[name]:.4f}")
    sync_ratio = {}
    for name, cfg in models.items():
        full, adapted = sync_bytes(cfg, False), sync_bytes(cfg, True)
        sync_ratio[name] = adapted["recv"] / full["recv"]
        print(f"separated sync (ShardSync, gloo), {name}: full {full['recv'] / 1e6:,.1f} MB in {full['seconds']:.3f} s, "
              f"LoRA {adapted['recv'] / 1e6:,.2f} MB in {adapted['seconds']:.3f} s, bytes ratio {sync_ratio[name]:.4f}")
    full_run, lora_run = separated_run_bytes(False, args.smoke), separated_run_bytes(True, args.smoke)
    print(f"separated rlfusion step, tiny base, 2 Ray devices: full {full_run / 1e6:.2f} MB synced, "
          f"LoRA {lora_run / 1e6:.3f} MB, ratio {lora_run / full_run:.4f}")
    reps = 1 if args.smoke else 3 if args.quick else 5
    n, max_new = (8, 16) if args.smoke else (64, 64)
    print(f"rollout, tiny base with rank-{RANK} adapters, {n} greedy problems x up to {max_new} tokens:")
    speed, switch_share = rollout_speed(reps, n, max_new)
    print(f"lora_merged_vs_unmerged_rollout_tokens_per_s: {speed:.2f} (reported; optim.lora_rollout=auto "
          f"merges replicas, =merged the trained model too)")
    print(f"lora_merge_unmerge_over_rollout: {switch_share:.4f} (reported)")
    print(f"lora_optimizer_bytes_over_full, tiny base: {opt_ratio['tiny']:.3f} (reported; rank 16 is 1/8 of its width)")
    print(f"lora_sync_bytes_over_full, tiny base: {sync_ratio['tiny']:.3f} (reported)")
    print(f"target lora_optimizer_bytes_over_full: {opt_ratio['qwen3-30b-a3b-shaped']:.4f} (goal <= 0.1)")
    print(f"target lora_sync_bytes_over_full: {sync_ratio['qwen3-30b-a3b-shaped']:.4f} (goal <= 0.1)")


if __name__ == "__main__":
    main()
