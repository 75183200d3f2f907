"""End to end: GRPO from the shipped base model raises held-out accuracy (about a minute)."""

from rlfusion.cli import SHIPPED_BASE
from rlfusion.config import load_config
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.trainer import RLTrainer


def test_grpo_from_the_shipped_base_learns(tmp_path):
    cfg = load_config(TrainConfig, None, [
        f'base="{SHIPPED_BASE}"', f'out_dir="{tmp_path}"', "run_name=e2e", "max_steps=30",
        "eval_every=1000", "eval_problems=200", "checkpoint_every=1000"])
    trainer = RLTrainer(cfg, tmp_path / "e2e", SHIPPED_BASE)  # the default deployment: Ray, colocated
    try:
        result = trainer.run(progress=False)
    finally:
        trainer.close()
    print(f"e2e: held-out {result.base_accuracy:.3f} -> {result.final_accuracy:.3f}")
    # Measured here: 50.5% -> 61.0% on 200 problems after 30 steps; demand +6 points.
    assert result.final_accuracy >= result.base_accuracy + 0.06, (result.base_accuracy,
                                                                  result.final_accuracy)
