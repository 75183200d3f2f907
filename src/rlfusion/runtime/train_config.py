"""Typed configuration of an RL run (`rlfusion train`): one dataclass per component.

Defaults are the embedded default run: GRPO on the built-in arithmetic task, from the tiny base
model, sized to finish in under 10 minutes on 2 CPU cores. The learning rate and clip were
measured on the tiny model: 3e-4 worked; 5e-4 was unstable; 1e-3 collapsed. A run starts from a
checkpoint (`base`); making one is `rlfusion pretrain`, with its own config (`PretrainConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfusion.config import check_fields
from rlfusion.model.lora import TARGETS as LORA_TARGETS, LoraSpec
from rlfusion.engine.scheduler import MAX_NUM_SEQS
from rlfusion.rl.datasets import DataConfig
from rlfusion.rl.env import EnvConfig
from rlfusion.rl.tasks.arithmetic import ArithmeticConfig
from rlfusion.runtime.deployment import PRECISIONS, DeployConfig
from rlfusion.stalesync.rules import StaleSyncConfig

ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "gae")  # gae: PPO with a critic
LORA_ROLLOUT = ("auto", "merged", "unmerged")
LOSS_AGGS = ("token", "seq")
KL_KINDS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
ROUTING_REPLAY = ("none", "rollout")
ROLLOUT_BACKENDS = ("native", "vllm")


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 160
    max_num_seqs: int = MAX_NUM_SEQS
    # engine admits waiting requests once this many slots are free (one prefill pass for several):
    # +17% rollout tokens/s on a StaleSync pool of 2x the slots (bench/stalesync.py notes)
    min_prefill_batch: int = 8
    # response lengths: "natural" (the policy ends a response with its end token, at most
    # max_new_tokens) or "replay" (each response forced to a length drawn per prompt group and
    # sample from a long-tailed log-normal, `rl/replay.py`; a throughput workload whose cost does
    # not depend on what the policy learns). With replay, max_new_tokens is the cap
    lengths: str = "natural"
    replay_median: float = 40.0  # with the cap max_new_tokens=160: ~10% at the cap, p99/median = 4
    replay_sigma: float = 1.08
    replay_between: float = 0.9  # share of the log-length variance between prompt groups
    # the engine that generates: "native" (rlfusion's continuous-batching engine, CPU or GPU) or
    # "vllm" (the `gpu` extra; GPUs only). vLLM holds its own copy of the weights: they are
    # loaded in buckets of deploy.bucket_mb whenever the policy changed, and on a device that
    # also trains it sleeps (KV cache and weights freed) while the actor trains
    backend: str = "native"
    gpu_memory_utilization: float = 0.5  # vllm: the share of its GPU's memory it may take
    # the rollout engine's compute precision apart from training's: "" = deploy.precision (one
    # precision everywhere), "fp32" or "bf16" (autocast: matmuls in bf16, as an accelerator's
    # rollout kernels run); a precision other than training's makes the rollout's logprobs and
    # router choices differ from the trainer's (the train-inference mismatch the metrics report)
    precision: str = ""
    # record each token's routed experts per MoE layer (native engine) for the mismatch metrics
    # (router agreement); algo.routing_replay=rollout records them whatever this says
    record_routes: bool = False

    def __post_init__(self) -> None:
        check_fields("rollout", {
            "prompts_per_step": (self.prompts_per_step >= 1, "must be >= 1"),
            "group_size": (self.group_size >= 2, "must be >= 2 (group baselines need two samples)"),
            "temperature": (self.temperature > 0, "must be > 0 for RL sampling"),
            "top_p": (0 < self.top_p <= 1, "must be in (0, 1]"),
            "top_k": (self.top_k >= 0, "must be >= 0 (0 = off)"),
            "max_new_tokens": (self.max_new_tokens >= 1, "must be >= 1"),
            "max_num_seqs": (self.max_num_seqs >= 1, "must be >= 1"),
            "min_prefill_batch": (self.min_prefill_batch >= 1, "must be >= 1 (1 = admit at once)"),
            "lengths": (self.lengths in ("natural", "replay"), "allowed: natural, replay"),
            "replay_median": (1 <= self.replay_median and (self.lengths != "replay"
                                                          or self.replay_median < self.max_new_tokens),
                              f"must be >= 1 and, with rollout.lengths=replay, below rollout.max_new_tokens="
                              f"{self.max_new_tokens} (the cap)"),
            "replay_sigma": (self.replay_sigma > 0, "must be > 0"),
            "replay_between": (0 <= self.replay_between <= 1, "must be in [0, 1]"),
            "backend": (self.backend in ROLLOUT_BACKENDS, f"allowed: {', '.join(ROLLOUT_BACKENDS)}"),
            "gpu_memory_utilization": (0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            "precision": (self.precision in ("", *PRECISIONS), f"allowed: '' (deploy.precision), {', '.join(PRECISIONS)}"),
        }, self)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"
    scale_by_std: bool = True  # GRPO: divide by the group std (False = Dr. GRPO)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low = DAPO clip-higher
    loss_agg: str = "token"
    behaviour_weight_cap: float = 2.0  # truncated importance weight for stale samples
    # the train-inference mismatch correction of the behaviour weight w = pi_proximal /
    # pi_behaviour (docs/usage.md): "tis" truncates w at behaviour_weight_cap; "mis" gives tokens
    # whose w lies outside [is_mask_low, is_mask_high] no loss; "seq_mask" drops sequences whose
    # geometric-mean w lies outside [1/seq_mask_threshold, seq_mask_threshold] and truncates the
    # rest; "none" is w = 1. The bands are the TIS cap's factor of 2 either way: a bf16 rollout
    # moves a token's log w by ~0.002 on average (measured), so they drop only tokens (sequences)
    # the engine sampled from a clearly different distribution, not the usual numerical noise
    is_correction: str = "tis"
    is_mask_low: float = 0.5
    is_mask_high: float = 2.0
    seq_mask_threshold: float = 2.0
    kl_coef: float = 0.001
    kl_kind: str = "k3"
    kl_mode: str = "loss"  # "loss": KL term in the loss; "reward": penalty on the reward
    entropy_coef: float = 0.0
    dynamic_sampling: bool = True  # DAPO: drop groups whose rewards are all equal
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens; 0 = off
    overlong_factor: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    # PPO with a critic (advantage = "gae")
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    critic_lr: float = 1e-3
    # MoE routing replay (R3): "rollout" = the actor's forward routes each token to the experts
    # the rollout engine chose for it (recorded per MoE layer, carried through the queue); the
    # gate weights are still the current router's over those experts, so the router learns.
    # "none" = the trainer routes by its own router
    routing_replay: str = "none"
    routing_replay_reference: bool = False  # the reference's forward replays them too

    def __post_init__(self) -> None:
        check_fields("algo", {
            "advantage": (self.advantage in ADVANTAGES, f"allowed: {', '.join(ADVANTAGES)}"),
            "clip_low": (0 < self.clip_low < 1, "must be in (0, 1)"),
            "clip_high": (self.clip_high > 0, "must be > 0"),
            "loss_agg": (self.loss_agg in LOSS_AGGS, f"allowed: {', '.join(LOSS_AGGS)}"),
            "behaviour_weight_cap": (self.behaviour_weight_cap >= 1, "must be >= 1"),
            "is_correction": (self.is_correction in ("none", "tis", "mis", "seq_mask"),
                              "allowed: none, tis, mis, seq_mask"),
            "is_mask_low": (0 <= self.is_mask_low <= 1, "must be in [0, 1] (a fresh sample's weight, 1, stays in)"),
            "is_mask_high": (self.is_mask_high >= 1, "must be >= 1 (a fresh sample's weight, 1, stays in)"),
            "seq_mask_threshold": (self.seq_mask_threshold >= 1, "must be >= 1 (the band is [1/t, t])"),
            "kl_coef": (self.kl_coef >= 0, "must be >= 0"),
            "kl_kind": (self.kl_kind in KL_KINDS, f"allowed: {', '.join(KL_KINDS)}"),
            "kl_mode": (self.kl_mode in KL_MODES, f"allowed: {', '.join(KL_MODES)}"),
            "entropy_coef": (self.entropy_coef >= 0, "must be >= 0"),
            "overlong_buffer": (self.overlong_buffer >= 0, "must be >= 0"),
            "ppo_epochs": (self.ppo_epochs >= 1, "must be >= 1"),
            "minibatches": (self.minibatches >= 1, "must be >= 1"),
            "gamma": (0 <= self.gamma <= 1, "must be in [0, 1]"),
            "lam": (0 <= self.lam <= 1, "must be in [0, 1]"),
            "value_clip": (self.value_clip > 0, "must be > 0"),
            "critic_lr": (self.critic_lr > 0, "must be > 0"),
            "routing_replay": (self.routing_replay in ROUTING_REPLAY, f"allowed: {', '.join(ROUTING_REPLAY)}"),
        }, self)


RECOMPUTE = ("none", "selective", "full", "swap", "plan")
DP_BALANCE = ("tokens", "cost")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    microbatch_tokens: int = 4096
    warmup_steps: int = 5
    # Linear decay from lr to lr * min_lr_ratio over `max_steps` updates (constant when
    # max_steps = 0): late updates get small, which keeps the final policy from oscillating.
    min_lr_ratio: float = 0.1
    # Aux-loss-free expert-bias updates during RL. Off by default: a bias step re-routes tokens
    # between rollout and update for no reward-driven reason.
    router_bias_update: bool = False
    # activations of the actor's forward kept for backward: "none" keeps them all; "selective"
    # recomputes each layer's attention in backward; "full" each whole layer (only its input is
    # kept); "swap" moves each layer's saved tensors to host memory and back; "plan" lets the
    # memory planner choose per layer and module, measured on the first update, the cheapest
    # mix that fits `activation_budget_mb` per micro-batch
    recompute: str = "none"
    activation_budget_mb: float = 0.0
    # expert load balancing (deploy.train_ep > 1): each update's routed-token counts feed an EMA
    # prediction of the next one's; a layer whose predicted max/mean load per expert-parallel
    # rank drops by at least `expert_balance_margin` has its experts migrated (weights and
    # optimizer state) to the placement that balances it; rollouts generate from the same
    # weights, in logical expert order
    expert_balance: bool = False
    expert_balance_margin: float = 0.05
    # what predicts the experts' load: "trainer" (the tokens each update's forward routed) or
    # "rollout" (the experts the rollout engine recorded for the update's tokens: the load the
    # policy put on them when it sampled; records the routes)
    expert_balance_source: str = "trainer"
    # how the update's rows are split over data-parallel ranks: "tokens" (equal tokens) or
    # "cost" (equal a*tokens + b*tokens^2, attention's quadratic term included, from the model
    # shape: a long sequence costs more than the same tokens in short ones)
    dp_balance: str = "tokens"
    # LoRA (0 = full fine-tuning): adapters of rank `lora_rank` scaled by `lora_alpha / lora_rank`
    # on `lora_targets` (comma-separated: attn, mlp (dense layers), shared, experts (per expert),
    # router; "" = those of attn, mlp, shared, experts the model has); the base stays frozen,
    # outside the optimizer, and is the reference policy; only the adapters are synced to
    # rollout devices and checkpointed (with a pointer to the base).
    # `lora_rollout`: how a rollout applies them: "merged" (folded into the weights it generates
    # from, 1.46x the tokens/s of unmerged on the tiny base here; the trained model itself is
    # merged for each rollout and unmerged after it, which rounds its frozen base by an ulp),
    # "unmerged" (two low-rank matmuls beside each adapted one), "auto" (merged where the device
    # generates from a replica it does not train, unmerged on the trained model: exact)
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: str = ""
    lora_rollout: str = "auto"

    def __post_init__(self) -> None:
        check_fields("optim", {
            "lora_rank": (self.lora_rank >= 0, "must be >= 0 (0: full fine-tuning)"),
            "lora_alpha": (self.lora_alpha > 0, "must be > 0"),
            "lora_targets": (all(t in LORA_TARGETS for t in self.lora_targets.split(",") if self.lora_targets),
                             f"a comma-separated list of {', '.join(LORA_TARGETS)} (\"\": the model's defaults)"),
            "lora_rollout": (self.lora_rollout in LORA_ROLLOUT, f"allowed: {', '.join(LORA_ROLLOUT)}"),
            "lr": (0 < self.lr <= 1e-2, "must be in (0, 0.01]; 3e-4 is the tested default"),
            "beta1": (0 <= self.beta1 < 1, "must be in [0, 1)"),
            "beta2": (0 <= self.beta2 < 1, "must be in [0, 1)"),
            "weight_decay": (self.weight_decay >= 0, "must be >= 0"),
            "grad_clip": (self.grad_clip > 0, "must be > 0"),
            "microbatch_tokens": (self.microbatch_tokens >= 64, "must be >= 64"),
            "warmup_steps": (self.warmup_steps >= 0, "must be >= 0"),
            "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            "recompute": (self.recompute in RECOMPUTE, f"allowed: {', '.join(RECOMPUTE)}"),
            "activation_budget_mb": (self.activation_budget_mb > 0 if self.recompute == "plan"
                                     else self.activation_budget_mb >= 0,
                                     "must be > 0 with optim.recompute=plan (the planner fits activations "
                                     "into it), else >= 0"),
            "expert_balance_margin": (0 <= self.expert_balance_margin < 1, "must be in [0, 1)"),
            "expert_balance_source": (self.expert_balance_source in ("trainer", "rollout"), "allowed: trainer, rollout"),
            "dp_balance": (self.dp_balance in DP_BALANCE, f"allowed: {', '.join(DP_BALANCE)}"),
        }, self)

    def lora_spec(self, seed: int) -> LoraSpec | None:
        """The adapters to put on the base (None: full fine-tuning)."""
        if not self.lora_rank:
            return None
        return LoraSpec(self.lora_rank, self.lora_alpha, tuple(t for t in self.lora_targets.split(",") if t), seed)


@dataclass(frozen=True)
class TrainConfig:
    # rlfusion or Hugging Face checkpoint folder, or a shipped base by name ("tiny", "tiny-long");
    # "" = the base pretrained into the cache by `rlfusion pretrain`, else the shipped "tiny"
    # (model.checkpoint.resolve_base)
    base: str = ""
    out_dir: str = "runs"
    run_name: str = ""  # "" = a timestamped name
    seed: int = 0
    max_steps: int = 200  # 0 = until time_budget_s
    time_budget_s: float = 480.0  # backstop: no step starts after this; evals come on top
    eval_every: int = 25
    eval_problems: int = 500  # at most the held-out set; with data.path the default lowers to data.num_heldout
    checkpoint_every: int = 25
    reward: str = "task"  # "task" (the task's verifier) or "module:function"
    reward_timeout_s: float = 60.0  # a user reward's longest scoring call (one batch); past it the batch fails
    # A sample whose user reward raised, timed out or returned a non-finite number or one outside
    # [reward_min, reward_max] gets reward 0 ("zero": it still trains) or leaves the update with its
    # group ("drop"); either way it is counted (`reward_failures`). The run stops when more than
    # reward_failure_limit of the last 64 samples a device scored failed.
    reward_on_failure: str = "zero"
    reward_min: float = -1e6  # the defaults bound nothing a reward means; set your reward's range
    reward_max: float = 1e6
    reward_failure_limit: float = 0.5
    threads: int = 2
    # the model's context length (prompt + response) in this run; 0 = the base checkpoint's. The
    # models' positions are rotary, derived rather than stored, so a longer context loads the same
    # weights; positions past those the base was trained on are the run's to judge (the replay
    # workload forces its lengths and does not depend on what the policy writes there)
    context_len: int = 0
    deterministic: bool = False  # torch deterministic algorithms (for resume tests)
    # Collapse guard: stop when, for this many consecutive steps, every reward is 0 or most
    # responses hit max_new_tokens (how a too-high lr failed on the tiny model). 0 = off.
    collapse_patience: int = 10
    task: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    data: DataConfig = field(default_factory=DataConfig)  # data.path set: train on that prompt set
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)
    stalesync: StaleSyncConfig = field(default_factory=StaleSyncConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        check_fields("train", {
            "max_steps": (self.max_steps >= 0, "must be >= 0 (0 = until time_budget_s)"),
            "time_budget_s": (self.time_budget_s > 0, "must be > 0"),
            "run_name": (self.run_name == "" or (self.run_name not in (".", "..") and "/" not in self.run_name
                                                 and "\\" not in self.run_name),
                         "must be a plain folder name inside out_dir (no '/' or '..')"),
            "eval_every": (self.eval_every >= 1, "must be >= 1"),
            "eval_problems": (self.eval_problems >= 1, "must be >= 1"),
            "checkpoint_every": (self.checkpoint_every >= 1, "must be >= 1"),
            "reward": (self.reward == "task" or ":" in self.reward,
                       "allowed: 'task' or 'module:function'"),
            "reward_timeout_s": (self.reward_timeout_s > 0, "must be > 0"),
            "reward_on_failure": (self.reward_on_failure in ("zero", "drop"), "allowed: zero, drop"),
            "reward_max": (self.reward_min < self.reward_max, f"must be more than reward_min={self.reward_min:g}"),
            "reward_failure_limit": (0 <= self.reward_failure_limit < 1,
                                     "must be in [0, 1) (the share of failed rewards that stops a run)"),
            "threads": (self.threads >= 1, "must be >= 1"),
            "context_len": (self.context_len == 0 or self.context_len > self.rollout.max_new_tokens,
                            f"must be 0 (the base's) or more than rollout.max_new_tokens="
                            f"{self.rollout.max_new_tokens} (room for the prompt)"),
            "collapse_patience": (self.collapse_patience >= 0, "must be >= 0 (0 = off)"),
        }, self)
        self._check_eval_problems()
        self._check_training_options()
        if self.deploy.mode == "hybrid" and not (self.stalesync.enabled and self.stalesync.max_staleness >= 1):
            raise ValueError("deploy.mode=hybrid needs stalesync.enabled=true and stalesync.max_staleness >= 1: "
                             "its train devices update while the others still generate")
        t = self.stalesync.rollout_finish_threshold
        if t > 1 and t > self.rollout.prompts_per_step:
            raise ValueError(f"stalesync.rollout_finish_threshold={t:g} is invalid: a count must be at most "
                             f"rollout.prompts_per_step={self.rollout.prompts_per_step} (or use a fraction in (0, 1])")

    def _check_training_options(self) -> None:
        """Options of the actor's update that need a particular training layout."""
        if self.algo.routing_replay_reference and self.algo.routing_replay == "none":
            raise ValueError("algo.routing_replay_reference=true is invalid with algo.routing_replay=none: the "
                             "reference replays the routes the actor replays (set algo.routing_replay=rollout)")
        if self.optim.expert_balance_source == "rollout" and not self.optim.expert_balance:
            raise ValueError("optim.expert_balance_source=rollout is invalid with optim.expert_balance=false: it "
                             "chooses what predicts the balancer's load (set optim.expert_balance=true)")
        if (self.algo.routing_replay != "none" or self.rollout.record_routes) and self.rollout.backend != "native":
            raise ValueError(f"algo.routing_replay={self.algo.routing_replay} / rollout.record_routes="
                             f"{str(self.rollout.record_routes).lower()} is invalid with rollout.backend="
                             f"{self.rollout.backend}: the routes are recorded by the native engine (vLLM's "
                             "offline API here returns no routed experts; allowed: native)")
        if self.env.name:
            for bad, why in ((self.rollout.backend != "native", f"rollout.backend={self.rollout.backend} (episodes "
                              "continue a kept cache row: the native engine's; allowed: native)"),
                             (self.algo.advantage == "gae", "algo.advantage=gae (the critic's per-token advantages run "
                              "over every response token, observations too; allowed: grpo, rloo, reinforce_pp)"),
                             (self.rollout.lengths == "replay", "rollout.lengths=replay (forced lengths have no turns; "
                              "allowed: natural)")):
                if bad:
                    raise ValueError(f"env={self.env.name!r} is invalid with {why}")
        if self.optim.expert_balance and self.deploy.train_ep < 2:
            raise ValueError(f"optim.expert_balance=true is invalid with deploy.train_ep={self.deploy.train_ep}: "
                             "it migrates experts between expert-parallel devices (set deploy.train_ep >= 2)")
        if not self.optim.lora_rank and (self.optim.lora_rollout != "auto" or self.optim.lora_targets):
            raise ValueError("optim.lora_rollout / optim.lora_targets are invalid with optim.lora_rank=0 (full "
                             "fine-tuning has no adapters): set optim.lora_rank >= 1 or leave them out")
        if self.optim.lora_rank:
            for bad, why in ((self.optim.router_bias_update, "optim.router_bias_update=true (it moves the routers' "
                              "biases, which are the frozen base's; set it false)"),
                             (self.optim.expert_balance, "optim.expert_balance=true (migrating experts moves frozen "
                              "weights between devices; set it false)"),
                             (self.algo.advantage == "gae", "algo.advantage=gae (the critic trains a full model; "
                              "allowed: grpo, rloo, reinforce_pp)"),
                             (self.rollout.backend != "native", f"rollout.backend={self.rollout.backend} (this vLLM "
                              "backend loads full weights, not adapters; allowed: native)")):
                if bad:
                    raise ValueError(f"optim.lora_rank={self.optim.lora_rank} is invalid with {why}")
        if self.optim.recompute == "plan" and self.deploy.train_pp > 1:
            raise ValueError(f"optim.recompute=plan is invalid with deploy.train_pp={self.deploy.train_pp}: "
                             "the planner measures a whole model's forward (use none, selective, full or swap)")

    def _check_eval_problems(self) -> None:
        """Evaluation draws from the held-out set: the built-in task's `task.num_heldout`
        problems, or with data.path the `data.num_heldout` rows held out of the file (exactly
        that many: the task refuses a file too short for it)."""
        if self.data.path:
            heldout, source, knob = self.data.num_heldout, f"data.path={self.data.path!r}", "data.num_heldout"
        else:
            heldout, source, knob = self.task.num_heldout, "the built-in task", "task.num_heldout"
        if self.eval_problems <= heldout:
            return
        if self.data.path and self.eval_problems == _EVAL_PROBLEMS_DEFAULT:
            # The default was sized for the built-in task; a prompt set holds out fewer (50), and
            # config.json and the report should say how many were evaluated.
            object.__setattr__(self, "eval_problems", heldout)
            return
        raise ValueError(f"eval_problems={self.eval_problems} is more than the {heldout} held-out "
                         f"problems of {source}; allowed: 1 to {heldout} (or raise {knob})")


_EVAL_PROBLEMS_DEFAULT = TrainConfig.__dataclass_fields__["eval_problems"].default
