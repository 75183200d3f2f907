"""Memory ledger: per-phase peaks, shared-storage dedup, model-state bytes, zero-redundancy rule."""

import pytest
import torch

from rlfusion.fusion import (
    MemoryLedger,
    check_zero_redundancy,
    grad_bytes,
    optimizer_bytes,
    param_bytes,
    tensor_bytes,
)

MB = 1 << 20


def test_peaks_per_phase_follow_category_changes():
    ledger = MemoryLedger("cpu:0")
    ledger.set("weights", 10 * MB)
    with ledger.phase("train"):
        ledger.set("grads", 10 * MB)
        ledger.set("optimizer", 20 * MB)
        ledger.set("activations", 5 * MB)  # train peak: 45 MB
        ledger.set("activations", 0)
    with ledger.phase("switch"):
        ledger.set("optimizer", 0)
        ledger.set("optimizer", 20 * MB, location="host")  # offloaded: not in the device total
        ledger.set("grads", 0)
        ledger.set("grads", 10 * MB, location="host")
    with ledger.phase("rollout"):
        ledger.set("kv_cache", 25 * MB)  # rollout peak: 35 MB
    assert ledger.peaks() == {"train": 45 * MB, "switch": 40 * MB, "rollout": 35 * MB}
    snap = ledger.snapshot()
    assert snap["device"] == {
        "weights": 10 * MB, "grads": 0, "optimizer": 0, "kv_cache": 25 * MB, "activations": 0,
        "buckets": 0,
    }
    assert snap["host"]["optimizer"] == 20 * MB and snap["host"]["grads"] == 10 * MB
    assert ledger.total("device") == 35 * MB and ledger.total("host") == 30 * MB
    # re-entering a phase keeps its earlier maximum; nested phases update both
    with ledger.phase("train"), ledger.phase("step"):
        ledger.set("activations", 1 * MB)
    assert ledger.peaks()["train"] == 45 * MB and ledger.peaks()["step"] == 36 * MB
    ledger.set("activations", 100 * MB)  # outside any phase: no peak moves
    assert ledger.peaks()["train"] == 45 * MB
    ledger.set_phase("eval")
    assert ledger.peaks()["eval"] == 135 * MB  # entering records the current total
    ledger.set_phase(None)


def test_shared_storages_count_once():
    bucket = torch.zeros(1000)  # 4000 bytes
    a, b = bucket[:600], bucket[600:]  # views: each costs the whole bucket, once
    assert tensor_bytes([a, b, bucket]) == 4000
    assert tensor_bytes([a, b, torch.zeros(10)]) == 4040
    ledger = MemoryLedger()
    assert ledger.track("weights", [a, b]) == 4000
    ledger.track("buckets", [bucket])
    assert ledger.snapshot()["device"]["weights"] == ledger.snapshot()["device"]["buckets"] == 4000
    assert ledger.total() == 4000  # weights living in the bucket are not a second copy
    ledger.track("weights", [torch.zeros(5, dtype=torch.float64)], name="embed")  # a 2nd part
    assert ledger.total() == 4040
    ledger.clear("weights", name="embed")
    assert ledger.total() == 4000
    ledger.clear("weights")
    ledger.clear("buckets")
    assert ledger.total() == 0


def test_tied_parameters_and_grads_count_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as in a language model head
    assert param_bytes(model) == 10 * 4 * 4
    assert grad_bytes(model) == 0
    model(torch.tensor([1, 2])).sum().backward()
    assert grad_bytes(model) == 10 * 4 * 4


def test_adamw_state_is_two_param_copies_plus_step_scalars():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert optimizer_bytes(opt) == 0
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    num_param_tensors = len(list(model.parameters()))
    # exp_avg + exp_avg_sq per parameter, plus one float32 0-d `step` tensor per parameter
    assert optimizer_bytes(opt) == 2 * param_bytes(model) + 4 * num_param_tensors
    assert grad_bytes(model) == param_bytes(model)


def test_zero_redundancy_rule():
    bucket = 4 * MB
    peaks = {"train": 40 * MB, "rollout": 30 * MB, "switch": 44 * MB}
    ok, report = check_zero_redundancy(peaks, bucket_bytes=bucket)
    assert ok and report.limit_bytes == 44 * MB and report.excess_bytes == 0
    peaks["switch"] = 44 * MB + 1
    ok, report = check_zero_redundancy(peaks, bucket_bytes=bucket)
    assert not ok and report.excess_bytes == 1

    # through the ledger: resharding bucket by bucket keeps the rule; building the whole
    # rollout copy of the weights before dropping the training copy breaks it.
    def run(whole_copy: bool) -> bool:
        ledger = MemoryLedger()
        ledger.set("weights", 10 * MB)
        with ledger.phase("train"):
            ledger.set("grads", 10 * MB)
            ledger.set("optimizer", 20 * MB)  # train peak: 40 MB
        with ledger.phase("switch"):
            ledger.set("buckets", bucket)  # one bucket in flight (switch peak 44 MB)
            if whole_copy:
                ledger.set("weights", 10 * MB, name="rollout")  # 54 MB: a redundant copy
            ledger.set("weights", 0)
            ledger.set("weights", 10 * MB, name="rollout")
            ledger.set("buckets", 0)
            ledger.set("optimizer", 20 * MB, location="host")
            ledger.set("optimizer", 0)
            ledger.set("grads", 0)
        with ledger.phase("rollout"):
            ledger.set("kv_cache", 20 * MB)
        return ledger.check_zero_redundancy(bucket_bytes=bucket)[0]

    assert run(whole_copy=False)
    assert not run(whole_copy=True)


def test_bad_input_is_rejected_with_one_line():
    ledger = MemoryLedger()
    with pytest.raises(ValueError, match="unknown memory category 'kv'"):
        ledger.set("kv", 1)
    with pytest.raises(ValueError, match="unknown memory location 'disk'"):
        ledger.set("weights", 1, location="disk")
    with pytest.raises(ValueError, match="must be an int >= 0"):
        ledger.set("weights", -1)
    with pytest.raises(ValueError, match="not a tensor"):
        ledger.track("weights", [1.0])
    with pytest.raises(ValueError, match="phase name"):
        ledger.set_phase("")
    with pytest.raises(ValueError, match="'switch' has no recorded peak"):
        check_zero_redundancy({"train": 1, "rollout": 1}, bucket_bytes=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        check_zero_redundancy({"train": 1, "rollout": 1, "switch": 1}, bucket_bytes=-1)
