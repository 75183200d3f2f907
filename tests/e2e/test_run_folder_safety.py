"""A run folder is never started over or written through a link: a finished run whose trainer
state is gone is neither restarted over nor damaged, `--restart` moves it aside, and symbolic
links in a run folder (received from someone else) never carry a write outside it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from rlfusion.cli import main
from rlfusion.obs.files import atomic_write_text, open_append, replace_dir
from rlfusion.runtime import run_state
from test_failures import _one_line

SMALL = ["max_steps=1", "checkpoint_every=25", "eval_every=25", "eval_problems=2", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "collapse_patience=0", "threads=1",
         "deploy.backend=local"]


def _args(base, out, name, *extra):
    return [f"base={base}", f"out_dir={out}", f"run_name={name}", *SMALL, *extra]


def _checksums(folder: Path) -> dict[str, str]:
    """Every file under `folder` but the lock (which names the process holding it)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != run_state.LOCK}


@pytest.fixture(scope="module")
def finished(base, tmp_path_factory) -> Path:
    """A run folder as a finished run leaves it (one step)."""
    out = tmp_path_factory.mktemp("finished")
    assert main(["train", *_args(base, out, "done")]) == 0
    run_dir = out / "done"
    assert {"metrics.jsonl", "summary.json", "final/", "checkpoint/"} <= set(run_state.outputs(run_dir))
    return run_dir


def _copy(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / finished.name
    shutil.copytree(finished, run_dir, symlinks=True)
    return run_dir


@pytest.mark.parametrize("removed", ["checkpoint/trainer_state.pt", "checkpoint"])
def test_a_finished_run_without_its_trainer_state_is_neither_restarted_over_nor_damaged(
        base, finished, tmp_path, capsys, removed):
    run_dir = _copy(finished, tmp_path)
    target = run_dir / removed
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    before = _checksums(run_dir)
    assert main(["train", "--resume", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert "no trainer state" in line and "metrics.jsonl" in line and "final/" in line
    assert f"base={run_dir / 'final'}" in line and f"rlfusion eval --ckpt {run_dir / 'final'}" in line
    assert main(["train", *_args(base, tmp_path, run_dir.name)]) == 2  # the same command again
    assert "never started over" in _one_line(capsys)
    assert _checksums(run_dir) == before


def test_restart_moves_the_old_run_aside_and_starts_over(base, finished, tmp_path, capsys):
    run_dir = _copy(finished, tmp_path)
    (run_dir / "checkpoint" / run_state.STATE).unlink()
    before = _checksums(run_dir)
    assert main(["train", *_args(base, tmp_path, run_dir.name), "--restart"]) == 0
    aside = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and _checksums(aside[0]) == before  # every old file, unchanged
    assert run_state.has_checkpoint(run_dir) and (run_dir / "final" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--restart"]) == 2
    assert "pass one of them" in _one_line(capsys)


@pytest.mark.parametrize("entry", [".lock", "timeline.json", "final", "checkpoint.tmp"])
def test_a_symlink_in_a_run_folder_leaves_its_outside_target_untouched(base, finished, tmp_path, capsys, entry):
    run_dir = _copy(finished, tmp_path / "runs")
    outside = tmp_path / "outside"
    if entry in ("final", "checkpoint.tmp"):  # a model folder someone else owns
        shutil.copytree(finished / "final", outside)
    else:
        outside.write_text("someone else's file\n")
    target = run_dir / entry
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    target.symlink_to(outside, target_is_directory=outside.is_dir())
    before = _checksums(outside) if outside.is_dir() else outside.read_bytes()
    assert main(["train", "--resume", str(run_dir), "max_steps=2"]) == 2
    line = _one_line(capsys)
    assert str(target) in line and "symbolic link" in line
    assert main(["train", *_args(base, tmp_path / "runs", run_dir.name), "--restart"]) == 2
    assert str(target) in _one_line(capsys)
    assert (_checksums(outside) if outside.is_dir() else outside.read_bytes()) == before


def test_writers_replace_a_link_instead_of_writing_through_it(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    link = tmp_path / "run" / "summary.json"
    link.parent.mkdir()
    link.symlink_to(outside)
    atomic_write_text(link, "new\n")
    assert not link.is_symlink() and link.read_text() == "new\n" and outside.read_text() == "keep\n"
    log = tmp_path / "run" / "metrics.jsonl"
    log.symlink_to(outside)
    with pytest.raises(OSError):
        open_append(log)
    folder_link = tmp_path / "run" / "final"
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("keep\n")
    folder_link.symlink_to(other, target_is_directory=True)
    fresh = tmp_path / "run" / ".final.tmp"
    fresh.mkdir()
    (fresh / "x").write_text("new\n")
    replace_dir(fresh, folder_link)
    assert not folder_link.is_symlink() and (folder_link / "x").read_text() == "new\n"
    assert (other / "x").read_text() == "keep\n" and outside.read_text() == "keep\n"
