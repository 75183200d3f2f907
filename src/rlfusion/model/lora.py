"""LoRA adapters on the MoE decoder: low-rank updates `W + (alpha / r) * B A` trained while the
base weights stay frozen.

Owns where adapters go (`TARGETS`: attention projections, dense MLPs, shared experts, routed
experts, and the router only when named), their tensors, their switching off (the frozen base
is the reference policy: `base_only()`), merging them into the weights and back, and their
names. Knows nothing about parallel layouts: an adapted `nn.Linear` stays an `nn.Linear`
(tensor parallelism places its adapter, `parallel/tensor_parallel.py`), and a routed expert's
adapter is stacked by expert like its weights, so expert parallelism slices both alike.

Shapes (PEFT's, per expert for the routed ones): a Linear `[out, in]` gets `lora_A [r, in]`
(random, seeded) and `lora_B [out, r]` (zeros: the adapted model starts equal to the base);
a routed expert's `x @ W_e` (`W_e [in, out]`) gets `x @ A_e @ B_e` with `lora_A_* [E, in, r]`
and `lora_B_* [E, r, out]`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# target → what it adapts. "router" is off by default: a changed router re-routes the tokens
# the rollout sampled (what routing replay exists to avoid) and its scores feed every expert.
TARGETS = {"attn": "attention projections", "mlp": "dense layers' MLPs", "shared": "shared experts",
           "experts": "routed experts", "router": "routers"}
DEFAULT_TARGETS = ("attn", "mlp", "shared", "experts")  # (those of them a model has: `LoraSpec.targets` ())
EXPERT_PROJS = ("gate", "up", "down")
_state = threading.local()


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ()  # () = every default target the model has
    seed: int = 0  # the adapters' initial A (every device draws the same)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraSpec":
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["targets"]), int(d.get("seed", 0)))


def active() -> bool:
    """Whether adapters apply in this thread (not inside `base_only()`)."""
    return not getattr(_state, "base_only", False)


@contextmanager
def base_only() -> Iterator[None]:
    """Forwards in this thread use the frozen base alone (the reference policy, without a second
    copy of the weights); modules whose adapters are merged are not the base (a device that
    merges keeps a copy for its reference)."""
    before = getattr(_state, "base_only", False)
    _state.base_only = True
    try:
        yield
    finally:
        _state.base_only = before


def is_adapter(name: str) -> bool:
    """Whether a parameter (state-dict) name is an adapter's."""
    return name.rpartition(".")[2].startswith("lora_")


class LoRALinear(nn.Linear):
    """An `nn.Linear` with a low-rank update: `x W^T + b + scale * (x A^T) B^T`. `lora_merged`:
    the update is folded into `weight` (`merge`), so the forward is the plain one."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_scale, self.lora_merged = scale, False
        w = base.weight
        self.lora_A = nn.Parameter(init_a(torch.empty(rank, self.in_features), generator).to(w.device, w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_merged or not active():
            return y
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale


def init_a(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """PEFT's (and nn.Linear's) init of A: uniform in ±1/sqrt(in)."""
    bound = 1.0 / math.sqrt(t.shape[-1])
    return t.uniform_(-bound, bound, generator=generator)


def expert_matmul(experts: nn.Module, proj: str, e, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w` (expert `e`'s `proj` weight, or all experts' with `e` None and batched `x`) plus
    the expert's adapter when `experts` has adapters that apply."""
    y = x @ w
    if experts.lora_scale is None or experts.lora_merged or not active():  # (a class default: no lookup miss)
        return y
    A, B = getattr(experts, f"lora_A_{proj}"), getattr(experts, f"lora_B_{proj}")
    if e is not None:
        A, B = A[e], B[e]
    return y + (x @ A) @ B * experts.lora_scale


def add_expert_adapters(experts: nn.Module, rank: int, scale: float, generator: torch.Generator) -> None:
    """Per-expert adapters on a `GroupedExperts` (stacked by expert, like its weights)."""
    for proj, w in zip(EXPERT_PROJS, expert_weights(experts)):
        E, din, dout = w.shape
        A = init_a(torch.empty(E, rank, din), generator).transpose(1, 2).contiguous()
        experts.register_parameter(f"lora_A_{proj}", nn.Parameter(A.to(w.device, w.dtype)))
        experts.register_parameter(f"lora_B_{proj}", nn.Parameter(torch.zeros(E, rank, dout, device=w.device,
                                                                              dtype=w.dtype)))
    experts.lora_scale, experts.lora_merged = scale, False


def add_router_adapter(router: nn.Module, rank: int, scale: float, generator: torch.Generator) -> None:
    """An adapter on a router's scores, `weight [E, D]` (`optim.lora_targets=router`)."""
    w = router.weight
    router.lora_A = nn.Parameter(init_a(torch.empty(rank, w.shape[1]), generator).to(w.device, w.dtype))
    router.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device, dtype=w.dtype))
    router.lora_scale, router.lora_merged = scale, False


EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")  # a `GroupedExperts`' weights, `EXPERT_PROJS` order


def expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(getattr(experts, name) for name in EXPERT_WEIGHTS)


def has_expert_adapters(experts: nn.Module) -> bool:
    return getattr(experts, "lora_A_gate", None) is not None


def copy_expert_adapters(src: nn.Module, dst: nn.Module, rows: slice) -> None:
    """`dst` (an expert-parallel shard holding experts `rows` of `src`) takes their adapters."""
    if not has_expert_adapters(src):
        return
    for proj in EXPERT_PROJS:
        for kind in "AB":
            t = getattr(src, f"lora_{kind}_{proj}")
            p = nn.Parameter(t.detach()[rows].clone(), requires_grad=t.requires_grad)
            dst.register_parameter(f"lora_{kind}_{proj}", p)
    dst.lora_scale, dst.lora_merged = src.lora_scale, src.lora_merged  # (the weights are copied as they are)


# ---- putting adapters on a model ------------------------------------------------------------

def _linear_targets(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """`(parent, attribute, linear)` of every Linear the targets adapt, in module order: all of
    a layer's attention ("attn"), a dense layer's MLP ("mlp"), an MoE layer's shared experts
    ("shared"; not their gate)."""
    out = []
    for layer in model.layers:
        groups = {"attn": layer.attn, "mlp": None if layer.is_moe else layer.mlp,
                  "shared": layer.mlp.shared if layer.is_moe else None}
        for kind, group in groups.items():
            if kind in targets and group is not None:
                out += [(parent, attr, child) for parent in group.modules()
                        for attr, child in parent.named_children() if isinstance(child, nn.Linear)]
    return out


def available(model: nn.Module) -> tuple[str, ...]:
    """The targets `model` has modules for."""
    moe = [layer.mlp for layer in model.layers if layer.is_moe]
    have = {"attn": True, "mlp": len(moe) < len(model.layers), "shared": any(m.shared is not None for m in moe),
            "experts": bool(moe), "router": bool(moe)}
    return tuple(t for t, ok in have.items() if ok)


def check_spec(model: nn.Module, spec: LoraSpec) -> None:
    """One line (`ValueError`) for targets this model has none of and a rank larger than a
    targeted layer's smaller side."""
    bad = [t for t in spec.targets if t not in TARGETS]
    if bad or not spec.targets:
        raise ValueError(f"optim.lora_targets={','.join(spec.targets) or '(empty)'}: unknown target "
                         f"{','.join(bad) or '(none given)'}; allowed: {', '.join(TARGETS)}")
    if spec.rank < 1 or spec.alpha <= 0:
        raise ValueError(f"optim.lora_rank={spec.rank}, optim.lora_alpha={spec.alpha}: the rank must be >= 1 "
                         f"and alpha > 0")
    moe = [layer.mlp for layer in model.layers if layer.is_moe]
    have = available(model)
    for t in spec.targets:
        if t not in have:
            raise ValueError(f"optim.lora_targets names {t!r} ({TARGETS[t]}), which this model does not have; "
                             f"it has: {', '.join(have)}")
    sides = [min(lin.in_features, lin.out_features) for *_, lin in _linear_targets(model, spec.targets)]
    if "experts" in spec.targets:
        sides += [min(w.shape[1:]) for m in moe for w in expert_weights(m.experts)]
    if "router" in spec.targets:
        sides += [min(m.router.weight.shape) for m in moe]
    if spec.rank > min(sides):
        raise ValueError(f"optim.lora_rank={spec.rank} is larger than the smallest targeted layer's side "
                         f"({min(sides)}): a rank above it adds nothing; allowed: 1..{min(sides)}")


def attach(model: nn.Module, spec: LoraSpec, base: str | None = None) -> nn.Module:
    """Put adapters on `model` (in place, before any parallel layout) and freeze everything
    else. Every process given the same spec draws the same adapters. `base`: where the base
    weights come from, recorded with their fingerprint (`model.lora_base`) for checkpoints that
    hold only the adapters."""
    if spec_of(model) is not None:
        raise ValueError("the model already has LoRA adapters; fold them in first (a plain model of "
                         "lora.merged_state) to adapt it again")
    if not spec.targets:  # the defaults this model has (a dense model has no experts)
        spec = dataclasses.replace(spec, targets=tuple(t for t in DEFAULT_TARGETS if t in available(model)))
    check_spec(model, spec)
    if base is not None:
        model.lora_base = {"base": str(Path(base).resolve()), "fingerprint": fingerprint(model)}
    generator = torch.Generator().manual_seed(spec.seed)
    for parent, attr, lin in _linear_targets(model, spec.targets):
        setattr(parent, attr, LoRALinear(lin, spec.rank, spec.scale, generator))
    for layer in model.layers:
        if not layer.is_moe:
            continue
        if "experts" in spec.targets:
            add_expert_adapters(layer.mlp.experts, spec.rank, spec.scale, generator)
        if "router" in spec.targets:
            add_router_adapter(layer.mlp.router, spec.rank, spec.scale, generator)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    model.lora = spec
    return model


def spec_of(model: nn.Module) -> LoraSpec | None:
    return getattr(model, "lora", None)


def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The named parameters an optimizer updates: every weight, or with adapters only theirs."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trained_part(model: nn.Module):
    """Which of `model`'s state-dict names training changes: None (all of them), or with
    adapters `is_adapter`."""
    return is_adapter if spec_of(model) is not None else None


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What training changes of `model`'s state dict: all of it, or with adapters only theirs."""
    part = trained_part(model)
    return {k: v for k, v in model.state_dict().items() if part is None or part(k)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by state-dict name (the module's own, not copies)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if is_adapter(k)}


# ---- merging --------------------------------------------------------------------------------

def _adapted(model: nn.Module) -> Iterator[nn.Module]:
    return (m for m in model.modules() if getattr(m, "lora_scale", None) is not None)


def _updates(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """An adapted module's `(weight attribute, the update its adapter stands for)`: `scale * B A`
    for a Linear or router (`weight [out, in]`), per expert `scale * A_e B_e` for routed experts."""
    if has_expert_adapters(m):
        return [(name, torch.bmm(getattr(m, f"lora_A_{proj}"), getattr(m, f"lora_B_{proj}")) * m.lora_scale)
                for proj, name in zip(EXPERT_PROJS, EXPERT_WEIGHTS)]
    return [("weight", (m.lora_B @ m.lora_A) * m.lora_scale)]


@torch.no_grad()
def merge(model: nn.Module, sign: float = 1.0) -> None:
    """Fold every adapter into its weight (`sign` -1: take it out again, `unmerge`); the
    forward then skips the adapters. In floating point merge-then-unmerge leaves each weight
    within an ulp of where it was (a rollout device that does it around every sync drifts by
    rounding only: logits ~1e-6 after 1000 syncs in fp32). Merging a merged module (or unmerging
    an unmerged one) raises: it would add the update twice."""
    for m in _adapted(model):
        if m.lora_merged == (sign > 0):
            raise RuntimeError(f"LoRA adapters are already {'merged' if sign > 0 else 'unmerged'}")
        for attr, delta in _updates(m):
            getattr(m, attr).add_(delta, alpha=sign)
        m.lora_merged = sign > 0


def unmerge(model: nn.Module) -> None:
    merge(model, sign=-1.0)


def refilled(model: nn.Module) -> None:
    """`model`'s weights were overwritten with the plain base (a replica filled anew from the
    training layout): its adapters are no longer merged into them."""
    for m in _adapted(model):
        m.lora_merged = False


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict (no adapter names) with every adapter folded into its weight:
    what an export or a merged rollout replica holds. New tensors; `model` is unchanged."""
    if is_merged(model):
        raise RuntimeError("merged_state of a model whose adapters are merged would add them twice")
    out = {k: v.detach() for k, v in model.state_dict().items() if not is_adapter(k)}
    for name, m in model.named_modules():
        if getattr(m, "lora_scale", None) is not None:
            for attr, delta in _updates(m):
                key = f"{name}.{attr}" if name else attr
                out[key] = out[key] + delta
    return out


def is_merged(model: nn.Module) -> bool:
    return any(m.lora_merged for m in _adapted(model))


@contextmanager
def taken_out(model: nn.Module) -> Iterator[None]:
    """Adapters merged into `model`'s weights out of them while the body writes new adapter
    values, folded in again afterwards (the body may raise: they go back in either way); a
    model without merged adapters as it is."""
    merged = is_merged(model)
    if merged:
        unmerge(model)
    try:
        yield
    finally:
        if merged:
            merge(model)


# ---- the base an adapter checkpoint points to ------------------------------------------------

def fingerprint(model: nn.Module) -> str:
    """A short digest of the frozen base's tensors (names, shapes, float64 sums): what an
    adapter checkpoint records of the base it was trained on, checked when it is loaded."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if is_adapter(name):
            continue
        h.update(f"{name}{tuple(t.shape)}{t.detach().double().sum().item():.6e}".encode())
    return h.hexdigest()[:16]
