"""`ParallelLayout`: how many ways a model is split along each parallel axis, and whether that
split fits a world size and a model shape.

Owns the layout fields, their meaning (including the expert-parallel convention) and the
validation that runs *before* any process group exists, so a bad layout is a one-line
`ValueError` naming the field, its value and what is allowed. It does not create process
groups (`mesh.py`) or touch modules (`api.py`).

Axes. The world is `pp × dp × tp` ranks, ordered with `tp` fastest, then `dp`, then `pp`
(rank = (pp_idx * dp + dp_idx) * tp + tp_idx):

- `tp`: tensor parallel (attention heads, dense and shared-expert FFN columns).
- `dp`: data parallel, sharded with FSDP2 (each dp rank sees its own rows of the batch).
- `pp`: pipeline stages; `vpp` model chunks per pipeline rank (interleaved 1F1B). The
  `pp*vpp` chunks hold contiguous layer ranges balanced by cost (`pipeline.stage_layers`), any
  number of layers each but at least one, so `num_layers` need not be a multiple of `pp*vpp`.
- `ep`: expert parallel, *carved out of dp × tp inside one pipeline stage*: the routed experts
  of a layer are split over `ep` consecutive ranks of the (dp, tp) grid. `ep` is the total
  expert-sharding degree and must be a multiple of `tp`, i.e. the TP ranks also split
  experts (the 718B run: TP8 × 4 data-parallel ranks = EP32). The `dp*tp/ep` groups holding
  the same experts are the expert-data-parallel (EDP) group, where expert grads are reduced.
  `ep=1` means experts are not split (they are replicated like any dense weight).
- `ranks_per_node`: consecutive ranks sharing a node (fast links); 0 = one node. Only the
  expert all-to-all looks at it: with `hierarchical_a2a` tokens cross nodes once per
  (token, node), then spread inside the node; without it the byte counters still report what
  a flat all-to-all sends across node boundaries.
- `overlap_fb`: the pipeline runs Adaptive Pipe (`overlap.py`): two stages per rank in a V
  (`vpp` must be 2), the forward of one micro-batch overlapped with the backward of another so
  each one's expert all-to-alls run under the other's computation; at least `pp*vpp`
  micro-batches. Without it, 1F1B (`vpp=1`) or interleaved 1F1B.
- `a2a_chunks`: 0 runs each expert all-to-all blocking; n >= 1 overlaps them with computation
  (each MoE layer's tokens in n chunks: the shared experts compute under the first chunk's
  dispatch, each chunk's experts under the next chunk's dispatch and the previous one's
  combine). Same results either way; only when each rank waits changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.model.config import ModelConfig

FIELDS = ("dp", "tp", "pp", "vpp", "ep")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    ranks_per_node: int = 0
    hierarchical_a2a: bool = False
    a2a_chunks: int = 0
    overlap_fb: bool = False

    def __post_init__(self) -> None:
        for key in FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{key}={value!r} is invalid: must be an integer >= 1")
        if not isinstance(self.a2a_chunks, int) or self.a2a_chunks < 0:
            raise ValueError(f"layout.a2a_chunks={self.a2a_chunks!r} is invalid: must be an integer >= 0 "
                             "(0 = blocking expert all-to-all, n = overlapped in n chunks)")
        if self.ranks_per_node < 0:
            raise ValueError(f"layout.ranks_per_node={self.ranks_per_node!r} is invalid: "
                             "must be >= 0 (0 = all ranks on one node)")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def min_microbatches(self) -> int:
        """The fewest micro-batches a pipeline pass may have: pp (1F1B keeps pp in flight), or
        every stage's worth with the overlapped V schedule."""
        return self.num_stages if self.overlap_fb else self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: copies of each expert shard within a pipeline stage."""
        return self.dp * self.tp // self.ep

    def describe(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in FIELDS if getattr(self, k) > 1]
        if self.hierarchical_a2a:
            parts.append(f"hier(rpn{self.ranks_per_node})")
        if self.a2a_chunks:
            parts.append(f"overlap{self.a2a_chunks}")
        if self.overlap_fb:
            parts.append("overlap_fb")
        return "×".join(parts) or "single"

    def validate(self, world_size: int, cfg: ModelConfig) -> None:
        """Raise a one-line ValueError for the first field that does not fit."""

        def need(ok: bool, key: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"layout.{key}={getattr(self, key)!r} is invalid: {allowed}")

        need(self.world_size == world_size, "dp",
             f"pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = {self.world_size} must equal the "
             f"world size {world_size}")
        self._validate_tp(cfg, need)
        self._validate_pp(cfg, need)
        self._validate_ep(cfg, need)

    def _validate_tp(self, cfg: ModelConfig, need) -> None:
        need(cfg.num_heads % self.tp == 0, "tp",
             f"must divide model.num_heads={cfg.num_heads} (allowed: {_divisors(cfg.num_heads)})")
        if cfg.attention == "gqa":
            need(cfg.num_kv_heads % self.tp == 0, "tp",
                 f"must divide model.num_kv_heads={cfg.num_kv_heads} "
                 f"(allowed: {_divisors(cfg.num_kv_heads)})")
        if cfg.num_dense_layers:
            need(cfg.dense_ffn_dim % self.tp == 0, "tp",
                 f"must divide model.dense_ffn_dim={cfg.dense_ffn_dim}")
        shared = cfg.num_shared_experts * cfg.expert_ffn_dim
        if cfg.num_moe_layers and shared:
            need(shared % self.tp == 0, "tp",
                 f"must divide the shared-expert width {shared}")

    def _validate_pp(self, cfg: ModelConfig, need) -> None:
        need(self.vpp == 1 or self.pp > 1, "vpp", "must be 1 when pp=1 (chunks interleave "
             "across pipeline ranks)")
        # stages may hold different numbers of layers (`pipeline.stage_layers`), but not none
        need(self.num_stages <= cfg.num_layers, "pp",
             f"pp*vpp = {self.num_stages} exceeds model.num_layers={cfg.num_layers} "
             "(every pipeline stage needs at least one layer)")
        need(self.pp == 1 or not cfg.tie_embeddings, "pp",
             "must be 1 with model.tie_embeddings=True (embedding and head on different stages)")
        need(not self.overlap_fb or (self.pp > 1 and self.vpp == 2), "overlap_fb",
             f"needs pp > 1 and vpp = 2 (two stages per rank in a V), got pp={self.pp}, vpp={self.vpp}")
        need(self.pp == 1 or cfg.aux_loss_coef == 0, "pp",
             "must be 1 with model.aux_loss_coef > 0 (the aux loss is not carried across stages)")

    def _validate_ep(self, cfg: ModelConfig, need) -> None:
        grid = self.dp * self.tp
        if self.ep > 1:
            need(self.ep % self.tp == 0, "ep",
                 f"must be 1 or a multiple of tp={self.tp} (TP ranks also split experts)")
            need(grid % self.ep == 0, "ep",
                 f"must divide dp*tp = {grid} (experts are split inside one pipeline stage; "
                 f"allowed: {_divisors(grid)})")
            need(cfg.num_moe_layers > 0, "ep", "must be 1 for a model without MoE layers")
            need(cfg.num_experts % self.ep == 0, "ep",
                 f"must divide model.num_experts={cfg.num_experts} "
                 f"(allowed: {_divisors(cfg.num_experts)})")
        if self.ranks_per_node:
            need(self.world_size % self.ranks_per_node == 0, "ranks_per_node",
                 f"must divide the world size {self.world_size}")
        need(self.a2a_chunks == 0 or self.ep > 1, "a2a_chunks",
             "must be 0 unless ep > 1 (it overlaps the expert all-to-all)")
        if self.hierarchical_a2a:
            need(self.ep > 1, "ep", "must be > 1 with hierarchical_a2a=True")
            need(self.ranks_per_node > 0 and self.ep % self.ranks_per_node == 0,
                 "ranks_per_node", f"must be > 0 and divide ep={self.ep} with "
                 "hierarchical_a2a=True (an expert group spans whole nodes)")
