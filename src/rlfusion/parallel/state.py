"""A training layout's state in the plain model's terms: the whole tensors a checkpoint holds,
gathered from this rank's shards and stages, and this rank's part of them when loading back.

Owns the per-parameter conversion (TP/FSDP DTensors gathered over their mesh and redistributed,
expert shards gathered over their expert-parallel group in logical expert order and cut to this
rank's slots) and the optimizer state keyed by the plain model's parameter order, the key a
replica's checkpoint uses, so checkpoints move between layouts. It does not know about RL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlfusion.parallel.data_parallel import local_tensor
from rlfusion.parallel.api import ParallelModel
from rlfusion.parallel.sharded import is_dtensor


class LayoutState:
    """`param_index`: the plain model's trained parameter name → its position among them (the
    optimizer key: every weight, or with LoRA the adapters)."""

    def __init__(self, pm: ParallelModel, param_index: dict[str, int]):
        self.pm, self.param_index = pm, param_index
        self.experts_of = {id(p): m for m in pm.experts for p in m.parameters(recurse=False)}

    def whole(self, t: Any, param: torch.Tensor) -> Any:
        """A parameter's (or its optimizer state's) whole tensor from this rank's shard
        (collective: every rank of the layout calls it in the same order)."""
        if is_dtensor(t):
            return t.full_tensor()
        experts = self.experts_of.get(id(param))
        if experts is not None and isinstance(t, torch.Tensor) and t.shape == param.shape:
            return experts.gather_full(t)
        return t

    def part(self, whole: Any, param: torch.Tensor) -> Any:
        """This rank's part of a whole tensor, laid out like `param` (the inverse of `whole`)."""
        if not isinstance(whole, torch.Tensor):
            return whole
        if is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor  # loaded: the layout made DTensors

            return distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        experts = self.experts_of.get(id(param))
        if experts is not None and whole.shape[1:] == param.shape[1:] and whole.shape[0] != param.shape[0]:
            slots = slice(experts.first_expert, experts.first_expert + experts.num_local)
            if experts.expert_to_slot_E is None:
                return whole[slots]
            order = experts.expert_to_slot_E.argsort().to(whole.device)
            return whole[order[slots]]  # the logical experts in this rank's slots
        return whole

    def optimizer_whole(self, optimizer: dict, keep: bool) -> dict | None:
        """`optimizer.state_dict()` of this rank's parameters → whole tensors keyed by the plain
        model's order (collective; with pipeline stages every stage's part travels to all).
        A rank with `keep=False` joins and returns None."""
        names = [name for name, _ in self.pm.trained_parameters()]
        params = [p for _, p in self.pm.trained_parameters()]
        pipeline = self.pm.layout.pp > 1
        whole = {}
        for i, st in sorted(optimizer["state"].items()):
            gathered = {k: _host(self.whole(v, params[i])) for k, v in st.items()}  # (in host memory: it travels)
            if keep or pipeline:
                whole[self.param_index[names[i]]] = gathered
        if pipeline:
            parts: list = [None] * self.pm.layout.pp
            dist.all_gather_object(parts, whole, group=self.pm.mesh.group("pp"))
            whole = dict(sorted(kv for part in parts for kv in part.items()))
        if not keep:
            return None
        groups = [{**g, "params": list(range(len(self.param_index)))} for g in optimizer["param_groups"]]
        return {"state": whole, "param_groups": groups}

    def optimizer_part(self, saved: dict, local_groups: list[dict]) -> dict:
        """A whole optimizer state (keyed by the plain model's order) → this rank's, for an
        optimizer over `pm.parameters()` whose own param groups are `local_groups`."""
        states = {int(i): st for i, st in saved["state"].items()}
        mine: dict[int, Any] = {}
        for i, (name, p) in enumerate(self.pm.trained_parameters()):
            st = states.get(self.param_index[name])
            if st is not None:
                mine[i] = {k: self.part(v, p) if k != "step" else v for k, v in st.items()}
        return {"state": mine, "param_groups": [{**g, "params": own["params"]}
                                                for g, own in zip(saved["param_groups"], local_groups)]}

    @torch.no_grad()
    def load_weights(self, model_state: dict[str, torch.Tensor], part=None) -> None:
        """Whole weights → this rank's shards and stages, in place (`part`: which names
        `model_state` holds, None: all; `lora.is_adapter`: the adapters)."""
        for name, t in self.pm.state_dict(keep_vars=True).items():
            if part is None or part(name):
                local_tensor(t).copy_(local_tensor(self.part(model_state[name], t)))


def _host(value):
    """A tensor in host memory (whole optimizer state leaves the device: it is gathered to
    every pipeline stage and checkpointed), anything else as it is."""
    return value.cpu() if isinstance(value, torch.Tensor) and value.device.type != "cpu" else value
