"""Multi-process helpers for the parallel-layout tests (and `bench/parallel.py`).

Functions here run on every rank of a `rlfusion.parallel.launch.run_world` world.
`train_and_compare` trains a layout for a few steps and compares losses and the gathered
state dict with a single-process reference that runs the same init and data;
`compare_a2a` runs one step with flat and with hierarchical expert all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlfusion.fusion.memory import MemoryLedger
from rlfusion.model import lora
from rlfusion.model.config import ModelConfig
from rlfusion.model.transformer import MoETransformer
from rlfusion.parallel import ParallelLayout, lm_loss, overlap, parallelize

LR = 0.05  # SGD: the weight comparison then measures gradient agreement directly (Adam's
# sign-like first step would turn fp32 rounding noise of near-zero grads into lr-sized diffs).


def small_config(**changes) -> ModelConfig:
    """Tiny-preset shape (4 heads / 2 kv heads, 4 layers, 8 experts) at a smaller width."""
    base = ModelConfig(vocab_size=17, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=8, num_dense_layers=1, dense_ffn_dim=64, num_experts=8, top_k=2,
                       expert_ffn_dim=16, num_shared_experts=1, max_seq_len=32,
                       bias_update_rate=1e-3)
    return base.replace(**changes)


def make_batches(cfg: ModelConfig, steps: int, rows: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, cfg.vocab_size, (rows, seq + 1), generator=g) for _ in range(steps)]


def nudge_adapters(model, std: float, seed: int) -> None:
    """Every LoRA B drawn from N(0, std) (a fresh B is zero: the adapted model equals its base,
    and A's first gradient is zero), the same on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.adapter_state(model).items():
            if name.rpartition(".")[2].startswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _model(cfg: ModelConfig, adapters: dict | None) -> MoETransformer:
    """The seeded model; with `adapters` (LoRA spec kwargs) adapted, their B nudged off zero (a
    fresh B is zero, and A's first gradient with it) the same way on every rank."""
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    if adapters:
        nudge_adapters(lora.attach(model, lora.LoraSpec(**adapters)), 0.1, seed=7)
    return model


def reference_run(cfg: ModelConfig, batches, adapters: dict | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(cfg, adapters)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
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


def parallel_run(cfg, layout: ParallelLayout, batches, n_microbatches: int = 1, adapters: dict | None = None):
    """Losses, the gathered state dict, the expert all-to-all counters and Adaptive Pipe's
    report (its chosen order; {} for other layouts)."""
    model = _model(cfg, adapters)
    pm = parallelize(model, layout, n_microbatches=n_microbatches)
    opt = torch.optim.SGD([p for _, p in pm.trained_parameters()], lr=LR)
    losses = []
    for tokens in batches:
        opt.zero_grad()
        losses.append(pm.forward_backward(pm.shard_batch(tokens[:, :-1]),
                                          pm.shard_batch(tokens[:, 1:])))
        opt.step()
        pm.update_router_bias()
    ledger = MemoryLedger()
    ledger.track("weights", [p.to_local() if hasattr(p, "to_local") else p for p in pm.parameters()])
    return losses, pm.full_state_dict(), pm.comm_counter(), pm.overlap_report(), ledger.total("device")


def train_and_compare(cases: list[tuple[str, dict, dict, int]], steps: int = 2,
                      rows: int = 8, seq: int = 12) -> dict[str, dict]:
    """cases: (name, layout kwargs, config changes, n_microbatches). Runs on every rank. A
    config change `lora` (LoRA spec kwargs) adapts the model: only its adapters train."""
    out = {}
    for name, layout_kw, cfg_changes, n_micro in cases:
        cfg_changes = dict(cfg_changes)
        adapters = cfg_changes.pop("lora", None)
        cfg = small_config(**cfg_changes)
        batches = make_batches(cfg, steps, rows, seq)
        ref_losses, ref_state = reference_run(cfg, batches, adapters)
        switches = overlap._TURNS.switches
        losses, state, counter, report, weight_bytes = parallel_run(cfg, ParallelLayout(**layout_kw), batches, n_micro,
                                                                    adapters)
        diffs = {k: (state[k] - ref_state[k]).abs().max().item() for k in ref_state if k in state}
        initial = _model(cfg, adapters).state_dict()
        out[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "losses": losses, "ref_losses": ref_losses,
            "missing": sorted(set(ref_state) ^ set(state)),
            "weight_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "moved": max((state[k] - v).abs().max().item() for k, v in initial.items()),
            "base_moved": max((state[k] - v).abs().max().item() for k, v in initial.items() if not lora.is_adapter(k)),
            "sent_bytes": counter.sent_bytes, "internode_bytes": counter.internode_bytes,
            "overlap": report, "turn_switches": overlap._TURNS.switches - switches, "weight_bytes": weight_bytes,
        }
    return out


def _one_step(cfg, layout: ParallelLayout, tokens):
    torch.manual_seed(0)
    model = MoETransformer(cfg).train()
    pm = parallelize(model, layout)
    logits = pm.chunks[0](pm.shard_batch(tokens[:, :-1]))
    lm_loss(logits, pm.shard_batch(tokens[:, 1:])).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "experts" in n}
    internode = torch.tensor(float(pm.comm_counter().internode_bytes))
    dist.all_reduce(internode)
    return logits.detach(), grads, int(internode)


def compare_a2a(cfg_changes: list[dict], ep: int, ranks_per_node: int, rows: int, seq: int):
    """Per config: flat vs hierarchical logits/expert-grad difference and world inter-node bytes."""
    out = []
    for changes in cfg_changes:
        cfg = small_config(**changes)
        tokens = make_batches(cfg, 1, rows, seq)[0]
        world = dist.get_world_size()
        flat = _one_step(cfg, ParallelLayout(dp=world, ep=ep, ranks_per_node=ranks_per_node), tokens)
        hier = _one_step(cfg, ParallelLayout(dp=world, ep=ep, ranks_per_node=ranks_per_node,
                                             hierarchical_a2a=True), tokens)
        out.append({"top_k": cfg.top_k, "num_experts": cfg.num_experts,
                    "logit_diff": (flat[0] - hier[0]).abs().max().item(),
                    "grad_diff": max((flat[1][n] - hier[1][n]).abs().max().item() for n in flat[1]),
                    "flat_internode": flat[2], "hier_internode": hier[2]})
    return out


def _local_grads(cfg, layout: ParallelLayout, tokens, n_micro: int, link: bool):
    """One forward + backward step: the global loss and this rank's gradients (its shards)."""
    torch.manual_seed(0)
    pm = parallelize(MoETransformer(cfg).train(), layout, n_microbatches=n_micro)
    if link:  # an emulated link: transfers arrive late, so chunks really wait on each other
        pm.emulate_link(latency_s=2e-4, bytes_per_s=5e7)
    loss = pm.forward_backward(pm.shard_batch(tokens[:, :-1]), pm.shard_batch(tokens[:, 1:]))
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for n, p in pm.named_parameters()}
    return loss, grads, pm.comm_counter()


def compare_overlap(cases: list[tuple[str, dict, dict, int]], chunks: int = 3) -> dict[str, dict]:
    """Per case: the overlapped expert all-to-all (`a2a_chunks=chunks`, over an emulated link)
    against the blocking one, same init and data: loss and every local gradient."""
    out = {}
    for name, layout_kw, cfg_changes, n_micro in cases:
        cfg = small_config(**cfg_changes)
        tokens = make_batches(cfg, 1, 8, 12)[0]
        loss, grads, blocking = _local_grads(cfg, ParallelLayout(**layout_kw), tokens, n_micro, False)
        loss_o, grads_o, overlapped = _local_grads(cfg, ParallelLayout(**layout_kw, a2a_chunks=chunks), tokens,
                                                   n_micro, True)
        local = [n for n in grads if grads[n].numel()]  # (an FSDP shard may be empty on a rank)
        out[name] = {"loss_diff": abs(loss - loss_o), "names": sorted(grads) == sorted(grads_o),
                     "grad_diff": max((grads[n] - grads_o[n]).abs().max().item() for n in local),
                     "grad_max": max(grads[n].abs().max().item() for n in local),
                     "blocking_calls": blocking.calls, "overlapped_calls": overlapped.calls,
                     "overlapped_wait_s": overlapped.wait_s}
    return out


def transfers_alive_after_steps(steps: int = 3) -> list[int]:
    """ep4 (blocking, then chunked) for `steps` steps: after each, how many more of the expert
    all-to-all's transfer records (`_Pair`, `InFlight`) are alive than before the first, once
    Python's collector ran — a record kept alive through its own autograd node would leak every
    step's tokens."""
    import gc

    from rlfusion.parallel.expert_parallel import InFlight, _Pair

    cfg = small_config()
    alive = []
    gc.collect()
    before = sum(isinstance(o, (_Pair, InFlight)) for o in gc.get_objects())  # (earlier parts' leftovers)
    for chunks in (0, 2):
        torch.manual_seed(0)
        pm = parallelize(MoETransformer(cfg).train(), ParallelLayout(dp=dist.get_world_size(), ep=4, a2a_chunks=chunks),
                         fsdp=False)
        for tokens in make_batches(cfg, steps, 8, 12):
            pm.forward_backward(pm.shard_batch(tokens[:, :-1]), pm.shard_batch(tokens[:, 1:]))
            gc.collect()
            alive.append(sum(isinstance(o, (_Pair, InFlight)) for o in gc.get_objects()) - before)
    return alive


def layouts_and_a2a(cases, a2a_args, overlap_cases=()) -> dict:
    """One world for everything: the layout comparisons, the all-to-all comparison, the
    overlapped all-to-all against the blocking one, and the transfers' lifetime."""
    return {"layouts": train_and_compare(cases), "a2a": compare_a2a(*a2a_args),
            "overlap": compare_overlap(list(overlap_cases)), "alive": transfers_alive_after_steps()}


def run_parts(parts: list[tuple[str, object, tuple]]) -> dict:
    """(On every rank.) Each `(name, function, args)` of `parts` in turn in this one world: its
    result by name, or `{"error": traceback}` where it raised; once a part has failed the
    later ones do not run (the ranks' collectives may be out of step)."""
    import traceback

    out, failed = {}, None
    for name, fn, args in parts:
        if failed is not None:
            out[name] = {"error": f"not run: part {failed!r} of the same world failed before it"}
            continue
        try:
            out[name] = fn(*args)
        except Exception:
            out[name], failed = {"error": traceback.format_exc()}, name
    return out


def sharded_grad_norm() -> dict:
    """`replicas.clip_grad_norm` on a 2 x 2 (dp, tp) mesh over gradients of every placement mix
    (sharded on one dim, on both, unevenly, replicated) plus a plain tensor: the norm of the
    whole tensors, and after clipping the whole gradients have norm `max_norm`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from rlfusion.parallel.data_parallel import clip_grad_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(5, 6, generator=g) for _ in range(4)] + [torch.randn(7, generator=g)]
    params = []
    for whole, placements in zip(wholes, [(Shard(0), Replicate()), (Replicate(), Shard(1)),
                                          (Shard(0), Shard(1)), (Replicate(), Replicate())]):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(whole), mesh, placements))
        p.grad = distribute_tensor(whole.clone(), mesh, placements)
        params.append(p)
    plain = torch.nn.Parameter(torch.zeros(7))
    plain.grad = wholes[-1].clone()
    params.append(plain)
    norm = clip_grad_norm(params, max_norm=1.0)
    clipped = torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten()
                         for p in params])
    return {"norm": float(norm), "want": float(torch.linalg.vector_norm(torch.cat([w.flatten() for w in wholes]))),
            "clipped": float(torch.linalg.vector_norm(clipped))}
