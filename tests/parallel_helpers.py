"""Multi-process helpers for the parallel-layout tests (and `bench/parallel.py`).

`run_world(fn, world, *args)` spawns `world` gloo ranks on 127.0.0.1 (one CPU thread each),
runs `fn(*args)` on every rank and returns the per-rank results. `train_and_compare` trains a
layout for a few steps and compares losses and the gathered state dict with a single-process
reference that runs the same init and data.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, lm_loss, parallelize

LR = 0.05  # SGD: the weight comparison then measures gradient agreement directly (Adam's
# sign-like first step would turn fp32 rounding noise of near-zero grads into lr-sized diffs).


def small_config(**changes) -> ModelConfig:
    """Tiny-preset shape (4 heads / 2 kv heads, 4 layers, 8 experts) at a smaller width."""
    base = ModelConfig(vocab_size=17, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=8, num_dense_layers=1, dense_ffn_dim=64, num_experts=8, top_k=2,
                       expert_ffn_dim=16, num_shared_experts=1, max_seq_len=32,
                       bias_update_rate=1e-3)
    return base.replace(**changes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(*args)
    except Exception:
        result = {"error": traceback.format_exc()}
        raise
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 300) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=timeout):
                pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world)]


def make_batches(cfg: ModelConfig, steps: int, rows: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g) for _ in range(steps)]


def reference_run(cfg: ModelConfig, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in batches:
        opt.zero_grad()
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        if cfg.aux_loss_coef > 0:
            loss = loss + model.aux_loss()
        loss.backward()
        opt.step()
        model.update_router_bias()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def parallel_run(cfg, layout: ParallelLayout, batches, n_microbatches: int = 1):
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    pm = parallelize(model, layout, n_microbatches=n_microbatches)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    losses = []
    for tokens in batches:
        opt.zero_grad()
        losses.append(pm.forward_backward(pm.shard_batch(tokens[:, :-1]),
                                          pm.shard_batch(tokens[:, 1:])))
        opt.step()
        pm.update_router_bias()
    return losses, pm.full_state_dict(), pm.comm_counter()


def train_and_compare(cases: list[tuple[str, dict, dict, int]], steps: int = 2,
                      rows: int = 8, seq: int = 12) -> dict[str, dict]:
    """cases: (name, layout kwargs, config changes, n_microbatches). Runs on every rank."""
    out = {}
    for name, layout_kw, cfg_changes, n_micro in cases:
        cfg = small_config(**cfg_changes)
        batches = make_batches(cfg, steps, rows, seq)
        ref_losses, ref_state = reference_run(cfg, batches)
        losses, state, counter = parallel_run(cfg, ParallelLayout(**layout_kw), batches, n_micro)
        diffs = {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state if k in state}
        out[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "losses": losses, "ref_losses": ref_losses,
            "missing": sorted(set(ref_state) ^ set(state)),
            "weight_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "moved": max((state[k] - v).abs().max().item() for k, v in
                         reference_initial_state(cfg).items()),
            "sent_bytes": counter.sent_bytes, "internode_bytes": counter.internode_bytes,
        }
    return out


def reference_initial_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v for k, v in MoETransformer(cfg).state_dict().items()}
