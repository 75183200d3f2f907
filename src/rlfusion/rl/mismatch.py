"""How far the rollout's policy is from the trainer's on the same tokens (the train-inference
mismatch): per update, from the logprobs and routes the update already has.

    mismatch_logprob_abs       mean |log p_rollout - log p_train| over response tokens
    mismatch_kl                token-level KL(rollout || train), the k3 estimate on the sampled
                               tokens: mean(r - 1 - log r), r = p_train / p_rollout
    router_agreement           (with recorded routes) the share of the trainer's own top-k
                               experts per token and MoE layer that were the rollout's, and per
                               layer `router_agreement_layer{i}`
    routed_differently_share   the share of fed tokens routed differently in at least one layer

Each also `..._lag0` / `..._lag1` (tokens sampled by the policy being trained, or by an older
one: StaleSync's stale tokens carry staleness on top of the mismatch). `p_train` is the policy
before this update (its first forward): on a fresh token the gap is the engine's precision,
kernels and batch shapes alone.

Legend: N packed tokens.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from rlfusion.model.routes import NO_ROUTE, Routes


class MismatchMeter:
    """Sums over an update's micro-batches; `metrics()` gives the means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add_tokens(self, logprobs_N: torch.Tensor, behaviour_N: torch.Tensor, mask_N: torch.Tensor,
                   stale_N: torch.Tensor) -> None:
        """Response tokens (`mask_N`) with the trainer's and the rollout's logprobs; `stale_N`:
        the token was sampled by an older policy version."""
        with torch.no_grad():
            valid = mask_N.bool()
            diff_N = (logprobs_N.detach() - behaviour_N)[valid]
            ratio_N = diff_N.exp()
            k3_N = ratio_N - 1 - diff_N
            stale = stale_N[valid]
            for name, keep in (("", None), ("_lag0", ~stale), ("_lag1", stale)):
                d, k = (diff_N, k3_N) if keep is None else (diff_N[keep], k3_N[keep])
                self.sums[f"abs{name}"] += float(d.abs().sum())
                self.sums[f"kl{name}"] += float(k.sum())
                self.sums[f"tokens{name}"] += len(d)

    def add_routes(self, routes: Routes | None, stale_N: torch.Tensor) -> None:
        """A forward's comparison of the trainer's own routing with the rollout's, over every MoE
        layer of each token."""
        if routes is None or not routes.overlap:
            return
        self.add_layer_overlap(routes)
        fed = routes.given_NLK[:, 0, 0] != NO_ROUTE
        differs = routes.differs_N if routes.differs_N is not None else torch.zeros_like(fed)
        for name, keep in (("", fed), ("_lag0", fed & ~stale_N), ("_lag1", fed & stale_N)):
            self.sums[f"differs{name}"] += float((differs & keep).sum())
            self.sums[f"fed{name}"] += float(keep.sum())

    def add_layer_overlap(self, routes: Routes) -> None:
        """One pipeline stage's comparison over its own MoE layers (the share of tokens routed
        differently needs every layer of a token at once, which no stage has)."""
        top_k = routes.given_NLK.shape[-1]
        for layer, (shared, tokens) in routes.overlap.items():
            self.sums[f"shared{layer}"] += shared
            self.sums[f"compared{layer}"] += tokens * top_k

    def reduce(self, group, num_layers: int) -> None:
        """Sum the sums over a data-parallel `group` (collective; every rank calls it)."""
        import torch.distributed as dist

        keys = [f"{k}{n}" for k in ("abs", "kl", "tokens", "differs", "fed") for n in ("", "_lag0", "_lag1")]
        keys += [f"{k}{i}" for i in range(num_layers) for k in ("shared", "compared")]
        t = torch.tensor([self.sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        self.sums = defaultdict(float, {k: v for k, v in zip(keys, t.tolist()) if v or not k.startswith(("shared", "compared"))})

    def metrics(self) -> dict[str, float]:
        s, out = self.sums, {}
        for name in ("", "_lag0", "_lag1"):
            if s[f"tokens{name}"]:
                out[f"mismatch_logprob_abs{name}"] = s[f"abs{name}"] / s[f"tokens{name}"]
                out[f"mismatch_kl{name}"] = s[f"kl{name}"] / s[f"tokens{name}"]
            if s[f"fed{name}"]:
                out[f"routed_differently_share{name}"] = s[f"differs{name}"] / s[f"fed{name}"]
        layers = sorted(int(k[len("compared"):]) for k in s if k.startswith("compared"))
        for i in layers:
            out[f"router_agreement_layer{i}"] = s[f"shared{i}"] / s[f"compared{i}"]
        if layers:
            out["router_agreement"] = sum(s[f"shared{i}"] for i in layers) / sum(s[f"compared{i}"] for i in layers)
        return out
