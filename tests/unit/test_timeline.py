"""Per-device timeline: union-of-overlaps utilization, Chrome trace, Gantt PNG, process merge."""

import json
import multiprocessing as mp

import pytest

from rlfusion.obs.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hand_made() -> Timeline:
    tl = Timeline(origin_wall_s=1000.0)
    # cpu:0 is shared by actor and reward: [0, 4) and [3, 6) overlap, union = [0, 6)
    tl.add("cpu:0", "rollout", 0.0, 4.0, role="actor", step=0)
    tl.add("cpu:0", "reward", 3.0, 6.0, role="reward", step=0)
    tl.add("cpu:0", "idle", 6.0, 8.0, role="actor")
    tl.add("cpu:0", "train", 8.0, 10.0, role="actor", step=0)
    # cpu:1: two disjoint spans and one nested inside the first; busy = 2 + 1 = 3
    tl.add("cpu:1", "reference", 1.0, 3.0, role="reference", step=0)
    tl.add("cpu:1", "reference", 1.5, 2.5, role="reference", step=1)
    tl.add("cpu:1", "transfer", 9.0, 9.5, role="actor")
    tl.add("cpu:1", "transfer", 9.5, 10.0, role="actor")  # touching, not overlapping
    return tl


def test_utilization_is_union_of_non_idle_spans_over_timeline_wall():
    util = _hand_made().utilization()
    assert set(util) == {"cpu:0", "cpu:1"}
    assert util["cpu:0"].wall_s == util["cpu:1"].wall_s == 10.0
    assert util["cpu:0"].busy_s == 8.0  # [0, 6) + [8, 10); idle does not count
    assert util["cpu:0"].fraction == 0.8
    assert util["cpu:0"].phase_s == {"rollout": 4.0, "reward": 3.0, "idle": 2.0, "train": 2.0}
    assert util["cpu:1"].busy_s == 3.0
    assert util["cpu:1"].phase_s == {"reference": 2.0, "transfer": 1.0}
    assert Timeline().utilization() == {}


def test_span_context_records_even_on_error_and_rejects_bad_spans():
    tl = Timeline()
    with tl.span("cpu:0", "train", role="actor", step=3):
        pass
    with pytest.raises(RuntimeError), tl.span("cpu:0", "switch"):
        raise RuntimeError("boom")
    (a, b) = tl.spans
    assert (a.phase, a.role, a.step) == ("train", "actor", 3) and b.phase == "switch"
    assert 0 <= a.start_s <= a.end_s <= b.start_s <= b.end_s <= tl.now()
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.add("cpu:0", "train", 2.0, 1.0)
    with pytest.raises(ValueError, match="phase"):
        tl.add("cpu:0", "", 0.0, 1.0)
    with pytest.raises(ValueError, match="step"):
        tl.add("cpu:0", "train", 0.0, 1.0, step=1.5)


def test_chrome_trace_has_one_process_per_device_one_thread_per_role(tmp_path):
    path = _hand_made().write_chrome_trace(tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "cpu:0", 1: "cpu:1"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert threads == {(0, 0): "actor", (0, 1): "reward", (1, 0): "reference", (1, 1): "actor"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 8
    reward = next(e for e in complete if e["name"] == "reward")
    assert (reward["pid"], reward["tid"], reward["ts"], reward["dur"]) == (0, 1, 3e6, 3e6)
    assert reward["args"] == {"role": "reward", "step": 0}
    assert "step" not in next(e for e in complete if e["name"] == "idle")["args"]


def test_gantt_png_written(tmp_path):
    tl = _hand_made()
    tl.add("cpu:2", "my_custom_phase", 2.0, 5.0, role="critic")
    path = tl.plot_gantt(tmp_path / "plots" / "timeline.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def _worker(conn, device):
    tl = Timeline()
    with tl.span(device, "rollout", role="actor", step=7):
        pass
    tl.add(device, "reward", 0.0, 0.5, role="reward")  # relative to the worker's own origin
    conn.send(tl.to_dicts())
    conn.close()


def test_merge_across_processes_aligns_on_the_wall_clock():
    main = Timeline()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_worker, args=(child, "cpu:1"))
    proc.start()
    rows = parent.recv()
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert {r["phase"] for r in rows} == {"rollout", "reward"}
    json.dumps(rows)  # rows are plain JSON
    with main.span("cpu:0", "train", role="actor"):
        pass
    main.add_dicts(rows)
    by_phase = {s.phase: s for s in main.spans}
    assert by_phase["rollout"].step == 7 and by_phase["rollout"].device == "cpu:1"
    # the worker started after `main`, so its spans land after main's origin
    assert by_phase["reward"].start_s > 0
    assert by_phase["reward"].duration_s == pytest.approx(0.5)


def test_merge_shifts_by_origin_and_round_trips_through_dicts():
    a = Timeline(origin_wall_s=100.0)
    b = Timeline(origin_wall_s=103.0)
    a.add("cpu:0", "train", 0.0, 2.0, role="actor", step=1)
    b.add("cpu:1", "rollout", 0.0, 1.0, role="actor", step=1)
    b.add_wall("cpu:1", "reward", 104.0, 104.5, role="reward")
    a.merge(b)
    assert [(s.device, s.phase, s.start_s, s.end_s) for s in a.spans] == [
        ("cpu:0", "train", 0.0, 2.0), ("cpu:1", "rollout", 3.0, 4.0), ("cpu:1", "reward", 4.0, 4.5),
    ]
    c = Timeline.from_dicts(a.to_dicts())
    assert c.origin_wall_s == 100.0 and c.spans == a.spans
    with pytest.raises(ValueError, match="lacks"):
        a.add_dicts([{"device": "cpu:0", "phase": "train"}])


def test_packed_spans_come_back_with_their_phases_and_times():
    from rlfusion.obs.timeline import pack_spans, unpack_spans

    t0 = 1.8e9  # wall-clock seconds
    spans = [("switch", t0, t0 + 0.01), ("rollout", t0 + 0.01, t0 + 2.5), ("my-phase", t0 + 2.5, t0 + 3600.0)]
    packed = pack_spans(spans)
    assert packed[0] == ("my-phase",)  # only names outside PHASES travel
    back = unpack_spans(packed)
    assert [p for p, _, _ in back] == ["switch", "rollout", "my-phase"]
    for (_, s, e), (_, s2, e2) in zip(spans, back):
        assert abs(s - s2) < 1e-3 and abs(e - e2) < 1e-3  # sub-millisecond within an hour
    assert unpack_spans(pack_spans([])) == []
