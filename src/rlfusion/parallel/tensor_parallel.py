"""Tensor parallelism for one decoder block: attention heads and dense/shared-expert FFN
columns split over the `tp` mesh axis (Megatron style, via DTensor `parallelize_module`).

Owns the plan (which Linear is column- or row-wise) and the per-rank head counts the plain
attention modules use to reshape their projections. Activations between blocks stay replicated
(no sequence parallelism). It does not touch routed experts (`expert_parallel.py`), the router,
norms, the embedding or the LM head, which stay replicated over TP (the vocabulary is tiny and
odd-sized in the debug presets).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlfusion.model.attention import GroupedQueryAttention
from rlfusion.model.transformer import Block


def _swiglu_plan(prefix: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # only TP layouts pay its import

    return {f"{prefix}.gate": ColwiseParallel(), f"{prefix}.up": ColwiseParallel(),
            f"{prefix}.down": RowwiseParallel()}


def _attention_plan(attn: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(attn, GroupedQueryAttention):
        return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel()}
    # MLA: the KV latent (wkv_a) is shared by all heads, so it stays replicated.
    wq = "attn.wq.2" if isinstance(attn.wq, nn.Sequential) else "attn.wq"
    return {wq: ColwiseParallel(), "attn.wkv_b": ColwiseParallel(), "attn.wo": RowwiseParallel()}


class _AllReduceGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces `grad[..., start:]` over TP.

    MLA's shared RoPE key (the tail of `wkv_a`'s output) is broadcast to every head, so with
    heads split over TP each rank's gradient for it is a partial sum over its own heads. The
    latent part needs no reduction: `wkv_b`'s column-parallel input already all-reduces it.
    """

    @staticmethod
    def forward(ctx, x, start, group):
        ctx.args = (start, group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start, group = ctx.args
        grad = grad.clone()
        tail = grad[..., start:].contiguous()
        dist.all_reduce(tail, group=group)
        grad[..., start:] = tail
        return grad, None, None


def _reduce_rope_key_grad(attn: nn.Module, tp_mesh: DeviceMesh) -> None:
    group, start = tp_mesh.get_group(), attn.kv_rank
    attn.wkv_a.register_forward_hook(
        lambda module, args, out: _AllReduceGradTail.apply(out, start, group))


def _place_adapters(block: Block, plan: dict, tp_mesh: DeviceMesh) -> None:
    """LoRA adapters (`model/lora.py`) of the split Linears: a column-parallel `W [out, in]`
    keeps `A [r, in]` whole and splits `B [out, r]` by rows with W's; a row-parallel one splits
    `A` by columns with W's (its `x A^T` is a partial sum, reduced with the layer's output) and
    keeps `B` whole. The styles shard every parameter of a column-parallel Linear by rows and
    leave a row-parallel one's others alone, so both are placed here."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    for name, style in plan.items():
        module = block.get_submodule(name)
        if getattr(module, "lora_A", None) is None:
            continue
        column = isinstance(style, ColwiseParallel)
        for attr, placement in (("lora_A", Replicate() if column else Shard(1)),
                                ("lora_B", Shard(0) if column else Replicate())):
            t = getattr(module, attr).detach()
            t = t.redistribute(tp_mesh, [placement]) if isinstance(t, DTensor) else distribute_tensor(t, tp_mesh, [placement])
            module.register_parameter(attr, nn.Parameter(t))


def apply_tensor_parallel(block: Block, tp_mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    plan = _attention_plan(block.attn)
    if not block.is_moe:
        plan |= _swiglu_plan("mlp")
    elif block.mlp.shared is not None:
        plan |= _swiglu_plan("mlp.shared")
    trains = {name: p.requires_grad for name, p in block.named_parameters()}
    parallelize_module(block, tp_mesh, plan)
    _place_adapters(block, plan, tp_mesh)
    for name, p in block.named_parameters():  # (the styles make every parameter anew, trainable)
        p.requires_grad_(trains[name])
    # Column-parallel projections now produce this rank's heads only.
    block.attn.num_heads //= tp
    if isinstance(block.attn, GroupedQueryAttention):
        block.attn.num_kv_heads //= tp
    else:
        _reduce_rope_key_grad(block.attn, tp_mesh)
