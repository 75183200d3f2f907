"""The MoE routes of one forward pass: which experts to replay per token and MoE layer, what the
routers chose, and how far their own choice is from a given one.

Rollout routing replay (R3): the rollout engine records, for every token it feeds its model, the
routed experts of each MoE layer (`record`); the trainer's forward over the same tokens then
routes each token to those experts (`replay`), recomputing the gate weights from its current
router over them, so the router still learns while the experts that see a token are the ones
that saw it when it was sampled. Without replay the given routes only measure the mismatch
(`agreement`): how many of the trainer's own top-k experts per token were also the rollout's.

A token with no given route (`NO_ROUTE` in every slot: the last token of a sample, never fed to
the engine) is routed by the trainer's own router, replay or not.

Legend: N tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NO_ROUTE = -1


@dataclass
class Routes:
    """Routes for one forward. `given_NLK`: each token's recorded experts per MoE layer (int,
    `NO_ROUTE` where none), or None; `replay`: route by them where given (else they are only
    compared with the router's own choice); `record`: keep each layer's choice in `chosen`."""

    given_NLK: torch.Tensor | None = None
    replay: bool = False
    record: bool = False
    chosen: list[torch.Tensor] = field(default_factory=list)  # per MoE layer fed, in order: [N, K]
    # per MoE layer index: [experts shared with the given route summed over tokens, tokens compared]
    overlap: dict[int, list[float]] = field(default_factory=dict)
    differs_N: torch.Tensor | None = None  # a token whose own choice differed in some layer

    def replayed(self, layer: int) -> torch.Tensor | None:
        """The experts MoE layer `layer` routes to (`[N, K]`, `NO_ROUTE` rows: its own), or None."""
        if not self.replay or self.given_NLK is None:
            return None
        return self.given_NLK[:, layer]

    def observe(self, layer: int, own_NK: torch.Tensor, used_NK: torch.Tensor) -> None:
        """What MoE layer `layer` chose by itself (`own_NK`) and routed to (`used_NK`); once per
        layer (a recomputed layer, in backward, routes the same tokens again)."""
        if layer in self.overlap or (self.record and len(self.chosen) > layer):
            return
        if self.record:
            self.chosen.append(used_NK.detach())
        if self.given_NLK is None:
            return
        given_NK = self.given_NLK[:, layer].to(own_NK.device)
        has_N = given_NK[:, 0] != NO_ROUTE
        shared_N = (own_NK.unsqueeze(-1) == given_NK.unsqueeze(-2)).any(-1).sum(-1)
        acc = self.overlap.setdefault(layer, [0.0, 0.0])
        acc[0] += float(shared_N[has_N].sum())
        acc[1] += float(has_N.sum())
        differs_N = has_N & (shared_N < own_NK.shape[1])
        self.differs_N = differs_N if self.differs_N is None else self.differs_N | differs_N.to(self.differs_N.device)

    def agreement(self) -> dict[int, float]:
        """Per MoE layer: the share of the router's own top-k experts that were the given ones."""
        top_k = self.given_NLK.shape[-1] if self.given_NLK is not None else 1
        return {layer: shared / (tokens * top_k) for layer, (shared, tokens) in sorted(self.overlap.items()) if tokens}

    def recorded_NLK(self) -> torch.Tensor:
        """What the layers chose, `[N, L, K]` (record only; every MoE layer fed once)."""
        return torch.stack(self.chosen, dim=1)


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type a recorded route is kept in: one byte per expert id up to 256
    experts (a recorded route is always an expert; `NO_ROUTE` exists only in packed batches)."""
    return torch.uint8 if num_experts <= 256 else torch.int16
