"""Checkpoint and resume of an RL run: model, optimizer, RNG states, data position, step, the
StaleSync's in-flight partial rollouts.

Written to a fresh hidden folder in `run_dir`; the previous checkpoint is renamed to
`checkpoint.old` before the new one takes its place, so a run killed at any moment of a save
leaves a complete checkpoint to resume from (`load` falls back to `checkpoint.old`). The final
model goes to `final/` the same way.

Checkpoints are shared between people, so loading one never runs code: the trainer state is
read with `torch.load(weights_only=True)`, which builds only tensors, containers, numbers and
strings plus the few plain dataclasses listed in `_STATE_CLASSES` (a pickled callable such as
`os.system` is refused).

Also here: the run-folder lock (`lock_run_dir`), taken before a run starts anything, so two
processes never write one run folder, and a folder holding a symbolic link is refused before
anything is written (`obs/files.py`: no write in a run folder follows a link); and what a run
folder holds (`outputs`), so a run that finished or started is never started over unless asked
(`move_aside`), and a resume without a trainer state says what can be done (`no_state_message`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import IO

import torch
from safetensors import SafetensorError

from rlfusion.errors import RunError
from rlfusion.model import lora
from rlfusion.model.checkpoint import (CONFIG, load_adapters_into, load_checkpoint, lora_spec_of, lora_table,
                                       save_checkpoint)
from rlfusion.model.files import load_weights_into
from rlfusion.obs.files import fresh_dir, refuse_links, replace_dir
from rlfusion.rl.problem import Problem
from rlfusion.rl.trajectory import Trajectory
from rlfusion.stalesync.book import Group

STATE = "trainer_state.pt"
LOCK = ".lock"
# What a trainer state may hold besides tensors, containers and scalars: StaleSync's batch
# waiting for the next update, the paused samples the rollout devices hold and the queue's rows
# (plain data, no behaviour on load)
_STATE_CLASSES = [Group, Trajectory, Problem]


def save(trainer) -> Path:
    """Write the checkpoint; a failed write (disk full, read-only folder) stops the run with one
    line and leaves the previous checkpoint as it was."""
    for leftover in trainer.run_dir.glob(".checkpoint.*.tmp"):  # of a save killed midway
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = fresh_dir(trainer.run_dir, "checkpoint")
    try:
        return _save(trainer, tmp)
    except (OSError, SafetensorError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not _is_write_error(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        kept = (f"the checkpoint of step {trainer.saved_step} in {trainer.run_dir / 'checkpoint'} is kept"
                if trainer.saved_step is not None else "no earlier checkpoint exists")
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:160]
        raise RunError(f"cannot save a checkpoint in {getattr(e, 'filename', None) or tmp} ({why}); {kept}") from None


def _is_write_error(e: RuntimeError) -> bool:
    """torch.save reports a failed write (disk full) as a RuntimeError from its zip writer."""
    text = str(e)
    return "inline_container" in text or "No space left" in text or "file write failed" in text


def _save(trainer, tmp: Path) -> Path:
    final = trainer.run_dir / "checkpoint"
    trainer.sync_model()
    save_checkpoint(tmp, trainer.model, trainer.tokenizer, {"rl_steps": trainer.step})
    devices = trainer.devices
    actor = devices.state()  # weights (saved above, from the controller's copy), optimizer, version
    torch.save({
        "step": trainer.step,
        "elapsed": trainer.elapsed,
        "base_accuracy": trainer.base_accuracy,
        "actor_version": actor["version"],
        "optimizer": actor["optimizer"],
        "engine_rng": devices.rng_state(),
        "torch_rng": torch.get_rng_state(),
        "bad_steps": trainer.bad_steps,
        # StaleSync: the book (groups in flight: ids, versions, where their samples are), the
        # batch already taken for the next update, the samples the rollout devices hold paused
        # (with their cache rows, resume_kv=keep) and the queue's rows (finished groups waiting
        # for an update, samples handed over), so a resumed run goes on exactly
        "stalesync": None if trainer.stale is None else {**trainer.schedule.state_dict(),
                                                         "paused": devices.paused(),
                                                         "queue": devices.queue.state_dict(),
                                                         "shape": _stalesync_shape(trainer)},
        "critic": devices.critic_state() if trainer.cfg.algo.advantage == "gae" else None,
    }, tmp / STATE)
    replace_dir(tmp, final, keep_old=trainer.run_dir / "checkpoint.old")
    return final


def save_final(trainer, heldout_accuracy: float) -> Path:
    """The run's final model in `run_dir/final`, written under a fresh name and renamed in."""
    tmp = fresh_dir(trainer.run_dir, "final")
    try:
        save_checkpoint(tmp, trainer.model, trainer.tokenizer,
                        {"rl_steps": trainer.step, "heldout_accuracy": heldout_accuracy})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = trainer.run_dir / "final"
    replace_dir(tmp, final)
    return final


def load(trainer) -> None:
    path = trainer.run_dir / "checkpoint"
    if not (path / STATE).is_file():
        path = trainer.run_dir / "checkpoint.old"  # killed between the two renames of a save
    if not (path / STATE).is_file():
        raise FileNotFoundError(no_state_message(trainer.run_dir))
    info = lora_table(path)  # a LoRA run's: its adapters onto the run's base, which is loaded already
    saved = _lora_settings(lora_spec_of(info, path / CONFIG) if info else None)
    now = _lora_settings(lora.spec_of(trainer.model))
    if saved != now:
        raise ValueError(f"{path} was written with {saved}, this run has {now}; resume it with the settings "
                         f"it was saved with")
    if info:
        load_adapters_into(trainer.model, path, info)
    else:
        load_weights_into(trainer.model, load_checkpoint(path)[0].state_dict(), str(path))
    file = path / STATE
    state = read_state(file)
    try:
        _restore(trainer, state, file)
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError, RuntimeError, ValueError) as e:
        if isinstance(e, ValueError) and str(file) in str(e):
            raise  # already names the file and what to do
        what = f"no entry {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise ValueError(f"{file} does not fit this run ({type(e).__name__}: {what}); it was not written by "
                         f"this version of rlfusion for this run's settings") from None


def _lora_settings(spec: lora.LoraSpec | None) -> str:
    if spec is None:
        return "optim.lora_rank=0 (full fine-tuning)"
    return f"optim.lora_rank={spec.rank} lora_alpha={spec.alpha:g} lora_targets={','.join(spec.targets)}"


def _restore(trainer, state: dict, path: Path) -> None:
    """Put every part of a trainer state back; a part of the wrong kind raises (see `load`)."""
    if not isinstance(state["step"], int) or state["step"] < 0:
        raise TypeError(f"step={state['step']!r} is not a step count")
    trainer.step, trainer.elapsed = state["step"], float(state["elapsed"])
    trainer.saved_step = trainer.step
    trainer.base_accuracy = state["base_accuracy"]
    _check_optimizer_shapes(state["optimizer"], [p for _, p in lora.trained_parameters(trainer.model)])
    trainer.devices.load_state({"model": lora.trained_state(trainer.model), "optimizer": state["optimizer"],
                                "version": state["actor_version"]})
    trainer.devices.set_rng_state(state["engine_rng"])
    torch.set_rng_state(state["torch_rng"])
    trainer.bad_steps = state.get("bad_steps", 0)
    if trainer.stale is not None and state.get("stalesync"):
        saved, now = state["stalesync"].get("shape"), _stalesync_shape(trainer)
        if saved is not None and saved != now:
            changed = ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k])
            raise ValueError(f"{path} holds StaleSync rollouts in flight that do not fit the new "
                             f"settings ({changed}); resume with the settings it was saved with")
        trainer.schedule.load_state_dict(state["stalesync"])
        trainer.devices.queue.load_state_dict(state["stalesync"]["queue"])
        trainer.devices.load_paused(state["stalesync"]["paused"])
    elif trainer.stale is not None and trainer.step:
        raise ValueError(f"{path} was written without StaleSync; resume it with stalesync.enabled=false")
    elif trainer.stale is None and state.get("stalesync"):
        raise ValueError(f"{path} holds StaleSync rollouts in flight; resume it with stalesync.enabled=true")
    if trainer.cfg.algo.advantage == "gae" and state.get("critic"):
        trainer.devices.load_critic_state(state["critic"])


def _check_optimizer_shapes(saved: dict, params: list[torch.Tensor]) -> None:
    """Optimizer moments must have their parameter's shape (torch would load others and fail
    in the next update). A device workers' state nests the optimizer's under "optimizer"."""
    inner = saved.get("optimizer", saved) if "state" not in saved else saved
    for i, moments in inner["state"].items():
        for key, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != params[int(i)].shape:
                raise TypeError(f"optimizer state {key} of parameter {i} has shape {list(value.shape)}, "
                                f"the parameter {list(params[int(i)].shape)}")


def read_state(file: Path) -> dict:
    """The trainer state in `file`, read without running any code it may carry."""
    try:
        with torch.serialization.safe_globals(_STATE_CLASSES):
            state = torch.load(file, weights_only=True)
    except Exception as e:  # truncated, foreign or code-carrying file: one line, never a trace
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "weights_only" in why or "Unsupported global" in str(e):
            why = "it holds objects other than tensors and plain data, which are never loaded"
        raise ValueError(f"{file} is not a readable rlfusion trainer state ({why})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{file} is not an rlfusion trainer state (no 'step' entry)")
    return state


def lock_run_dir(run_dir: Path) -> IO:
    """Take the run folder for this process (created if missing) until the returned file is
    closed or the process exits. A second run or resume of the same folder stops here with one
    line, before it has written anything."""
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(run_dir)
    try:
        handle = os.fdopen(os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a+")
    except OSError as e:
        raise ValueError(f"cannot take the run folder's lock {run_dir / LOCK} ({e.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"run folder {run_dir} is in use by {owner}; wait for it to finish or "
                         f"pick another run_name=") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"rlfusion pid {os.getpid()}\n")
    handle.flush()
    return handle


# What a run writes besides config.json and its lock: a folder holding any of these is a run
# that started (and perhaps finished), never one to start over.
OUTPUTS = ("metrics.jsonl", "tb", "summary.json", "final", "plots", "timeline.json", "timeline.png", "checkpoint",
           "checkpoint.old")


def outputs(run_dir: Path) -> list[str]:
    """The outputs of a run that `run_dir` holds, as "name" or "name/" (folders)."""
    return [name + ("/" if (run_dir / name).is_dir() else "") for name in OUTPUTS
            if (run_dir / name).exists() or (run_dir / name).is_symlink()]


def refuse_outputs(run_dir: Path) -> None:
    """Raise a one-line ValueError when `run_dir` holds a run's outputs."""
    held = outputs(run_dir)
    if held:
        raise ValueError(f"{run_dir} holds a run's outputs ({', '.join(held)}); a new run is never started "
                         f"over them (rlfusion train --restart moves them aside)")


def move_aside(run_dir: Path) -> Path | None:
    """Move every entry of `run_dir` but its lock into a new `run_dir/replaced-DATE-TIME/`, so a
    run can start there again without losing them; None when there was nothing to move."""
    entries = [p for p in run_dir.iterdir() if p.name != LOCK and not p.name.startswith("replaced-")]
    if not entries:
        return None
    aside = run_dir / time.strftime("replaced-%Y%m%d-%H%M%S")
    while aside.exists():
        aside = aside.with_name(aside.name + "-1")
    aside.mkdir()
    for p in entries:
        p.rename(aside / p.name)
    return aside


def latest_weights(run_dir: Path) -> Path | None:
    """The folder of `run_dir`'s most trained model (final/, checkpoint/ or checkpoint.old/)."""
    best, best_steps = None, -1
    for name in ("final", "checkpoint", "checkpoint.old"):
        try:
            meta = json.loads((run_dir / name / "config.json").read_text(encoding="utf-8"))
            steps = int(meta["extra"]["rl_steps"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (run_dir / name / "model.safetensors").is_file() and steps > best_steps:
            best, best_steps = run_dir / name, steps
    return best


def no_state_message(run_dir: Path) -> str:
    """Why `run_dir` cannot be resumed (it has no trainer state), what it holds and what to do."""
    held = outputs(run_dir)
    if not held:
        return (f"{run_dir} has no checkpoint to resume from: the run stopped before its first step; "
                f"start it again with the same command")
    weights = latest_weights(run_dir)
    options = "start it again under a new run_name="
    if weights is not None:
        options = (f"continue from its last weights as a new run (rlfusion train base={weights} run_name=NEW; the "
                   f"optimizer state is lost), evaluate them (rlfusion eval --ckpt {weights}), or {options}")
    return (f"{run_dir} has no trainer state to resume from (checkpoint/{STATE} is missing) but holds "
            f"{', '.join(held)}: {options}; `rlfusion train ... --restart` starts it over in place after "
            f"moving these to {run_dir}/replaced-DATE/")


def is_run_folder(run_dir: Path) -> bool:
    """Whether `run_dir/config.json` is a run's config, not a model checkpoint's."""
    import json

    try:
        data = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "rollout" in data


def has_checkpoint(run_dir: Path) -> bool:
    return any((run_dir / name / STATE).is_file() for name in ("checkpoint", "checkpoint.old"))


def _stalesync_shape(trainer) -> dict:
    """What in-flight StaleSync state depends on: the bound, the group and batch sizes and
    whether a batch waits for the next update (separated overlap)."""
    cfg = trainer.cfg
    return {"max_staleness": cfg.stalesync.max_staleness, "group_size": cfg.rollout.group_size,
            "prompts_per_step": cfg.rollout.prompts_per_step, "overlap": trainer.overlap}
