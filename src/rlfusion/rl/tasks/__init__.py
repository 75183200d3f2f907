"""Tasks with verifiable answers: the built-in synthetic one (the tiny CPU path trains on it)
and prompt sets on disk; `make_task` picks the run's."""

from rlfusion.rl.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, verify_arithmetic
from rlfusion.rl.tasks.dataset import DatasetTask, make_task

__all__ = ["ArithmeticConfig", "ArithmeticTask", "DatasetTask", "make_task", "verify_arithmetic"]
