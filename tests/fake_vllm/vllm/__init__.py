"""A fake `vllm` for tests on machines without a GPU: the offline API surface rlfusion's vLLM
backend (`engine/vllm_backend.py`) uses, run by rlfusion's native engine.

- `LLM(model=HF folder, **kwargs)`: loads the folder with `model/hf.load_hf`; `llm_engine` has
  `add_request / step / abort_request` with cumulative outputs like vLLM's (`RequestOutput`
  with `outputs[0].token_ids / logprobs / finish_reason`, `finished`).
- `collective_rpc(method, args)` calls the `worker_extension_cls` mixed into a fake worker, whose
  `model_runner.model.load_weights` takes HF-named tensors and rebuilds the native model once
  every tensor has come, so a wrong name or layout in a weight update changes what it generates.
- `sleep(level)`: the engine refuses to step while asleep; level 2 drops the weights (they turn
  to NaN, as vLLM discards them) until a full weight update arrives. `wake_up()`.
- `LLM.events` records sleeps, wakes and completed weight loads; `LLM.kwargs` the arguments it
  was built with and `LLM.dp_env` the `VLLM_DP_*` variables set when it was built (a layout's);
  `INSTANCES` lists every `LLM` built in this process.
- `EngineArgs` has the fields the backend checks for (a dataclass, as vLLM's), and
  `__version__` the release they came in.

Tests put it in front of the real one: `sys.modules["vllm"]` in process, or this folder's
parent on `PYTHONPATH` for Ray workers.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass

import torch

from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams as NativeParams
from rlfusion.model.hf import load_hf, state_from_hf, state_to_hf

IS_FAKE = True
INSTANCES: list["LLM"] = []
__version__ = "0.10.0"


@dataclass
class EngineArgs:
    model: str = ""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    logprobs_mode: str = "raw_logprobs"


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list
    finished: bool


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Model:
    def __init__(self, native, family, llm):
        self.native, self.family, self.llm, self.received = native, family, llm, {}
        self.expected, self.reloads = set(state_to_hf(native, family)), 0

    def parameters(self):
        return self.native.parameters()

    def load_weights(self, weights):
        self.received.update(dict(weights))
        if set(self.received) >= self.expected:  # every tensor has come: rebuild the policy
            self.native.load_state_dict(state_from_hf(self.received, self.native.config, self.family),
                                        strict=False)
            self.received, self.reloads = {}, self.reloads + 1
            self.llm.dropped = False
            self.llm.events.append("load")


class _EngineCore:
    def __init__(self, native, llm, max_num_seqs, seed):
        self.llm = llm
        self.engine = LLMEngine(native, EngineConfig(max_num_seqs=max_num_seqs, seed=seed))
        self.live: dict[str, Request] = {}

    def add_request(self, request_id, prompt, params):
        p = NativeParams(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k),
                         max_new_tokens=params.max_tokens, stop_ids=tuple(params.stop_token_ids))
        self.live[request_id] = Request(request_id, list(prompt["prompt_token_ids"]), p)
        self.engine.add_request(self.live[request_id])

    def _output(self, rid, reason):
        r = self.live[rid]
        lps = [{t: Logprob(lp)} for t, lp in zip(r.output_ids, r.logprobs)]
        return RequestOutput(rid, [CompletionOutput(list(r.output_ids), lps, reason)], reason is not None)

    def step(self):
        if self.llm.sleeping is not None:
            raise RuntimeError("fake vLLM: step() while asleep")
        if self.llm.dropped:
            raise RuntimeError("fake vLLM: step() after sleep(level=2) without a full weight update")
        done = {c.request_id: c.finish_reason for c in self.engine.step()}
        outs = [self._output(rid, done.get(rid)) for rid in self.live]
        for rid in done:
            del self.live[rid]
        return outs

    def abort_request(self, ids):
        self.engine.abort(ids)
        for rid in ids:
            self.live.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.live)


class LLM:
    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        self.dp_env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_DP_")}
        native, _, meta = load_hf(model)
        self.native = native
        module, _, name = kwargs["worker_extension_cls"].rpartition(".")
        worker_cls = type("Worker", (getattr(sys.modules[module], name),), {})
        self.worker = worker_cls()
        self.worker.model_runner = types.SimpleNamespace(model=_Model(native, meta["family"], self))
        self.llm_engine = _EngineCore(native, self, kwargs.get("max_num_seqs", 8), kwargs.get("seed", 0))
        self.sleeping: int | None = None
        self.dropped = False
        self.events: list[str] = []
        INSTANCES.append(self)

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]

    def sleep(self, level=1):
        if self.llm_engine.has_unfinished_requests():
            raise RuntimeError("fake vLLM: sleep() with unfinished requests")
        self.sleeping = level
        self.events.append(f"sleep{level}")
        if level == 2:
            self.dropped = True
            with torch.no_grad():
                for p in self.native.parameters():
                    p.fill_(float("nan"))

    def wake_up(self):
        self.sleeping = None
        self.events.append("wake")
