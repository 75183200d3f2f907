"""Built-in synthetic tasks with verifiable answers (the tiny CPU path trains on these)."""

from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, verify_arithmetic

__all__ = ["ArithmeticConfig", "ArithmeticTask", "verify_arithmetic"]
