"""Pipeline parallelism: cutting the plain model into stage chunks and running them with
1F1B (`vpp=1`) or interleaved 1F1B (`vpp>1`) from `torch.distributed.pipelining`, or with
Adaptive Pipe (`overlap_fb`, `overlap.py`).

Owns the layer split (`stage_layers`: each of the `S = pp*vpp` stages holds a contiguous,
non-empty range of layers, the ranges balanced by cost, so any `num_layers >= S` works; pipeline
rank `p` holds stages `p, p+pp, p+2pp, ...`, the looped placement interleaving needs, or with
`overlap_fb` the V `p, 2pp-1-p`) and the
`PipelineChunk` module that runs one stage. Chunks keep the plain model's parameter
names (`layers.3.attn.wq.weight`), so state dicts merge back without renaming. It does not know
about TP, EP or FSDP, which are applied to the chunks afterwards.

Legend: B micro-batch rows, T tokens, D model dim, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from rlfusion.model.config import ModelConfig
from rlfusion.model.flops import head_matmul_flops, layer_matmul_flops
from rlfusion.model.kv_cache import AttnContext
from rlfusion.model.routes import Routes
from rlfusion.model.transformer import MoETransformer
from rlfusion.partition import partition, ranges


class PipelineChunk(nn.Module):
    """Layers `[first, last)`, plus the embedding on the first stage and norm + head on the last."""

    def __init__(self, model: MoETransformer, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.embed = model.embed if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.top_k = model.config.top_k
        self.replay = False  # route by the given routes (else only compare with them)
        self.observed: list[Routes] = []  # this pass's routes, per micro-batch (the mismatch metrics)

    def forward(self, x: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens `[B, T]` (first stage) or hidden `[B, T, D]` → hidden, or logits `[B, T, V]`.
        `routes` `[B, T, L * K]`: the rollout's experts per token and MoE layer, replayed with
        `replay` else compared (`model.routes`; every stage gets the micro-batch's, each uses its
        own layers')."""
        x_BTD = self.embed(x) if self.embed is not None else x
        ctx = AttnContext.build(x_BTD.shape[0], x_BTD.shape[1], None, x_BTD.device)
        given = None
        if routes is not None:
            given = Routes(routes.flatten(0, 1).view(x_BTD.shape[0] * x_BTD.shape[1], -1, self.top_k), self.replay)
            self.observed.append(given)
        for layer in self.layers.values():
            x_BTD = layer(x_BTD, ctx, given)
        if self.norm is None:
            return x_BTD
        return self.lm_head(self.norm(x_BTD))


def stage_indices(pp: int, vpp: int, pp_index: int, v: bool = False) -> list[int]:
    """The stages pipeline rank `pp_index` holds: looped (`p, p+pp, ...`, interleaved 1F1B) or,
    with `v` (two per rank, the forward/backward-overlapped schedule), a V: `p` and `2pp-1-p`."""
    if v:
        return [pp_index, 2 * pp - 1 - pp_index]
    return [chunk * pp + pp_index for chunk in range(vpp)]


def layer_costs(cfg: ModelConfig) -> list[float]:
    """What each layer costs its stage, in forward matmul FLOPs per token (`model.flops`; the
    backward is about twice the forward for every layer alike, so it changes no split): a dense
    or an MoE layer (its shared experts, router and the `top_k` routed experts a token chose).
    The last layer also carries the LM head (the loss over the vocabulary is a few FLOPs per
    logit beside the head's `2 * d_model` per logit). The first layer carries the embedding, a
    row lookup: no FLOPs. The attention core (the same in every layer) is left out, so the
    split does not depend on the sequence length."""
    costs = [layer_matmul_flops(cfg, i) for i in range(cfg.num_layers)]
    costs[-1] += head_matmul_flops(cfg)
    return costs


def stage_layers(cfg: ModelConfig, num_stages: int) -> list[range]:
    """The layers of each pipeline stage: contiguous, non-empty ranges covering every layer once,
    cut so the costliest stage (`layer_costs`) is as cheap as any cut makes it. The one rule of
    the split: a config and a stage count always give the same ranges."""
    return ranges(partition(layer_costs(cfg), num_stages))


def split_model(model: MoETransformer, pp: int, vpp: int, pp_index: int, v: bool = False) -> list[PipelineChunk]:
    num_stages = pp * vpp
    layers = stage_layers(model.config, num_stages)
    return [PipelineChunk(model, layers[s].start, layers[s].stop, s == 0, s == num_stages - 1)
            for s in stage_indices(pp, vpp, pp_index, v)]


class PaddedRouting:
    """Router load counts of padded micro-batches count real tokens only.

    A pipeline runs rows padded to one shape, and every padding token is routed like a real one
    (causal attention keeps it from changing the real tokens' outputs, but the routers'
    `tokens_per_expert`, which the aux-loss-free bias update and expert balancing read, would
    count it). Hooks on each chunk's routers, from outside the model file, recount each forward
    over the real tokens of the micro-batch it runs: a chunk runs its micro-batches in order, so
    a per-chunk counter names the micro-batch. `set_valid` gives the pass's masks."""

    def __init__(self, chunks: list[nn.Module]):
        from rlfusion.model.moe import Router

        self.valid: list[torch.Tensor] | None = None  # per micro-batch, [b, T] bool
        self._seen = [0] * len(chunks)
        self._handles = []
        self._chunk_of: dict[int, int] = {}  # id(router) → its chunk
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._chunk_hook(c)))
            for router in (m for m in chunk.modules() if isinstance(m, Router)):
                self._chunk_of[id(router)] = c
                self._handles.append(router.register_forward_pre_hook(self._before))
                self._handles.append(router.register_forward_hook(self._after(c)))
        self._saved: dict[int, torch.Tensor] = {}

    def valid_of(self, router: nn.Module) -> torch.Tensor | None:
        """The real-token mask (`[N]` bool) of the micro-batch `router` is routing now; None
        outside a pipeline pass (every token is real)."""
        c = self._chunk_of.get(id(router))
        if self.valid is None or c is None or self._seen[c] == 0:
            return None
        return self.valid[self._seen[c] - 1].reshape(-1)

    def set_valid(self, valid: list[torch.Tensor] | None) -> None:
        self.valid, self._seen = valid, [0] * len(self._seen)

    def _chunk_hook(self, c: int):
        def hook(module, args):
            self._seen[c] += 1
        return hook

    def _before(self, router, args) -> None:
        if self.valid is not None:
            self._saved[id(router)] = router.tokens_per_expert.clone()

    def _after(self, c: int):
        def hook(router, args, output) -> None:
            from rlfusion.parallel.recompute import is_recomputing

            before = self._saved.pop(id(router), None)
            if before is None or not (router.training and torch.is_grad_enabled()) or is_recomputing():
                return  # (a replay in backward restores the counts itself)
            valid_N = self.valid[self._seen[c] - 1].reshape(-1).to(output[0].device)
            counts_E = torch.bincount(output[0][valid_N].flatten(), minlength=router.num_experts)
            router.tokens_per_expert.copy_(before + counts_E.float())
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def build_schedule(chunks: list[nn.Module], stages: list[int], num_stages: int, group,
                   device: torch.device, micro_BT: tuple[int, int], d_model: int, vocab: int,
                   n_microbatches: int, loss_fn: Callable, overlap=None):
    """One `PipelineStage` per chunk, with example shapes (MoE routing is data-dependent, so
    the stages cannot infer shapes by running the model on meta tensors). `requires_grad`
    on the examples tells the stage that activations and their gradients flow both ways.
    `overlap` (an `overlap.OverlapOrder`): the forward/backward-overlapped V schedule
    (`overlap.dualpipev_schedule`); else 1F1B, or interleaved 1F1B with several chunks."""
    # imported here, not with the module: it pulls in torch._dynamo (~0.3 s), which every
    # device worker and CLI process would pay at start-up even without a pipeline layout
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    B, T = micro_BT
    hidden = torch.empty(B, T, d_model, device=device, requires_grad=True)
    pipeline_stages = []
    for chunk, s in zip(chunks, stages):
        inp = torch.zeros(B, T, dtype=torch.long, device=device) if s == 0 else hidden
        out = torch.empty(B, T, vocab, device=device, requires_grad=True) if s == num_stages - 1 else hidden
        pipeline_stages.append(PipelineStage(chunk, s, num_stages, device, input_args=(inp,),
                                             output_args=(out,), group=group))
    if overlap is not None:
        from rlfusion.parallel.overlap import dualpipev_schedule

        return dualpipev_schedule(pipeline_stages, n_microbatches, loss_fn, overlap)
    if len(pipeline_stages) == 1:
        return Schedule1F1B(pipeline_stages[0], n_microbatches, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches, loss_fn=loss_fn)
