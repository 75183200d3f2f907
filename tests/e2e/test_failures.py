"""Faults a careless or hostile user meets: a checkpoint that carries code, the device world's
ports, stops before the first periodic checkpoint, two runs of one folder, an unreachable
cluster, a disk that fills during a save. Each ends in one line and loses nothing saved."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlfusion.cli import main
from rlfusion.config import load_config
from rlfusion.model.checkpoint import save_checkpoint
from rlfusion.model.config import get_preset
from rlfusion.model.tokenizer import CharTokenizer
from rlfusion.model.transformer import MoETransformer
from rlfusion.runtime import run_state
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer, write_run_config

TESTS = Path(__file__).parents[1]  # the helpers (reward_fns)
SMALL = ["max_steps=3", "checkpoint_every=25", "eval_every=25", "eval_problems=2", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "collapse_patience=0", "threads=1"]


def _args(base, out, name, *extra):
    return [f"base={base}", f"out_dir={out}", f"run_name={name}", *SMALL, *extra]


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _cli(*args, cwd=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "rlfusion.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


class _Marker:
    """Pickles to a call that creates a file: what a hostile trainer_state.pt would carry."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _run_folder(base, tmp_path, name, model=None) -> Path:
    """A run folder as a saved run leaves it (local backend), whose checkpoint we then tamper with."""
    run_dir = tmp_path / name
    cfg = load_config(TrainConfig, None, _args(base, tmp_path, name, "deploy.backend=local"))
    trainer = RLTrainer(cfg, run_dir, base)
    write_run_config(run_dir, cfg)
    run_state.save(trainer)
    if model is not None:
        save_checkpoint(run_dir / "checkpoint", model, CharTokenizer.arithmetic())
    return run_dir


def test_a_trainer_state_carrying_code_runs_none_on_resume(base, tmp_path, capsys):
    run_dir = _run_folder(base, tmp_path, "hostile")
    marker = tmp_path / "marker"
    state = run_state.read_state(run_dir / "checkpoint" / run_state.STATE)
    torch.save({**state, "bad_steps": _Marker(marker)}, run_dir / "checkpoint" / run_state.STATE)
    assert main(["train", "--resume", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert "trainer_state.pt" in line and "never loaded" in line
    assert not marker.exists()


def test_resume_from_a_checkpoint_of_another_architecture_is_one_line(base, tmp_path, capsys):
    other = MoETransformer(dataclasses.replace(get_preset("tiny"), expert_ffn_dim=64))
    run_dir = _run_folder(base, tmp_path, "other", model=other)
    assert main(["train", "--resume", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert str(run_dir / "checkpoint") in line and "shape" in line


def test_resume_from_truncated_weights_is_one_line(base, tmp_path, capsys):
    run_dir = _run_folder(base, tmp_path, "truncated")
    weights = run_dir / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["train", "--resume", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert str(weights) in line and "not a readable safetensors file" in line


def test_resume_without_a_checkpoint_says_how_to_start_again(base, tmp_path, capsys):
    cfg = load_config(TrainConfig, None, _args(base, tmp_path, "empty", "deploy.backend=local"))
    write_run_config(tmp_path / "empty", cfg)  # a start that stopped before its first step
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "start it again with the same command" in _one_line(capsys)
    # and the same command does start it again
    assert main(["train", *_args(base, tmp_path, "empty", "deploy.backend=local", "max_steps=1")]) == 0
    assert run_state.has_checkpoint(tmp_path / "empty")


def test_a_failed_checkpoint_write_keeps_the_previous_one(base, tmp_path, monkeypatch):
    run_dir = _run_folder(base, tmp_path, "full")  # checkpoint of step 0
    cfg = json.loads((run_dir / "config.json").read_text())
    trainer = RLTrainer(load_config(TrainConfig, None, _args(base, tmp_path, "full", "deploy.backend=local")),
                        run_dir, base)
    trainer.saved_step, trainer.step = 0, 1

    def disk_full(obj, path, *a, **k):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(run_state.torch, "save", disk_full)
    with pytest.raises(run_state.RunError, match=r"No space left on device.*step 0 .* is kept"):
        run_state.save(trainer)
    assert run_state.read_state(run_dir / "checkpoint" / run_state.STATE)["step"] == 0
    assert not list(run_dir.glob(".checkpoint.*.tmp")) and cfg["run_name"] == "full"


def test_bad_reward_module_is_named_on_the_default_backend(base, tmp_path, capsys):
    assert main(["train", *_args(base, tmp_path, "rw", "reward=no_such_reward_module:score")]) == 2
    line = _one_line(capsys)
    assert "no_such_reward_module" in line and "died" not in line and "checkpoint" not in line


def test_unreachable_ray_address_is_one_line_within_seconds(base, tmp_path, capsys):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert main(["train", *_args(base, tmp_path, "addr", f'deploy.ray_address="127.0.0.1:{port}"')]) == 2
    assert "no Ray cluster answers there" in _one_line(capsys)
    assert time.monotonic() - start < 30


def test_a_second_run_of_one_folder_stops_and_the_first_is_unharmed(base, tmp_path, capsys):
    first = _cli("train", *_args(base, tmp_path, "twin", "deploy.backend=local", "max_steps=4"))
    lock = tmp_path / "twin" / run_state.LOCK
    deadline = time.monotonic() + 120
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert main(["train", *_args(base, tmp_path, "twin", "deploy.backend=local")]) == 2
    assert "is in use by rlfusion pid" in _one_line(capsys)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert (tmp_path / "twin" / "final" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (tmp_path / "twin" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and max(steps) == 4  # one run's metrics, not two interleaved


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
        if any(json.loads(r)["step"] >= step and "reward_mean" in json.loads(r) for r in rows):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("backend, signum", [("ray", signal.SIGINT), ("local", signal.SIGTERM)])
def test_a_signal_at_step_1_leaves_a_checkpoint_that_resume_continues(base, tmp_path, backend, signum):
    run_dir = tmp_path / "stop"
    proc = _cli("train", *_args(base, tmp_path, "stop", f"deploy.backend={backend}", "max_steps=50"))
    _wait_for_step(run_dir, proc, 1)
    os.killpg(proc.pid, signum)  # as a terminal's Ctrl-C: the whole process group
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err
    assert f"--resume {run_dir}" in err.strip().splitlines()[-1]
    stopped_at = run_state.read_state(run_dir / "checkpoint" / run_state.STATE)["step"]
    assert stopped_at >= 1
    resumed = _cli("train", "--resume", str(run_dir), f"max_steps={stopped_at + 1}")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert run_state.read_state(run_dir / "checkpoint" / run_state.STATE)["step"] == stopped_at + 1


LISTENERS = r'''
import json, os, socket, sys
from pathlib import Path
from rlfusion.config import load_config
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer

def tree(root):
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out

def listening(pids):
    inodes = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                found.append((table, f[1].split(":")[0], int(f[1].split(":")[1], 16)))
    return found

def reachable(addresses, port):
    out = []
    for address in addresses:
        try:
            socket.create_connection((address, port), timeout=2).close()
            out.append(address)
        except OSError:
            pass
    return out

cfg = load_config(TrainConfig, None, sys.argv[2:])
trainer = RLTrainer(cfg, Path(cfg.out_dir) / "ports", Path(cfg.base))
host, port = trainer.devices.rendezvous
print(json.dumps({"rendezvous": [host, port], "listening": listening(tree(os.getpid())),
                  "reachable": reachable(json.loads(sys.argv[1]), port)}))
trainer.close()
'''


def _is_loopback(table: str, hex_addr: str) -> bool:
    if table == "tcp":
        return hex_addr[-2:] == "7F"  # little-endian IPv4: 127.x.x.x
    return hex_addr in ("00000000000000000000000001000000",  # ::1
                        ) or hex_addr.startswith("0000000000000000FFFF0000") and hex_addr[-2:] == "7F"


def _non_loopback_addresses() -> list[str]:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return [a for a in out if ":" not in a and not a.startswith("127.")]


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only(base, tmp_path):
    outside = _non_loopback_addresses()
    proc = subprocess.run([sys.executable, "-c", LISTENERS, json.dumps(outside),
                           *_args(base, tmp_path, "ports", "deploy.num_devices=2")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rendezvous"][0] == "127.0.0.1"
    assert report["listening"], "the check found no listening socket at all"
    exposed = [(t, a, p) for t, a, p in report["listening"] if not _is_loopback(t, a)]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert report["reachable"] == [], "the rendezvous port answered on a non-loopback address"


@pytest.mark.slow
def test_a_reward_returning_none_on_a_device_worker_is_one_line(base, tmp_path):
    proc = _cli("train", *_args(base, tmp_path, "none", "reward=reward_fns:always_none", "deploy.num_devices=2"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    last = err.strip().splitlines()[-1]  # before it: Ray's start-up note and the progress bar
    assert "Traceback" not in err and last.startswith("rlfusion train: error: "), err
    assert "reward='reward_fns:always_none' returned None" in last
    assert "--resume" in last  # the checkpoint of step 0 is the way back
    assert run_state.has_checkpoint(tmp_path / "none")


def test_an_unwritable_run_folder_is_one_line(base, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main(["train", *_args(base, tmp_path / "file", "x", "deploy.backend=local")]) == 1
    assert str(tmp_path / "file") in _one_line(capsys)


@pytest.mark.parametrize("tamper, says", [
    (lambda s: s.pop("elapsed"), "no entry 'elapsed'"),
    (lambda s: s.update(step="abc"), "is not a step count"),
    (lambda s: s.update(engine_rng=[torch.zeros(5)]), "does not fit this run"),
    (lambda s: s.update(torch_rng=torch.zeros(5)), "does not fit this run"),
])
def test_a_trainer_state_of_the_wrong_shape_is_one_line(base, tmp_path, capsys, tamper, says):
    run_dir = _run_folder(base, tmp_path, "tampered")
    file = run_dir / "checkpoint" / run_state.STATE
    state = run_state.read_state(file)
    tamper(state)
    torch.save(state, file)
    assert main(["train", "--resume", str(run_dir)]) == 2
    line = _one_line(capsys)
    assert str(file) in line and says in line


def test_nothing_overwrites_a_checkpoint(base, tmp_path, capsys):
    run_dir = _run_folder(base, tmp_path, "kept")
    ckpt = run_dir / "checkpoint"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    # a new run named after the checkpoint folder, inside the run folder
    assert main(["train", *_args(base, run_dir, "checkpoint", "deploy.backend=local")]) == 2
    assert "holds a model checkpoint" in _one_line(capsys)
    assert main(["train", *_args(base, tmp_path, "kept/checkpoint", "deploy.backend=local")]) == 2
    assert "plain folder name" in _one_line(capsys)
    assert main(["export-hf", str(ckpt), str(ckpt)]) == 2
    assert "never overwrites" in _one_line(capsys)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


@pytest.mark.parametrize("argv, says", [
    (["train", "--resume", ""], "--resume needs the run folder"),
    (["eval", "--ckpt", "", "--n", "2"], "--ckpt is empty"),
    (["eval", "--k", "-1", "--n", "2"], "--k=-1 must be in [0, 64]"),
])
def test_empty_or_out_of_range_flags_are_one_line(argv, says, capsys):
    assert main(argv) == 2
    assert says in _one_line(capsys)


def test_resume_of_a_model_checkpoint_points_to_its_run_folder(base, tmp_path, capsys):
    run_dir = _run_folder(base, tmp_path, "inner")
    assert main(["train", "--resume", str(run_dir / "checkpoint")]) == 2
    assert f"--resume {run_dir}" in _one_line(capsys)
