"""vLLM rollout backend (GPU only, the optional `gpu` extra) with the native engine's contract.

`VLLMEngine` has the methods of `LLMEngine` the RL stages use (`add_request`, `step`,
`has_unfinished`, `abort`, `generate`, `policy_version`) returning the same `Completion`s: token
ids, per-token logprobs and policy versions, finish reason `stop` / `length` / `aborted`; an
aborted completion resumes through `Request.resume` like the native one. On top: weight updates
from `fusion/buckets` (native tensor names, translated to the HF names vLLM's model loader
expects by `model/hf.HFNames`), and `sleep` / `wake_up` to free GPU memory while a co-located
actor trains.

vLLM is imported only when an engine is built (never on the CPU path; tests pass a fake
module). Version notes: written against vLLM's offline `LLM` API with `enable_sleep_mode`,
`worker_extension_cls` + `collective_rpc` and `logprobs_mode="processed_logprobs"`, so logprobs
are those of the temperature-scaled distribution like the native engine's (they also include
top-k/top-p truncation, which the native engine leaves out: keep top_k=0, top_p=1 for RL).

Inference layout (`VLLMLayout`, from `deploy.infer_ep` / `infer_tp`, vLLM >= 0.10.0): each engine
is one vLLM data-parallel rank; the ranks of an expert-parallel group step in lock-step inside
vLLM (an engine out of work runs empty passes while its peers decode), but vLLM's offline ranks
start a round only once each has a request: every engine of a group must be given at least one
request per rollout, or its peers wait in their first MoE all-to-all.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlfusion.engine.engine import run_to_completion
from rlfusion.engine.runner import fresh_stats
from rlfusion.engine.scheduler import MAX_NUM_SEQS
from rlfusion.engine.types import Completion, Request
from rlfusion.fusion.buckets import Bucket, pack, plan_buckets, specs_of, unpack

EXTRA = "gpu"


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise ImportError(f"the vLLM backend needs vllm on a GPU machine: pip install 'rlfusion[{EXTRA}]'") from None
    return vllm


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`): loads HF-named tensors into the
    running model. `self.model_runner` is the worker's, provided by vLLM."""

    def load_hf_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        device = next(self.model_runner.model.parameters()).device
        self.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in named])
        return len(named)


class VLLMEngine:
    """One vLLM engine over an HF folder (export a native model with `model/hf.save_hf` first,
    or build it with `from_model`). Requests carry token ids, so vLLM never loads a tokenizer."""

    holds_weights = True  # its own copy of the policy: `load_state` after every change

    def __init__(self, hf_path: str | Path, native_config, family: str, *, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 max_num_seqs: int = MAX_NUM_SEQS, dtype: str = "bfloat16", layout: VLLMLayout | None = None,
                 vllm_module: Any = None) -> None:
        """`layout`: this engine's place in the rollout's inference layout (`VLLMLayout`; None =
        one GPU holding every expert). `ValueError` when the installed vLLM cannot take it, or
        when this process sees fewer GPUs than its tensor-parallel degree."""
        from rlfusion.model.hf import HFNames

        self._vllm = vllm_module or _import_vllm()
        self.layout = layout or VLLMLayout()
        check_layout_support(self._vllm, self.layout)
        if self.layout.infer_tp > 1 and torch.cuda.is_available() and torch.cuda.device_count() < self.layout.infer_tp:
            raise ValueError(f"deploy.infer_tp={self.layout.infer_tp} needs that many GPUs visible to each rollout "
                             f"worker; this one sees {torch.cuda.device_count()}")
        # read by vLLM while it builds the engine (and by its engine-core process, which inherits them)
        os.environ.update(self.layout.environment())
        self.llm = self._vllm.LLM(
            model=str(hf_path), seed=seed, dtype=dtype, enable_sleep_mode=True,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len or native_config.max_seq_len, max_num_seqs=max_num_seqs,
            skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoaderExtension", **self.layout.engine_kwargs())
        self.names = HFNames(native_config, family)
        self.policy_version = 0
        self.asleep = False
        self.num_steps = 0
        self._requests: dict[str, Request] = {}  # unfinished, as submitted
        self._latest: dict[str, Any] = {}  # last cumulative vLLM output per request
        self._stats = fresh_stats()
        self._folder: tempfile.TemporaryDirectory | None = None  # an exported policy's, kept while the engine lives

    @classmethod
    def from_model(cls, model, hf_path: str | Path | None = None, **kwargs: Any) -> "VLLMEngine":
        """An engine for a native `model`: over `hf_path` when the run's base is an HF folder of
        it, else over an export of `model` to a temporary folder (`ValueError` when its family
        cannot hold it, see `check_servable`)."""
        from rlfusion.model.hf import infer_family, save_hf

        check_servable(model)
        family = infer_family(model.config)
        folder = None
        if hf_path is None:
            folder = tempfile.TemporaryDirectory(prefix="rlfusion-vllm-")
            hf_path = save_hf(model, folder.name, family=family)
        engine = cls(hf_path, model.config, family, **kwargs)
        engine._folder = folder
        return engine

    # ---- generation ----

    def add_request(self, request: Request) -> None:
        self._check_awake("add_request")
        p = request.params
        already = len(request.output_ids)
        params = self._vllm.SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k else -1,
            max_tokens=p.max_new_tokens - already, stop_token_ids=list(p.stop_ids), logprobs=0,
            detokenize=False, ignore_eos=not p.stop_ids)  # no stop tokens: not the model's own EOS either
        # A resumed request continues after its earlier output: vLLM sees it as prompt.
        prompt = {"prompt_token_ids": list(request.prompt_ids) + list(request.output_ids)}
        self.llm.llm_engine.add_request(request.request_id, prompt, params)
        self._requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[Completion]:
        self._check_awake("step")
        start, finished, tokens = time.perf_counter(), [], 0
        for out in self.llm.llm_engine.step():
            before = self._latest.get(out.request_id)
            new = len(out.outputs[0].token_ids) - (len(before.outputs[0].token_ids) if before is not None else 0)
            tokens += new
            self._latest[out.request_id] = out
            if out.finished:
                finished.append(self._completion(out.request_id, _finish_reason(out)))
        self.num_steps += 1
        st = self._stats  # vLLM schedules prefill and decode in one step: all of it counts as decode
        st["decode_passes"] += 1
        st["decode_rows"] += tokens
        st["decode_s"] += time.perf_counter() - start
        return finished

    def take_stats(self) -> dict[str, float]:
        """Steps (as decode passes), the tokens they generated and their seconds since the last call."""
        out, self._stats = self._stats, fresh_stats()
        return out

    def rng_state(self) -> torch.Tensor:
        """vLLM's sampler state is its own: a resumed run samples anew (an empty state)."""
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor) -> None:
        pass  # see `rng_state`

    def abort(self, request_ids: Iterable[str], keep_cache: bool = False) -> list[Completion]:
        """Stop the given requests now; partial outputs come back with reason `aborted`. vLLM
        frees an aborted request's cache blocks, so `keep_cache` keeps nothing: a resumed request
        is prefilled again (`saved_bytes` stays 0)."""
        ids = [i for i in request_ids if i in self._requests]
        self.llm.llm_engine.abort_request(ids)
        return [self._completion(i, "aborted") for i in ids]

    saved_bytes = 0  # no cache rows outlive an abort (see `abort`)

    def drop_saved(self) -> int:
        return 0

    def saved_rows(self) -> dict:
        return {}

    def load_saved_rows(self, rows: dict) -> None:
        if rows:
            raise ValueError("this checkpoint holds cache rows of paused requests from the native engine; "
                             "vLLM cannot take them: resume with rollout.backend=native")

    def generate(self, requests: list[Request]) -> list[Completion]:
        return run_to_completion(self, requests)

    def _completion(self, request_id: str, reason: str) -> Completion:
        req = self._requests.pop(request_id)
        out = self._latest.pop(request_id, None)
        new_ids, new_lps = [], []
        if out is not None:
            seq = out.outputs[0]
            new_ids = list(seq.token_ids)
            new_lps = [float(lp[t].logprob) for t, lp in zip(new_ids, seq.logprobs or [])]
            if len(new_lps) != len(new_ids):
                raise RuntimeError(f"vLLM returned {len(new_lps)} logprobs for {len(new_ids)} tokens "
                                   f"of request {request_id!r}; is SamplingParams.logprobs=0 honoured?")
        return Completion(request_id, list(req.prompt_ids), list(req.output_ids) + new_ids,
                          list(req.logprobs) + new_lps,
                          list(req.versions) + [self.policy_version] * len(new_ids), reason, req.params)

    # ---- weights and memory ----

    def load_state(self, state: dict[str, torch.Tensor], bucket_bytes: int) -> int:
        """Load a native state dict (the policy's) in flat buckets of at most `bucket_bytes`;
        returns the number of HF tensors loaded. Every engine gets every tensor whole, also in an
        expert-parallel or tensor-parallel layout: vLLM's `load_weights` takes full checkpoint
        tensors and keeps what its rank holds (its experts, its tensor-parallel slice)."""
        buckets = ((bucket, pack(bucket, state)) for bucket in plan_buckets(specs_of(state), bucket_bytes))
        return self.update_weights(buckets)

    @property
    def cache_bytes(self) -> int:
        return 0  # vLLM's KV cache is its own allocator's (`gpu_memory_utilization`), not a tensor here

    def update_weights(self, buckets: Iterable[tuple[Bucket, torch.Tensor]]) -> int:
        """Load new policy weights, one flat bucket at a time (native names, see
        `fusion/buckets.py`); the next tokens carry the next policy version. Returns the number
        of HF tensors loaded."""
        self._check_awake("update_weights")
        loaded = 0
        for bucket, flat in buckets:
            # host tensors: collective_rpc serializes its arguments to vLLM's engine-core process
            named = [(name, t.detach().cpu()) for native, t in unpack(bucket, flat).items()
                     for name, t in self.names.tensors(native, t)]
            loaded += sum(self.llm.collective_rpc("load_hf_weights", args=(named,)))
        self.policy_version += 1
        return loaded

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for training: level 1 offloads the weights to host and drops the KV
        cache; level 2 also drops the weights (reload them with `update_weights` after waking)."""
        if self._requests:
            raise RuntimeError(f"cannot sleep with {len(self._requests)} unfinished requests; abort them first")
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} is invalid: allowed 1 or 2")
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self) -> None:
        self.llm.wake_up()
        self.asleep = False

    def _check_awake(self, what: str) -> None:
        if self.asleep:
            raise RuntimeError(f"vLLM engine is asleep: call wake_up() before {what}()")


def check_servable(model) -> None:
    """`ValueError` unless vLLM can serve `model` as it is: an HF family holds its architecture
    and its routers carry no expert bias the family lacks (`model/hf.py`)."""
    from rlfusion.model.hf import infer_family, state_to_hf_checks

    state_to_hf_checks(model, infer_family(model.config))


def _finish_reason(out) -> str:
    reason = out.outputs[0].finish_reason
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    if reason == "abort":
        return "aborted"
    raise RuntimeError(f"vLLM finish_reason={reason!r} for request {out.request_id!r} is not one of "
                       f"stop, length, abort")


# ---- the rollout's inference layout (`deploy.infer_ep`, `deploy.infer_tp`) ----

LAYOUT_VLLM = "0.10.0"  # the oldest vLLM with every option below (and `logprobs_mode`, which the engine needs anyway)
DP_ENV = ("VLLM_DP_SIZE", "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT")


def dp_ranks_per_group(infer_ep: int, infer_tp: int) -> int:
    """How many vLLM engines (data-parallel ranks, one per rollout worker) form one expert-parallel
    group: vLLM splits the routed experts over data_parallel_size x tensor_parallel_size GPUs, so
    infer_ep / infer_tp; 1 without expert parallelism. `ValueError` for a layout vLLM cannot take."""
    if infer_ep < 1 or infer_tp < 1:
        raise ValueError(f"deploy.infer_ep={infer_ep} / infer_tp={infer_tp} is invalid: both must be >= 1")
    if infer_ep > 1 and infer_ep % infer_tp:
        allowed = ", ".join(str(d) for d in range(1, infer_ep + 1) if infer_ep % d == 0)
        raise ValueError(f"deploy.infer_ep={infer_ep} / infer_tp={infer_tp} is invalid for rollout.backend=vllm: "
                         f"vLLM splits the experts over data-parallel ranks x infer_tp GPUs, so infer_tp must "
                         f"divide infer_ep (allowed infer_tp: {allowed})")
    return infer_ep // infer_tp if infer_ep > 1 else 1


@dataclass(frozen=True)
class VLLMLayout:
    """Where one vLLM engine sits in the rollout's inference layout. Each engine is one vLLM
    data-parallel rank (attention and dense weights whole, its own requests) over `infer_tp`
    GPUs; `dp_ranks_per_group` engines form one expert-parallel group whose MoE layers exchange
    tokens with an all-to-all. vLLM's offline API starts a rank from its process environment
    (`VLLM_DP_*`, as its multi-process data-parallel example does; `LLM(data_parallel_size>1)`
    is refused outside torchrun's external launcher, which would reuse the device world this
    process already joined), so a layout is engine arguments plus environment.

    `rank`: this engine's data-parallel rank in its group, 0 .. group - 1. `master`: (host, port)
    of the group's rendezvous, the same for every rank of one group and different between
    groups; vLLM uses a few consecutive ports from `port` on. Unused with a group of one."""

    infer_ep: int = 1
    infer_tp: int = 1
    rank: int = 0
    master: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        group = dp_ranks_per_group(self.infer_ep, self.infer_tp)
        if not 0 <= self.rank < group:
            raise ValueError(f"vLLM data-parallel rank {self.rank} is invalid: a group of infer_ep={self.infer_ep} / "
                             f"infer_tp={self.infer_tp} has ranks 0..{group - 1}")
        if group > 1 and self.master is None:
            raise ValueError(f"a vLLM expert-parallel group of {group} ranks needs its rendezvous master (host, port)")

    @property
    def dp_size(self) -> int:
        return dp_ranks_per_group(self.infer_ep, self.infer_tp)

    @property
    def single(self) -> bool:
        """One GPU, every expert: the plain engine."""
        return self.infer_ep == 1 and self.infer_tp == 1

    def engine_kwargs(self) -> dict[str, Any]:
        """`vllm.LLM` arguments of this layout."""
        if self.single:
            return {}
        return {"tensor_parallel_size": self.infer_tp, "enable_expert_parallel": self.infer_ep > 1}

    def environment(self) -> dict[str, str]:
        """`VLLM_DP_*` variables that make this process's engine rank `rank` of its group.
        LOCAL rank 0: vLLM picks the engine's GPUs from the visible ones at that offset, and a
        rollout worker sees only its own."""
        if self.dp_size == 1:
            return {}
        host, port = self.master
        return dict(zip(DP_ENV, (str(self.dp_size), str(self.rank), "0", host, str(port))))


def check_layout_support(vllm: Any, layout: VLLMLayout) -> None:
    """`ValueError` unless the installed vLLM takes `layout`'s options (read from `EngineArgs`'s
    fields and the version string, not assumed)."""
    if layout.single:
        return
    version = getattr(vllm, "__version__", "unknown")
    engine_args = getattr(vllm, "EngineArgs", None)
    fields = {f.name for f in dataclasses.fields(engine_args)} if dataclasses.is_dataclass(engine_args) else set()
    missing = sorted((set(layout.engine_kwargs()) | {"logprobs_mode"}) - fields)
    if missing or _older(version, LAYOUT_VLLM):
        raise ValueError(f"deploy.infer_ep={layout.infer_ep} / infer_tp={layout.infer_tp} needs vLLM >= {LAYOUT_VLLM} "
                         f"(installed: {version}{'; no ' + ', '.join(missing) if missing else ''})")


def _older(version: str, than: str) -> bool:
    """`version` parses and is older than `than` (dev and local suffixes ignored)."""
    def parts(v: str) -> tuple[int, ...]:
        out = []
        for p in v.split("+")[0].split(".")[:3]:
            if not p.isdigit():
                break
            out.append(int(p))
        return tuple(out)
    have = parts(version)
    return bool(have) and have < parts(than)
