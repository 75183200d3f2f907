"""Pipeline parallelism: cutting the plain model into stage chunks and running them with
1F1B (`vpp=1`) or interleaved 1F1B (`vpp>1`) from `torch.distributed.pipelining`.

Owns the layer split (stage `s` holds layers `[s*L/S, (s+1)*L/S)` of `S = pp*vpp` stages;
pipeline rank `p` holds stages `p, p+pp, p+2pp, ...`, the looped placement interleaving needs)
and the `PipelineChunk` module that runs one stage. Chunks keep the plain model's parameter
names (`layers.3.attn.wq.weight`), so state dicts merge back without renaming. It does not know
about TP, EP or FSDP, which are applied to the chunks afterwards.

Legend: B micro-batch rows, T tokens, D model dim, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from rlfusion.model.kv_cache import AttnContext
from rlfusion.model.transformer import MoETransformer


class PipelineChunk(nn.Module):
    """Layers `[first, last)`, plus the embedding on the first stage and norm + head on the last."""

    def __init__(self, model: MoETransformer, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.embed = model.embed if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[B, T]` (first stage) or hidden `[B, T, D]` → hidden, or logits `[B, T, V]`."""
        x_BTD = self.embed(x) if self.embed is not None else x
        ctx = AttnContext.build(x_BTD.shape[0], x_BTD.shape[1], None, x_BTD.device)
        for layer in self.layers.values():
            x_BTD = layer(x_BTD, ctx)
        if self.norm is None:
            return x_BTD
        return self.lm_head(self.norm(x_BTD))


def stage_indices(pp: int, vpp: int, pp_index: int) -> list[int]:
    return [chunk * pp + pp_index for chunk in range(vpp)]


def split_model(model: MoETransformer, pp: int, vpp: int, pp_index: int) -> list[PipelineChunk]:
    num_stages, num_layers = pp * vpp, model.config.num_layers
    per_stage = num_layers // num_stages
    return [PipelineChunk(model, s * per_stage, (s + 1) * per_stage, s == 0, s == num_stages - 1)
            for s in stage_indices(pp, vpp, pp_index)]


def build_schedule(chunks: list[nn.Module], stages: list[int], num_stages: int, group,
                   device: torch.device, micro_BT: tuple[int, int], d_model: int, vocab: int,
                   n_microbatches: int, loss_fn: Callable):
    """One `PipelineStage` per chunk, with example shapes (MoE routing is data-dependent, so
    the stages cannot infer shapes by running the model on meta tensors). `requires_grad`
    on the examples tells the stage that activations and their gradients flow both ways."""
    B, T = micro_BT
    hidden = torch.empty(B, T, d_model, device=device, requires_grad=True)
    pipeline_stages = []
    for chunk, s in zip(chunks, stages):
        inp = torch.zeros(B, T, dtype=torch.long, device=device) if s == 0 else hidden
        out = torch.empty(B, T, vocab, device=device, requires_grad=True) if s == num_stages - 1 else hidden
        pipeline_stages.append(PipelineStage(chunk, s, num_stages, device, input_args=(inp,),
                                             output_args=(out,), group=group))
    if len(pipeline_stages) == 1:
        return Schedule1F1B(pipeline_stages[0], n_microbatches, loss_fn=loss_fn)
    return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches, loss_fn=loss_fn)
