"""A device's memory budget (`deploy.device_memory_mb`): the refusal before the first step names
the phase, the bytes and a layout that fits (runtime/base_fit.py); the rollout's KV cache takes what
the budget leaves (`rollout_kv_rows`); a phase that goes above it at run time stops with one line
(fusion/switch.py, fusion/memory.py)."""

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from rlfusion.config import load_config
from rlfusion.engine.engine import EngineConfig, LLMEngine
from rlfusion.engine.types import Request, SamplingParams
from rlfusion.fusion.memory import MemoryBudgetError, MemoryLedger
from rlfusion.fusion.switch import DeviceSwitch
from rlfusion.model.config import get_preset
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.rl.trajectory import Trajectory
from rlfusion.runtime import base_fit
from rlfusion.runtime.actor import ActorStage
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.runtime.train_config import AlgoConfig, OptimConfig, TrainConfig

MIB = 2**20
TINY = get_preset("tiny")
CONFIG = Path("m/config.json")


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["deploy.num_devices=2", *overrides])


def _refusal(cfg: TrainConfig, model_cfg=TINY) -> str:
    with pytest.raises(ValueError) as e:
        base_fit.check_fits(cfg, model_cfg, CONFIG, overlap=False)
    return str(e.value)


def _rows(cfg: TrainConfig, model_cfg=TINY) -> int:
    return base_fit.rollout_kv_rows(cfg, model_cfg, DeploymentPlan.build(cfg.deploy))


# ---- the estimate ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny-mla"])
def test_a_kv_row_is_what_the_model_allocates_for_one_sequence(preset):
    model_cfg = dataclasses.replace(get_preset(preset), max_seq_len=96)
    model = MoETransformer.meta(model_cfg)
    with torch.device("cpu"):
        cache = model.new_kv_cache(1, dtype=torch.float32)
    assert base_fit.kv_row_bytes(model_cfg) == cache.nbytes


def test_expert_parallel_replica_and_shards_per_phase():
    """tiny (1.73M parameters, 6.6 MiB per float32 copy) on 2 colocated devices, no reference."""
    counts = TINY.param_counts()
    full, experts = 4 * counts["total"], 4 * counts["routed_experts"]
    phases = lambda *o: base_fit._device_phases(0, _cfg("algo.kl_coef=0", *o),  # noqa: E731
                                                DeploymentPlan.build(_cfg(*o).deploy), TINY)
    replica = phases()
    assert (replica["rollout"].device, replica["rollout"].host) == (full, 2 * full)  # the moments wait on host
    assert replica["train"].device == 4 * full
    ep = phases("deploy.train_ep=2", "deploy.infer_ep=2")
    half = full - experts // 2  # the dense weights whole, half of the routed experts
    assert ep["rollout"].device == half and ep["rollout"].host == 3 * half  # the shard and its moments on host
    assert ep["switch"].device == 2 * half  # the replica filled while the shard is in
    assert ep["train"].device == 4 * half


# ---- refused before the first step ----------------------------------------------------------

def test_a_budget_full_replicas_cannot_train_in_is_refused_naming_a_layout_that_fits():
    message = _refusal(_cfg("deploy.device_memory_mb=28"))
    assert message.startswith("m/config.json: 1,728,896 parameters, 0.0 GiB per float32 copy: device 0's train "
                              "phase needs at least 33.0 MiB (weights 13.2 MiB + grads 6.6 MiB + optimizer 13.2 MiB), "
                              "more than its budget deploy.device_memory_mb=28; a layout would fit: "), message
    assert "\n" not in message
    keys = message.rpartition(": ")[2].split()
    base_fit.check_fits(_cfg("deploy.device_memory_mb=28", *keys), TINY, CONFIG, overlap=False)
    base_fit.check_fits(_cfg("deploy.device_memory_mb=28", "deploy.train_ep=2", "deploy.infer_ep=2"), TINY, CONFIG,
                        overlap=False)


def test_a_rollout_without_room_for_one_kv_row_is_refused():
    """The rule: the rollout holds its replica, one bucket and at least one KV row of the
    engine's whole context; here no layout makes room for a 64 MiB row."""
    long = dataclasses.replace(TINY, max_seq_len=32768)
    message = _refusal(_cfg("deploy.device_memory_mb=50", "algo.kl_coef=0"), long)
    assert ("device 0's rollout phase needs at least 74.6 MiB (weights 6.6 MiB + one bucket 4.0 MiB + 1 KV row of "
            "32768 tokens 64.0 MiB), more than its budget deploy.device_memory_mb=50; no layout") in message
    assert message.endswith("raise deploy.device_memory_mb, lower context_len or use a smaller base")


def test_no_budget_on_cpu_refuses_nothing_and_keeps_max_num_seqs():
    cfg = _cfg("rollout.max_num_seqs=7")
    base_fit.check_fits(cfg, TINY, CONFIG, overlap=False)
    assert base_fit.device_budget(cfg) == 0 and _rows(cfg) == 7


# ---- the KV cache takes what the budget leaves ----------------------------------------------

def test_a_smaller_replica_shard_leaves_more_kv_rows():
    ep1 = _cfg("deploy.device_memory_mb=28", "deploy.train_ep=2")
    ep2 = _cfg("deploy.device_memory_mb=28", "deploy.train_ep=2", "deploy.infer_ep=2")
    # (28 MiB - resident - a 4 MiB bucket) / 0.5 MiB a row: replica + reference 13.2 MiB, 10.9 with infer_ep=2
    assert (_rows(ep1), _rows(ep2)) == (21, 26)
    assert _rows(dataclasses.replace(ep2, rollout=dataclasses.replace(ep2.rollout, max_num_seqs=8))) == 8


def test_rows_where_none_fit_is_one_line():
    cfg = _cfg("deploy.device_memory_mb=17", "deploy.train_ep=2")
    with pytest.raises(ValueError, match=r"^deploy.device_memory_mb=17: the rollout holds 13.2 MiB and one bucket "
                                         r"\(4.0 MiB\), which leaves 0.0 MiB, less than one KV-cache row of 256 "
                                         r"tokens \(0.5 MiB\)$"):
        _rows(cfg)


# ---- a phase above the budget at run time ---------------------------------------------------

def test_the_ledger_checks_its_budget():
    ledger = MemoryLedger("device3", budget_bytes=10 * MIB)
    ledger.set("weights", 6 * MIB)
    with ledger.phase("rollout"):
        ledger.set("kv_cache", 4 * MIB)
        ledger.check_budget()  # at the budget is within it
        ledger.set("kv_cache", 5 * MIB)
        ledger.set("optimizer", 8 * MIB, location="host")  # host bytes are not the device's
        with pytest.raises(MemoryBudgetError, match=r"^device3: the rollout phase holds 11.0 MiB on the device "
                                                    r"\(weights 6.0 MiB, kv_cache 5.0 MiB\), more than its budget "
                                                    r"deploy.device_memory_mb=10 \(10.0 MiB\)$"):
            ledger.check_budget()
    MemoryLedger().check_budget()  # no budget: never
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0"):
        MemoryLedger(budget_bytes=-1)


def _switch(budget: int) -> tuple[DeviceSwitch, ActorStage, CharTokenizer]:
    torch.manual_seed(0)
    model, tok = MoETransformer(TINY), CharTokenizer.arithmetic()
    actor = ActorStage(model, AlgoConfig(kl_coef=0.0), OptimConfig(warmup_steps=0), 1.0)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4))
    switch = DeviceSwitch(1, model, model, engine, 4 * MIB, False, lambda phase: contextlib.nullcontext(),
                          budget_bytes=budget)
    switch.attach(optimizer=actor.optimizer)
    return switch, actor, tok


def _trajs(switch: DeviceSwitch, tok: CharTokenizer) -> list[Trajectory]:
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    with switch.rollout():
        done = switch.engine.generate([Request(str(i), [tok.bos_id, *tok.encode(f"{i}+1=")], params) for i in range(4)])
    out = []
    for i, c in enumerate(done):
        t = Trajectory.of_completion(c)
        t.advantage = 1.0 if i % 2 else -1.0
        out.append(t)
    return out


def test_a_train_phase_above_the_budget_stops_after_a_rollout_within_it():
    """Weights 6.6 MiB + 4 KV rows 2 MiB fit 10 MiB; weights + grads + AdamW's moments do not."""
    switch, actor, tok = _switch(10 * MIB)
    trajs = _trajs(switch, tok)  # the rollout phase fits
    with pytest.raises(MemoryBudgetError, match=r"^device 1: the train phase holds 26.4 MiB on the device "
                                                r"\(weights 6.6 MiB, grads 6.6 MiB, optimizer 13.2 MiB\), more than "
                                                r"its budget deploy.device_memory_mb=10 \(10.0 MiB\)$"):
        with switch.train():
            actor.update(trajs)


def test_the_budget_is_reported_beside_the_phase_peaks():
    switch, actor, tok = _switch(40 * MIB)
    trajs = _trajs(switch, tok)
    with switch.train():
        actor.update(trajs)
    memory = switch.memory()
    assert memory["budget_bytes"] == 40 * MIB
    assert memory["peaks/rollout"] <= memory["peaks/train"] <= 40 * MIB
    assert switch.memory()["budget_bytes"] == 40 * MIB  # the next step's ledger keeps it


def test_lora_trains_where_full_fine_tuning_does_not_fit():
    """LoRA keeps gradients and AdamW moments of the adapters only, and the reference is the
    policy's frozen base: a budget full fine-tuning's train phase overflows fits."""
    message = _refusal(_cfg("deploy.device_memory_mb=28"))
    assert "train phase needs at least 33.0 MiB" in message
    base_fit.check_fits(_cfg("deploy.device_memory_mb=28", "optim.lora_rank=4"), TINY, CONFIG, overlap=False)
    phases = base_fit._device_phases(0, _cfg("optim.lora_rank=4"), DeploymentPlan.build(_cfg().deploy), TINY)
    parts = dict(phases["train"].parts)
    share = base_fit._adapter_share(_cfg("optim.lora_rank=4"), TINY)
    assert 0 < share < 0.1 and parts["grads"] == round(4 * TINY.param_counts()["total"] * share)
    full = base_fit._device_phases(0, _cfg(), DeploymentPlan.build(_cfg().deploy), TINY)
    one_copy = 4 * TINY.param_counts()["total"]
    assert dict(full["train"].parts)["weights"] == 2 * one_copy  # the policy and the reference's copy
    assert parts["weights"] == one_copy  # the reference is the policy's frozen base
