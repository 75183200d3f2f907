"""Run-folder observability: metrics JSONL/TensorBoard, plots, summary table and JSON."""

import json
import math
import sys

import pytest

from rlfusion.obs import (
    MetricsWriter,
    format_table,
    plot_metrics,
    plot_panels_grid,
    read_metrics,
    truncate_metrics,
    write_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_rows(run_dir, steps, tensorboard=False):
    with MetricsWriter(run_dir, tensorboard=tensorboard) as writer:
        for step in steps:
            writer.log(step, {"reward_mean": 0.1 * step, "kl": 0.01})
    return run_dir / "metrics.jsonl"


def test_writer_rows_round_trip_and_nonfinite_as_null(tmp_path):
    with MetricsWriter(tmp_path / "run", tensorboard=False) as writer:
        writer.log(0, {"reward_mean": 0.5, "kl": float("nan")})
        writer.log(1, {"reward_mean": 1, "loss": float("inf")})
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["reward_mean"] == 0.5 and rows[0]["kl"] is None
    assert rows[1]["loss"] is None
    assert all(r["time"] >= 0 for r in rows)
    assert "NaN" not in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_writer_appends_and_rejects_bad_input(tmp_path):
    _write_rows(tmp_path, [0, 1])
    path = _write_rows(tmp_path, [2])
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="'step'"):
            writer.log(3, {"step": 1.0})
        with pytest.raises(TypeError, match="'acc'"):
            writer.log(3, {"acc": "high"})
        with pytest.raises(TypeError, match="step must be an int"):
            writer.log(3.0, {})
    with pytest.raises(RuntimeError, match="closed"):
        writer.log(4, {})


def test_tensorboard_events_written_without_nonfinite(tmp_path):
    pytest.importorskip("tensorboard")
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        assert writer.tensorboard_enabled
        writer.log(0, {"reward_mean": 0.25, "kl": float("nan")})
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert events.stat().st_size > 0
    tags = [v.tag for e in loader.EventFileLoader(str(events)).Load() for v in e.summary.value]
    assert tags == ["reward_mean"]


def test_missing_tensorboard_falls_back_to_jsonl_with_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        writer = MetricsWriter(tmp_path, tensorboard=True)
    with writer:
        writer.log(0, {"kl": 0.1})
    assert not writer.tensorboard_enabled and not (tmp_path / "tb").exists()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["kl"] == 0.1


def test_truncated_last_line_is_skipped_but_corrupt_middle_line_raises(tmp_path):
    path = _write_rows(tmp_path, [0, 1])
    with path.open("a") as f:
        f.write('{"step": 2, "reward_me')  # run killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    _write_rows(tmp_path, [2])  # reopening drops the fragment before appending
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    path.write_text('{"step": 0}\n{"step": 1, oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


def test_truncate_metrics_keeps_rows_up_to_step(tmp_path):
    path = _write_rows(tmp_path, range(6))
    with path.open("a") as f:
        f.write('{"step": 6, "kl"')
    assert truncate_metrics(path, after_step=3) == 4
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert path.read_text().endswith("\n")
    _write_rows(tmp_path, [4])  # resumed run continues without duplicates
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temp file left behind


def test_plot_metrics_writes_present_panels_only(tmp_path):
    rows = [
        {"step": s, "reward_mean": 0.1 * s, "kl": None if s == 2 else 0.01 * s,
         "response_length_mean": 10.0 + s}
        for s in range(5)
    ]
    rows[4]["heldout_accuracy"] = None  # only a null: no data for this panel
    paths = plot_metrics(rows, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["kl.png", "response_length.png", "reward.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
    assert not (tmp_path / "plots" / "accuracy.png").exists()
    assert plot_metrics(rows, tmp_path / "p2", {"custom": ["absent"]}) == []
    with pytest.raises(ValueError, match="panel name"):
        plot_metrics(rows, tmp_path / "p3", {"a/b": ["kl"]})


def test_plot_panels_grid_writes_one_overview(tmp_path):
    rows = [{"step": s, "reward_mean": float(s), "heldout_accuracy": 0.3} for s in range(3)]
    path = plot_panels_grid(rows, tmp_path / "overview.png")
    assert path == tmp_path / "overview.png" and path.read_bytes()[:8] == PNG_MAGIC
    assert plot_panels_grid(rows, tmp_path / "none.png", {"x": ["absent"]}) is None
    assert not (tmp_path / "none.png").exists()


def test_format_table_aligns_columns():
    table = format_table([("base accuracy", "34.0%"), ("updates", "120")], "RL run summary")
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line is as wide as the box
    assert "RL run summary" in lines[1]
    body = [line for line in lines if "accuracy" in line or "updates" in line]
    assert [line.index("|", 1) for line in body] == [body[0].index("|", 1)] * 2
    assert body[1].endswith("  120 |")  # values right-aligned
    wide_title = format_table([("a", "1")], "a title longer than both columns")
    assert len({len(line) for line in wide_title.splitlines()}) == 1
    with pytest.raises(ValueError, match="row 0"):
        format_table([("a", 1)], "t")


def test_write_summary_round_trip_with_null_for_nan(tmp_path):
    summary = {
        "base_accuracy": 0.34, "final_accuracy": float("nan"), "updates": 10,
        "config": {"lr": 1e-4, "run_dir": tmp_path, "sizes": (1, 2)}, "inf": [float("-inf")],
    }
    path = write_summary(tmp_path / "run", summary)
    assert path == tmp_path / "run" / "summary.json"
    text = path.read_text()
    assert "NaN" not in text and text.startswith('{\n  "base_accuracy"')
    loaded = json.loads(text)
    assert loaded["base_accuracy"] == 0.34 and loaded["final_accuracy"] is None
    assert loaded["config"] == {"lr": 1e-4, "run_dir": str(tmp_path), "sizes": [1, 2]}
    assert loaded["inf"] == [None] and math.isclose(loaded["updates"], 10)
    with pytest.raises(TypeError, match=r"summary\.bad"):
        write_summary(tmp_path / "run", {"bad": object()})
    assert json.loads(path.read_text()) == loaded  # a failed write leaves the old file


def test_packed_numbers_send_their_names_only_when_they_change():
    import pickle

    from rlfusion.obs.metrics import NumberPacker, NumberUnpacker

    packer, unpacker = NumberPacker(), NumberUnpacker()
    first = packer.pack({"reward_mean": 0.5, "grad_norm": 1.25})
    again = packer.pack({"reward_mean": 0.75, "grad_norm": 2.0})
    assert first[0] == ("reward_mean", "grad_norm") and again[0] is None
    assert len(pickle.dumps(again)) < len(pickle.dumps(first)) - 20
    assert unpacker.unpack(first) == {"reward_mean": 0.5, "grad_norm": 1.25}
    assert unpacker.unpack(again) == {"reward_mean": 0.75, "grad_norm": 2.0}
    assert unpacker.unpack(packer.pack({"kl": 3})) == {"kl": 3.0}  # new names go again
    packer.pack({"kl": 5, "lr": 1e-6})  # lost on the way, with the new names
    with pytest.raises(ValueError, match="a packed call was lost"):
        unpacker.unpack(packer.pack({"kl": 6, "lr": 2e-6}))
