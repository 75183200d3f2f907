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

from rlfusion.model.moe import Router
from rlfusion.model.transformer import Block, MoETransformer
from rlfusion.parallel.data_parallel import apply_fsdp, shard_batch
from rlfusion.parallel.expert_parallel import CommCounter, ExpertParallelExperts, LinkModel
from rlfusion.parallel.layout import ParallelLayout
from rlfusion.parallel.mesh import ParallelMesh, build_mesh
from rlfusion.parallel.overlap import OverlapOrder
from rlfusion.parallel.sharded import is_dtensor
from rlfusion.parallel.pipeline import PaddedRouting, build_schedule, split_model, stage_indices
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
        self._loss_now: Callable = loss_fn  # what the schedule's loss calls (`pipeline_pass` sets it)
        self.routing = PaddedRouting(chunks) if mesh.layout.pp > 1 else None
        # Adaptive Pipe's order (`overlap.py`), agreed over the stage's ranks (their pairs'
        # collectives must interleave alike): the sum over the whole layout
        self.overlap = OverlapOrder(self._sum_over_layout) if mesh.layout.overlap_fb else None

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the plain model's names (a pipeline chunk keeps them)."""
        return [item for chunk in self.chunks for item in chunk.named_parameters()]

    def trained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The named parameters the optimizer updates (with LoRA only the adapters)."""
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This rank's part of the plain model's state dict (its shards, its stages)."""
        return {k: v for chunk in self.chunks for k, v in chunk.state_dict(keep_vars=keep_vars).items()}

    def routers(self) -> list[Router]:
        return [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, Router)]

    @property
    def stages(self) -> list[int]:
        """The pipeline stages this rank holds (looped, or a V with `overlap_fb`)."""
        return stage_indices(self.layout.pp, self.layout.vpp, self.mesh.coord("pp"), self.layout.overlap_fb)

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the first stage: it reads the tokens."""
        return 0 in self.stages

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the last stage: it computes the loss (pp rank 0 in the V)."""
        return self.layout.num_stages - 1 in self.stages

    @property
    def loss_pp_index(self) -> int:
        """The pipeline index of the ranks that hold the last stage (the loss and its metrics)."""
        return 0 if self.layout.overlap_fb else self.layout.pp - 1

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

    def pipeline_pass(self, tokens_BT: torch.Tensor, side_BTK: torch.Tensor, loss_fn: Callable,
                      n_microbatches: int, valid_BT: torch.Tensor, backward: bool = True,
                      routes_BTX: torch.Tensor | None = None) -> None:
        """One pass of the pipeline schedule over this data-parallel rank's rows, padded to one
        shape: `tokens_BT` enter the first stage; `side_BTK` (the per-token inputs the loss
        reads: targets, masks, advantages, old logprobs...) is split into micro-batches like
        the rows and reaches `loss_fn(logits_bTV, side_bTK)` on the last stage, whose losses are
        summed, not averaged (a loss normalized by the global batch); with `backward`
        gradients accumulate (the layout's schedule: 1F1B, interleaved 1F1B or Adaptive Pipe),
        else the pass is forward only.
        `valid_BT` marks real tokens: only they count in the routers' load. `routes_BTX`: MoE
        routes to replay (`PipelineChunk.forward`), split into micro-batches like the rows and
        given to every stage. Every rank of the pipeline passes the same shapes (the first and
        last stage read the tensors)."""
        self._ensure_schedule(tokens_BT.shape, n_microbatches)
        self._loss_now = loss_fn
        self.routing.set_valid(list(valid_BT.tensor_split(n_microbatches)))
        self._schedule.scale_grads = False
        args = (tokens_BT,) if self.is_first_stage else ()
        target = side_BTK if self.is_last_stage else None
        run = self._schedule.step if backward else self._schedule.eval
        kwargs = {"routes": routes_BTX} if routes_BTX is not None else {}
        try:
            run(*args, target=target, return_outputs=False, **kwargs)
        finally:
            self.routing.set_valid(None)
            self._loss_now = self.loss_fn
        if backward and self.overlap is not None:
            self.overlap.settle()

    def _pipeline_step(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        self._ensure_schedule(tokens_BT.shape, self.n_microbatches)
        self._schedule.scale_grads = True  # the mean loss of each micro-batch: their mean
        losses: list[torch.Tensor] = []
        args = (tokens_BT,) if self.is_first_stage else ()
        if self.is_last_stage:
            self._schedule.step(*args, target=targets_BT, losses=losses, return_outputs=False)
        else:
            self._schedule.step(*args, return_outputs=False)
        if self.overlap is not None:
            self.overlap.settle()
        local = (torch.stack(losses).mean().detach() if losses
                 else torch.zeros((), device=self.device))
        dist.all_reduce(local, group=self.mesh.group("pp"))  # only the last stage has it
        return local

    def _ensure_schedule(self, shape_BT: torch.Size, n: int) -> None:
        B, T = shape_BT
        pp = self.layout.pp
        if B % n:
            raise ValueError(f"rows per data-parallel rank {B} must be divisible by "
                             f"n_microbatches={n}")
        if n < self.layout.min_microbatches or n % pp:
            raise ValueError(f"n_microbatches={n} is invalid: must be a multiple of layout.pp={pp} and at least "
                             f"{self.layout.min_microbatches}")
        if self._schedule_shape == (B, T, n):
            return
        self._schedule = build_schedule(
            self.chunks, stage_indices(pp, self.layout.vpp, self.mesh.coord("pp"), self.layout.overlap_fb),
            self.layout.num_stages, self.mesh.group("pp"), self.device, (B // n, T),
            self.config.d_model, self.config.vocab_size, n, lambda out, target: self._loss_now(out, target),
            self.overlap)
        self._schedule_shape = (B, T, n)

    def _sum_over_layout(self, t: torch.Tensor) -> None:
        for axis in ("pp", "dp", "tp"):
            if self.mesh.size(axis) > 1:
                dist.all_reduce(t, group=self.mesh.group(axis))

    def overlap_report(self) -> dict[str, float]:
        """Adaptive Pipe's chosen order and the pair times it was chosen from (`overlap.py`);
        {} without it."""
        return {} if self.overlap is None else self.overlap.report()

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
        """This rank's expert all-to-all figures since the last reset: bytes sent, calls, and
        the seconds it waited on them (its exposed expert communication)."""
        total = CommCounter()
        for e in self.experts:
            total.sent_bytes += e.counter.sent_bytes
            total.internode_bytes += e.counter.internode_bytes
            total.calls += e.counter.calls
            total.wait_s += e.counter.wait_s
        return total

    def emulate_link(self, latency_s: float, bytes_per_s: float) -> None:
        """Give this rank's expert all-to-alls an emulated link (`expert_parallel.LinkModel`),
        one for all its layers, as one network port would be: for measuring how much of that
        communication computation hides where the real link is nearly free."""
        link = LinkModel(latency_s, bytes_per_s)
        for e in self.experts:
            e.link = link

    def reset_comm_counters(self) -> None:
        for e in self.experts:
            e.counter.reset()

    @torch.no_grad()
    def full_state_dict(self, keep: bool = True, part=None) -> dict[str, torch.Tensor] | None:
        """The plain model's state dict (same keys, full tensors, on CPU) on every rank.

        Collective over the whole world: TP/FSDP DTensors are gathered with `full_tensor()`,
        expert shards over their EP group, pipeline stages over the pp group. A rank with
        `keep=False` joins every gather, drops each tensor at once (unless its stage's part must
        travel to the other stages) and returns None. `part`: only the names it accepts (None:
        all; `lora.is_adapter`: a LoRA model's adapters).
        """
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            owner = {id(p): m for m in chunk.modules() if isinstance(m, ExpertParallelExperts)
                     for p in m.parameters(recurse=False)}
            tensors = dict(chunk.named_parameters()) | dict(chunk.named_buffers())
            for name in chunk.state_dict():
                if part is not None and not part(name):
                    continue
                t = tensors[name]
                if is_dtensor(t):
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
                loss_fn: Callable = lm_loss, device_type: str = "cpu", fsdp: bool = True,
                sum_gradients: bool = False, ranks: list[int] | None = None) -> ParallelModel:
    """Apply `layout` to `model` (modified in place; with pp > 1 only this rank's chunks live on).

    Data parallelism (dp > 1) shards with FSDP2, averaging gradients (`sum_gradients`: summing
    them, for a loss normalized by the global batch); with `fsdp=False` each data-parallel rank
    keeps a whole replica of its stage and the caller sums the gradients (`data_parallel.
    sum_over_replicas`). `ranks`: the global ranks the layout spans (default: the world); the
    ranks outside it must call `mesh.build_mesh(layout, cfg, ranks=ranks)` at the same point,
    since process groups are created by every rank."""
    cfg = model.config
    if layout.pp > 1 and (n_microbatches < layout.min_microbatches or n_microbatches % layout.pp):
        raise ValueError(f"n_microbatches={n_microbatches} is invalid: must be a multiple of layout.pp={layout.pp} "
                         f"and at least {layout.min_microbatches} (the micro-batches the schedule keeps in flight)")
    mesh = build_mesh(layout, cfg, device_type, ranks)  # validates before creating any group
    if mesh is None:
        raise ValueError(f"rank {dist.get_rank()} is not one of the layout's ranks {ranks}")
    chunks: list[nn.Module] = ([model] if layout.pp == 1 else
                               split_model(model, layout.pp, layout.vpp, mesh.coord("pp"), layout.overlap_fb))
    for chunk in chunks:
        for block in [m for m in chunk.modules() if isinstance(m, Block)]:
            if layout.tp > 1:
                apply_tensor_parallel(block, mesh.device_mesh["tp"])
            if block.is_moe and layout.ep > 1:
                block.mlp.experts = ExpertParallelExperts(block.mlp.experts, mesh)
        if layout.dp > 1 and fsdp:
            apply_fsdp(chunk, mesh.device_mesh["dp"], sum_gradients=sum_gradients)
    device = torch.device(device_type) if device_type == "cpu" else torch.device(
        device_type, torch.accelerator.current_device_index())
    return ParallelModel(mesh, chunks, cfg, n_microbatches, loss_fn, device)
