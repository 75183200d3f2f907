"""DistQueue in-process core: delivery guarantees, policies, back-pressure, errors, checkpoint, packing."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlfusion.queue import (ColumnSpec, DistQueue, QueueConfig, QueueFullError, pack_column, packed_bytes,
                            padded_bytes, split_balanced, unpack_column)

COLUMNS = (ColumnSpec("prompt", "int32", variable_length=True), ColumnSpec("response", "int32", variable_length=True),
           ColumnSpec("reward", "float32"), ColumnSpec("advantage", "float32"), ColumnSpec("meta", "object"))


def make_queue(**kw) -> DistQueue:
    return DistQueue(QueueConfig(COLUMNS, **kw))


def snapshot(q: DistQueue) -> dict:
    return q.state_dict()


@settings(max_examples=25, deadline=None)
@given(num_producers=st.integers(1, 3), num_consumers=st.integers(1, 3), rows_per_producer=st.integers(1, 30),
       batch=st.integers(1, 7), capacity=st.one_of(st.none(), st.integers(8, 20)))
def test_concurrent_exactly_once(num_producers, num_consumers, rows_per_producer, batch, capacity):
    q = make_queue(capacity=capacity, put_timeout_s=10.0)
    total = num_producers * rows_per_producer
    consumers = [f"c{i}" for i in range(num_consumers)]
    seen: dict[str, list[int]] = {c: [] for c in consumers}

    def produce(p: int) -> None:
        for i in range(rows_per_producer):
            q.put({"prompt": [[p, i]], "reward": [float(p * 1000 + i)]})

    def consume(c: str, reader: int) -> None:  # two threads per consumer race for its rows
        while True:
            with lock:
                if len(seen[c]) >= total:
                    return
            b = q.get(c, ["prompt", "reward"], batch, block=True, timeout=0.05)
            for pr, rw in zip(b.columns["prompt"], b.columns["reward"]):
                assert rw == pr[0] * 1000 + pr[1]
            with lock:
                seen[c].extend(int(r) for r in b.columns["reward"])
            if capacity is not None:
                q.clear_consumed(consumers)

    lock = threading.Lock()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(num_producers)]
    threads += [threading.Thread(target=consume, args=(c, k)) for c in consumers for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    expected = sorted(p * 1000 + i for p in range(num_producers) for i in range(rows_per_producer))
    for c in consumers:
        assert sorted(seen[c]) == expected, c  # nothing lost, nothing twice


def test_partial_column_readiness():
    q = make_queue()
    ids = q.put({"prompt": [[1], [2], [3]]})
    assert len(q.get("actor", ["prompt", "reward"], 3)) == 0
    q.put({"reward": [0.5]}, row_ids=[ids[1]])
    b = q.get("actor", ["prompt", "reward"], 3)
    assert b.row_ids == [ids[1]] and b.columns == {"prompt": [[2]], "reward": [0.5]}
    assert len(q.get("actor", ["prompt", "reward"], 3)) == 0  # consumed
    assert q.get("ref", ["prompt"], 3).row_ids == ids  # other consumer has its own marks


def test_group_policy_returns_whole_ready_groups_only():
    q = make_queue(group_size=2)
    a = q.put({"prompt": [[1], [2]]}, group_ids=[7, 7])
    b = q.put({"prompt": [[3]], "reward": [1.0]}, group_ids=[8])
    q.put({"reward": [1.0]}, row_ids=[a[0]])
    assert len(q.get("actor", ["prompt", "reward"], 4, policy="group")) == 0  # group 7 half ready, 8 half present
    q.put({"reward": [2.0]}, row_ids=[a[1]])
    q.put({"prompt": [[4]], "reward": [3.0]}, group_ids=[8])
    got = q.get("actor", ["prompt", "reward"], 2, policy="group")
    assert got.row_ids == a and got.group_ids == [7, 7]
    got = q.get("actor", ["prompt", "reward"], 4, policy="group")
    assert got.group_ids == [8, 8] and got.row_ids[0] == b[0]
    with pytest.raises(ValueError, match="group_size"):
        q.get("actor", ["prompt"], 3, policy="group")
    with pytest.raises(ValueError, match="group 8"):
        q.put({"prompt": [[5]]}, group_ids=[8])


def test_readers_sharing_a_batch_take_its_groups_only_and_count_what_is_taken():
    q = make_queue(group_size=2)
    q.put({"prompt": [[1], [2], [3], [4], [5]]}, group_ids=[0, 0, 1, 1, 2], versions=[0, 0, 1, 0, 0])
    first = q.get("reward", ["prompt"], 1, groups=[1, 0])
    assert first.row_ids == [0]  # row order, whatever order the groups are named in
    assert q.count_consumed("reward", [0, 1]) == 1
    rest = q.get("reward", ["prompt"], 9, groups=[0, 1])
    assert rest.row_ids == [1, 2, 3] and q.count_consumed("reward", [0, 1]) == 4
    assert len(q.get("reward", ["prompt"], 9, groups=[0, 1])) == 0  # group 2 is not theirs
    assert q.get("old", ["prompt"], 2, policy="oldest_version", groups=[1]).row_ids == [3, 2]
    assert q.get("whole", ["prompt"], 4, policy="group", groups=[1, 2]).group_ids == [1, 1]  # 2 is half there


def test_a_blocking_get_of_groups_ends_at_the_first_row_or_once_all_are_taken():
    import time
    q = make_queue(group_size=2)
    start = time.monotonic()
    threading.Timer(0.2, lambda: q.put({"prompt": [[1]]}, group_ids=[0])).start()
    got = q.get("reward", ["prompt"], 8, block=True, timeout=30, groups=[0], min_count=1)
    assert got.row_ids == [0] and time.monotonic() - start < 10  # one row ends the wait
    q.put({"prompt": [[2]]}, group_ids=[0])
    assert q.get("reward", ["prompt"], 8, groups=[0]).row_ids == [1]
    start = time.monotonic()
    assert len(q.get("reward", ["prompt"], 8, block=True, timeout=30, groups=[0], min_count=1)) == 0
    assert time.monotonic() - start < 10  # group 0's 2 rows are all taken: nothing more can come


def test_oldest_version_policy():
    q = make_queue()
    q.put({"reward": [0.0, 1.0, 2.0, 3.0]}, versions=[3, 1, 2, 1])
    b = q.get("actor", ["reward"], 3, policy="oldest_version")
    assert b.versions == [1, 1, 2] and b.columns["reward"] == [1.0, 3.0, 2.0]


def test_blocking_get_waits_for_producer():
    q = make_queue()
    threading.Timer(0.05, lambda: q.put({"reward": [1.0, 2.0]})).start()
    assert q.get("actor", ["reward"], 2, block=True, timeout=5).columns["reward"] == [1.0, 2.0]
    assert len(q.get("actor", ["reward"], 1, block=True, timeout=0.02)) == 0  # times out, returns empty


def test_back_pressure_waits_then_raises_and_never_drops():
    q = make_queue(capacity=2)
    ids = q.put({"reward": [1.0, 2.0]})
    with pytest.raises(QueueFullError, match="full"):
        q.put({"reward": [3.0]}, timeout=0.05)
    assert len(q) == 2
    threading.Timer(0.05, lambda: q.retire([ids[0]])).start()
    q.put({"reward": [3.0]}, timeout=5)  # unblocked by the retire
    assert q.get("x", ["reward"], 5).columns["reward"] == [2.0, 3.0]
    with pytest.raises(ValueError, match="capacity"):
        q.put({"reward": [0.0, 0.0, 0.0]})


@pytest.mark.parametrize("kwargs, match", [
    ({"data": {"nope": [1]}}, "unknown column 'nope'"),
    ({"data": {"reward": ["x"]}}, "column 'reward'"),
    ({"data": {"prompt": [[1.5]]}}, "column 'prompt'"),
    ({"data": {"prompt": [[2**40]]}}, "column 'prompt'.*int32"),
    ({"data": {"prompt": [[1], [2]], "reward": [1.0]}}, "column 'reward': 1 values for 2 rows"),
    ({"data": {"reward": [1.0]}, "row_ids": [99]}, "row 99 does not exist"),
    ({"data": {"prompt": [[1]]}, "row_ids": [0]}, "column 'prompt' is already written"),
    ({"data": {"reward": [1.0]}, "versions": [1, 2]}, "versions"),
    ({"data": [{"reward": 1.0}, {"prompt": [1]}]}, "row 1"),
])
def test_bad_input_raises_and_leaves_state_unchanged(kwargs, match):
    q = make_queue()
    q.put({"prompt": [[1], [2]]})
    before = snapshot(q)
    data = kwargs.pop("data")
    with pytest.raises(ValueError, match=match):
        q.put(data, **kwargs)
    assert snapshot(q) == before
    with pytest.raises(ValueError, match="unknown column"):
        q.get("actor", ["nope"], 1)
    assert snapshot(q) == before


def test_put_to_retired_row_errors():
    q = make_queue()
    ids = q.put({"prompt": [[1], [2]]})
    assert q.retire([ids[0], ids[0], 42]) == [ids[0]]
    with pytest.raises(ValueError, match=f"row {ids[0]} is retired"):
        q.put({"reward": [1.0]}, row_ids=[ids[0]])
    q.get("a", ["prompt"], 5)
    q.get("b", ["prompt"], 5)
    assert q.clear_consumed(["a"]) == [ids[1]] and len(q) == 0


def test_retired_rows_leave_no_trace_that_grows():
    """A long run retires every row; the queue's bookkeeping stays the size of the live rows,
    and a retired row still refuses writes after a checkpoint round trip."""
    q = make_queue()
    for _ in range(50):
        q.retire(q.put({"prompt": [[1], [2], [3]]}))
    state = q.state_dict()
    assert len(q) == 0 and len(repr(state)) < 2000
    q2 = make_queue()
    q2.load_state_dict(state)
    with pytest.raises(ValueError, match="row 7 is retired"):
        q2.put({"reward": [1.0]}, row_ids=[7])


def test_checkpoint_round_trip_with_partial_rows(tmp_path):
    q = make_queue(capacity=10, group_size=2)
    ids = q.put([{"prompt": [1, 2], "meta": "p0"}, {"prompt": [3], "meta": "p0"}], group_ids=[0, 0], versions=[4, 5])
    q.put({"response": [[9, 9, 9]], "reward": [1.0]}, row_ids=[ids[0]])  # row 1 is an unfinished rollout
    q.get("reward_stage", ["response"], 5)
    q.put({"prompt": [[7]]}, group_ids=[1])
    torch.save(q.state_dict(), tmp_path / "q.pt")
    r = make_queue(capacity=10, group_size=2)
    r.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=False))
    assert r.state_dict() == q.state_dict()
    assert len(r.get("reward_stage", ["response"], 5)) == 0  # consumed mark survived
    r.put({"response": [[8]], "reward": [0.0]}, row_ids=[ids[1]])  # finish the partial row
    b = r.get("actor", ["prompt", "response", "reward", "meta"], 2, policy="group")
    assert b.row_ids == ids and b.versions == [4, 5] and b.columns["response"] == [[9, 9, 9], [8]]
    assert r.put({"prompt": [[0]]}, group_ids=[1]) == [3]  # row ids continue
    with pytest.raises(ValueError, match="columns"):
        DistQueue(QueueConfig(COLUMNS[:2], group_size=2)).load_state_dict(q.state_dict())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(-2**40, 2**40), max_size=8), max_size=6))
def test_pack_unpack_round_trip_ints(values):
    flat, lengths = pack_column(values)
    assert unpack_column(flat, lengths) == values
    assert lengths.tolist() == [len(v) for v in values]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=8), min_size=1, max_size=6))
def test_pack_unpack_round_trip_floats(values):
    flat, lengths = pack_column(values)
    assert flat.dtype == torch.float32 and unpack_column(flat, lengths) == values


@pytest.mark.parametrize("hi, dtype", [(127, torch.int8), (128, torch.int16), (32767, torch.int16),
                                       (32768, torch.int32), (2**31, torch.int64)])
def test_pack_narrows_int_dtype(hi, dtype):
    flat, _ = pack_column([[0, hi], [-1]])
    assert flat.dtype == dtype


def test_packed_beats_padded_on_long_tail():
    values = [[1] * 10] * 99 + [[1] * 1000]
    assert packed_bytes(values) < 0.2 * padded_bytes(values)
    assert padded_bytes(values) == 100 * 1000 * 8
    with pytest.raises(ValueError, match="lengths sum"):
        unpack_column(torch.zeros(3), torch.tensor([1, 1]))


def test_split_balanced_equalizes_tokens():
    lengths = [100, 10, 10, 10, 50, 50, 30, 20]
    parts = split_balanced(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 10


def test_batch_split_balanced_across_dp_ranks():
    q = make_queue()
    lengths = [400, 10, 30, 200, 20, 150, 60, 90]
    q.put({"prompt": [[1] * 5 for _ in lengths], "response": [[2] * n for n in lengths]})
    batch = q.get("actor", ["prompt", "response"], 8)
    parts = batch.split_balanced(2, ["prompt", "response"])
    assert sorted(r for p in parts for r in p.row_ids) == batch.row_ids  # every row exactly once
    loads = [sum(len(x) + len(y) for x, y in zip(p.columns["prompt"], p.columns["response"])) for p in parts]
    contiguous = [sum(n + 5 for n in lengths[:4]), sum(n + 5 for n in lengths[4:])]
    assert max(loads) / (sum(loads) / 2) <= 1.05 < max(contiguous) / (sum(contiguous) / 2)
    for p in parts:  # rows keep their own cells
        assert all(len(r) == lengths[rid] for rid, r in zip(p.row_ids, p.columns["response"]))
    with pytest.raises(ValueError, match="length column 'reward'"):
        batch.split_balanced(2, ["reward"])


def test_float32_cells_are_stored_as_they_travel():
    q = make_queue()
    q.put({"reward": [0.1], "prompt": [[1]]})
    got = q.get("a", ["reward"], 1).columns["reward"][0]
    assert got == torch.tensor(0.1, dtype=torch.float32).item() != 0.1  # what the Ray wire returns too


@pytest.mark.parametrize("spec, values", [
    (ColumnSpec("lp", "float32", variable_length=True), [[0.1, 2], [], torch.tensor([0.3, -1.5])]),
    (ColumnSpec("ids", "int16", variable_length=True), [[1, 2, 3], torch.tensor([4, 5]), []]),
    (ColumnSpec("reward", "float32"), [0.1, 1, -2.5]),
    (ColumnSpec("n", "int64"), [3, -4, 2**40]),
])
def test_a_column_normalized_at_once_equals_cell_by_cell(spec, values):
    assert spec.normalize_many(values) == [spec.normalize(v) for v in values]


def test_a_bad_cell_in_a_column_names_the_column_and_value():
    with pytest.raises(ValueError, match="column 'ids': value 40000 is outside the int16 range"):
        ColumnSpec("ids", "int16", variable_length=True).normalize_many([[1], [40000]])
    with pytest.raises(ValueError, match="column 'lp': expected a sequence of float32, got str"):
        ColumnSpec("lp", "float32", variable_length=True).normalize_many([[0.5], "x"])
