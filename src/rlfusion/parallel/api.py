"""`parallelize(model, layout)`: apply a `ParallelLayout` to a plain `MoETransformer`, and the
`ParallelModel` handle a training step uses.

Order: validate and build groups → cut pipeline chunks → TP per block → swap routed experts
for their EP shard → FSDP2 per chunk. One `forward_backward` call yields one optimizer step's
gradients (pipeline micro-batches inside, expert grads reduced at the end); the optimizer is
the caller's, over `parameters()`. `full_state_dict()` gathers the plain model's state dict
(same names) from any layout, which the train↔inference reshard builds on.

Owns the step protocol across layouts; it does not know about RL or optimizers.

Legend: B rows (this data-parallel rank's), T tokens, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rlfusion.model.moe import Router
from rlfusion.model.transformer import Block, MoETransformer
from rlfusion.parallel.data_parallel import apply_fsdp, shard_batch
from rlfusion.parallel.expert_parallel import CommCounter, ExpertParallelExperts
from rlfusion.parallel.layout import ParallelLayout
from rlfusion.parallel.mesh import ParallelMesh, build_mesh
from rlfusion.parallel.pipeline import build_schedule, split_model, stage_indices
from rlfusion.parallel.tensor_parallel import apply_tensor_parallel


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (the same on every micro-batch, so means compose)."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten())


class ParallelModel:
    def __init__(self, mesh: ParallelMesh, chunks: list[nn.Module], cfg, n_microbatches: int,
                 loss_fn: Callable, device: torch.device):
        self.mesh, self.layout, self.chunks, self.config = mesh, mesh.layout, chunks, cfg
        self.n_microbatches, self.loss_fn, self.device = n_microbatches, loss_fn, device
        self.experts = [m for c in chunks for m in c.modules() if isinstance(m, ExpertParallelExperts)]
        self._schedule, self._schedule_shape = None, None

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def train(self, mode: bool = True) -> "ParallelModel":
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def shard_batch(self, x_B: torch.Tensor) -> torch.Tensor:
        return shard_batch(x_B, self.mesh.coord("dp"), self.layout.dp)

    # ---- one step ----------------------------------------------------------------------------

    def forward_backward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> float:
        """Accumulate this rank's gradients for one step; returns the global mean loss."""
        if self.layout.pp == 1:
            logits = self.chunks[0](tokens_BT)
            loss = self.loss_fn(logits, targets_BT)
            if self.config.aux_loss_coef > 0:
                loss = loss + self.chunks[0].aux_loss()
            loss.backward()
            local = loss.detach().clone()
        else:
            local = self._pipeline_step(tokens_BT, targets_BT)
        if self.layout.dp > 1:
            dist.all_reduce(local, group=self.mesh.group("dp"))
        for experts in self.experts:
            experts.sync_grads()
        return float(local) / self.layout.dp

    def _pipeline_step(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        pp_index, pp = self.mesh.coord("pp"), self.layout.pp
        self._ensure_schedule(tokens_BT.shape)
        losses: list[torch.Tensor] = []
        if pp_index == 0:
            self._schedule.step(tokens_BT, target=targets_BT if pp == 1 else None, losses=losses)
        elif pp_index == pp - 1:
            self._schedule.step(target=targets_BT, losses=losses)
        else:
            self._schedule.step()
        local = (torch.stack(losses).mean().detach() if losses
                 else torch.zeros((), device=self.device))
        dist.all_reduce(local, group=self.mesh.group("pp"))  # only the last stage has it
        return local

    def _ensure_schedule(self, shape_BT: torch.Size) -> None:
        B, T = shape_BT
        n, pp = self.n_microbatches, self.layout.pp
        if B % n:
            raise ValueError(f"rows per data-parallel rank {B} must be divisible by "
                             f"n_microbatches={n}")
        if self._schedule_shape == (B, T):
            return
        self._schedule = build_schedule(
            self.chunks, stage_indices(pp, self.layout.vpp, self.mesh.coord("pp")),
            self.layout.num_stages, self.mesh.group("pp"), self.device, (B // n, T),
            self.config.d_model, self.config.vocab_size, n, self.loss_fn)
        self._schedule_shape = (B, T)

    @torch.no_grad()
    def update_router_bias(self) -> None:
        """Aux-loss-free balancing on the global token counts (summed over data parallel)."""
        for chunk in self.chunks:
            for router in (m for m in chunk.modules() if isinstance(m, Router)):
                if self.layout.dp > 1:
                    dist.all_reduce(router.tokens_per_expert, group=self.mesh.group("dp"))
                router.update_bias(self.config.bias_update_rate)

    # ---- weights and counters ----------------------------------------------------------------

    def comm_counter(self) -> CommCounter:
        total = CommCounter()
        for e in self.experts:
            total.sent_bytes += e.counter.sent_bytes
            total.internode_bytes += e.counter.internode_bytes
            total.calls += e.counter.calls
        return total

    def reset_comm_counters(self) -> None:
        for e in self.experts:
            e.counter.reset()

    @torch.no_grad()
    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """The plain model's state dict (same keys, full tensors, on CPU) on every rank.

        Collective over the whole world: TP/FSDP DTensors are gathered with `full_tensor()`,
        expert shards over their EP group, pipeline stages over the pp group. A rank with
        `keep=False` joins every gather, drops each tensor at once (unless its stage's part must
        travel to the other stages) and returns None.
        """
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            owner = {id(p): m for m in chunk.modules() if isinstance(m, ExpertParallelExperts)
                     for p in m.parameters(recurse=False)}
            tensors = dict(chunk.named_parameters()) | dict(chunk.named_buffers())
            for name in chunk.state_dict():
                t = tensors[name]
                if isinstance(t, DTensor):
                    t = t.full_tensor()
                elif id(t) in owner:
                    t = owner[id(t)].gather_full(t)
                if keep or self.layout.pp > 1:
                    out[name] = t.detach().cpu().clone()
        if self.layout.pp > 1:
            parts: list = [None] * self.layout.pp
            dist.all_gather_object(parts, out, group=self.mesh.group("pp"))
            out = {k: v for part in parts for k, v in part.items()}
        return out if keep else None


def parallelize(model: MoETransformer, layout: ParallelLayout, *, n_microbatches: int = 1,
                loss_fn: Callable = lm_loss, device_type: str = "cpu") -> ParallelModel:
    """Apply `layout` to `model` (modified in place; with pp > 1 only this rank's chunks live on)."""
    cfg = model.config
    if layout.pp > 1 and (n_microbatches < layout.pp or n_microbatches % layout.pp):
        raise ValueError(f"n_microbatches={n_microbatches} is invalid: must be a multiple of "
                         f"layout.pp={layout.pp} (1F1B keeps pp micro-batches in flight)")
    mesh = build_mesh(layout, cfg, device_type)  # validates before creating any group
    chunks: list[nn.Module] = ([model] if layout.pp == 1 else
                               split_model(model, layout.pp, layout.vpp, mesh.coord("pp")))
    for chunk in chunks:
        for block in [m for m in chunk.modules() if isinstance(m, Block)]:
            if layout.tp > 1:
                apply_tensor_parallel(block, mesh.device_mesh["tp"])
            if block.is_moe and layout.ep > 1:
                block.mlp.experts = ExpertParallelExperts(block.mlp.experts, mesh)
        if layout.dp > 1:
            apply_fsdp(chunk, mesh.device_mesh["dp"])
    device = torch.device(device_type) if device_type == "cpu" else torch.device(
        device_type, torch.accelerator.current_device_index())
    return ParallelModel(mesh, chunks, cfg, n_microbatches, loss_fn, device)
