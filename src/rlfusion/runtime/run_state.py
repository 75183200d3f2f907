"""Checkpoint and resume of an RL run: model, optimizer, RNG states, data position, step, the
DistQueue's rows (including partially filled ones) and StaleSync's in-flight partial rollouts.

Written to `run_dir/checkpoint.tmp`; the previous checkpoint is renamed to `checkpoint.old`
before the new one takes its place, so a run killed at any moment of a save leaves a complete
checkpoint to resume from (`load` falls back to `checkpoint.old`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlfusion.model.checkpoint import load_checkpoint, save_checkpoint

STATE = "trainer_state.pt"


def save(trainer) -> Path:
    final = trainer.run_dir / "checkpoint"
    tmp = trainer.run_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.sync_model()
    save_checkpoint(tmp, trainer.model, trainer.tokenizer, {"rl_steps": trainer.step})
    torch.save({
        "step": trainer.step,
        "elapsed": trainer.elapsed,
        "base_accuracy": trainer.base_accuracy,
        "actor_version": trainer.actor.version,
        "optimizer": trainer.actor.optimizer.state_dict(),
        "prompt_rng": trainer.prompt_rng.getstate(),
        "engine_rng": trainer.rollout.rng_state(),
        "torch_rng": torch.get_rng_state(),
        "bad_steps": trainer.bad_steps,
        "queue": trainer.flow.queue.state_dict(),  # empty between synchronous steps
        # StaleSync: groups in flight (partial samples with their token versions) and the batch
        # already taken for the next update, so a resumed run keeps the staleness bound
        "stalesync": None if trainer.stale is None else {"book": trainer.stale.state_dict(),
                                                         "pending": trainer.pending,
                                                         "shape": _stalesync_shape(trainer)},
        "critic": (None if trainer.critic is None else
                   {"model": trainer.critic.model.state_dict(),
                    "optimizer": trainer.critic.optimizer.state_dict()}),
    }, tmp / STATE)
    old = trainer.run_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load(trainer) -> None:
    path = trainer.run_dir / "checkpoint"
    if not (path / STATE).is_file():
        path = trainer.run_dir / "checkpoint.old"  # killed between the two renames of a save
    if not (path / STATE).is_file():
        raise FileNotFoundError(f"{trainer.run_dir} has no checkpoint to resume from "
                                f"(expected {path / STATE})")
    model, _, _ = load_checkpoint(path)
    trainer.model.load_state_dict(model.state_dict())
    try:
        state = torch.load(path / STATE, weights_only=False)
    except Exception as e:  # truncated or foreign file: one line, not a pickle trace
        raise ValueError(f"{path / STATE} is not a readable rlfusion trainer state ({e})") from None
    trainer.step, trainer.elapsed = state["step"], state["elapsed"]
    trainer.base_accuracy = state["base_accuracy"]
    trainer.actor.version = state["actor_version"]
    trainer.actor.optimizer.load_state_dict(state["optimizer"])
    trainer.prompt_rng.setstate(state["prompt_rng"])
    trainer.rollout.set_rng_state(state["engine_rng"])
    torch.set_rng_state(state["torch_rng"])
    trainer.bad_steps = state.get("bad_steps", 0)
    if "queue" in state:
        trainer.flow.queue.load_state_dict(state["queue"])
    if trainer.stale is not None and state.get("stalesync"):
        saved, now = state["stalesync"].get("shape"), _stalesync_shape(trainer)
        if saved is not None and saved != now:
            changed = ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k])
            raise ValueError(f"{path / STATE} holds StaleSync rollouts in flight that do not fit the new "
                             f"settings ({changed}); resume with the settings it was saved with")
        trainer.stale.load_state_dict(state["stalesync"]["book"])
        trainer.pending = state["stalesync"]["pending"]
    elif trainer.stale is not None and trainer.step:
        raise ValueError(f"{path / STATE} was written without StaleSync; resume it with stalesync.enabled=false")
    elif trainer.stale is None and state.get("stalesync"):
        raise ValueError(f"{path / STATE} holds StaleSync rollouts in flight; resume it with stalesync.enabled=true")
    if trainer.critic is not None and state.get("critic"):
        trainer.critic.model.load_state_dict(state["critic"]["model"])
        trainer.critic.optimizer.load_state_dict(state["critic"]["optimizer"])


def _stalesync_shape(trainer) -> dict:
    """What in-flight StaleSync state depends on: the bound, the group and batch sizes and
    whether a batch waits for the next update (separated overlap)."""
    cfg = trainer.cfg
    return {"max_staleness": cfg.stalesync.max_staleness, "group_size": cfg.rollout.group_size,
            "prompts_per_step": cfg.rollout.prompts_per_step, "overlap": trainer.overlap}
