"""Checkpoint and resume of an RL run: model, optimizer, RNG states, data position and step.

Written to `run_dir/checkpoint.tmp` and renamed over `run_dir/checkpoint`, so a run killed
mid-save keeps its previous checkpoint.
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
    save_checkpoint(tmp, trainer.model, trainer.tokenizer, {"rl_steps": trainer.step})
    torch.save({
        "step": trainer.step,
        "elapsed": trainer.elapsed,
        "base_accuracy": trainer.base_accuracy,
        "actor_version": trainer.actor.version,
        "optimizer": trainer.actor.optimizer.state_dict(),
        "prompt_rng": trainer.prompt_rng.getstate(),
        "engine_rng": trainer.rollout.engine.runner.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "critic": (None if trainer.critic is None else
                   {"model": trainer.critic.model.state_dict(),
                    "optimizer": trainer.critic.optimizer.state_dict()}),
    }, tmp / STATE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def load(trainer) -> None:
    path = trainer.run_dir / "checkpoint"
    if not (path / STATE).is_file():
        raise FileNotFoundError(f"{trainer.run_dir} has no checkpoint to resume from "
                                f"(expected {path / STATE})")
    model, _, _ = load_checkpoint(path)
    trainer.model.load_state_dict(model.state_dict())
    state = torch.load(path / STATE, weights_only=False)
    trainer.step, trainer.elapsed = state["step"], state["elapsed"]
    trainer.base_accuracy = state["base_accuracy"]
    trainer.actor.version = state["actor_version"]
    trainer.actor.optimizer.load_state_dict(state["optimizer"])
    trainer.prompt_rng.setstate(state["prompt_rng"])
    trainer.rollout.engine.runner.generator.set_state(state["engine_rng"])
    torch.set_rng_state(state["torch_rng"])
    if trainer.critic is not None and state.get("critic"):
        trainer.critic.model.load_state_dict(state["critic"]["model"])
        trainer.critic.optimizer.load_state_dict(state["critic"]["optimizer"])
